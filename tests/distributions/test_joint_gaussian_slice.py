"""JointGaussianSlice: a slice of a joint Gaussian given the slices before it, whose KL to a
prior without parents is the expected KL over those slices, in closed form."""

import pyro.distributions as dist
import torch
from torch.distributions import kl_divergence

from pyro_trees.distributions import JointGaussianSlice

P, M, S = 2, 3, 4  # outputs, inducing points, noise entries of the earlier slices


def _factor(n, scale=0.3):
    noise = torch.randn(n, n, dtype=torch.float64).tril(-1)
    return torch.eye(n, dtype=torch.float64) + scale * noise


def _prior():
    """``P`` independent ``N(m_p, K)`` over ``M`` points, as the deep GP's layer prior."""
    a = torch.randn(M, M, dtype=torch.float64)
    k_tril = torch.linalg.cholesky(a @ a.T + M * torch.eye(M, dtype=torch.float64))
    loc = torch.randn(P, M, dtype=torch.float64)
    return dist.MultivariateNormal(loc, scale_tril=k_tril).to_event(1), loc, k_tril


def test_kl_is_the_expected_kl_over_the_earlier_slices():
    torch.manual_seed(0)
    n = P * M
    mean = torch.randn(n, dtype=torch.float64)
    tril, cross = _factor(n), 0.5 * torch.randn(n, S, dtype=torch.float64)
    eps = torch.randn(S, dtype=torch.float64)
    q = JointGaussianSlice(mean + cross @ eps, tril, (P, M), mean=mean, cross=cross)
    prior, p_loc, k_tril = _prior()
    got = kl_divergence(q, prior)
    # reference: the flattened Gaussians, the prior block diagonal over the outputs;
    # E_eps KL[N(mu + C eps, L L^T) || p] = KL[N(mu, L L^T) || p] + tr(K^-1 C C^T) / 2
    k_block = torch.block_diag(*[k_tril @ k_tril.T] * P)
    p_flat = dist.MultivariateNormal(p_loc.reshape(-1), covariance_matrix=k_block)
    at_mean = kl_divergence(dist.MultivariateNormal(mean, scale_tril=tril), p_flat)
    spread = 0.5 * torch.trace(torch.linalg.solve(k_block, cross @ cross.T))
    torch.testing.assert_close(got, at_mean + spread)
    # the conditional itself (its loc) does not enter the KL: only mean and cross do
    q2 = JointGaussianSlice(mean, tril, (P, M), mean=mean, cross=cross)
    torch.testing.assert_close(kl_divergence(q2, prior), got)


def test_log_prob_and_draws_are_the_conditional_gaussian():
    torch.manual_seed(1)
    n = P * M
    loc, tril = torch.randn(n, dtype=torch.float64), _factor(n)
    q = JointGaussianSlice(
        loc, tril, (P, M), mean=loc, cross=torch.zeros(n, S, dtype=torch.float64)
    )
    ref = dist.MultivariateNormal(loc, scale_tril=tril)
    x = q.sample((5,))
    assert x.shape == (5, P, M)
    torch.testing.assert_close(q.log_prob(x), ref.log_prob(x.reshape(5, n)))
    torch.testing.assert_close(q.mean, loc.reshape(P, M))
    draws = q.sample((20000,)).reshape(-1, n)
    torch.testing.assert_close(draws.mean(0), loc, atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(draws.T), tril @ tril.T, atol=0.1, rtol=0)
