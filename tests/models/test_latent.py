import pytest
import torch
from pyro import poutine
from torch.distributions import MultivariateNormal

from pyro_trees.distributions import KroneckerNormal
from pyro_trees.models import SYNTHETIC_AFFINITY, GraphPriorVAE, SyntheticGraphVAE


def test_kronecker_normal_matches_dense():
    c = torch.eye(4, dtype=torch.float64) + 0.5 * SYNTHETIC_AFFINITY.double()
    q = KroneckerNormal.from_affinity(SYNTHETIC_AFFINITY.double(), 0.5, 3)
    z = q.sample((5,))
    assert z.shape == (5, 4, 3)
    dense = MultivariateNormal(torch.zeros(12, dtype=torch.float64), torch.kron(c, torch.eye(3)))
    assert torch.allclose(q.log_prob(z), dense.log_prob(z.reshape(5, 12)))
    with pytest.raises(ValueError, match="positive definite"):
        KroneckerNormal.from_affinity(SYNTHETIC_AFFINITY, 3.0, 2)
    with pytest.raises(ValueError, match="symmetric"):
        KroneckerNormal.from_affinity(torch.triu(torch.ones(3, 3)), 0.1, 2)


def test_synthetic_exact_log_likelihood_is_the_marginal_of_the_trace():
    model = SyntheticGraphVAE()
    x = model.generate(3, torch.Generator().manual_seed(1))
    # log p(x) = log p(x, z) - log p(z | x) for any z; check with the Gaussian posterior
    tr = poutine.trace(model).get_trace(x)
    z = tr.nodes["z"]["value"].double()
    tr.compute_log_prob()
    log_joint = (tr.nodes["z"]["log_prob"] + tr.nodes["x"]["log_prob"]).double()
    c = (model.prior_tril @ model.prior_tril.T).double()
    prec = torch.linalg.inv(c) + torch.eye(4, dtype=torch.float64) / model.noise_var
    cov = torch.linalg.inv(prec)
    mean = cov @ x.double() / model.noise_var
    post = KroneckerNormal(torch.linalg.cholesky(cov).expand(3, 4, 4), 4)
    log_post = post.log_prob(z - mean)
    assert torch.allclose(model.exact_log_likelihood(x), log_joint - log_post, atol=1e-3)


def test_graph_prior_vae_shapes_and_errors():
    edges = torch.tensor([[0, 1], [2, 3]])
    model = GraphPriorVAE(edges, 5, num_nodes=4, latent_dim=2, hidden=(4,))
    x = (torch.rand(4, 5) < 0.5).float()
    tr = poutine.trace(model).get_trace(x, idx=torch.tensor([0, 1, 3]))
    assert tr.nodes["z"]["value"].shape == (3, 2)
    assert torch.allclose(
        model.prior(torch.tensor([0, 1])).covariance_matrix,
        torch.tensor([[1.0, 0.5], [0.5, 1.0]]),
    )
    with pytest.raises(ValueError, match="positive definite"):
        GraphPriorVAE(torch.ones(3, 3) - torch.eye(3), 5, strength=1.5)
    with pytest.raises(ValueError, match="likelihood"):
        GraphPriorVAE(edges, 5, num_nodes=4, likelihood="poisson")
    with pytest.raises(ValueError, match="num_groups"):
        SyntheticGraphVAE()()
