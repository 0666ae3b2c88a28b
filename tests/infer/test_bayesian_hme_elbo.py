"""``BayesianHMEELBO`` is ``Trace_ELBO`` of the Bayesian HME's SVI path as one tensor
program: the same value and gradients on the same draws, eager and compiled, with and
without restarts, full batch and minibatch; the guide's start and other pairs take
``Trace_ELBO``."""

import pickle
import warnings

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO

from pyro_trees.guides import BayesianHMEGuide, RestartPlate
from pyro_trees.infer import BayesianHMEELBO
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models import BayesianHME
from pyro_trees.topology import Topology

# see tests/infer/test_compiled.py: the compiler's capture without code generation
BACKEND = "aot_eager"
TOPOLOGIES = {"balanced, 4 experts": {1, 2, 3}, "one expert": set(), "unbalanced": {1, 3}}


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=gen, dtype=torch.float64)
    noise = 0.1 * torch.randn(40, 2, generator=gen, dtype=torch.float64)
    return x, torch.stack([x[:, 0].sin(), x[:, 1]], -1) + noise


def _pair(topology, restarts):
    torch.manual_seed(0)
    model = BayesianHME(2, 2, Topology(TOPOLOGIES[topology]))
    guide = BayesianHMEGuide(model, init="random", num_restarts=restarts)
    return (RestartPlate(model, restarts) if restarts else model), guide


def _grads(value, params):
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


@pytest.mark.parametrize("batch", [None, 15], ids=["full batch", "minibatch"])
@pytest.mark.parametrize("restarts", [None, 3], ids=["one fit", "3 restarts"])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_equals_trace_elbo_on_the_same_draws(topology, restarts, batch):
    x, y = _data()
    kwargs = {} if batch is None else {"subsample_size": batch}
    reference = Trace_ELBO(max_plate_nesting=2)
    with isolated_params():
        model, guide = _pair(topology, restarts)
        loss = BayesianHMEELBO(compile=BACKEND if restarts else False)
        loss.differentiable_loss(model, guide, x, y)  # the guide's start, traced
        params = list(guide.parameters())
        for seed in (3, 4):
            torch.manual_seed(seed)
            a = reference.differentiable_loss(model, guide, x, y, **kwargs)
            torch.manual_seed(seed)
            b = loss.differentiable_loss(model, guide, x, y, **kwargs)
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)
            for gb, ga in zip(_grads(b, params), _grads(a, params), strict=True):
                torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-10)
        if loss.compile:
            assert loss._compiled.failed is None


def test_the_guides_start_takes_the_traced_path_silently():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("balanced, 4 experts", 2)
        assert guide.awaiting_data
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            BayesianHMEELBO().differentiable_loss(model, guide, x, y)
        assert not guide.awaiting_data


def test_other_pairs_train_with_trace_elbo_after_one_warning():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("balanced, 4 experts", 3)
        loss = BayesianHMEELBO()
        loss.differentiable_loss(model, guide, x, y)  # the start
        with (
            pytest.warns(RuntimeWarning, match=r"not called as model\(x, y\)"),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", "Found vars in model but not guide")
            torch.manual_seed(1)
            a = loss.differentiable_loss(model, guide, x, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            warnings.filterwarnings("ignore", "Found vars in model but not guide")
            loss.differentiable_loss(model, guide, x, None)  # warned once
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Found vars in model but not guide")
            b = Trace_ELBO(max_plate_nesting=2).differentiable_loss(model, guide, x, None)
        torch.testing.assert_close(a, b)


def test_plain_svi_trains_every_restart_and_the_loss_pickles():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("unbalanced", 3)
        loss = BayesianHMEELBO(compile=BACKEND)
        svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), loss)
        svi.step(x, y)
        before = guide.W_loc.detach().clone()
        losses = [svi.step(x, y) for _ in range(40)]
        assert (guide.W_loc.detach() - before).abs().amax((1, 2, 3)).gt(0).all()
    assert losses[-1] < losses[0]
    again = pickle.loads(pickle.dumps(loss))
    assert again.compile == BACKEND and again.fallback is None


def test_bad_data_sizes_and_restart_counts_raise():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("balanced, 4 experts", 3)
        loss = BayesianHMEELBO()
        loss.differentiable_loss(model, guide, x, y)  # the start
        bad = y.clone()
        bad[0, 0] = float("nan")
        with pytest.raises(ValueError, match="y contains 1 NaN"):
            loss.differentiable_loss(model, guide, x, bad)
        for size in (-1, 0, 41, 32.0, True):
            with pytest.raises(ValueError, match="subsample_size"):
                loss.differentiable_loss(model, guide, x, y, subsample_size=size)
        with pytest.raises(ValueError, match="3 restarts but the model's RestartPlate 5"):
            loss.differentiable_loss(RestartPlate(model.model, 5), guide, x, y)
