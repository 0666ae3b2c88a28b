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


def test_constrained_clustering_factor_and_guides():
    import pyro
    from pyro.infer import SVI, Trace_ELBO

    from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide
    from pyro_trees.models import ConstrainedClusteringVAE

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(10, 8, generator=g) < 0.4).float()
    pairs = torch.tensor([[0, 1], [2, 3], [1, 5], [7, 9]])
    w = torch.tensor([3.0, -2.0, 1.5, 4.0])
    model = ConstrainedClusteringVAE(8, 3, latent_dim=2, hidden=(6,), constraints=pairs, weights=w)
    idx = torch.tensor([5, 1, 0, 2, 9])  # holds pairs (0,1) and (1,5) only
    tr = poutine.trace(model).get_trace(x, idx=idx)
    z = tr.nodes["z"]["value"]
    assert z.shape == (5, 2)
    r = model.responsibilities(z)
    expected = 3.0 * (r[2] * r[1]).sum() + 1.5 * (r[1] * r[0]).sum()
    assert torch.allclose(tr.nodes["constraints"]["fn"].log_factor, expected)
    assert model.predict(z).shape == (5,)
    parents = torch.tensor([-1, 0, -1, 2, -1, 1, -1, -1, -1, 7])  # must-links as a forest
    for guide in (
        TreeVIGuide(GaussianEncoder(8, 2, (6,)), None),
        TreeVIGuide(GaussianEncoder(8, 2, (6,)), parents, pair_net=PairNet(8, 2, (6,))),
    ):
        pyro.clear_param_store()
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        losses = [svi.step(x, idx=idx) for _ in range(3)] + [svi.step(x)]
        assert all(torch.isfinite(torch.tensor(losses)))
    with pytest.raises(ValueError, match="weights"):
        ConstrainedClusteringVAE(8, 3, constraints=pairs, weights=w[:2])
    with pytest.raises(ValueError, match="num_clusters"):
        ConstrainedClusteringVAE(8, 1)


def test_synthetic_model_rejects_bad_x():
    model = SyntheticGraphVAE()
    x = model.generate(5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"x must have shape \(G, N, F\) = \(G, 4, 4\)"):
        model(torch.cat([x, x[:, :1]], 1))  # five instances per group
    with pytest.raises(ValueError, match=r"x must have shape \(G, N, F\)"):
        model(x[0])
    bad = x.clone()
    bad[2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        model(bad)


def test_graph_prior_vae_rejects_bad_graphs_and_inputs():
    edges = torch.tensor([[0, 1], [2, 3], [1, 3]])
    with pytest.raises(ValueError, match="num_nodes is required with an edge list"):
        GraphPriorVAE(edges, 5)
    with pytest.raises(ValueError, match=r"edge index out of range.*num_nodes=4"):
        GraphPriorVAE(torch.tensor([[0, 1], [2, 4], [1, 3]]), 5, num_nodes=4)
    with pytest.raises(ValueError, match="edge index out of range"):
        GraphPriorVAE(torch.tensor([[0, 1], [-1, 3], [1, 3]]), 5, num_nodes=4)
    with pytest.raises(ValueError, match="integer"):
        GraphPriorVAE(edges.float(), 5, num_nodes=4)
    with pytest.raises(ValueError, match=r"num_nodes=5"):
        GraphPriorVAE(torch.zeros(4, 4), 5, num_nodes=5)
    model = GraphPriorVAE(edges, 5, num_nodes=4, latent_dim=2, hidden=(4,))
    x = (torch.rand(4, 5) < 0.5).float()
    with pytest.raises(ValueError, match=r"x must have shape \(N, F\) = \(4, 5\)"):
        model(torch.cat([x, x[:1]]))
    with pytest.raises(ValueError, match=r"x must have shape \(N, F\)"):
        model(x[:, :4])
    with pytest.raises(ValueError, match=r"idx holds indices outside \[0, 4\)"):
        model(x, idx=torch.tensor([0, 4]))
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        model(bad)
    with pytest.raises(ValueError, match="x contains 1 NaN"):
        model(bad, idx=torch.tensor([1, 3]))
    tr = poutine.trace(model).get_trace(bad, idx=torch.tensor([0, 1]))  # bad row not in B
    assert tr.nodes["x"]["value"].shape == (2, 5)


def test_constrained_clustering_rejects_out_of_range_constraints_and_bad_x():
    from pyro_trees.models import ConstrainedClusteringVAE

    x = (torch.rand(10, 8) < 0.4).float()
    pairs = torch.tensor([[0, 1], [2, 12]])
    w = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match=r"constraint index out of range.*num_nodes=10"):
        ConstrainedClusteringVAE(8, 3, constraints=pairs, weights=w, num_nodes=10)
    with pytest.raises(ValueError, match="constraint index out of range"):
        ConstrainedClusteringVAE(8, 3, constraints=-pairs, weights=w)
    # without num_nodes the range is checked against x (and z) when the model runs
    model = ConstrainedClusteringVAE(8, 3, latent_dim=2, hidden=(4,), constraints=pairs, weights=w)
    with pytest.raises(ValueError, match="constraint names instance 12 but x has 10 instances"):
        model(x)
    with pytest.raises(ValueError, match="constraint names instance 12"):
        model(x, idx=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="constraint names instance 12 but z has 10"):
        model.pairwise_log_factor(torch.randn(10, 2))
    tr = poutine.trace(model).get_trace(torch.cat([x, x[:3]]))  # 13 rows hold instance 12
    assert tr.nodes["z"]["value"].shape == (13, 2)
    sized = ConstrainedClusteringVAE(8, 3, latent_dim=2, hidden=(4,), num_nodes=10)
    with pytest.raises(ValueError, match=r"x must have shape \(N, F\) = \(10, 8\)"):
        sized(x[:9])
    with pytest.raises(ValueError, match=r"idx holds indices outside \[0, 10\)"):
        sized(x, idx=torch.tensor([3, 10]))
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x contains 0 NaN and 1 infinite"):
        sized(bad)
