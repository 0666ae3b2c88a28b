import pickle

import pytest
import torch
from torch.distributions import MultivariateNormal

from pyro_trees.distributions import MixtureOfTreeNormals, TreeNormal


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(batch=(), m=2, n=4, d=2):
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 0], [2, -1, 1, 2]])[:m]
    loc = torch.randn(batch + (m, n, d))
    scale = torch.rand(batch + (m, n, d)) + 0.4
    rho = torch.rand(m, n, d) * 1.8 - 0.9
    logits = torch.randn(batch + (m,))
    return loc, scale, parents, rho, logits


@pytest.mark.parametrize("batch", [(), (3,)])
def test_log_prob_matches_dense_mixture(batch):
    loc, scale, parents, rho, logits = make(batch, m=3)
    q = MixtureOfTreeNormals(loc, scale, parents, rho, logits)
    assert q.batch_shape == batch and q.event_shape == (4, 2)
    x = q.sample((5,))
    assert x.shape == (5,) + batch + (4, 2)
    dense = []
    for k in range(3):
        tn = TreeNormal(loc[..., k, :, :], scale[..., k, :, :], parents[k], rho[k])
        mvn = MultivariateNormal(loc[..., k, :, :].reshape(batch + (8,)), tn.covariance_matrix)
        dense.append(mvn.log_prob(x.reshape((5,) + batch + (8,))))
    expected = (torch.stack(dense, -1) + torch.log_softmax(logits, -1)).logsumexp(-1)
    assert torch.allclose(q.log_prob(x), expected)


def test_entropy_bounds_bracket_monte_carlo_entropy():
    loc, scale, parents, rho, logits = make((), m=3)
    loc = loc * 0.3  # overlapping components make the bound gap small but positive
    q = MixtureOfTreeNormals(loc, scale, parents, rho, logits)
    x = q.sample((100000,))
    lp = q.log_prob(x)
    mc, se = -lp.mean(), lp.std() / 100000**0.5
    lower, upper = q.entropy_lower_bound(), q.entropy_upper_bound()
    assert lower <= mc + 3 * se
    assert mc - 3 * se <= upper
    assert lower < upper


def test_lower_bound_is_exact_for_identical_components():
    loc, scale, parents, rho, logits = make((), m=2)
    parents = parents[[0, 0]]
    q = MixtureOfTreeNormals(loc[:1], scale[:1], parents, rho[[0, 0]], logits)
    single = TreeNormal(loc[0], scale[0], parents[0], rho[0])
    assert torch.allclose(q.entropy_lower_bound(), single.entropy())
    x = single.sample((3,))
    assert torch.allclose(q.log_prob(x), single.log_prob(x))


def test_rsample_components_gradients():
    loc, scale, parents, rho, logits = make((), m=2)
    rho.requires_grad_()
    loc.requires_grad_()
    q = MixtureOfTreeNormals(loc, scale, parents, rho, logits)
    z = q.rsample_components((4,))
    assert z.shape == (4, 2, 4, 2)
    z.pow(2).sum().backward()
    assert loc.grad.abs().sum() > 0 and rho.grad.abs().sum() > 0


def test_bad_input_and_contract():
    loc, scale, parents, rho, logits = make((), m=2)
    with pytest.raises(ValueError, match="cycle"):
        MixtureOfTreeNormals(loc, scale, torch.tensor([[-1, 0, 0, 1], [1, 0, -1, 2]]), rho, logits)
    with pytest.raises(ValueError, match="components"):
        MixtureOfTreeNormals(loc, scale, parents[:1], rho, logits[:1])
    with pytest.raises(ValueError, match="logits"):
        MixtureOfTreeNormals(loc, scale, parents, rho, torch.zeros(3))
    with pytest.raises(ValueError, match="rho"):
        MixtureOfTreeNormals(loc, scale, parents, rho.clone().fill_(1.5), logits)
    q = MixtureOfTreeNormals(loc, scale, parents, rho, logits)
    e = q.expand((3,))
    x = q.sample()
    assert e.batch_shape == (3,) and torch.allclose(e.log_prob(x), q.log_prob(x).expand(3))
    r = pickle.loads(pickle.dumps(q))
    assert torch.allclose(r.log_prob(x), q.log_prob(x))
    assert "num_components: 2" in repr(q)
    assert q.mean.shape == (4, 2)
