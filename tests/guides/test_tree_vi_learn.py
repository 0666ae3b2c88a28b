"""Learning the tree of a TreeVIGuide (eq. 17) and per-pair offsets of PairNet."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.nn import PyroModule

from pyro_trees.distributions import KroneckerNormal, TreeNormal
from pyro_trees.guides import (
    GaussianEncoder,
    GroupEncoder,
    PairNet,
    TreeVIGuide,
    TreeVIMixtureGuide,
)
from pyro_trees.infer import acyclicity, learn_guide_tree, parents_to_adjacency
from pyro_trees.models import GraphPriorVAE, SyntheticGraphVAE


class TreeGroups(PyroModule):
    """``G`` independent groups of ``N`` instances whose exact posterior is a tree.

    Prior ``Z_g ~ N(0, Lam^-1 ⊗ I_D)`` with ``Lam = 0.3 I + 2 L``, ``L`` the weighted
    Laplacian of ``parents``; ``X_g | Z_g ~ N(Z_g, 0.5)``. The posterior precision
    ``Lam + 2 I`` has the tree's sparsity, the same for every group, and its mean is
    linear in the group's data: the guide family (affine group encoder, free scales,
    per-pair correlation offsets) holds the exact posterior on the true tree only.
    """

    def __init__(self, parents, latent_dim=1, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        n = parents.numel()
        w = 1.0 + 2.0 * torch.rand(n, n, generator=gen, dtype=torch.float64)
        w = parents_to_adjacency(parents).double() * (w + w.T) / 2
        lam = 0.3 * torch.eye(n, dtype=torch.float64) + 2 * (torch.diag(w.sum(1)) - w)
        self.cov = torch.linalg.inv(lam)
        self.register_buffer("tril", torch.linalg.cholesky(self.cov).float())
        self.n, self.d, self.noise_var = n, latent_dim, 0.5

    def forward(self, x, subsample_size=None):
        with pyro.plate("groups", x.shape[0], subsample_size=subsample_size, dim=-1) as i:
            z = pyro.sample("z", KroneckerNormal(self.tril, self.d))
            pyro.sample("x", dist.Normal(z, math.sqrt(self.noise_var)).to_event(2), obs=x[i])

    def generate(self, groups, seed):
        gen = torch.Generator().manual_seed(seed)
        marg = self.cov + self.noise_var * torch.eye(self.n, dtype=torch.float64)
        eps = torch.randn(groups, self.d, self.n, generator=gen, dtype=torch.float64)
        return (eps @ torch.linalg.cholesky(marg).T).transpose(-1, -2).float()

    def log_evidence(self, x):
        """Exact ``log p(x)`` per group, averaged over the groups."""
        marg = self.cov + self.noise_var * torch.eye(self.n, dtype=torch.float64)
        mvn = torch.distributions.MultivariateNormal(torch.zeros(self.n, dtype=torch.float64), marg)
        return float(mvn.log_prob(x.double().transpose(-1, -2)).sum(-1).mean())


TRUE = torch.tensor([-1, 0, 1, 1, 3])  # 0 - 1 - {2, 3}, 3 - 4
WRONG = torch.tensor([4, 4, 4, 4, -1])  # a star at 4: shares the edge 3 - 4 only


def edges(parents):
    a = parents_to_adjacency(parents)
    return {(int(i), int(j)) for i, j in a.nonzero() if i < j}


def tree_guide(n, d, parents=None):
    net = PairNet(d, d, hidden_sizes=(4,), num_nodes=n, offsets="pair", zero_init=True)
    return TreeVIGuide(GroupEncoder(n, d, d), parents, pair_net=net, plate="groups")


def mc_elbo(model, guide, x, passes=50):
    with torch.no_grad(), pyro.get_param_store().scope():
        loss = sum(Trace_ELBO().loss(model, guide, x) for _ in range(passes)) / passes
    return -loss / x.shape[0]


def train_and_score(model, guide, x, steps):
    """Plain SVI, then the ELBO per group; in a param store of its own (the guides'
    parameters share names)."""
    with pyro.get_param_store().scope():
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
        for _ in range(steps):
            svi.step(x, subsample_size=32)
        return mc_elbo(model, guide, x)


def test_learn_tree_recovers_the_posterior_tree_and_svi_continues():
    """Measured with these settings over the seeds the test starts from (0-19): the
    exact tree on 20 of 20, the ELBO 0.08-0.25 below log p(x). With the function's
    defaults for the ranking (``refine_steps=100``, ``eval_particles=16``) a wrong tree
    won on 1 of 10 seeds (restarts refined too briefly, ranked by too few draws: with
    64 draws and 100 refining steps another seed failed instead)."""
    model = TreeGroups(TRUE, latent_dim=1, seed=0)
    x = model.generate(64, seed=1)
    guide = tree_guide(5, 1)
    res = learn_guide_tree(
        guide,
        model,
        x,
        subsample_size=32,
        num_restarts=3,
        num_particles=1,
        inner_steps=40,
        max_outer=10,
        lr=0.1,
        param_lr=0.05,
        refine_steps=300,
        eval_particles=64,
        generator=torch.Generator().manual_seed(0),
    )
    # the hard tree is a valid forest, installed in the guide, and it is the true tree
    assert res.h_hard == 0.0
    oriented = torch.zeros(5, 5)
    child = (res.parents >= 0).nonzero().squeeze(-1)
    oriented[child, res.parents[child]] = 1.0
    assert float(acyclicity(oriented)) == 0.0
    assert all(p.grad is None for p in guide.parameters())  # nothing stale for SVI
    assert torch.equal(guide.parents, res.parents)
    assert edges(guide.parents) == edges(TRUE)
    exact = model.log_evidence(x)
    assert exact - 0.35 < res.elbo <= exact + 0.05  # a bound, near it on the exact family
    # plain SVI continues on the learned tree; a wrong fixed tree is worse, even with
    # three times the SVI steps
    learned_before = mc_elbo(model, guide, x, 20)
    learned = train_and_score(model, guide, x, 200)
    wrong_elbo = train_and_score(model, tree_guide(5, 1, WRONG), x, 600)
    assert learned > wrong_elbo + 0.1
    assert learned <= exact + 0.05  # a bound (up to Monte Carlo noise)
    assert learned > learned_before - 0.1
    print(
        f"learned tree {res.parents.tolist()} (ELBO per group {res.elbo:.3f} after eq. 17, "
        f"{learned:.3f} after SVI), wrong star {wrong_elbo:.3f}, log p(x) {exact:.3f}"
    )


def test_soft_distribution_at_one_hot_parents_is_the_tree_guide():
    """The all-pairs correlations and a fixed tree's read the same offsets."""
    model = SyntheticGraphVAE()
    x = model.generate(6, torch.Generator().manual_seed(0))
    t = torch.tensor([-1, 0, 1, 0])
    guide = TreeVIGuide(
        GroupEncoder(4, 4, 4),
        t,
        pair_net=PairNet(4, 4, num_nodes=4, offsets="pair"),
        plate="groups",
    )
    with torch.no_grad():
        guide.pair_net.pair_bias.normal_()
    hard = torch.zeros(4, 5)
    hard[torch.arange(4), torch.where(t < 0, 4, t)] = 1.0
    soft = guide.soft_distribution(x, hard)
    tree = guide.distribution(x)
    assert isinstance(tree, TreeNormal) and soft.batch_shape == tree.batch_shape == (6,)
    z = tree.sample((3,))
    torch.testing.assert_close(soft.log_prob(z), tree.log_prob(z), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(soft.to_tree_normal(t).rho, tree.rho)
    # an ordered pair's offset: rho[i, j] and rho[j, i] differ
    assert not torch.allclose(soft.rho, soft.rho.transpose(-3, -2))


def test_pair_offsets_follow_node_identities_under_minibatches():
    n, f, d = 7, 3, 2
    x = torch.randn(n, f)
    parents = torch.tensor([-1, 0, 1, 1, 3, 0, 5])
    net = PairNet(f, d, hidden_sizes=(4,), num_nodes=n, offsets="pair")
    with torch.no_grad():
        net.pair_bias.normal_()
    guide = TreeVIGuide(GaussianEncoder(f, d, hidden_sizes=(4,)), parents, pair_net=net)
    full = guide._all_pair_rho(x, d)  # (N, N, D): rho[i, j] for child i, parent j
    idx = torch.tensor([4, 3, 1, 6])
    q = guide.distribution(x, idx)
    for k, p in enumerate(q.parents.tolist()):
        if p >= 0:
            torch.testing.assert_close(q.rho[k], full[idx[k], idx[p]])
    assert not q.rho[0].abs().sum() == 0  # 4 <- 3 kept inside the batch
    # the existing per-child offsets are untouched by the new option
    child = PairNet(f, d, num_nodes=n)
    assert child.offsets == "child" and child.pair_bias is None
    assert PairNet(f, d).offsets is None and net.offsets == "pair" and net.edge_bias is None


def test_pair_net_bad_input():
    with pytest.raises(ValueError, match="offsets must be"):
        PairNet(3, 2, num_nodes=4, offsets="edge")
    with pytest.raises(ValueError, match="needs num_nodes"):
        PairNet(3, 2, offsets="pair")
    net = PairNet(3, 2, num_nodes=4, offsets="pair")
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="nodes=\\(child, parent\\)"):
        net(x, x)
    with pytest.raises(ValueError, match="out of range"):
        net(x, x, nodes=(torch.arange(4), torch.tensor([1, 2, 3, 4])))
    with pytest.raises(ValueError, match="integer"):
        net(x, x, nodes=(torch.arange(4.0), torch.arange(4)))
    with pytest.raises(ValueError, match="broadcast"):
        net(x, x, nodes=(torch.arange(3), torch.arange(3)))
    with pytest.raises(ValueError, match="offset table is for 4 nodes"):
        TreeVIGuide(GaussianEncoder(3, 2), torch.tensor([-1, 0, 1]), pair_net=net)


def test_learn_tree_bad_input():
    model = TreeGroups(TRUE, latent_dim=1)
    x = model.generate(8, seed=0)
    quick = {"max_outer": 1, "inner_steps": 2, "eval_particles": 1}
    # no pair network, per-child offsets, edge features, a mixture: no all-pairs scores
    with pytest.raises(ValueError, match="no pair_net"):
        learn_guide_tree(
            TreeVIGuide(GroupEncoder(5, 1, 1), None, plate="groups"), model, x, **quick
        )
    child = TreeVIGuide(
        GroupEncoder(5, 1, 1), TRUE, pair_net=PairNet(1, 1, num_nodes=5), plate="groups"
    )
    with pytest.raises(ValueError, match="offsets='pair'"):
        learn_guide_tree(child, model, x, **quick)
    feats = TreeVIGuide(
        GroupEncoder(5, 1, 1),
        TRUE,
        pair_net=PairNet(1, 1, edge_features=1),
        edge_features=torch.ones(5, 1),
        plate="groups",
    )
    with pytest.raises(ValueError, match="edge_features"):
        learn_guide_tree(feats, model, x, **quick)
    mix = TreeVIMixtureGuide(
        GroupEncoder(5, 1, 1), torch.stack([TRUE, WRONG]), pair_net=PairNet(1, 1), plate="groups"
    )
    with pytest.raises(ValueError, match="single tree"):
        learn_guide_tree(mix, model, x, **quick)

    class Unbroadcastable(torch.nn.Module):  # scores (x_i, x_j) rows, not all pairs
        def forward(self, xi, xj):
            return torch.tanh(torch.cat([xi, xj], -1) @ torch.ones(2, 1)) * 0.5

    with pytest.raises(ValueError, match="cannot score all pairs"):
        unbroadcastable = TreeVIGuide(
            GroupEncoder(5, 1, 1), TRUE, pair_net=Unbroadcastable(), plate="groups"
        )
        learn_guide_tree(unbroadcastable, model, x, **quick)
    guide = tree_guide(5, 1)
    # shape mismatches: data rows, the model's latent site
    with pytest.raises(ValueError, match="offset table is for 5 nodes"):
        learn_guide_tree(guide, model, torch.randn(8, 4, 1), **quick)
    with pytest.raises(ValueError, match="shape \\(G, N, F\\)"):
        learn_guide_tree(guide, model, x[0], **quick)
    with pytest.raises(ValueError, match="has shape"):
        learn_guide_tree(guide, TreeGroups(TRUE, latent_dim=2), x, **quick)
    # other latent sites, a missing site or plate, idx minibatches, bad counts

    class TwoLatents(TreeGroups):
        def forward(self, x, subsample_size=None):
            super().forward(x, subsample_size)
            pyro.sample("w", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="latent sites other than 'z'"):
        learn_guide_tree(guide, TwoLatents(TRUE), x, **quick)

    def no_plate(x, subsample_size=None):
        pyro.sample("z", dist.Normal(torch.zeros(8, 5, 1), 1.0).to_event(3))

    with pytest.raises(ValueError, match="no plate named 'groups'"):
        learn_guide_tree(guide, no_plate, x, **quick)
    with pytest.raises(ValueError, match="no sample site named 'z'"):
        learn_guide_tree(guide, lambda x, **kw: None, x, **quick)
    with pytest.raises(ValueError, match="idx"):
        learn_guide_tree(guide, model, x, idx=torch.arange(3), **quick)
    with pytest.raises(ValueError, match="num_restarts"):
        learn_guide_tree(guide, model, x, num_restarts=0)
    with pytest.raises(ValueError, match="num_particles"):
        learn_guide_tree(guide, model, x, num_particles=0)


def test_instance_level_guide_learns_over_all_instances():
    """Without a group plate the tree spans the N instances of x (no subsampling)."""
    n, f, d = 6, 5, 2
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, f, generator=g) < 0.4).float()
    model = GraphPriorVAE(
        torch.tensor([[0, 1], [2, 3], [4, 5]]), f, num_nodes=n, latent_dim=d, hidden_sizes=(4,)
    )
    net = PairNet(f, d, hidden_sizes=(4,), num_nodes=n, offsets="pair", zero_init=True)
    guide = TreeVIGuide(GaussianEncoder(f, d, hidden_sizes=(4,)), None, pair_net=net)
    res = learn_guide_tree(guide, model, x, max_outer=3, inner_steps=10, eval_particles=2)
    assert res.h_hard == 0.0 and torch.equal(guide.parents, res.parents)
    assert guide.distribution(x).event_shape == (n, d)
    assert all(p.grad is None for p in list(guide.parameters()) + list(model.parameters()))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    assert math.isfinite(svi.step(x))
    with pytest.raises(ValueError, match="subsample_size needs a guide with a group plate"):
        learn_guide_tree(guide, model, x, subsample_size=2)


@pytest.mark.cuda
def test_learn_tree_on_cuda():
    model = TreeGroups(TRUE, latent_dim=1).cuda()
    x = model.generate(16, seed=0).cuda()
    guide = tree_guide(5, 1).cuda()
    res = learn_guide_tree(guide, model, x, subsample_size=8, max_outer=2, inner_steps=5)
    assert res.h_hard == 0.0 and guide.parents.device.type == "cuda"
    assert guide.distribution(x).rsample().device.type == "cuda"
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    assert math.isfinite(svi.step(x, subsample_size=8))
