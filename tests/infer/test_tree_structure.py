import pytest
import torch

from pyro_trees.distributions import SoftTreeNormal, validate_parents
from pyro_trees.infer.tree_structure import (
    acyclicity,
    learn_tree_structure,
    maximum_spanning_tree,
    parents_from_edges,
    parents_to_adjacency,
    parents_to_probs,
    similarity_dfs_tree,
)


def brute_force_best_tree_weight(w):
    """Best spanning-tree weight by enumerating Pruefer sequences (n <= 6)."""
    import itertools

    n = w.shape[0]
    best = -float("inf")
    for seq in itertools.product(range(n), repeat=n - 2):
        degree = [1] * n
        for s in seq:
            degree[s] += 1
        edges, seq = [], list(seq)
        for s in seq:
            leaf = min(i for i in range(n) if degree[i] == 1)
            edges.append((leaf, s))
            degree[leaf] -= 1
            degree[s] -= 1
        u, v = [i for i in range(n) if degree[i] == 1]
        edges.append((u, v))
        best = max(best, sum(float(w[a, b]) for a, b in edges))
    return best


def chow_liu_weights(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, n, generator=g) @ torch.randn(n, n, generator=g) * 0.5
    x = x + torch.randn(300, n, generator=g)
    r = torch.corrcoef(x.T)
    w = -0.5 * torch.log1p(-(r**2))
    return w.fill_diagonal_(0.0)


def test_maximum_spanning_tree_is_optimal():
    w = chow_liu_weights(6)
    parents = maximum_spanning_tree(w.masked_fill(torch.eye(6, dtype=torch.bool), -torch.inf))
    validate_parents(parents)
    assert int((parents < 0).sum()) == 1
    got = float((parents_to_adjacency(parents) * w).sum() / 2)
    assert got == pytest.approx(brute_force_best_tree_weight(w), rel=1e-6)


def test_maximum_spanning_tree_from_edge_list_gives_forest():
    edges = torch.tensor([[0, 1], [1, 2], [0, 2], [3, 4]])
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0])
    parents = maximum_spanning_tree(weights, edges=edges, num_nodes=6)
    adj = parents_to_adjacency(parents)
    assert adj[0, 1] == 1 and adj[1, 2] == 1 and adj[0, 2] == 0 and adj[3, 4] == 1
    assert int((parents < 0).sum()) == 3  # {0,1,2}, {3,4}, {5}
    with pytest.raises(ValueError, match="out of range"):
        maximum_spanning_tree(weights, edges=edges + 5, num_nodes=6)


def test_parents_from_edges_and_cycle_error():
    parents = parents_from_edges([[0, 1], [1, 2], [1, 3]], 4, root=2)
    assert parents.tolist() == [1, 2, -1, 1]
    with pytest.raises(ValueError, match="cycle"):
        parents_from_edges([[0, 1], [1, 2], [2, 0]], 3)


def test_similarity_dfs_tree_is_a_valid_tree_following_similarity():
    g = torch.Generator().manual_seed(1)
    # two well-separated clusters: DFS edges should mostly stay within a cluster
    centers = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    labels = torch.arange(60) % 2
    x = centers[labels] + torch.randn(60, 3, generator=g)
    parents = similarity_dfs_tree(x, num_neighbors=5, temperature=0.1, generator=g)
    validate_parents(parents)
    child = parents >= 0
    same = (labels[child] == labels[parents[child]]).float().mean()
    assert same > 0.9
    chain = similarity_dfs_tree(x[:10], num_neighbors=None)
    assert int((chain < 0).sum()) == 1 and int(torch.bincount(chain[chain >= 0]).max()) == 1
    with pytest.raises(ValueError, match="NaN"):
        similarity_dfs_tree(torch.full((3, 2), float("nan")))


def test_acyclicity_function():
    chain = torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 0, 0]])
    assert float(acyclicity(chain)) == pytest.approx(0.0, abs=1e-12)
    cycle = chain.clone()
    cycle[2, 0] = 1
    assert float(acyclicity(cycle)) > 0.1
    # the symmetric adjacency of any edge has a 2-cycle: hence the oriented matrix
    assert float(acyclicity(chain + chain.T)) > 0.1


def test_learned_structure_is_acyclic_and_near_chow_liu():
    n = 6
    w = chow_liu_weights(n, seed=2)
    res = learn_tree_structure(w, inner_steps=60, max_outer=15, lr=0.1, h_tol=1e-5)
    assert res.h <= 1e-5
    assert res.h_hard == pytest.approx(0.0, abs=1e-9)
    validate_parents(res.parents)
    got = float((parents_to_adjacency(res.parents) * w).sum() / 2)
    assert got >= 0.9 * brute_force_best_tree_weight(w)
    # a callable objective is accepted too
    res2 = learn_tree_structure(lambda p: (p[:, :n] * w).sum(), n, inner_steps=30, max_outer=10)
    validate_parents(res2.parents)
    assert res2.h_hard == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="square"):
        learn_tree_structure(torch.zeros(3, 4))


def test_single_root_relaxes_spanning_trees_where_the_free_one_empties():
    """With weak edge scores beside a root option worth more, the free relaxation's best
    acyclic point is the empty forest; ``single_root=True`` keeps one unit of root mass,
    so the solver must orient edges and returns a spanning tree."""
    n = 6
    w = 0.2 * chow_liu_weights(n, seed=2) / chow_liu_weights(n, seed=2).max()
    free = learn_tree_structure(w, root_score=0.5, inner_steps=60, max_outer=15, lr=0.1)
    assert free.parents.tolist() == [-1] * n
    one = learn_tree_structure(
        w, root_score=0.5, inner_steps=60, max_outer=15, lr=0.1, single_root=True
    )
    assert one.h_hard == 0.0 and int((one.parents < 0).sum()) == 1
    validate_parents(one.parents)
    torch.testing.assert_close(one.probs.sum(1), torch.ones(n, dtype=torch.float64))
    assert float(one.probs[:, n].sum()) == pytest.approx(1.0, abs=1e-9)  # one root's mass
    got = float((parents_to_adjacency(one.parents) * w).sum() / 2)
    assert got >= 0.9 * brute_force_best_tree_weight(w)


def test_parents_to_probs_is_the_hard_point_of_the_relaxation():
    parents = torch.tensor([-1, 0, 0, 1, -1, 4])
    p = parents_to_probs(parents)
    assert p.shape == (6, 7) and p.dtype == torch.float64
    assert torch.equal(p.sum(-1), torch.ones(6))
    assert p[0, 6] == 1 and p[4, 6] == 1 and p[3, 1] == 1 and p[5, 4] == 1
    # the inverse of SoftTreeNormal.hard_parents; the first N columns point child -> parent
    q = SoftTreeNormal(torch.zeros(6, 2), torch.ones(6, 2), p, torch.zeros(6, 6, 2))
    assert torch.equal(q.hard_parents(), parents)
    assert float(acyclicity(p[:, :6])) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="cycle"):
        parents_to_probs([1, 0])
    with pytest.raises(ValueError):
        parents_to_probs([-1, 0], num_nodes=3)
