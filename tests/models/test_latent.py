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
    model = GraphPriorVAE(edges, 5, num_nodes=4, latent_dim=2, hidden_sizes=(4,))
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
    model = ConstrainedClusteringVAE(
        8, 3, latent_dim=2, hidden_sizes=(6,), constraints=pairs, weights=w
    )
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
    model = GraphPriorVAE(edges, 5, num_nodes=4, latent_dim=2, hidden_sizes=(4,))
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
    model = ConstrainedClusteringVAE(
        8, 3, latent_dim=2, hidden_sizes=(4,), constraints=pairs, weights=w
    )
    with pytest.raises(ValueError, match="constraint names instance 12 but x has 10 instances"):
        model(x)
    with pytest.raises(ValueError, match="constraint names instance 12"):
        model(x, idx=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="constraint names instance 12 but z has 10"):
        model.pairwise_log_factor(torch.randn(10, 2))
    tr = poutine.trace(model).get_trace(torch.cat([x, x[:3]]))  # 13 rows hold instance 12
    assert tr.nodes["z"]["value"].shape == (13, 2)
    sized = ConstrainedClusteringVAE(8, 3, latent_dim=2, hidden_sizes=(4,), num_nodes=10)
    with pytest.raises(ValueError, match=r"x must have shape \(N, F\) = \(10, 8\)"):
        sized(x[:9])
    with pytest.raises(ValueError, match=r"idx holds indices outside \[0, 10\)"):
        sized(x, idx=torch.tensor([3, 10]))
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x contains 0 NaN and 1 infinite"):
        sized(bad)


def test_constrained_clustering_paper_settings_and_grey_levels():
    """DC-GMM's settings: ReLU decoder, uniform fixed mixture weights, and grey levels
    scored by their binary cross-entropy."""
    import pyro
    from pyro.infer import SVI, Trace_ELBO

    from pyro_trees.guides import GaussianEncoder, TreeVIGuide
    from pyro_trees.models import ConstrainedClusteringVAE

    g = torch.Generator().manual_seed(0)
    x = torch.rand(10, 8, generator=g)  # grey levels in [0, 1]
    pairs, w = torch.tensor([[0, 1], [2, 3]]), torch.tensor([2.0, -2.0])
    model = ConstrainedClusteringVAE(
        8,
        3,
        latent_dim=2,
        hidden_sizes=(6, 5),
        activation="relu",
        learn_cluster_weights=False,
        constraints=pairs,
        weights=w,
    )
    assert [type(m).__name__ for m in model.decoder] == [
        "Linear", "ReLU", "Linear", "ReLU", "Linear"
    ]  # fmt: skip
    assert "cluster_logits" in dict(model.named_buffers())
    assert "cluster_logits" not in dict(model.named_parameters())
    tr = poutine.trace(model).get_trace(x)
    logits = model.decoder(tr.nodes["z"]["value"])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, x, reduction="sum")
    assert torch.allclose(tr.nodes["x"]["fn"].log_prob(x), -bce)
    pyro.clear_param_store()
    guide = TreeVIGuide(GaussianEncoder(8, 2, (6,), activation="relu"), None)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(3):
        assert torch.isfinite(torch.tensor(svi.step(x)))
    assert torch.equal(model.cluster_logits, torch.zeros(3))  # stays uniform
    assert not any(k.endswith("cluster_logits") for k in pyro.get_param_store())
    with pytest.raises(ValueError, match=r"x must lie in \[0, 1\]"):
        model(x * 2)
    with pytest.raises(ValueError, match="activation must be one of softplus, relu"):
        ConstrainedClusteringVAE(8, 3, activation="tanh")
    with pytest.raises(ValueError, match="activation must be one of softplus, relu"):
        GaussianEncoder(8, 2, activation="tanh")


def _dense_reference(edges, n):
    """The dense adjacency the model used to store (before the sparse layout)."""
    a = torch.zeros(n, n)
    a[edges[:, 0], edges[:, 1]] = 1.0
    a[edges[:, 1], edges[:, 0]] = 1.0
    a.fill_diagonal_(0.0)
    return a


def test_graph_prior_vae_sparse_batches_equal_the_dense_path():
    """The induced subgraph of a batch, from the sorted sparse layout, is bit-identical
    to ``A[idx][:, idx]`` of the dense matrix, and so is the batch prior's factor."""
    g = torch.Generator().manual_seed(0)
    n = 30
    edges = torch.randint(0, n, (70, 2), generator=g)  # duplicates and self-loops too
    edges = torch.cat([edges, edges[:5].flip(1), torch.tensor([[3, 3]])])
    dense = _dense_reference(edges, n)
    w = torch.rand(n, n, generator=g) * (torch.rand(n, n, generator=g) < 0.1)
    weighted = (w + w.T) / 2  # a weighted affinity given densely
    for adjacency, ref, s in ((edges, dense, 0.05), (weighted, weighted, 0.3)):
        model = GraphPriorVAE(
            adjacency, 5, num_nodes=n, strength=s, latent_dim=2, hidden_sizes=(4,)
        )
        assert sum(b.numel() for b in model.buffers()) < 3 * n + 2 * int((ref != 0).sum())
        assert torch.equal(model.adjacency_matrix(), ref)
        for size in (1, 2, 7, 19, n):
            idx = torch.randperm(n, generator=g)[:size]
            expected = ref[idx][:, idx]
            assert torch.equal(model.adjacency_matrix(idx), expected)
            eye = torch.eye(size, dtype=torch.float64)
            tril = torch.linalg.cholesky(eye + s * expected.double()).float()
            assert torch.equal(model.prior(idx).scale_tril, tril)
        assert int((model.adjacency_matrix(idx) != 0).sum()) > 0  # the batches hold edges
    with pytest.raises(ValueError, match="repeated"):
        model.prior(torch.tensor([1, 4, 1]))


def test_graph_prior_vae_large_graph_is_checked_without_a_dense_matrix():
    """Beyond DENSE_CHECK_MAX_NODES nodes positive definiteness is certified from a
    spectral-radius bound; for bipartite graphs (a chain, a star) that is exact."""
    from pyro_trees.models.graph_prior import DENSE_CHECK_MAX_NODES

    n = DENSE_CHECK_MAX_NODES + 1
    chain = torch.stack([torch.arange(n - 1), torch.arange(1, n)], 1)  # rho = 2 cos(pi/(n+1))
    model = GraphPriorVAE(chain, 5, num_nodes=n, strength=0.499, latent_dim=2, hidden_sizes=(4,))
    assert sum(b.numel() for b in model.buffers()) == (n + 1) + 2 * 2 * (n - 1)
    idx = torch.tensor([10, 12, 11, 500])
    expected = torch.tensor([[0.0, 0, 1, 0], [0, 0, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert torch.equal(model.adjacency_matrix(idx), expected)
    with pytest.raises(ValueError, match="could not be certified positive definite"):
        GraphPriorVAE(chain, 5, num_nodes=n, strength=0.501)  # truly indefinite
    star = torch.stack([torch.zeros(n - 1, dtype=torch.long), torch.arange(1, n)], 1)
    rho = (n - 1) ** 0.5  # the star's eigenvalues are +-rho and 0
    GraphPriorVAE(star, 5, num_nodes=n, strength=0.99 / rho, latent_dim=2, hidden_sizes=(4,))
    with pytest.raises(ValueError, match="positive definite"):
        GraphPriorVAE(star, 5, num_nodes=n, strength=1.01 / rho)


def _reference_batch_constraints(pairs, weights, idx):
    """The former O(C) scan: every constraint looked up in the sorted batch."""
    sorted_idx, order = idx.sort()
    pos = torch.searchsorted(sorted_idx, pairs).clamp_max(idx.numel() - 1)
    inside = (sorted_idx[pos] == pairs).all(-1)
    return order[pos[inside]], weights[inside]


def test_constrained_clustering_batch_constraints_equal_the_full_scan():
    from pyro_trees.models import ConstrainedClusteringVAE

    g = torch.Generator().manual_seed(0)
    n = 40
    pairs = torch.randint(0, 30, (80, 2), generator=g)  # instances 30..39: unconstrained
    pairs = torch.cat([pairs, pairs[:6], pairs[6:12].flip(1)])  # repeats, both orders
    w = torch.randn(pairs.shape[0], generator=g)
    model = ConstrainedClusteringVAE(
        5, 3, latent_dim=2, hidden_sizes=(4,), constraints=pairs, weights=w
    )
    for size in (1, 2, 9, 25, n):
        idx = torch.randperm(n, generator=g)[:size]
        got, got_w = model._batch_constraints(idx)
        ref, ref_w = _reference_batch_constraints(pairs, w, idx)
        assert torch.equal(got, ref) and torch.equal(got_w, ref_w)
        z = torch.randn(3, size, 2, generator=g)
        r = model.responsibilities(z)
        same = (r.index_select(-2, ref[:, 0]) * r.index_select(-2, ref[:, 1])).sum(-1)
        assert torch.equal(model.pairwise_log_factor(z, idx=idx), (ref_w * same).sum(-1))
    assert got.shape[0] == pairs.shape[0]  # the whole data holds every constraint
    with pytest.raises(ValueError, match="repeated"):
        model.pairwise_log_factor(torch.randn(3, 2), idx=torch.tensor([0, 5, 0]))
