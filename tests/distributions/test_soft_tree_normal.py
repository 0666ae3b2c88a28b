import math

import pytest
import torch

from pyro_trees.distributions import SoftTreeNormal, TreeNormal
from pyro_trees.infer import parents_to_probs

TREES = {
    "chain": [-1, 0, 1, 2, 3, 4],
    "star": [3, 3, 3, -1, 3, 3, 3],
    "forest": [-1, 0, 0, 1, -1, 4, 3, -1],
    "random": [5, 7, 0, 8, 5, -1, 4, 2, 2, 0],
    "isolated": [-1, -1, -1],
}


def random_soft(n, gen, dtype=torch.float64):
    logits = torch.randn(n, n + 1, generator=gen, dtype=dtype)
    logits[torch.arange(n), torch.arange(n)] = -math.inf
    return torch.softmax(logits, -1)


def params(n, d, gen, batch=()):
    loc = torch.randn(batch + (n, d), generator=gen, dtype=torch.float64)
    scale = torch.rand(batch + (n, d), generator=gen, dtype=torch.float64) + 0.3
    rho = torch.rand(batch + (n, n, d), generator=gen, dtype=torch.float64) * 1.9 - 0.95
    return loc, scale, rho


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("d", [1, 3])
def test_exact_at_hard_parents(name, d):
    gen = torch.Generator().manual_seed(len(name) * 10 + d)
    parents = torch.tensor(TREES[name])
    n = parents.numel()
    loc, scale, rho = params(n, d, gen)
    q = SoftTreeNormal(loc, scale, parents_to_probs(parents), rho)
    safe = parents.clamp_min(0)
    edge_rho = torch.where((parents < 0)[:, None], 0.0, rho[torch.arange(n), safe])
    t = TreeNormal(loc, scale, parents, edge_rho)
    torch.testing.assert_close(q.log_det, torch.zeros(d, dtype=torch.float64), atol=1e-12, rtol=0)
    eps = torch.randn(4, n, d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(q.whiten_inverse(eps), t.whiten_inverse(eps), atol=1e-12, rtol=0)
    z = t.rsample((5,))
    torch.testing.assert_close(q.log_prob(z), t.log_prob(z), atol=1e-10, rtol=0)
    torch.testing.assert_close(q.entropy(), t.entropy(), atol=1e-10, rtol=0)
    torch.testing.assert_close(q.covariance_matrix, t.covariance_matrix, atol=1e-12, rtol=0)
    torch.testing.assert_close(q.variance, t.variance, atol=1e-12, rtol=0)
    # the same random stream gives the same samples as z = loc + scale * L eps
    torch.manual_seed(3)
    zq = q.rsample((2,))
    torch.manual_seed(3)
    eps = torch.randn(2, n, d, dtype=torch.float64)
    torch.testing.assert_close(zq, loc + scale * t.whiten_inverse(eps), atol=1e-12, rtol=0)
    # the hard tree read back, and the (N, N) form of probs without the root column
    assert torch.equal(q.hard_parents(), parents)
    t2 = q.to_tree_normal()
    torch.testing.assert_close(t2.log_prob(z), t.log_prob(z), atol=1e-12, rtol=0)
    q2 = SoftTreeNormal(loc, scale, parents_to_probs(parents)[:, :n], rho)
    torch.testing.assert_close(q2.log_prob(z), q.log_prob(z), atol=1e-12, rtol=0)


def test_per_child_rho_is_tree_normal_rho():
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor(TREES["random"])
    n, d = parents.numel(), 2
    loc, scale, _ = params(n, d, gen)
    rho_child = torch.rand(n, d, generator=gen, dtype=torch.float64) - 0.5
    q = SoftTreeNormal(
        loc, scale, parents_to_probs(parents), rho_child.unsqueeze(-2).expand(n, n, d)
    )
    t = TreeNormal(loc, scale, parents, rho_child)
    z = t.rsample((3,))
    torch.testing.assert_close(q.log_prob(z), t.log_prob(z), atol=1e-12, rtol=0)


@pytest.mark.parametrize("d", [1, 2])
def test_soft_parents_match_dense_gaussian(d):
    gen = torch.Generator().manual_seed(d)
    n = 6
    loc, scale, rho = params(n, d, gen)
    q = SoftTreeNormal(loc, scale, random_soft(n, gen), rho)
    assert (q.log_det.abs() > 1e-3).all()  # soft parents: not a forest
    cov = q.covariance_matrix
    mvn = torch.distributions.MultivariateNormal(loc.reshape(-1), cov)
    z = q.rsample((7,))
    torch.testing.assert_close(q.log_prob(z), mvn.log_prob(z.reshape(7, -1)), atol=1e-10, rtol=0)
    torch.testing.assert_close(q.entropy(), mvn.entropy(), atol=1e-10, rtol=0)
    torch.testing.assert_close(q.variance.reshape(-1), cov.diagonal(), atol=1e-12, rtol=0)
    # the dimensions are independent
    mask = torch.eye(d, dtype=torch.bool).repeat(n, n)
    assert (cov[~mask] == 0).all()
    # empirical covariance of many samples
    zs = q.rsample((40000,)).reshape(40000, -1)
    emp = torch.cov(zs.T)
    assert (emp - cov).abs().max() < 0.06 * cov.diagonal().max()


def test_batch_shapes_and_expand():
    gen = torch.Generator().manual_seed(5)
    n, d = 5, 2
    loc, scale, rho = params(n, d, gen, batch=(3,))
    probs = torch.stack([random_soft(n, gen) for _ in range(3)])
    q = SoftTreeNormal(loc, scale, probs, rho)
    assert q.batch_shape == (3,) and q.event_shape == (n, d)
    z = q.rsample((4,))
    assert z.shape == (4, 3, n, d)
    lp = q.log_prob(z)
    assert lp.shape == (4, 3)
    for b in range(3):
        qb = SoftTreeNormal(loc[b], scale[b], probs[b], rho[b])
        torch.testing.assert_close(lp[:, b], qb.log_prob(z[:, b]), atol=1e-10, rtol=0)
        torch.testing.assert_close(q.entropy()[b], qb.entropy(), atol=1e-10, rtol=0)
    # unbatched probs and rho broadcast against batched loc
    q1 = SoftTreeNormal(loc, scale, probs[0], rho[0])
    assert q1.batch_shape == (3,) and q1.rsample().shape == (3, n, d)
    e = q1.expand((2, 3))
    assert e.batch_shape == (2, 3) and e.log_prob(e.rsample()).shape == (2, 3)


def test_gradients_reach_all_parameters():
    gen = torch.Generator().manual_seed(7)
    n, d = 5, 2
    loc, scale, rho = (t.requires_grad_() for t in params(n, d, gen))
    logits = torch.randn(n, n + 1, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.eye(n, n + 1, dtype=torch.bool)
    probs = torch.softmax(logits.masked_fill(mask, -math.inf), -1)
    q = SoftTreeNormal(loc, scale, probs, rho)
    z = q.rsample((3,))
    (z.pow(2).sum() + q.entropy() + q.log_prob(z.detach()).sum()).backward()
    for t in (loc, scale, rho, logits):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_entropy_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(8)
    n = 4
    loc, scale, rho = params(n, 1, gen)
    mask = torch.eye(n, n + 1, dtype=torch.bool)

    def h(logits, rho):
        probs = torch.softmax(logits.masked_fill(mask, -math.inf), -1)
        return SoftTreeNormal(loc, scale, probs, rho).entropy()

    logits = torch.randn(n, n + 1, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(h, (logits, rho.clone().requires_grad_()))


def test_bad_input_raises():
    gen = torch.Generator().manual_seed(9)
    n, d = 4, 2
    loc, scale, rho = params(n, d, gen)
    p = random_soft(n, gen)
    with pytest.raises(ValueError, match="probs must have shape"):
        SoftTreeNormal(loc, scale, p[:, :2], rho)
    with pytest.raises(ValueError, match="rho must have shape"):
        SoftTreeNormal(loc, scale, p, rho[..., 0])
    with pytest.raises(ValueError, match="rho must have shape"):
        SoftTreeNormal(loc, scale, p, torch.zeros(n, n, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not broadcast"):
        SoftTreeNormal(loc, scale[:, :1].expand(n, 3), p, rho)
    with pytest.raises(ValueError, match="loc and scale must have shape"):
        SoftTreeNormal(loc[0], scale, p, rho)
    with pytest.raises(ValueError, match="batch shapes"):
        SoftTreeNormal(loc.expand(3, n, d), scale, p.expand(2, n, n + 1), rho)
    with pytest.raises(ValueError, match="torch.Tensor"):
        SoftTreeNormal(loc, scale, p.tolist(), rho)
    bad = p.clone()
    bad[1, 1] = 0.1
    with pytest.raises(ValueError, match="self-parent weight at node 1"):
        SoftTreeNormal(loc, scale, bad, rho)
    with pytest.raises(ValueError, match="sum to 1"):
        SoftTreeNormal(loc, scale, p * 0.9, rho)
    with pytest.raises(ValueError, match="at most 1"):
        SoftTreeNormal(loc, scale, p[:, :n] * 2, rho)
    neg = p.clone()
    neg[0, 1], neg[0, 2] = neg[0, 1] + 0.5, neg[0, 2] - 0.5
    with pytest.raises(ValueError, match="non-negative"):
        SoftTreeNormal(loc, scale, neg, rho)
    with pytest.raises(ValueError, match="probs contains NaN"):
        SoftTreeNormal(loc, scale, p.masked_fill(p > 0.2, math.nan), rho)
    with pytest.raises(ValueError, match=r"rho must lie in the open interval"):
        SoftTreeNormal(loc, scale, p, rho.clamp(-0.5, 0.5).index_fill(0, torch.tensor([0]), 1.0))
    with pytest.raises(ValueError, match="scale must be positive"):
        SoftTreeNormal(loc, -scale, p, rho)
    with pytest.raises(ValueError, match="loc contains NaN"):
        SoftTreeNormal(loc * math.inf, scale, p, rho)
    q = SoftTreeNormal(loc, scale, p, rho)
    with pytest.raises(ValueError, match="does not broadcast"):
        q.whiten_inverse(torch.zeros(n + 1, d, dtype=torch.float64))
    with pytest.raises(ValueError, match="unbatched"):
        SoftTreeNormal(loc, scale, p.expand(2, n, n + 1), rho).hard_parents()


@pytest.mark.cuda
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(11)
    n, d = 6, 2
    loc, scale, rho = params(n, d, gen)
    probs = random_soft(n, gen)
    q = SoftTreeNormal(loc, scale, probs, rho)
    qc = SoftTreeNormal(loc.cuda(), scale.cuda(), probs.cuda(), rho.cuda())
    eps = torch.randn(3, n, d, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(qc.whiten_inverse(eps.cuda()).cpu(), q.whiten_inverse(eps))
    z = q.rsample((2,))
    torch.testing.assert_close(qc.log_prob(z.cuda()).cpu(), q.log_prob(z))
    torch.testing.assert_close(qc.entropy().cpu(), q.entropy())
    assert qc.rsample((4,)).device.type == "cuda"
    parents = torch.tensor(TREES["forest"])
    m = parents.numel()
    lc, sc, rc = (t.cuda() for t in params(m, d, gen))
    tree = SoftTreeNormal(lc, sc, parents_to_probs(parents).cuda(), rc).to_tree_normal(parents)
    assert tree.loc.device.type == "cuda"
