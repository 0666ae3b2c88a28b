import itertools
import math
import pickle

import pytest
import torch
from torch.distributions import kl_divergence

from pyro_trees.distributions import (
    BalancedLeaf,
    TreeBalance,
    TreeRouting,
    expected_log_coupling,
    tree_balance_kl,
)


def _all_routings(depth, n):
    return torch.tensor(list(itertools.product(range(2**depth), repeat=n)))


@pytest.mark.parametrize("depth,n", [(1, 5), (2, 4), (3, 3)])
def test_log_prob_is_normalised(depth, n):
    p = TreeBalance(depth, n)
    values = _all_routings(depth, n)
    total = p.log_prob(values).logsumexp(0)
    assert float(total) == pytest.approx(0.0, abs=1e-5)


def test_depth_one_is_eq4_normalised():
    n = 6
    p = TreeBalance(1, n)
    for k in range(n + 1):
        value = torch.tensor([1] * k + [0] * (n - k))
        expected = math.log(math.comb(n, k)) - math.log(math.comb(2 * n, n))
        assert float(p.log_prob(value)) == pytest.approx(expected, abs=1e-5)


def test_balanced_routings_are_more_probable():
    p = TreeBalance(2, 8)
    balanced = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    lopsided = torch.tensor([0, 0, 0, 0, 0, 0, 0, 3])
    assert p.log_prob(balanced) > p.log_prob(lopsided)


def test_marginal_is_uniform_and_coupling_consistent():
    depth, n = 2, 3
    p = TreeBalance(depth, n)
    values = _all_routings(depth, n)
    probs = p.log_prob(values).exp()
    for leaf in range(4):
        assert float(probs[values[:, 0] == leaf].sum()) == pytest.approx(0.25, abs=1e-6)
    lhs = p.log_coupling(values)
    rhs = p.log_prob(values) - n * p.marginal.log_prob(values).sum(-1) / n
    torch.testing.assert_close(lhs, rhs)


def test_sample_frequencies_match_log_prob():
    torch.manual_seed(0)
    p = TreeBalance(1, 4)
    samples = p.sample((4000,))
    assert samples.shape == (4000, 4)
    counts = samples.sum(-1)  # number going right
    for k in range(5):
        expected = math.comb(4, k) ** 2 / math.comb(8, 4)
        assert float((counts == k).double().mean()) == pytest.approx(expected, abs=0.03)
    deep = TreeBalance(3, 10).sample((2,))
    assert deep.shape == (2, 10) and int(deep.max()) < 8 and int(deep.min()) >= 0


def test_distribution_contract():
    p = TreeBalance(2, 5)
    assert p.event_shape == (5,) and p.batch_shape == ()
    q = p.expand((3,))
    assert q.batch_shape == (3,) and q.log_prob(torch.zeros(3, 5, dtype=torch.long)).shape == (3,)
    assert p.support.check(torch.tensor([0, 1, 2, 3, 3])).all()
    assert not p.support.check(torch.tensor([0, 1, 2, 3, 4])).all()
    assert "TreeBalance" in repr(p)
    r = pickle.loads(pickle.dumps(p))
    assert r.depth == 2 and r.num_points == 5
    leaf = BalancedLeaf(2, 100).expand((7,))
    assert isinstance(leaf, BalancedLeaf) and leaf.num_points == 100 and leaf.batch_shape == (7,)
    with pytest.raises(ValueError):
        TreeBalance(0, 3)


def test_too_deep_a_prior_says_how_much_memory_it_needs(monkeypatch):
    # 4 copies x 2**40 leaves x 4 bytes (float32 counts or logits) = 16 TiB
    with pytest.raises(ValueError, match=r"2\*\*40 .*counts would need about 16.0 TiB"):
        TreeBalance(40, 3)
    with pytest.raises(ValueError, match=r"leaf logits would need about 32.0 TiB"):
        BalancedLeaf(40, 3, dtype=torch.float64)
    from pyro_trees import trees

    monkeypatch.setattr(trees, "_available_memory_bytes", lambda device: 2**26)  # 64 MiB
    p = TreeBalance(16, 64)  # the counts fit; sampling needs (2**15, 65) logits
    assert p.log_prob(torch.zeros(64, dtype=torch.long)) < 0
    with pytest.raises(ValueError, match=r"sampling the routing of 64 points.*65.0 MiB"):
        p.sample()


@pytest.mark.parametrize("depth,n", [(1, 8), (2, 5)])
def test_stirling_kl_close_to_exact(depth, n):
    torch.manual_seed(1)
    for scale in (0.3, 1.0, 3.0):
        logits = torch.randn(n, 2**depth, dtype=torch.float64) * scale
        exact = tree_balance_kl(logits, depth, method="exact")
        approx = tree_balance_kl(logits, depth, method="stirling")
        assert float(exact) >= -1e-9
        # O(1) error per internal node (the O(log N) terms of Stirling cancel).
        assert abs(float(approx - exact)) <= 1.0 * (2**depth - 1)


def test_stirling_kl_error_is_order_one_while_kl_grows():
    """Depth 1, N = 200: the exact KL needs the Poisson-binomial law of K."""
    torch.manual_seed(2)
    n = 200
    p_right = torch.rand(n, dtype=torch.float64) * 0.3  # unbalanced routing: large KL
    logits = torch.stack([torch.log1p(-p_right), torch.log(p_right)], -1)
    # Poisson-binomial distribution of K by dynamic programming.
    pk = torch.zeros(n + 1, dtype=torch.float64)
    pk[0] = 1.0
    for pi in p_right:
        pk = torch.cat([pk[:1] * (1 - pi), pk[1:] * (1 - pi) + pk[:-1] * pi])
    k = torch.arange(n + 1, dtype=torch.float64)
    log_binom = torch.lgamma(torch.tensor(n + 1.0)) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    exact_coupling = (
        (pk * log_binom).sum() - (math.lgamma(2 * n + 1) - 2 * math.lgamma(n + 1)) + n * math.log(2)
    )
    approx = expected_log_coupling(logits, 1)
    assert abs(float(approx - exact_coupling)) < 1.0
    assert float(-exact_coupling) > 10.0  # the KL itself is large


def test_sign_of_per_point_entropy_term():
    """More confident routing with the same aggregate must raise the KL (eq. 9's sign)."""
    n = 6
    vague = torch.zeros(n, 2, dtype=torch.float64)
    confident = torch.tensor([[0.0, 8.0], [8.0, 0.0]] * 3, dtype=torch.float64)
    assert tree_balance_kl(confident, 1, method="exact") > tree_balance_kl(vague, 1, method="exact")
    assert tree_balance_kl(confident, 1) > tree_balance_kl(vague, 1)


def test_registered_kl_and_routing_distribution():
    logits = torch.randn(5, 4)
    q = TreeRouting(logits)
    p = TreeBalance(2, 5)
    torch.testing.assert_close(kl_divergence(q, p), tree_balance_kl(logits, 2))
    value = q.sample()
    assert value.shape == (5,)
    assert q.log_prob(value).shape == ()
    with pytest.raises(ValueError, match="does not match"):
        kl_divergence(q, TreeBalance(2, 6))


def test_exact_kl_refuses_large_enumerations():
    with pytest.raises(ValueError, match="stirling"):
        tree_balance_kl(torch.zeros(30, 4), 2, method="exact")
    with pytest.raises(ValueError, match="method"):
        tree_balance_kl(torch.zeros(3, 4), 2, method="other")


def test_coupling_gradient_is_finite_at_hard_routing():
    logits = torch.tensor([[0.0, -200.0], [0.0, -200.0]], requires_grad=True)
    expected_log_coupling(logits, 1).backward()
    assert torch.isfinite(logits.grad).all()
