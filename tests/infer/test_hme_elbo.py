"""``HMEELBO`` is ``TreeELBO`` of the HME in closed form: the same value and gradients,
eager and compiled, full batch and minibatch; it trains through plain ``SVI``."""

import pickle

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI

from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import HMEELBO, TreeELBO
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models import HME

# see tests/infer/test_compiled.py: the compiler's capture without code generation
BACKEND = "aot_eager"

CASES = {
    "regression": ({"noise_scale": None}, "constant"),
    "two outputs, linear experts": ({"num_outputs": 2}, "linear"),
    "classification, linear experts": ({"likelihood": "categorical", "num_classes": 3}, "linear"),
}
WEIGHTS = [
    {"balance_weight": 1.0, "entropy_weight": -1.0},  # the estimators' defaults
    {"balance_weight": 0.5, "entropy_weight": 1.0},
]


def _data(case: str):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    if case.startswith("classification"):
        return x, torch.randint(0, 3, (40,), generator=gen)
    if case.startswith("two"):
        return x, torch.randn(40, 2, generator=gen, dtype=torch.float64)
    return x, x[:, 0].sin()


def _pair(case: str, x, y):
    kwargs, experts = CASES[case]
    model = HME(3, 2, experts=experts, **kwargs).double()
    guide = RNNTreeGuide(3, 2, feedback="hard").double()
    poutine.trace(guide).get_trace(x, y)  # the data-driven start
    poutine.trace(model).get_trace(x, y)
    return model, guide


def _grads(value, params):
    return [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, torch.autograd.grad(value, params, allow_unused=True), strict=True)
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_the_closed_form_equals_the_enumerated_tree_elbo(case):
    x, y = _data(case)
    with isolated_params():
        model, guide = _pair(case, x, y)
        params = [*model.parameters(), *guide.parameters()]
        for weights in WEIGHTS:
            a = TreeELBO(**weights)(model, guide)(x, y)
            b = HMEELBO(**weights)(model, guide)(x, y)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
            for ga, gb in zip(_grads(a, params), _grads(b, params), strict=True):
                torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_loss_equals_the_eager_one(case):
    x, y = _data(case)
    with isolated_params():
        model, guide = _pair(case, x, y)
        params = [*model.parameters(), *guide.parameters()]
        eager, compiled = HMEELBO(), HMEELBO(compile=BACKEND)
        # full batch, then (one case: a program per variant costs seconds) a minibatch
        for subsample_size in (None, 16) if case == "regression" else (None,):
            pyro.set_rng_seed(3)
            a = eager.differentiable_loss(model, guide, x, y, subsample_size)
            pyro.set_rng_seed(3)
            b = compiled.differentiable_loss(model, guide, x, y, subsample_size)
            assert compiled._compiled.failed is None
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-10)
            for ga, gb in zip(_grads(a, params), _grads(b, params), strict=True):
                torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-10)


def test_missing_inputs_and_soft_feedback_run_eagerly():
    x, y = _data("regression")
    x[3, 1] = float("nan")
    with isolated_params():
        model, guide = _pair("regression", x, y)
        loss = HMEELBO(compile=BACKEND)
        value = loss.differentiable_loss(model, guide, x, y)
        assert torch.isfinite(value)
        assert loss._checked["complete"][2] is False  # seen as incomplete: the eager path
        torch.testing.assert_close(value, HMEELBO().differentiable_loss(model, guide, x, y))


def test_svi_trains_through_it_from_a_fresh_model_and_it_pickles():
    """Plain ``SVI`` with a model and guide that have not run: the first step starts
    them (as under ``TreeELBO``) and the steps lower the loss."""
    x, y = _data("regression")
    with isolated_params():
        model, guide = HME(3, 2).double(), RNNTreeGuide(3, 2).double()
        loss = HMEELBO(compile=BACKEND)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), loss)
        losses = [svi.step(x, y) for _ in range(30)]
        assert model.initialised and guide.initialised
        assert losses[-1] < losses[0]
        again = pickle.loads(pickle.dumps(loss))
        assert again.compile == BACKEND and again.entropy_weight == 1.0


def test_wrong_pairs_and_missing_targets_are_refused():
    x, y = _data("regression")
    model, guide = HME(3, 2), RNNTreeGuide(3, 2)
    with pytest.raises(ValueError, match="needs the targets y"):
        HMEELBO().differentiable_loss(model, guide, x)
    with pytest.raises(ValueError, match="needs an RNNTreeGuide"):
        HMEELBO().differentiable_loss(model, lambda x, y: None, x, y)
    with pytest.raises(ValueError, match=r"x must be \(N, 3\)"):
        HMEELBO().differentiable_loss(model, guide, x[:, :2], y)
