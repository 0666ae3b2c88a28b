"""VaRTELBO: the vectorised estimator equals Trace_ELBO's on the same draws."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI
from pyro.optim import ClippedAdam

from pyro_trees.guides import VaRTGuide
from pyro_trees.infer import VaRTELBO
from pyro_trees.infer.vart_elbo import vart_elbo
from pyro_trees.models import VaRT
from tests.infer._stacked import check_stack_equals_fits


@pytest.fixture(autouse=True)
def _module_local_params():
    with pyro.settings.context(module_local_params=True):
        yield


def _setup(depth, temperature, n=13, L=3):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, L, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    model = VaRT(
        L, kl_weight=0.05, split_alpha=0.8, split_beta=1.5, split_scale=1.3, leaf_scale=0.9
    )
    guide = VaRTGuide(model, depth, temperature=temperature, init="random").double()
    with torch.no_grad():  # move every parameter away from its symmetric start
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, guide, x, y


def _trace_elbo(model, guide, x, y, subsample_size):
    guide_tr = poutine.trace(guide).get_trace(x, y, subsample_size)
    model_tr = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(x, y, subsample_size)
    values = {
        k: v["value"]
        for k, v in guide_tr.nodes.items()
        if v["type"] == "sample" and not v["is_observed"] and k != "data"
    }
    idx = model_tr.nodes["data"]["value"]
    return model_tr.log_prob_sum() - guide_tr.log_prob_sum(), values, idx


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("temperature", [0.4, 0.0])
@pytest.mark.parametrize("subsample_size", [None, 5])
def test_equals_trace_elbo_on_the_same_draws(depth, temperature, subsample_size):
    model, guide, x, y = _setup(depth, temperature)
    ref, values, idx = _trace_elbo(model, guide, x, y, subsample_size)
    ours = vart_elbo(
        model,
        guide,
        x,
        y,
        subsample_size,
        values=values,
        subsample=idx if subsample_size else None,
    )
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-9)


def test_gradients_equal_trace_elbo_on_the_same_draws():
    # the vectorised draws are differentiable functions of the guide's parameters; feed the
    # same draws to the Pyro model and guide and compare the pathwise gradients
    model, guide, x, y = _setup(3, 0.5)
    params = list(guide.parameters())
    values = guide.rsample(x)
    guide_tr = poutine.trace(poutine.condition(guide, data=values)).get_trace(x, y)
    model_tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    ref = model_tr.log_prob_sum() - guide_tr.log_prob_sum()
    g_ref = torch.autograd.grad(ref, params, retain_graph=True)
    ours = vart_elbo(model, guide, x, y, values=values)
    g_ours = torch.autograd.grad(ours, params)
    assert torch.allclose(ours, ref, rtol=1e-12)
    for a, b in zip(g_ours, g_ref, strict=True):
        assert (a != 0).any()
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)


def test_every_parameter_receives_a_gradient_and_svi_runs():
    model, guide, x, y = _setup(3, 0.7)
    loss = VaRTELBO()(model, guide)(x, y)
    loss.backward()
    for name, p in guide.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).any(), name
    svi = SVI(model, guide, ClippedAdam({"lr": 0.01}), VaRTELBO())
    losses = [svi.step(x, y, subsample_size=6) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_bad_input():
    model, guide, x, y = _setup(2, 0.7)
    with pytest.raises(ValueError, match="targets y"):
        VaRTELBO().differentiable_loss(model, guide, x)
    with pytest.raises(ValueError, match="shape"):
        VaRTELBO().differentiable_loss(model, guide, x[:, :2], y)
    with pytest.raises(ValueError, match="VaRT model"):
        VaRTELBO().differentiable_loss(lambda *a: None, guide, x, y)


def _per_node_prior(L=3, scale_tril=True):
    """Per-node prior tensors, some covering fewer nodes than a depth-3 guide has."""
    g = torch.Generator().manual_seed(5)
    w = L + 1
    tril = torch.randn(7, w, w, generator=g, dtype=torch.float64).tril(-1) * 0.3
    tril = tril + torch.diag_embed(0.5 + torch.rand(7, w, generator=g, dtype=torch.float64))
    return {
        "node_split_prob": 0.1 + 0.8 * torch.rand(5, generator=g, dtype=torch.float64),
        "node_split_loc": torch.randn(3, w, generator=g, dtype=torch.float64),
        "node_split_scale": tril if scale_tril else tril.diagonal(dim1=-2, dim2=-1),
        "node_leaf_loc": torch.randn(15, w, generator=g, dtype=torch.float64),
        "node_leaf_scale": 0.5 + torch.rand(20, w, generator=g, dtype=torch.float64),
    }


def _with_prior(model, **node):
    return VaRT(
        model.in_features,
        kl_weight=model.kl_weight,
        split_alpha=model.split_alpha,
        split_beta=model.split_beta,
        split_scale=model.split_scale,
        leaf_scale=model.leaf_scale,
        site_depth=model.site_depth,  # the depth of the guide built on ``model``
        **node,
    )


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("temperature", [0.4, 0.0])
@pytest.mark.parametrize("scale_tril", [True, False])
def test_equals_trace_elbo_with_per_node_priors(depth, temperature, scale_tril):
    base, guide, x, y = _setup(depth, temperature)
    model = _with_prior(base, **_per_node_prior(scale_tril=scale_tril))
    ref, values, idx = _trace_elbo(model, guide, x, y, 5)
    ours = vart_elbo(model, guide, x, y, 5, values=values, subsample=idx)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-9)
    # the per-node values enter: the default prior scores the same draws differently
    default = vart_elbo(base, guide, x, y, 5, values=values, subsample=idx)
    assert not torch.allclose(ours, default, rtol=1e-6)


def test_per_node_priors_at_the_default_values_are_the_default_prior():
    base, guide, x, y = _setup(3, 0.4)
    w = base.in_features + 1
    depths = torch.tensor([0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3])
    same = _with_prior(
        base,
        node_split_prob=torch.tensor([base.split_prob(int(d)) for d in depths]),
        node_split_loc=torch.zeros(7, w),
        node_split_scale=torch.diag_embed(torch.full((7, w), base.split_scale)),
        node_leaf_loc=torch.zeros(15, w),
        node_leaf_scale=torch.full((15, w), base.leaf_scale),
    )
    assert same.node_prior(0, 15) is not None and base.node_prior(0, 15) is None
    ref, values, _ = _trace_elbo(same, guide, x, y, None)
    a = vart_elbo(base, guide, x, y, values=values)
    b = vart_elbo(same, guide, x, y, values=values)
    assert torch.allclose(b, ref, rtol=1e-12, atol=1e-9)
    assert torch.allclose(a, b, rtol=1e-6)


def _with_missing(x):
    """``x`` with holes: one cell, one whole row, two cells of another row."""
    x = x.clone()
    x[0, 1] = float("nan")
    x[3] = float("nan")
    x[5, 0] = x[5, 2] = float("nan")
    return x


@pytest.mark.parametrize("subsample_size", [None, 6])
def test_equals_trace_elbo_with_missing_inputs(subsample_size):
    g = torch.Generator().manual_seed(7)
    x = _with_missing(torch.randn(13, 3, generator=g, dtype=torch.float64))
    y = torch.randn(13, generator=g, dtype=torch.float64)
    model = VaRT(3, kl_weight=0.05, missing=True, missing_concentration=1.5)
    guide = VaRTGuide(model, 3, temperature=0.4, init="random").double()
    with torch.no_grad():  # every parameter away from its start, rho's too
        for p in guide.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ref, values, idx = _trace_elbo(model, guide, x, y, subsample_size)
    assert "rho_2" in values
    ours = vart_elbo(
        model, guide, x, y, subsample_size, values=values, subsample=idx if subsample_size else None
    )
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-9)
    # the pathwise gradients of the same draws agree, and reach rho's parameters
    params = list(guide.parameters())
    values = guide.rsample(x)
    guide_tr = poutine.trace(poutine.condition(guide, data=values)).get_trace(x, y)
    model_tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
    ref = model_tr.log_prob_sum() - guide_tr.log_prob_sum()
    g_ref = torch.autograd.grad(ref, params, retain_graph=True)
    g_ours = torch.autograd.grad(vart_elbo(model, guide, x, y, values=values), params)
    for (name, _), a, b in zip(guide.named_parameters(), g_ours, g_ref, strict=True):
        assert torch.isfinite(a).all() and (a != 0).any(), name
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), name
    assert any(name.startswith("rho_logits") for name, _ in guide.named_parameters())


def test_classification_elbo_with_missing_inputs():
    from pyro_trees.models import VaRTClassification

    g = torch.Generator().manual_seed(8)
    x = _with_missing(torch.randn(13, 3, generator=g, dtype=torch.float64))
    y = torch.randint(0, 3, (13,), generator=g)
    model = VaRTClassification(3, 3, kl_weight=0.2, missing=True)
    guide = VaRTGuide(model, 2, temperature=0.4, init="random").double()
    ref, values, _ = _trace_elbo(model, guide, x, y, None)
    assert torch.allclose(vart_elbo(model, guide, x, y, values=values), ref, rtol=1e-12)


@pytest.mark.parametrize("family", ["regression", "probit", "softmax"])
def test_a_stack_of_trees_equals_each_fit_on_its_own_rows(family):
    """StackedGuides of tree guides with row weights: fit j's ELBO (value and
    gradients) is its own guide's on its training rows, on the same draws."""
    from pyro_trees.models import VaRTClassification

    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 3, generator=g, dtype=torch.float64)
    if family == "regression":
        model, y = VaRT(3, kl_weight=0.2), torch.randn(24, generator=g, dtype=torch.float64)
    else:
        classes = 2 if family == "probit" else 3
        model = VaRTClassification(3, classes, link=family, kl_weight=0.2)
        y = torch.randint(0, classes, (24,), generator=g)
    guides = []
    for _ in range(3):
        guide = VaRTGuide(model, 3, temperature=0.5, init="random", generator=g).double()
        guide.init_splits_from_data(x, generator=g)
        guides.append(guide)
    rows = [torch.arange(24)[j * 6 :] for j in range(3)]
    check_stack_equals_fits(VaRTELBO(), vart_elbo, model, guides, x, y, rows, 7)


def test_rows_loss_scores_the_rows_it_is_given():
    """All rows standing for themselves: the loss of the full batch on the same draws;
    the likelihood's part scales with num_rows; bad indices and counts raise."""
    torch.manual_seed(0)
    x, y = torch.randn(20, 2), torch.randn(20)
    model = VaRT(2)
    guide = VaRTGuide(model, depth=2)
    loss = VaRTELBO()
    loss.differentiable_loss(model, guide, x, y)  # the guide's start draws too
    torch.manual_seed(1)
    full = loss.differentiable_loss(model, guide, x, y)
    torch.manual_seed(1)
    rows = loss.rows_loss(model, guide, x, y, torch.arange(20), 20)
    torch.testing.assert_close(rows, full)
    idx = torch.tensor([3, 7, 11])
    values = []
    for num_rows in (3, 6, 9):
        torch.manual_seed(2)
        values.append(float(loss.rows_loss(model, guide, x, y, idx, num_rows).detach()))
    assert values[2] - values[1] == pytest.approx(values[1] - values[0], rel=1e-4)
    mask = torch.zeros(20, dtype=torch.bool)
    for bad in (mask, torch.tensor([], dtype=torch.long), idx.float(), idx.view(1, 3), [3]):
        with pytest.raises(ValueError, match="subsample must be a non-empty 1-D integer"):
            loss.rows_loss(model, guide, x, y, bad, 20)
    for bad in (0, 2, 7.5, -20, True):
        with pytest.raises(ValueError, match="num_rows must be an integer"):
            loss.rows_loss(model, guide, x, y, idx, bad)
