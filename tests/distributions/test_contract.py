"""Every distribution of ``pyro_trees.distributions`` keeps Pyro's distribution contract.

One parametrised test per property, over every distribution (as zuko tests all its flows
with one test): sample shapes, values in the support, ``log_prob`` shapes and finiteness,
``expand`` to a larger batch, gradients of ``log_prob`` and (where ``has_rsample``) of
``rsample`` reaching every parameter, and ``enumerate_support`` where it is offered.
"""

import pytest
import torch

import pyro_trees.distributions as ptd

N, D = 4, 3
PARENTS = torch.tensor([-1, 0, 0, 1])


def _leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape, dtype=torch.float64)).requires_grad_()


def _unit(*shape):
    return torch.rand(*shape, dtype=torch.float64).mul(0.8).add(0.1).requires_grad_()


def _tree_normal():
    loc, scale, rho = _leaf(N, D), _unit(N, D), _unit(N, D)
    return ptd.TreeNormal(loc, scale, PARENTS, rho), [loc, scale, rho]


def _tree_normal_instances():
    tree, params = _tree_normal()
    return ptd.TreeNormalInstances(tree), params


def _soft_tree_normal():
    loc, scale = _leaf(N, D), _unit(N, D)
    probs = torch.full((N, N + 1), 0.2, dtype=torch.float64)
    probs[:, -1] = 0.4
    probs[torch.arange(N), torch.arange(N)] = 0.0
    probs = (probs / probs.sum(-1, keepdim=True)).requires_grad_()
    rho = _unit(N, N, D).mul(0.5).detach().requires_grad_()
    return ptd.SoftTreeNormal(loc, scale, probs, rho), [loc, scale, probs, rho]


def _mixture_of_tree_normals():
    loc, scale, rho = _leaf(2, N, D), _unit(2, N, D), _unit(2, N, D)
    parents = torch.stack([PARENTS, torch.tensor([1, -1, 1, 2])])
    logits = _leaf(2)
    return ptd.MixtureOfTreeNormals(loc, scale, parents, rho, logits), [loc, scale, rho, logits]


def _kronecker_normal():
    a = torch.randn(N, N, dtype=torch.float64)
    tril = torch.linalg.cholesky(a @ a.T + N * torch.eye(N, dtype=torch.float64))
    tril = tril.requires_grad_()
    return ptd.KroneckerNormal(tril, D), [tril]


def _joint_gaussian_slice():
    n, s = 2 * D, 3
    loc = _leaf(N, n)
    tril = torch.eye(n, dtype=torch.float64) + 0.3 * torch.randn(n, n, dtype=torch.float64).tril(-1)
    tril = tril.requires_grad_()
    mean, cross = loc.detach()[0], 0.2 * torch.randn(n, s, dtype=torch.float64)
    return ptd.JointGaussianSlice(loc, tril, (2, D), mean=mean, cross=cross), [loc, tril]


def _split_indicator():
    probs = _unit(5)
    return ptd.SplitIndicator(probs), [probs]


def _relaxed_split_indicator():
    logits = _leaf(5)
    return ptd.RelaxedSplitIndicator(logits, 0.5), [logits]


def _tree_routing():
    logits = _leaf(N, 2**2)
    return ptd.TreeRouting(logits), [logits]


def _tree_balance():
    return ptd.TreeBalance(2, N), []


def _balanced_leaf():
    return ptd.BalancedLeaf(2, N, dtype=torch.float64), []


FACTORIES = {
    f.__name__.strip("_"): f
    for f in (
        _tree_normal,
        _tree_normal_instances,
        _soft_tree_normal,
        _mixture_of_tree_normals,
        _kronecker_normal,
        _joint_gaussian_slice,
        _split_indicator,
        _relaxed_split_indicator,
        _tree_routing,
        _tree_balance,
        _balanced_leaf,
    )
}


def test_every_public_distribution_is_covered():
    classes = {
        name
        for name in ptd.__all__
        if isinstance(getattr(ptd, name), type)
        and issubclass(getattr(ptd, name), torch.distributions.Distribution)
    }
    covered = {type(f()[0]).__name__ for f in FACTORIES.values()}
    assert classes == covered


@pytest.fixture(params=list(FACTORIES), ids=list(FACTORIES))
def made(request):
    torch.manual_seed(0)
    return FACTORIES[request.param]()


def test_sample_shapes_and_support(made):
    d, _ = made
    shape = d.batch_shape + d.event_shape
    assert d.sample().shape == shape
    x = d.sample((3,))
    assert x.shape == (3,) + shape
    assert bool(d.support.check(x).all())


def test_log_prob_shape_and_finite(made):
    d, _ = made
    x = d.sample((3,))
    lp = d.log_prob(x)
    assert lp.shape == (3,) + d.batch_shape
    assert torch.isfinite(lp).all()


def test_expand(made):
    d, _ = made
    big = d.expand((2,) + d.batch_shape)
    x = big.sample()
    assert x.shape == (2,) + d.batch_shape + d.event_shape
    assert big.log_prob(x).shape == (2,) + d.batch_shape
    torch.testing.assert_close(big.log_prob(x)[0], d.log_prob(x[0]))


def test_log_prob_gradient_reaches_every_parameter(made):
    d, params = made
    if not params:
        pytest.skip(f"{type(d).__name__} has no tensor parameters")
    x = d.sample((2,)).detach()
    d.log_prob(x).sum().backward()
    for p in params:
        assert p.grad is not None and torch.isfinite(p.grad).all()


def test_rsample_gradient(made):
    d, params = made
    if not d.has_rsample:
        pytest.skip(f"{type(d).__name__} is not reparameterised")
    z = d.rsample((2,))
    assert z.requires_grad
    (z**2).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in params)


def test_enumerate_support(made):
    d, _ = made
    if not d.has_enumerate_support:
        pytest.skip(f"{type(d).__name__} does not enumerate")
    values = d.enumerate_support(expand=False)
    assert bool(d.support.check(values).all())
    total = d.log_prob(values).logsumexp(0)
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-6, rtol=0)
