"""VaRTForestELBO equals Trace_ELBO on the same draws; gradients are finite; it trains."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI

from pyro_trees.guides import VaRTForestGuide
from pyro_trees.infer import VaRTForestELBO
from pyro_trees.infer.vart_forest_elbo import vart_forest_elbo
from pyro_trees.models import VaRTForest, forest_mean
from tests.infer._stacked import check_stack_equals_fits


def _data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, torch.sin(2 * x[:, 0]) + x[:, 1] + 0.1 * torch.randn(n, generator=g).double()


def test_equals_trace_elbo_on_the_same_draws():
    x, y = _data()
    model = VaRTForest(2, num_trees=4, depth=3, kl_weight=0.3, name="m")
    guide = VaRTForestGuide(model, temperature=0.7, name="m")
    with torch.no_grad():
        gt = poutine.trace(guide).get_trace(x, y)
        values = {k: s["value"] for k, s in gt.nodes.items() if s["type"] == "sample"}
        mt = poutine.trace(poutine.replay(model, trace=gt)).get_trace(x, y)
        expected = mt.log_prob_sum() - gt.log_prob_sum()
        got = vart_forest_elbo(model, guide, x, y, values=values)
    assert torch.allclose(got, expected, rtol=1e-10), (got, expected)


def test_gradients_finite_and_svi_learns():
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data(200)
    model = VaRTForest(2, num_trees=10, depth=2, kl_weight=1e-3)
    guide = VaRTForestGuide(model)
    loss = VaRTForestELBO().differentiable_loss(model, guide, x, y, subsample_size=50)
    loss.backward()
    grads = [p.grad for p in guide.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": 0.03}), VaRTForestELBO())
    for _ in range(300):
        svi.step(x, y)
    with torch.no_grad():
        rmse = (forest_mean(guide.mean_tree(), x) - y).pow(2).mean().sqrt()
    assert rmse < 0.5 * y.std(), rmse  # the trees learn the function (sd of y ~ 1.2)


def test_equals_trace_elbo_with_missing_inputs():
    """With NaN in x: the same value and pathwise gradients as Trace_ELBO, rho's included."""
    x, y = _data(20, seed=3)
    x[0, 1] = x[4, 0] = float("nan")
    x[7] = float("nan")
    model = VaRTForest(2, num_trees=3, depth=2, kl_weight=0.3, missing=True)
    guide = VaRTForestGuide(model, temperature=0.7, init="random").double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    params = list(guide.parameters())
    values = guide.rsample(x)
    gt = poutine.trace(poutine.condition(guide, data=values)).get_trace(x, y)
    mt = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    expected = mt.log_prob_sum() - gt.log_prob_sum()
    got = vart_forest_elbo(model, guide, x, y, values=values)
    assert torch.allclose(got, expected, rtol=1e-10), (got, expected)
    g_ref = torch.autograd.grad(expected, params, retain_graph=True)
    g_got = torch.autograd.grad(got, params)
    for (name, _), a, b in zip(guide.named_parameters(), g_got, g_ref, strict=True):
        assert torch.isfinite(a).all() and (a != 0).any(), name
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), name


def test_a_stack_of_fits_equals_each_fit_on_its_own_rows():
    """Stacked guides with row weights: fit j's ELBO (value and gradients) is its own
    guide's ELBO on its training rows, on the same draws."""
    with pyro.settings.context(module_local_params=True):
        _stack_equals_fits()


def _stack_equals_fits():
    x, y = _data(30, seed=5)
    model = VaRTForest(2, num_trees=3, depth=2, kl_weight=0.3)
    guides = []
    for j in range(3):
        g = torch.Generator().manual_seed(j)
        guide = VaRTForestGuide(model, temperature=0.6, init="random", generator=g).double()
        guide.init_splits_from_data(x, generator=g)
        guides.append(guide)
    rows = [torch.arange(30)[j * 10 :] for j in range(3)]  # fit j ignores the first 10 j rows
    check_stack_equals_fits(VaRTForestELBO(), vart_forest_elbo, model, guides, x, y, rows, 11)


def test_row_weights_need_a_full_batch():
    x, y = _data(10)
    model = VaRTForest(2, num_trees=2, depth=1)
    guide = VaRTForestGuide(model).double()
    with pytest.raises(ValueError, match="full batch"):
        vart_forest_elbo(model, guide, x, y, subsample_size=5, weight=torch.ones(10))
