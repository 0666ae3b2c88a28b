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


def test_shared_logits_with_batched_components_sample_per_batch_element():
    """``(M,)`` logits with ``batch_shape + (M, N, D)`` components: ``sample`` draws one
    component per batch element, with the mixture weights as frequencies."""
    m, batch, n, d = 3, (4,), 4, 2
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 0], [2, -1, 1, 2]])
    # component k of batch element b sits at 10 * (k + 3 b): far apart, so a draw tells
    # which component (and which batch element) it came from
    offset = 10.0 * (torch.arange(m) + 3 * torch.arange(batch[0])[:, None])
    loc = offset[..., None, None].expand(batch + (m, n, d)).clone()
    scale = torch.full(batch + (m, n, d), 0.1)
    rho = torch.rand(m, n, d) * 1.8 - 0.9
    logits = torch.tensor([0.4, -0.8, 1.1])
    q = MixtureOfTreeNormals(loc, scale, parents, rho, logits)
    assert q.batch_shape == batch and q.logits.shape == batch + (m,)
    assert q.rsample_components((5,)).shape == (5,) + batch + (m, n, d)
    assert q.sample().shape == batch + (n, d)
    x = q.sample((4000,))
    assert x.shape == (4000,) + batch + (n, d)
    picked = (x.mean((-2, -1)) - offset[:, 0]) / 10.0  # (4000, 4): component index
    assert torch.allclose(picked, picked.round(), atol=0.2)
    picked = picked.round().long()
    assert picked.min() >= 0 and picked.max() < m
    freq = torch.stack([(picked == k).double().mean(0) for k in range(m)], -1)  # (4, M)
    expected = torch.softmax(logits, -1).expand_as(freq)
    assert (freq - expected).abs().max() < 0.03  # standard error ~0.008
    # the batch elements pick their components independently, not one index for all
    all_same = (picked == picked[:, :1]).all(-1).double().mean()
    assert abs(all_same - expected[0].pow(4).sum()) < 0.03
    assert q.log_prob(x[:3]).shape == (3,) + batch
