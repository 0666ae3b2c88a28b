import pickle

import pytest
import torch

from pyro_trees import trees
from pyro_trees.topology import Topology, enumerate_topologies, mirror_map, num_topologies

WEDDERBURN_ETHERINGTON = [1, 1, 1, 2, 3, 6, 11, 23, 46, 98]


@pytest.mark.parametrize("n", range(1, 11))
def test_counts_are_wedderburn_etherington(n):
    tops = enumerate_topologies(n, n)
    assert len(tops) == WEDDERBURN_ETHERINGTON[n - 1] == num_topologies(n)
    assert all(t.num_experts == n and t.num_gates == n - 1 for t in tops)
    # unique up to mirror symmetry: canonical forms are pairwise distinct
    assert len({t.canonical() for t in tops}) == len(tops)


def _all_labelled(n):
    """Every ordered full binary tree with n leaves (Catalan many)."""
    if n == 1:
        return [None]
    return [(a, b) for k in range(1, n) for a in _all_labelled(k) for b in _all_labelled(n - k)]


@pytest.mark.parametrize("n", range(1, 8))
def test_enumeration_covers_every_tree(n):
    reps = set(enumerate_topologies(n, n))
    for t in _all_labelled(n):
        assert Topology.from_nested(t).canonical() in reps


def test_range_and_order():
    tops = enumerate_topologies(5, 2)
    assert [t.num_experts for t in tops] == [2, 3, 4, 4, 5, 5, 5]


def test_unbalanced_structure():
    t = Topology({1, 3})
    assert t.experts == (2, 6, 7)
    assert not t.is_balanced() and t.depth == 2
    s = t.sign_matrix()
    assert s.tolist() == [[-1, 1, 1], [0, -1, 1]]
    assert str(t) == "(E (E E))"
    assert Topology.from_experts([7, 2, 6]) == t
    assert Topology.from_nested(t.to_nested()) == t


def test_expert_log_probs_match_trees_core_for_balanced():
    logits = torch.randn(5, 7, dtype=torch.float64)
    t = Topology.balanced(3)
    assert t.is_balanced() and t.num_experts == 8
    expected = trees.leaf_log_probs(logits)
    assert torch.allclose(t.expert_log_probs(logits), expected)


def test_expert_log_probs_normalised_unbalanced():
    for t in enumerate_topologies(6, 1):
        logits = torch.randn(4, t.num_gates, dtype=torch.float64) * 3
        lp = t.expert_log_probs(logits)
        assert torch.allclose(lp.logsumexp(-1), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize(
    "gates, match",
    [
        ({2, 3}, "root"),
        ({1, 5}, "parent"),
        ({1, 0}, ">= 1"),
        ({1, 2.5}, "integers"),
        ([1, 1], "duplicates"),
        (5, "iterable"),
    ],
)
def test_invalid_topologies(gates, match):
    with pytest.raises(ValueError, match=match):
        Topology(gates)


def test_invalid_expert_sets():
    with pytest.raises(ValueError, match="ancestors"):
        Topology.from_experts([1, 2])
    with pytest.raises(ValueError, match="without an expert"):
        Topology.from_experts([2, 6])
    with pytest.raises(ValueError, match="None or a pair"):
        Topology.from_nested((None, 3))
    with pytest.raises(ValueError):
        enumerate_topologies(0)
    with pytest.raises(ValueError):
        enumerate_topologies(2, 3)


def test_hash_pickle_single_expert():
    t = Topology()
    assert t.experts == (1,) and t.num_gates == 0 and t.depth == 0
    u = Topology({1, 2, 5})
    assert pickle.loads(pickle.dumps(u)) == u
    assert len({u, Topology([5, 2, 1])}) == 1


def test_mirror_map_permutes_the_sign_matrix():
    def images(tree):
        if tree is None:
            return {None}
        return {p for a in images(tree[0]) for b in images(tree[1]) for p in ((a, b), (b, a))}

    for src in enumerate_topologies(5, 1):
        for nested in images(src.to_nested()):
            target = Topology.from_nested(nested)
            gate_src, flip, expert_src = mirror_map(src, target)
            s = src.sign_matrix(dtype=torch.float64)
            sign = 1.0 - 2.0 * torch.tensor(flip, dtype=torch.float64)
            expected = s[gate_src][:, expert_src] * sign.unsqueeze(-1)
            assert torch.equal(target.sign_matrix(dtype=torch.float64), expected)
    with pytest.raises(ValueError, match="mirror images"):
        mirror_map(Topology.balanced(1), Topology.balanced(2))
