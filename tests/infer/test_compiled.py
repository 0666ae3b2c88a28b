"""The compiled VaRT losses equal the eager ones on the same draws; compilation failures
fall back; the estimators' rule for when to compile."""

import math
import pickle

import pyro
import pytest
import torch
from pyro.infer import SVI

from pyro_trees.guides import VaRTForestGuide, VaRTGuide
from pyro_trees.infer import CompiledLoss, VaRTELBO, VaRTForestELBO, compiled, fit
from pyro_trees.models import VaRT, VaRTClassification, VaRTForest

# "aot_eager" traces the program (one graph, differentiated by AOTAutograd) without
# generating code: the same capture as the default backend, seconds instead of a minute,
# and no C++ compiler needed.
BACKEND = "aot_eager"


def _pair(kind: str):
    if kind == "forest":
        model = VaRTForest(3, num_trees=3, depth=2)
        return model, VaRTForestGuide(model), VaRTForestELBO
    model = VaRTClassification(3, num_classes=3) if kind == "classification" else VaRT(3)
    return model, VaRTGuide(model, 2), VaRTELBO


def _loss_and_grads(loss, model, guide, x, y, subsample_size):
    pyro.set_rng_seed(5)
    guide.zero_grad()
    value = loss.differentiable_loss(model, guide, x, y, subsample_size)
    value.backward()
    return value.detach(), [p.grad.clone() for p in guide.parameters()]


@pytest.mark.parametrize("kind", ["tree", "forest", "classification"])
def test_the_compiled_loss_equals_the_eager_one_on_the_same_draws(kind):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    if kind == "classification":
        y = torch.randint(3, (40,), generator=gen)
    else:
        y = x[:, 0].sin()
    with pyro.settings.context(module_local_params=True):
        model, guide, loss_cls = _pair(kind)
        guide.temperature = 0.7
        guide.params(x)  # the lazy start, before the seeded draws
        eager, compiled_loss = loss_cls(), loss_cls(compile=BACKEND)
        # full batch, then (one family: a program per variant costs seconds) a minibatch
        for subsample_size in (None, 16) if kind == "tree" else (None,):
            a, grad_a = _loss_and_grads(eager, model, guide, x, y, subsample_size)
            b, grad_b = _loss_and_grads(compiled_loss, model, guide, x, y, subsample_size)
            assert compiled_loss._compiled.failed is None
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-10)
            for ga, gb in zip(grad_a, grad_b, strict=True):
                assert torch.allclose(ga, gb, rtol=1e-10, atol=1e-10)
        # a second model and guide of the same shapes reuse the compiled program
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model2, guide2, _ = _pair(kind)
        guide2.temperature = 0.3
        _loss_and_grads(compiled_loss, model2, guide2, x, y, None)
        if kind == "tree":  # and more rows in minibatches of the same size, too
            _loss_and_grads(compiled_loss, model2, guide2, torch.cat([x, x]), y.repeat(2), 16)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_batches_of_new_sizes_stop_recompiling_after_the_second():
    """Full batches of 30, 40 and 50 rows (three folds of a cross-validation): the
    second size compiles a program with a symbolic row count, the third reuses it."""
    graphs = []
    with pyro.settings.context(module_local_params=True):
        for n in (30, 40, 50):
            x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
            model, guide, loss_cls = _pair("tree")
            guide.temperature = 0.5
            guide.params(x)
            a, _ = _loss_and_grads(loss_cls(), model, guide, x, x[:, 0], None)
            b, _ = _loss_and_grads(loss_cls(compile=BACKEND), model, guide, x, x[:, 0], None)
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-10)
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[2] == graphs[1]


def test_missing_inputs_and_hard_splits_run_eagerly():
    x = torch.randn(30, 2, generator=torch.Generator().manual_seed(1))
    y = x[:, 0]
    x_missing = x.clone()
    x_missing[::3, 1] = float("nan")
    loss = VaRTELBO(compile="no_such_backend")  # would fail (and warn) if it compiled
    with pyro.settings.context(module_local_params=True):
        model = VaRT(2, missing=True)
        guide = VaRTGuide(model, 2)
        assert torch.isfinite(loss.differentiable_loss(model, guide, x_missing, y))
        model = VaRT(2)
        guide = VaRTGuide(model, 2)
        with guide.temperature_set_to(0.0):
            assert torch.isfinite(loss.differentiable_loss(model, guide, x, y))
    assert loss._compiled.failed is None


def test_a_program_that_cannot_compile_warns_once_and_trains_eagerly():
    x = torch.randn(30, 2, generator=torch.Generator().manual_seed(2))
    y = x[:, 0]
    with pyro.settings.context(module_local_params=True):
        model = VaRT(2)
        guide = VaRTGuide(model, 2)
        guide.params(x)
        loss = VaRTELBO(compile="no_such_backend")
        with pytest.warns(RuntimeWarning, match="could not compile .* training runs eagerly"):
            first = loss.differentiable_loss(model, guide, x, y)
        assert loss._compiled.failed and "no_such_backend" in loss._compiled.failed
        pyro.set_rng_seed(0)
        again = loss.differentiable_loss(model, guide, x, y)  # no second warning
        pyro.set_rng_seed(0)
        assert torch.equal(again, VaRTELBO().differentiable_loss(model, guide, x, y))
        assert torch.isfinite(first)


def _scaled_sum(x, weights):
    return (x * weights[0]).sum()


def test_past_its_recompile_limit_a_program_warns_once_and_runs_eagerly():
    program = CompiledLoss(_scaled_sum, compile="eager", recompile_limit=2)
    for n in (1, 2):  # as many weight tuples, one program each (a tuple's length is static)
        assert float(program(torch.ones(3), (torch.tensor(2.0),) * n)) == 6.0
    assert program.failed is None
    with pytest.warns(RuntimeWarning, match="could not compile .* training runs eagerly"):
        assert float(program(torch.ones(3), (torch.tensor(2.0),) * 3)) == 6.0
    assert "recompile" in program.failed.lower()
    assert float(program(torch.ones(3), (torch.tensor(2.0),) * 4)) == 6.0  # no second warning


def test_fit_and_svi_train_through_a_compiled_loss_and_it_pickles():
    # the shapes of the equality test's tree, so that its compiled program is reused
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = x[:, 0].sin()
    results = {}
    for name, loss in (("eager", VaRTELBO()), ("compiled", VaRTELBO(compile=BACKEND))):
        pyro.set_rng_seed(0)  # the lazy start draws from the global stream
        with pyro.settings.context(module_local_params=True):
            model = VaRT(3)
            guide = VaRTGuide(model, 2, generator=torch.Generator().manual_seed(0))
            guide.params(x)
            results[name] = fit(model, guide, x, y, loss=loss, num_steps=15, seed=0, progress=False)
    assert results["compiled"].losses == pytest.approx(results["eager"].losses, rel=1e-9)
    # plain Pyro: SVI.step goes through the same differentiable_loss
    with pyro.settings.context(module_local_params=True):
        model = VaRT(3)
        guide = VaRTGuide(model, 2)
        guide.params(x)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), VaRTELBO(compile=BACKEND))
        assert all(math.isfinite(svi.step(x, y)) for _ in range(3))
    restored = pickle.loads(pickle.dumps(VaRTELBO(compile=BACKEND)))
    assert restored.compile == BACKEND and restored._compiled.failed is None


def test_the_estimators_compile_only_where_it_pays():
    assert not compiled.should_compile("cpu", 10**6, 10**6)
    assert not compiled.should_compile(None, 10**6, 10**6)
    assert not compiled.should_compile("cuda", 100, 400)  # a short fit: eager
    assert compiled.should_compile("cuda", 1000, 400)  # an estimator's default fit
    assert compiled.should_compile(torch.device("cuda", 0), 5000, 2048)


@pytest.mark.parametrize("kind", ["tree", "forest", "classification"])
def test_missing_values_refused_also_after_an_in_place_edit(kind):
    """The losses check for missing values once per input tensor (not at every step: the
    check reads back to the host), and again when the tensor changes in place."""
    model, guide, loss_cls = _pair(kind)
    x = torch.randn(6, 3)
    y = torch.randint(0, 3, (6,)) if kind == "classification" else torch.randn(6)
    loss = loss_cls()
    assert torch.isfinite(loss.differentiable_loss(model, guide, x, y))
    x[2, 1] = float("nan")
    for fresh in (loss, loss_cls()):
        with pytest.raises(ValueError, match="missing values"):
            fresh.differentiable_loss(model, guide, x, y)
