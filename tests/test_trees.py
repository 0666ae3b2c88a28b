import math

import pytest
import torch

from pyro_trees import trees


@pytest.mark.parametrize("depth", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leaf_probabilities_sum_to_one(depth, dtype):
    logits = torch.randn(7, trees.num_internal(depth), dtype=dtype) * 3
    lp = trees.leaf_log_probs(logits)
    assert lp.shape == (7, 2**depth) and lp.dtype == dtype
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(7, dtype=dtype))


def test_leaf_log_probs_match_path_products():
    depth = 3
    logits = torch.randn(trees.num_internal(depth), dtype=torch.float64)
    lp = trees.leaf_log_probs(logits)
    bits = trees.leaf_bits(depth)
    for leaf in range(2**depth):
        node, expected = 1, 0.0
        for d in range(depth):
            b = int(bits[leaf, d])
            z = float(logits[node - 1])
            expected += math.log(1 / (1 + math.exp(-z))) if b else math.log(1 / (1 + math.exp(z)))
            node = 2 * node + b
        assert abs(float(lp[leaf]) - expected) < 1e-12


def test_depth_16_float32_does_not_underflow():
    depth = 16
    logits = torch.full((trees.num_internal(depth),), 30.0, dtype=torch.float32)
    lp = trees.leaf_log_probs(logits)
    assert torch.isfinite(lp).all()
    # The least likely leaf goes left 16 times against log-odds 30: about -480 nats,
    # far below float32's smallest probability, yet finite in log space.
    assert float(lp.min()) == pytest.approx(16 * -30.0, rel=1e-4)
    assert float(lp.logsumexp(-1)) == pytest.approx(0.0, abs=1e-4)


def test_node_log_reach_is_consistent():
    depth = 4
    lp = trees.leaf_log_probs(torch.randn(3, trees.num_internal(depth), dtype=torch.float64))
    reach = trees.node_log_reach(lp)
    assert reach.shape == (3, 2 ** (depth + 1) - 1)
    torch.testing.assert_close(reach[:, 0], torch.zeros(3, dtype=torch.float64))
    for node in range(1, 2**depth):  # internal: children add up to the parent
        both = torch.logaddexp(reach[:, 2 * node - 1], reach[:, 2 * node])
        torch.testing.assert_close(both, reach[:, node - 1])


def test_hard_route_matches_heap_walk():
    depth = 4
    go_right = torch.rand(50, trees.num_internal(depth)) > 0.5
    leaf = trees.hard_route(go_right)
    for i in range(50):
        node = 1
        for _ in range(depth):
            node = 2 * node + int(go_right[i, node - 1])
        assert int(leaf[i]) == node - 2**depth


def test_depth_one_hard_route_and_leaf_bits():
    assert trees.leaf_bits(2).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert trees.hard_route(torch.tensor([[True], [False]])).tolist() == [1, 0]


def test_heap_helpers():
    assert trees.parent(5) == 2 and trees.left_child(3) == 6 and trees.right_child(3) == 7
    assert trees.depth_of(1) == 0 and trees.depth_of(7) == 2 and trees.depth_of(8) == 3
    with pytest.raises(ValueError):
        trees.parent(1)


def _random_rules(depth, n_features, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = trees.num_internal(depth)
    return trees.DecisionRules(
        torch.randint(n_features, (n,), generator=g),
        torch.randn(n, generator=g),
        torch.rand(n, generator=g) > 0.5,
        [f"leaf {i}" for i in range(2**depth)],
    )


def test_rules_reproduce_hard_routing():
    rules = _random_rules(4, 3)
    x = torch.randn(500, 3)
    leaf = rules.route(x)
    ops = {
        "<=": lambda a, t: a <= t,
        ">": lambda a, t: a > t,
        ">=": lambda a, t: a >= t,
        "<": lambda a, t: a < t,
    }
    conditions = rules.leaf_conditions()
    for i in range(500):
        satisfied = [all(ops[op](float(x[i, f]), t) for f, op, t in conds) for conds in conditions]
        assert satisfied.count(True) == 1
        assert satisfied.index(True) == int(leaf[i])


def test_export_text_lists_every_leaf():
    rules = _random_rules(2, 2)
    text = rules.export_text(feature_names=["a", "b"], prune=False)
    assert text.count("leaf ") == 4
    assert text.startswith("|--- ")
    assert all(line.startswith("|") for line in text.splitlines())


def _pulse_rules_with_an_impossible_branch():
    # root: x <= 0 goes left. Left child: x <= 1.5, whose right side (x <= 0 and
    # x > 1.5) is empty. Right child (greater=False: right iff x < -1), whose right side
    # (x > 0 and x < -1) is empty too.
    return trees.DecisionRules(
        feature=torch.tensor([0, 0, 0]),
        threshold=torch.tensor([0.0, 1.5, -1.0]),
        greater=torch.tensor([True, True, False]),
        leaf_values=["a", "b", "c", "d"],
    )


def test_export_text_prunes_unreachable_branches():
    rules = _pulse_rules_with_an_impossible_branch()
    assert rules.leaf_reachable().tolist() == [True, False, True, False]
    text = rules.export_text(feature_names=["x"])
    assert text == "|--- x <= 0.000\n|   |--- a\n|--- x >  0.000\n|   |--- c\n"
    full = rules.export_text(feature_names=["x"], prune=False)
    assert full.count("|--- ") == 10 and "x >  1.500" in full


def test_export_text_keeps_a_boundary_point_and_drops_infinite_tests():
    # x <= 0 then x >= 0 (greater=False): only x == 0 goes left there, still reachable;
    # a threshold of +inf (a zero slope) sends everything one way
    rules = trees.DecisionRules(
        feature=torch.tensor([0, 0, 1]),
        threshold=torch.tensor([0.0, 0.0, math.inf]),
        greater=torch.tensor([True, False, True]),
        leaf_values=["a", "b", "c", "d"],
    )
    assert rules.leaf_reachable().tolist() == [True, True, True, False]
    text = rules.export_text()
    assert text.count("|--- ") == 7 and "inf" not in text and text.endswith("|   |--- c\n")


@pytest.mark.parametrize("seed", range(5))
def test_pruned_rules_hold_every_routed_leaf_once(seed):
    rules = _random_rules(4, 2, seed=seed)
    reachable = rules.leaf_reachable()
    x = torch.randn(2000, 2, generator=torch.Generator().manual_seed(seed)) * 2
    assert bool(reachable[rules.route(x)].all())
    text = rules.export_text()
    for i, value in enumerate(rules.leaf_values):
        assert text.count(f"|--- {value}\n") == int(reachable[i])


def test_depth_one_split_uses_node_logit():
    lp = trees.leaf_log_probs(torch.tensor([[0.0], [100.0]]))
    torch.testing.assert_close(lp.exp(), torch.tensor([[0.5, 0.5], [0.0, 1.0]]))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
def test_check_depth_rejects_bad_depth(bad):
    with pytest.raises(ValueError, match="depth"):
        trees.check_depth(bad)


def test_check_depth_says_how_much_memory_is_needed():
    with pytest.raises(ValueError, match=r"2\*\*40 .*would need about 15.6 PiB"):
        trees.check_depth(40, num_points=1000, max_bytes=2**30)
    assert trees.check_depth(3, num_points=10) == 3
    with pytest.raises(ValueError, match=r"the leaf values would need about 4.0 GiB.*depth\.$"):
        trees.check_depth(20, width=2**8, what="the leaf values", max_bytes=2**30)


def test_check_depth_asks_the_device_only_for_a_need_above_a_mebibyte(monkeypatch):
    asked = []
    monkeypatch.setattr(trees, "_available_memory_bytes", lambda device: asked.append(1) or 2**19)
    assert trees.check_depth(16) == 16  # 4 x 2**16 x 4 bytes = 1 MiB
    assert asked == []
    with pytest.raises(ValueError, match="about 2.0 MiB but only 512.0 KiB"):
        trees.check_depth(17)
    assert asked == [1]


def test_node_logits_must_be_a_full_tree():
    with pytest.raises(ValueError, match="2\\*\\*D - 1"):
        trees.leaf_log_probs(torch.zeros(4))


def test_conditional_logits_invert_leaf_log_probs_and_aggregates_weight_by_reach():
    torch.manual_seed(0)
    z = torch.randn(2, 5, 7, dtype=torch.float64) * 3  # batch (2,), 5 points, depth 3
    lp = trees.leaf_log_probs(z)
    torch.testing.assert_close(trees.conditional_right_logits(lp), z)
    alpha, mass = trees.aggregate_right_probs(lp)
    assert alpha.shape == mass.shape == (2, 7)
    reach = trees.node_log_reach(lp).exp()  # (2, 5, 15)
    torch.testing.assert_close(mass, reach[..., :7].sum(-2))
    torch.testing.assert_close(mass[..., 0], torch.full((2,), 5.0, dtype=torch.float64))
    # alpha_i = sum_n P_n(i) sigmoid(z_ni) / sum_n P_n(i)  (eq. 26 of App. D)
    torch.testing.assert_close(alpha, (reach[..., :7] * torch.sigmoid(z)).sum(-2) / mass)


def test_cuda_budget_counts_the_caching_allocators_unused_blocks(monkeypatch):
    # No GPU needed: the three CUDA queries are stubbed.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100, 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 700)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 650)
    assert trees._available_memory_bytes("cuda") == 150
    assert trees._available_memory_bytes(torch.device("cuda", 0)) == 150


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_logits_log_reach_equals_the_level_by_level_pass(depth):
    """The two products with the ancestor matrices give ``splits_log_reach`` of
    ``logsigmoid(z)`` and ``logsigmoid(-z)``, values and gradients (a batch of rows)."""
    z = torch.randn(2, 7, (1 << depth) - 1, dtype=torch.float64, requires_grad=True)
    got = trees.logits_log_reach(z)
    want = trees.splits_log_reach(
        torch.nn.functional.logsigmoid(z), torch.nn.functional.logsigmoid(-z)
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(got)
    (g,) = torch.autograd.grad((got * w).sum(), z)
    (h,) = torch.autograd.grad((want * w).sum(), z)
    torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)
    left, right = trees.ancestor_paths((1 << depth) - 1, torch.float64)
    assert left.shape == right.shape == ((1 << depth) - 1, (2 << depth) - 1)
    assert not (left * right).any() and (left + right)[:, 0].sum() == 0  # the root: none
    assert (left + right).sum(0).tolist() == [trees.depth_of(i) for i in range(1, 2 << depth)]


def test_logits_log_reach_keeps_float32_precision_at_large_logits():
    """Every summand is at most 0, so large logits do not cancel: the probabilities of
    reaching the nodes in float32 are those of float64 to 1e-7 (a difference of two sums,
    logsigmoid(z) over the ancestors minus z over the right turns, was off by 1e-5 at
    |z| = 30 and 4e-4 at |z| = 1e4)."""
    z = torch.randn(500, 15, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for size in (30.0, 1e4):
        want = trees.logits_log_reach(z * size).exp()
        got = trees.logits_log_reach((z * size).float()).double().exp()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n_int", [0, 2, 4, 6])
def test_ancestor_paths_refuse_an_incomplete_tree(n_int):
    with pytest.raises(ValueError, match="2\\*\\*D - 1"):
        trees.ancestor_paths(n_int)
    if n_int:
        with pytest.raises(ValueError, match="2\\*\\*D - 1"):
            trees.logits_log_reach(torch.zeros(3, n_int))
