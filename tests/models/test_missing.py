"""Missing inputs in VaRT trees and forests: the one routing rule
(:func:`pyro_trees.trees.split_log_probs` with :func:`missing_share`), its identities on
small trees, and the models' ``missing`` option."""

import math

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive

from pyro_trees import trees
from pyro_trees.guides import VaRTForestGuide, VaRTGuide
from pyro_trees.models import VaRT, VaRTClassification, VaRTForest, tree_mean
from pyro_trees.models.vart_mixture import (
    forest_mean,
    leaf_mixtures,
    leaf_tree,
    log_leaf_weights,
    missing_share,
    route_log_probs,
    with_bias,
)

NAN = float("nan")


@pytest.fixture(autouse=True)
def _module_local_params():
    with pyro.settings.context(module_local_params=True):
        yield


def _tree(depth=2, L=3, seed=0, dtype=torch.float64):
    """A full tree of ``depth`` with random splits, leaves and ``rho``."""
    g = torch.Generator().manual_seed(seed)
    n_int, n_all = 2**depth - 1, 2 ** (depth + 1) - 1
    split = torch.cat([torch.ones(n_int, dtype=dtype), torch.zeros(n_all - n_int, dtype=dtype)])
    log_exist = torch.zeros(n_all, dtype=dtype)
    return {
        "split": split,
        "log_exist": log_exist,
        "beta": torch.randn(n_int, L + 1, generator=g, dtype=dtype),
        "theta": torch.randn(n_all, L + 1, generator=g, dtype=dtype),
        "log_sigma": 0.3 * torch.randn(n_all, generator=g, dtype=dtype),
        "rho": torch.rand(n_int, generator=g, dtype=dtype),
    }


def test_without_missing_inputs_the_rule_is_logsigmoid_exactly():
    u = torch.randn(50, 7, dtype=torch.float64) * 30
    left, right = trees.split_log_probs(u)
    assert torch.equal(left, torch.nn.functional.logsigmoid(u))
    assert torch.equal(right, torch.nn.functional.logsigmoid(-u))
    # a zero share through the missing branch gives the same values
    zero = torch.zeros_like(u)
    l0, r0 = trees.split_log_probs(u, zero, torch.full_like(u, 0.3))
    torch.testing.assert_close(l0, left, rtol=0, atol=1e-15)
    torch.testing.assert_close(r0, right, rtol=0, atol=1e-15)


def test_a_split_on_missing_inputs_only_goes_right_with_rho():
    u = torch.randn(20, 3, dtype=torch.float64) * 5
    rho = torch.tensor([0.1, 0.5, 0.93], dtype=torch.float64)
    left, right = trees.split_log_probs(u, torch.ones_like(u), rho)
    torch.testing.assert_close(right.exp(), rho.expand_as(u), rtol=1e-14, atol=0)
    torch.testing.assert_close(left.exp(), (1 - rho).expand_as(u), rtol=1e-14, atol=0)


def test_the_rule_mixes_the_split_and_rho_by_the_share():
    u = torch.randn(30, 4, dtype=torch.float64)
    m = torch.rand(30, 4, dtype=torch.float64)
    rho = torch.rand(4, dtype=torch.float64)
    left, right = trees.split_log_probs(u, m, rho)
    torch.testing.assert_close(right.exp(), (1 - m) * torch.sigmoid(-u) + m * rho)
    torch.testing.assert_close(left.exp() + right.exp(), torch.ones_like(u))


@pytest.mark.parametrize("share", [0.0, 0.4, 1.0])
def test_gradients_reach_rho_and_stay_finite_at_the_ends(share):
    u = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    m = torch.full((6, 3), share, dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([0.2, 0.6, 0.9], dtype=torch.float64, requires_grad=True)
    left, right = trees.split_log_probs(u, m, rho)
    (left.sum() + 2 * right.sum()).backward()
    for t in (u, m, rho):
        assert torch.isfinite(t.grad).all()
    assert (rho.grad != 0).all() == (share > 0)
    assert (u.grad != 0).all() == (share < 1)


def test_missing_share_is_the_squared_weights_share_by_hand():
    beta = torch.tensor([[3.0, 4.0, 0.0, 7.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    missing = torch.tensor([[True, False, False], [False, True, True], [True, True, True]])
    m = missing_share(beta, missing)  # (3 rows, 2 splits)
    expected = torch.tensor([[9 / 25, 0.0], [16 / 25, 0.0], [1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(m, expected)  # the intercept never counts; no weight: 0


def test_route_log_probs_refuses_missing_inputs_without_rho():
    beta = torch.randn(3, 3)
    with pytest.raises(ValueError, match="missing=True"):
        route_log_probs(torch.zeros(2, 3), beta, torch.ones(2, 2, dtype=torch.bool), None)


def _by_hand(tree, x):
    """P(x -> leaf) of a depth-2 tree row by row, the rule written out, and the mean."""
    beta, rho, theta = tree["beta"], tree["rho"], tree["theta"]
    out = []
    for row in x:
        miss = torch.isnan(row)
        x0 = torch.where(miss, torch.zeros_like(row), row)
        x1 = torch.cat([x0, x0.new_ones(1)])
        right = []
        for i in range(3):
            w = beta[i, :-1] ** 2
            m = float(w[miss].sum() / w.sum())
            right.append((1 - m) * torch.sigmoid(-(beta[i] @ x1)) + m * rho[i])
        r1, r2, r3 = right
        reach = torch.stack([(1 - r1) * (1 - r2), (1 - r1) * r2, r1 * (1 - r3), r1 * r3])
        out.append((reach * (theta[3:] @ x1)).sum())
    return torch.stack(out)


def test_every_routing_agrees_with_the_rule_by_hand():
    tree = _tree()
    x = torch.randn(8, 3, dtype=torch.float64)
    x[0, 1] = NAN
    x[2, :] = NAN
    x[5, 0] = x[5, 2] = NAN
    ref = _by_hand(tree, x)
    torch.testing.assert_close(tree_mean(tree, x), ref)  # log_leaf_weights' route
    # the posterior-tree route of the estimators: one stacked tree cut to its leaves
    stacked = {k: v.unsqueeze(0) for k, v in tree.items()}
    logits, means, _ = leaf_mixtures(leaf_tree(stacked), x)
    torch.testing.assert_close((logits.softmax(-1) * means).sum(-1)[0], ref)
    # the forest's route (path matrices): a forest of this one tree
    forest = {k: v.unsqueeze(0) for k, v in tree.items()}
    torch.testing.assert_close(forest_mean(forest, x), ref)


def test_complete_rows_route_as_before_in_a_batch_with_missing_ones():
    tree = _tree(depth=3, L=4, seed=1)
    x = torch.randn(10, 4, dtype=torch.float64)
    clean = log_leaf_weights(tree, with_bias(x))
    x[3, 2] = NAN
    mixed = log_leaf_weights(tree, with_bias(x))
    keep = torch.arange(10) != 3
    torch.testing.assert_close(mixed[keep], clean[keep], rtol=1e-14, atol=1e-14)


def test_models_without_missing_refuse_nan_and_draw_no_rho():
    x = torch.randn(5, 2)
    x[1, 0] = NAN
    for model in (VaRT(2), VaRTForest(2, num_trees=2, depth=2), VaRTClassification(2)):
        with pytest.raises(ValueError, match="missing=True"):
            model(x)
        trace = poutine.trace(model).get_trace(torch.randn(5, 2))
        assert not any(name.startswith("rho") for name in trace.nodes)


def test_missing_models_draw_rho_sites_weighted_like_beta():
    model = VaRT(2, missing=True, missing_concentration=2.0)
    guide = VaRTGuide(model, 2)
    x = torch.randn(6, 2)
    x[0, 1] = NAN
    trace = poutine.trace(guide).get_trace(x)
    assert trace.nodes["rho_0"]["value"].shape == (1,)
    assert trace.nodes["rho_1"]["value"].shape == (2,)
    assert "rho_2" not in trace.nodes  # the truncated level has no split
    prior = poutine.trace(poutine.replay(model, trace=trace)).get_trace(x)
    for d in (0, 1):  # Beta(2, 2) priors, weighted (and masked) as the level's beta
        site, beta = prior.nodes[f"rho_{d}"], prior.nodes[f"beta_{d}"]
        assert isinstance(site["fn"], pyro.distributions.Beta)
        torch.testing.assert_close(site["fn"].concentration1, torch.full((2**d,), 2.0))
        torch.testing.assert_close(torch.as_tensor(site["scale"]), torch.as_tensor(beta["scale"]))
    # the guide starts at the prior Beta(2, 2): mean 1/2, concentration 4
    torch.testing.assert_close(guide.rho_mean(), torch.full((3,), 0.5))
    assert torch.allclose(guide.rho_concentration, torch.full((3,), 4.0))
    assert "rho" in guide.mean_tree() and "rho" in model.sample_tree()


def test_predictive_draws_with_missing_inputs():
    model = VaRT(3, missing=True)
    guide = VaRTGuide(model, 2)
    x = torch.randn(7, 3)
    x[:, 0] = NAN
    x[4] = NAN
    out = Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    assert out["obs"].shape == (4, 7) and torch.isfinite(out["obs"]).all()
    forest = VaRTForest(3, num_trees=3, depth=2, missing=True)
    out = Predictive(forest, guide=VaRTForestGuide(forest), num_samples=4, parallel=True)(x)
    assert out["obs"].shape == (4, 1, 7) and torch.isfinite(out["obs"]).all()  # trees dim kept


def test_a_row_missing_every_input_follows_rho_alone():
    """With every input missing, a depth-1 tree sends the row right with probability rho,
    and its leaves read the inputs as 0 (their intercepts)."""
    tree = _tree(depth=1, L=2, seed=3)
    x = torch.full((1, 2), NAN, dtype=torch.float64)
    rho = float(tree["rho"][0])
    expected = (1 - rho) * tree["theta"][1, -1] + rho * tree["theta"][2, -1]
    torch.testing.assert_close(tree_mean(tree, x)[0], expected)
    assert math.isfinite(float(tree_mean(tree, x)[0]))
