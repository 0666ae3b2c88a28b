import math
import pickle

import pytest
import torch
from torch.distributions import MultivariateNormal

from pyro_trees.distributions import TreeNormal, tree_depths, validate_parents


def random_forest(n, num_roots=1, generator=None):
    """Random recursive forest: node i > num_roots - 1 picks a parent among 0..i-1."""
    parents = [-1] * num_roots
    for i in range(num_roots, n):
        parents.append(int(torch.randint(0, i, (), generator=generator)))
    perm = torch.randperm(n, generator=generator)  # relabel so parents are not sorted
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    p = torch.tensor(parents)
    out = torch.full((n,), -1, dtype=torch.long)
    for old in range(n):
        out[inv[old]] = -1 if p[old] < 0 else inv[p[old]]
    return out


def dense_cov_eq3(loc, scale, parents, rho):
    """Eq. 3 built by walking paths in Python: corr(i, j) = product of rho on the path."""
    n, d = loc.shape
    parents = parents.tolist()

    def ancestors(i):
        out = [i]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out

    cov = torch.zeros(n * d, n * d, dtype=loc.dtype)
    for i in range(n):
        ai = ancestors(i)
        for j in range(n):
            aj = ancestors(j)
            common = [a for a in ai if a in aj]
            if not common:
                continue  # different trees of the forest
            lca = common[0]
            path = ai[: ai.index(lca)] + aj[: aj.index(lca)]  # child ends of the path's edges
            c = torch.ones(d, dtype=loc.dtype)
            for t in path:
                c = c * rho[t]
            for k in range(d):
                cov[i * d + k, j * d + k] = c[k] * scale[i, k] * scale[j, k]
    return cov


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(n=7, d=3, batch=(), roots=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = random_forest(n, roots, g)
    loc = torch.randn(batch + (n, d), generator=g)
    scale = torch.rand(batch + (n, d), generator=g) + 0.3
    rho = torch.rand(n, d, generator=g) * 1.9 - 0.95
    return loc, scale, parents, rho


@pytest.mark.parametrize("n,roots", [(1, 1), (2, 1), (6, 1), (9, 3), (5, 5)])
def test_covariance_matches_eq3(n, roots):
    loc, scale, parents, rho = make(n, 2, roots=roots, seed=n)
    q = TreeNormal(loc, scale, parents, rho)
    expected = dense_cov_eq3(loc, scale, parents, rho)
    assert torch.allclose(q.covariance_matrix, expected, atol=1e-12)


def test_chain_covariance_matches_eq3():
    n, d = 8, 2
    parents = torch.arange(-1, n - 1)
    loc, scale = torch.randn(n, d), torch.rand(n, d) + 0.5
    rho = torch.rand(n, d) * 1.8 - 0.9
    for method in ("levels", "paths", "jump"):
        q = TreeNormal(loc, scale, parents, rho, method=method)
        assert torch.allclose(q.covariance_matrix, dense_cov_eq3(loc, scale, parents, rho))


@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_log_prob_and_entropy_match_dense_mvn(batch):
    loc, scale, parents, rho = make(6, 2, batch=batch, roots=2)
    q = TreeNormal(loc, scale, parents, rho)
    assert q.batch_shape == batch and q.event_shape == (6, 2)
    mvn = MultivariateNormal(loc.reshape(batch + (12,)), q.covariance_matrix)
    x = q.sample((4,))
    assert x.shape == (4,) + batch + (6, 2)
    x0, params = x.clone(), [t.clone() for t in (loc, scale, rho)]
    assert torch.allclose(q.log_prob(x), mvn.log_prob(x.reshape((4,) + batch + (12,))))
    # the in-place kernels (no autograd) leave the value and the parameters untouched
    assert torch.equal(x, x0)
    assert all(torch.equal(a, b) for a, b in zip(params, (loc, scale, rho), strict=True))
    assert torch.allclose(q.entropy(), mvn.entropy())


@pytest.mark.parametrize("batch", [(), (3,)])
def test_rho_shared_across_dimensions_counts_every_dimension(batch):
    # rho of width 1 broadcasts over the D dimensions: the log-determinant has N * D terms
    loc, scale, parents, rho = make(6, 3, batch=batch, roots=2)
    shared = rho[..., :1]
    q = TreeNormal(loc, scale, parents, shared)
    full = TreeNormal(loc, scale, parents, shared.expand(rho.shape))
    x = full.sample((4,))
    torch.testing.assert_close(q.log_prob(x), full.log_prob(x))
    mvn = MultivariateNormal(loc.reshape(batch + (18,)), full.covariance_matrix)
    torch.testing.assert_close(q.log_prob(x), mvn.log_prob(x.reshape((4,) + batch + (18,))))
    torch.testing.assert_close(q.entropy(), full.entropy())


def test_levels_and_jump_agree_on_random_trees():
    for seed in range(5):
        loc, scale, parents, rho = make(40, 3, batch=(2,), roots=1 + seed % 3, seed=seed)
        q = TreeNormal(loc, scale, parents, rho)
        eps = torch.randn(5, 2, 40, 3)
        a = q.whiten_inverse(eps, method="levels")
        b = q.whiten_inverse(eps, method="jump")
        assert torch.allclose(a, b, atol=1e-12)
        # whiten is the exact inverse of the recursion
        assert torch.allclose(q.whiten(q.loc + q.scale * a), eps, atol=1e-10)


def test_jump_uses_log_height_steps():
    parents = torch.arange(-1, 1000)  # a chain of 1001 nodes, height 1000
    q = TreeNormal(torch.zeros(1001, 1), torch.ones(1001, 1), parents, torch.full((1001, 1), 0.5))
    assert q.height == 1000
    assert len(q._plan.jumps) == 10  # ceil(log2(1001))
    assert q._choose_method() == "paths"  # auto: the heavy-path plan for deep trees
    assert torch.equal(tree_depths(parents), torch.arange(1001))
    assert len(q._plan.paths[2]) == 2  # a chain is one heavy path: a single round


def special_trees(n):
    """Chain, star, caterpillar (spine with one leaf per spine node), a forest of
    chains, a complete binary tree and isolated nodes, each relabelled at random."""
    g = torch.Generator().manual_seed(n)
    chain = torch.arange(-1, n - 1)
    star = torch.zeros(n, dtype=torch.long)
    star[0] = -1
    cat = torch.tensor([-1] + [max(0, 2 * ((i - 1) // 2)) if i % 2 else i - 2 for i in range(1, n)])
    chains = torch.where(torch.arange(n) % 5 == 0, -1, torch.arange(-1, n - 1))
    binary = (torch.arange(n) - 1).div(2, rounding_mode="floor")
    isolated = torch.full((n,), -1)
    out = []
    for p in (chain, star, cat, chains, binary, isolated):
        perm = torch.randperm(n, generator=g)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(n)
        q = torch.where(p < 0, -1, inv[p.clamp(min=0)])
        relabelled = torch.empty_like(p)
        relabelled[inv] = q
        out.append(validate_parents(relabelled))
    return out


def sequential_recursion(parents, rho, eps):
    """Eq. 8 node by node in Python (roots first): the reference for every plan."""
    n = parents.numel()
    u = torch.zeros_like(eps)
    done = [False] * n
    order = []
    while len(order) < n:
        for i in range(n):
            if not done[i] and (parents[i] < 0 or done[parents[i]]):
                done[i] = True
                order.append(i)
    for i in order:
        if parents[i] < 0:
            u[..., i, :] = eps[..., i, :]
        else:
            r = rho[..., i, :]
            u[..., i, :] = r * u[..., int(parents[i]), :] + (1 - r**2).sqrt() * eps[..., i, :]
    return u


@pytest.mark.parametrize("grad", [False, True])
def test_all_plans_equal_sequential_recursion(grad):
    """levels, paths and jump, with and without autograd (in-place kernels), reproduce
    eq. 8 applied node by node, on random forests and on special shapes."""
    g = torch.Generator().manual_seed(11)
    trees = [random_forest(n, r, g) for n, r in ((1, 1), (2, 1), (37, 1), (64, 4), (101, 7))]
    trees += special_trees(23) + special_trees(64)
    for parents in trees:
        n = parents.numel()
        rho = (torch.rand(n, 3, generator=g) * 1.9 - 0.95).requires_grad_(grad)
        eps = torch.randn(2, n, 3, generator=g)
        ref = sequential_recursion(parents, rho.detach(), eps)
        q = TreeNormal(torch.zeros(n, 3), torch.ones(n, 3), parents, rho)
        for method in ("levels", "paths", "jump"):
            u = q.whiten_inverse(eps.clone(), method=method)
            assert u.requires_grad == grad
            assert torch.allclose(u, ref, atol=1e-12), (method, parents.tolist())


def test_paths_rounds_are_logarithmic():
    for parents in special_trees(1000) + [random_forest(1000, 3, torch.Generator().manual_seed(1))]:
        q = TreeNormal(torch.zeros(1000, 1), torch.ones(1000, 1), parents, torch.zeros(1000, 1))
        perm, inv, offsets, root_pos, head_pos, rounds = q._plan.paths
        assert len(offsets) - 1 <= 1 + math.log2(1000)  # light depth <= log2 N
        assert torch.equal(perm[inv], torch.arange(1000))
        assert root_pos.numel() == int((parents < 0).sum())
        # within a path each node follows its parent
        nonhead = torch.ones(1000, dtype=torch.bool)
        nonhead[head_pos] = False
        pos = torch.arange(1000)[nonhead]
        assert torch.equal(parents[perm[pos]], perm[pos - 1])


def test_rsample_methods_same_law_in_place():
    """In-place (no autograd) rsample of every plan: exact moments via a fixed seed
    are not comparable across plans (noise order differs), so compare the empirical
    covariance of each with the dense eq. 3 matrix."""
    loc, scale, parents, rho = make(5, 2, roots=2, seed=8)
    for method in ("levels", "paths", "jump"):
        q = TreeNormal(loc, scale, parents, rho, method=method)
        with torch.no_grad():
            x = q.rsample((100000,)).reshape(-1, 10)
        assert torch.allclose(x.mean(0), loc.reshape(-1), atol=0.03)
        assert torch.allclose(torch.cov(x.T), q.covariance_matrix, atol=0.04)


def test_empirical_covariance():
    loc, scale, parents, rho = make(5, 2, roots=2, seed=3)
    q = TreeNormal(loc, scale, parents, rho)
    x = q.sample((200000,)).reshape(-1, 10)
    emp = torch.cov(x.T)
    assert torch.allclose(x.mean(0), loc.reshape(-1), atol=0.02)
    assert torch.allclose(emp, q.covariance_matrix, atol=0.03)


def test_gradients_reach_loc_scale_rho():
    loc, scale, parents, rho = make(6, 2, roots=1, seed=4)
    loc.requires_grad_()
    scale.requires_grad_()
    rho.requires_grad_()
    for method in ("levels", "paths", "jump"):
        q = TreeNormal(loc, scale, parents, rho, method=method)
        (q.rsample((3,)).pow(2).sum() + q.entropy()).backward()
        non_root = parents >= 0
        for t in (loc, scale):
            assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
        assert rho.grad[non_root].abs().sum() > 0
        assert torch.all(rho.grad[~non_root] == 0)  # root entries are ignored
        loc.grad = scale.grad = rho.grad = None


def test_gradcheck_log_prob_and_rsample():
    loc, scale, parents, rho = make(4, 1, roots=1, seed=5)
    x = torch.randn(4, 1)
    eps = torch.randn(2, 4, 1)

    def lp(loc, scale, rho):
        return TreeNormal(loc, scale, parents, rho).log_prob(x)

    args = tuple(t.clone().requires_grad_() for t in (loc, scale, rho))
    assert torch.autograd.gradcheck(lp, args)
    for method in ("levels", "paths", "jump"):

        def rs(loc, scale, rho, method=method):
            q = TreeNormal(loc, scale, parents, rho, method=method)
            return q.loc + q.scale * q.whiten_inverse(eps)

        assert torch.autograd.gradcheck(rs, args)


@pytest.mark.parametrize(
    "parents,match",
    [
        ([-1, 2, 1], "cycle"),
        ([1, 2, 0], "cycle"),
        ([-1, 0, 5], "out of range"),
        ([-1, -2, 0], "out of range"),
        ([-1, 1, 0], "self-loop"),
        ([[-1, 0]], "one-dimensional"),
        ([-1.0, 0.0], "integer"),
    ],
)
def test_validate_parents_errors(parents, match):
    with pytest.raises(ValueError, match=match):
        validate_parents(parents)


def test_validate_parents_accepts_forest():
    assert validate_parents([-1, 0, -1, 2, 2]).tolist() == [-1, 0, -1, 2, 2]
    with pytest.raises(ValueError, match="3 nodes"):
        validate_parents([-1, 0], num_nodes=3)


def test_bad_parameters_raise():
    loc, scale, parents, rho = make(4, 2)
    with pytest.raises(ValueError, match="rho"):
        TreeNormal(loc, scale, parents, torch.full((4, 2), 1.0))
    with pytest.raises(ValueError, match="loc"):
        TreeNormal(loc.clone().fill_(float("nan")), scale, parents, rho)
    with pytest.raises(ValueError, match="scale"):
        TreeNormal(loc, scale.clone().fill_(float("inf")), parents, rho)
    with pytest.raises(ValueError, match="scale"):
        TreeNormal(loc, -scale, parents, rho)
    with pytest.raises(ValueError, match="instances"):
        TreeNormal(loc, scale, torch.tensor([-1, 0, 1]), rho)
    with pytest.raises(ValueError, match="shape mismatch"):
        TreeNormal(loc, scale, parents, torch.zeros(4, 3))
    with pytest.raises(ValueError, match="shape"):
        TreeNormal(loc[0], scale, parents, rho)
    with pytest.raises(ValueError, match="cycle"):
        TreeNormal(loc, scale, torch.tensor([1, 0, -1, 0]), rho)
    with pytest.raises(ValueError, match="method"):
        TreeNormal(loc, scale, parents, rho, method="fast")


def test_contract_expand_support_repr_pickle():
    loc, scale, parents, rho = make(5, 2)
    q = TreeNormal(loc, scale, parents, rho)
    assert set(q.arg_constraints) == {"loc", "scale", "rho"}
    assert q.support.event_dim == 2
    assert bool(q.support.check(q.sample()))
    assert "TreeNormal" in repr(q) and "(5, 2)" in repr(q)
    e = q.expand((3, 2))
    assert e.batch_shape == (3, 2) and e.sample().shape == (3, 2, 5, 2)
    x = q.sample()
    assert torch.allclose(e.log_prob(x), q.log_prob(x).expand(3, 2))
    assert torch.allclose(e.entropy(), q.entropy().expand(3, 2))
    r = pickle.loads(pickle.dumps(q))
    assert torch.allclose(r.log_prob(x), q.log_prob(x))
    assert torch.equal(r.parents, q.parents)
    assert q.mean is q.loc and torch.allclose(q.variance, scale**2)


def test_covariance_too_large_raises():
    n = 10000
    q = TreeNormal(torch.zeros(n, 1), torch.ones(n, 1), torch.arange(-1, n - 1), torch.zeros(n, 1))
    with pytest.raises(ValueError, match="max_dense"):
        _ = q.covariance_matrix


def test_float32():
    loc, scale, parents, rho = make(6, 2)
    q = TreeNormal(loc.float(), scale.float(), parents, rho.float())
    assert q.rsample().dtype == torch.float32 and q.log_prob(q.sample()).dtype == torch.float32


@pytest.mark.cuda
def test_cuda():
    loc, scale, parents, rho = make(6, 2)
    dev = torch.device("cuda")
    c = TreeNormal(loc, scale, parents, rho).covariance_matrix
    for method in ("levels", "paths", "jump"):
        q = TreeNormal(loc.to(dev), scale.to(dev), parents.to(dev), rho.to(dev), method=method)
        x = q.rsample((3,))
        assert x.device.type == "cuda" and q.log_prob(x).device.type == "cuda"
        assert torch.allclose(q.covariance_matrix.cpu(), c)
