"""Missing inputs in the RNN-Tree: eq. 13 with a node's own route for a missing input, its
hard limit, the greedy start's learnt direction, and the decision rules' text."""

import math

import pytest
import torch

from pyro_trees import trees
from pyro_trees._tree_start import _balanced_cuts, _greedy_cuts_missing, balanced_start
from pyro_trees.guides import RNNTree

NAN = float("nan")


def _moved(tree, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tree.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        tree.missing_logits.copy_(torch.randn(tree.missing_logits.shape, generator=g).double())
    return tree


def _by_hand(log_dim, w0, w1, a, x):
    """q(m = 1) of every node for one row: sum_l pi_l (sigmoid(a_l) if x_l is missing,
    else sigmoid(w0_l + w1_l x_l))."""
    pi = log_dim.exp()
    miss = torch.isnan(x)
    x0 = torch.where(miss, torch.zeros_like(x), x)
    term = torch.where(miss, torch.sigmoid(a), torch.sigmoid(w0 + w1 * x0))
    return (pi * term).sum(-1)


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_missing_inputs_take_the_nodes_own_route(feedback):
    torch.manual_seed(0)
    tree = _moved(RNNTree(3, 2, hidden_size=6, feedback=feedback).double())
    x = torch.randn(6, 3, dtype=torch.float64)
    x[0, 1] = NAN
    x[2] = NAN
    x[4, 0] = x[4, 2] = NAN
    right = torch.sigmoid(tree.node_logits(x, noise=False))  # (6, 3)
    if feedback == "hard":
        log_dim, w0, w1 = tree._node_heads(x.dtype)
        a = tree.missing_logits
        for n in range(6):
            torch.testing.assert_close(right[n], _by_hand(log_dim, w0, w1, a, x[n]))
    else:  # the roll-out: depth d's heads and missing_logits[d], at every node of depth d
        for n in range(6):
            h = tree.h0.unsqueeze(0)
            inp = h.new_zeros(1, 1)
            for d in range(2):
                h = tree.cell(inp, h)
                log_dim, w0, w1 = tree._heads(h)
                q = _by_hand(log_dim[0], w0[0], w1[0], tree.missing_logits[d], x[n])
                nodes = right[n, (1 << d) - 1 : (2 << d) - 1]
                torch.testing.assert_close(nodes, q.expand_as(nodes))
                inp = q.reshape(1, 1)
    # complete rows route exactly as they do in a batch without missing values
    keep = torch.tensor([1, 3, 5])
    torch.testing.assert_close(right[keep], torch.sigmoid(tree.node_logits(x[keep], noise=False)))


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_missing_logits_train_only_with_missing_true(feedback):
    x = torch.randn(8, 2, dtype=torch.float64)
    x[1, 0] = NAN
    off = RNNTree(2, 2, feedback=feedback)
    assert "missing_logits" not in dict(off.named_parameters())
    assert "missing_logits" in off.state_dict()  # a buffer: routes as started
    on = RNNTree(2, 2, feedback=feedback, missing=True).double()
    on(x, noise=False).logsumexp(-1).sum().backward()  # touches every leaf's probability
    (on(x, noise=False)[:, 0]).sum().backward()
    grad = on.missing_logits.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    for name, p in on.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_the_hard_tree_sends_a_missing_value_by_the_sign_of_its_logit(feedback):
    torch.manual_seed(1)
    tree = _moved(RNNTree(2, 2, feedback=feedback).double(), seed=2)
    rules = tree.rules()
    node_logits = tree.missing_logits
    if feedback == "soft":
        node_logits = trees.depth_logits_to_node_logits(node_logits.T).T
    expected = node_logits.gather(-1, rules.feature.unsqueeze(-1)).squeeze(-1) > 0
    assert torch.equal(rules.missing_right, expected)
    x = torch.randn(40, 2, dtype=torch.float64)
    x[::3, 0] = NAN
    x[1::4, 1] = NAN
    leaf = tree.hard_leaf(x)
    for n in range(40):  # walk the tree by hand
        node = 1
        for _ in range(2):
            j = node - 1
            v = x[n, rules.feature[j]]
            go = bool(rules.missing_right[j]) if math.isnan(v) else bool(v > rules.threshold[j])
            if not bool(rules.greater[j]) and not math.isnan(v):
                go = bool(v < rules.threshold[j])
            node = 2 * node + go
        assert int(leaf[n]) == node - 4


def test_greedy_start_sends_missing_points_where_their_targets_belong():
    """x > 0 has y = 1; the points missing x have y = 1 too: the greedy cut sends them
    right (log-odds +dim_margin); a dimension none misses gets its observed log-odds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).double()
    gone = torch.arange(200) % 5 == 0
    x[gone, 0] = NAN
    y[gone] = 1.0
    cut, gain, right = _greedy_cuts_missing(x, y)
    assert bool(right[0]) and abs(float(cut[0])) < 0.2
    targets, leaf, missing = balanced_start(x, y, 1, cuts="greedy", with_missing=True)
    assert targets.shape == (1, 6) and missing.shape == (1, 2)
    assert float(missing[0, 0]) == 3.0  # dim_margin
    observed = x[:, 1] > cut[1]
    odds = math.log((float(observed.sum()) + 0.5) / (200 - float(observed.sum()) + 0.5))
    assert float(missing[0, 1]) == pytest.approx(odds)
    assert bool((leaf[gone] == 1).all())  # the missing points went right
    # the other way round: their targets are those of x <= 0
    y[gone] = 0.0
    _, _, right = _greedy_cuts_missing(x, y)
    assert not bool(right[0])


def test_balanced_cuts_sit_among_the_observed_values():
    pts = torch.tensor([[1.0, NAN], [2.0, NAN], [NAN, NAN], [4.0, 5.0], [8.0, NAN]])
    cut, spread = _balanced_cuts(pts, like=pts[0])
    assert float(cut[0]) == 3.0  # between 2 and 4, the median of 1, 2, 4, 8
    assert float(cut[1]) == 5.0 and float(spread[1]) == 0.0  # one value: no spread
    assert float(spread[0]) == pytest.approx(float(torch.tensor([1.0, 2, 4, 8]).std()))


def test_init_balanced_and_routing_with_missing_values():
    torch.manual_seed(3)
    x = torch.randn(100, 3, dtype=torch.float64)
    y = x[:, 0] + 0.1 * torch.randn(100, dtype=torch.float64)
    x[torch.rand(100, 3) < 0.2] = NAN
    for feedback in ("hard", "soft"):
        tree = RNNTree(3, 3, feedback=feedback, missing=True).double()
        tree.init_scaling(x)
        assert torch.isfinite(tree.x_loc).all() and torch.isfinite(tree.x_scale).all()
        tree.init_balanced(x, y, cuts="greedy")
        out = tree(x, noise=False)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.exp().sum(-1), torch.ones(100, dtype=torch.float64))
        assert tree.hard_leaf(x).shape == (100,)


def test_decision_rules_route_and_print_missing_values():
    rules = trees.DecisionRules(
        feature=torch.tensor([0, 1, 1]),
        threshold=torch.tensor([0.5, 0.0, 2.0]),
        greater=torch.tensor([True, True, True]),
        leaf_values=["a", "b", "c", "d"],
        missing_right=torch.tensor([True, False, True]),
    )
    x = torch.tensor([[NAN, 1.0], [NAN, NAN], [0.0, NAN], [1.0, 3.0]])
    assert rules.route(x).tolist() == [2, 3, 0, 3]
    text = rules.export_text(show_missing=True)
    assert "x_0 >  0.500 or missing" in text and "x_1 <= 0.000 or missing" in text
    assert "or missing" not in rules.export_text()  # the default text is unchanged
    # x_1 > 2 under x_1 <= 0 is unreachable for an observed x_1, but a missing one (sent
    # left at the root) goes right at node 2; node 3 (x_1 > 0, no missing value reaches
    # it) decides x_1 > -1 and prints its right leaf alone
    chained = trees.DecisionRules(
        feature=torch.tensor([1, 1, 1]),
        threshold=torch.tensor([0.0, 2.0, -1.0]),
        greater=torch.tensor([True, True, True]),
        leaf_values=["a", "b", "c", "d"],
        missing_right=torch.tensor([False, True, False]),
    )
    pruned = chained.export_text()
    kept = chained.export_text(show_missing=True)
    assert "|   |--- x_1 >  2.000 or missing" in kept and "x_1 >  2.000" not in pruned
    assert kept.splitlines()[-1] == "|   |--- d" and kept.count("|   |   |--- ") == 2
