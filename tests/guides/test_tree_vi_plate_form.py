"""A user's own VAE with the usual plate form of a latent (``z`` inside
``pyro.plate("data", N)`` with ``.to_event(1)``) trains and predicts with a TreeVI guide."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch import nn

from pyro_trees.distributions import TreeNormal, TreeNormalInstances
from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide, TreeVIMixtureGuide

N, F, D = 16, 3, 2
CHAIN = torch.tensor([-1] + list(range(N - 1)))


def _data():
    g = torch.Generator().manual_seed(0)
    # a chain of correlated instances
    z = torch.cumsum(torch.randn(N, D, generator=g), 0) / 2
    return z @ torch.randn(D, F, generator=g) + 0.3 * torch.randn(N, F, generator=g)


def _user_model(decoder):
    def model(x, subsample_size=None):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as i:
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([D]).to_event(1))
            return pyro.sample("x", dist.Normal(decoder(z), 0.3).to_event(1), obs=x[i])

    return model


def _guide(parents=CHAIN):
    net = None if parents is None else PairNet(F, D, (8,))
    return TreeVIGuide(GaussianEncoder(F, D, (8,)), parents, pair_net=net, plate="data")


def test_tree_normal_instances_splits_the_density_by_instance():
    g = torch.Generator().manual_seed(1)
    loc, scale = torch.randn(3, N, D, generator=g), torch.rand(3, N, D, generator=g) + 0.5
    rho = 0.9 * torch.tanh(torch.randn(3, N, D, generator=g))
    q = TreeNormal(loc, scale, CHAIN, rho)
    qi = q.per_instance()
    assert isinstance(qi, TreeNormalInstances)
    assert qi.batch_shape == (3, N) and qi.event_shape == (D,)
    z = q.rsample()
    torch.testing.assert_close(qi.log_prob(z).sum(-1), q.log_prob(z))
    torch.testing.assert_close(qi.entropy().sum(-1), q.entropy())
    assert qi.expand((5, 3, N)).rsample().shape == (5, 3, N, D)
    with pytest.raises(ValueError, match="instances"):
        qi.expand((3, N + 1))


@pytest.mark.parametrize("parents", [CHAIN, None], ids=["tree", "mean_field"])
def test_user_vae_in_plate_form_trains_and_predicts(parents):
    x = _data()
    model, guide = _user_model(nn.Linear(D, F)), _guide(parents)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    losses = [svi.step(x) for _ in range(150)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-20:]) < sum(losses[:20])
    tr = poutine.trace(guide).get_trace(x)
    site = tr.nodes["z"]
    assert site["fn"].batch_shape == (N,) and site["fn"].event_shape == (D,)
    assert [f.name for f in site["cond_indep_stack"]] == ["data"]
    if parents is not None:  # the plate's per-instance terms add up to the tree's density
        q = guide.distribution(x)
        torch.testing.assert_close(
            site["fn"].log_prob(site["value"]).sum(), q.log_prob(site["value"])
        )
    for parallel in (False, True):
        out = Predictive(model, guide=guide, num_samples=6, parallel=parallel)(x)
        assert out["z"].shape == (6, N, D)


def test_plate_form_subsamples_the_same_instances_in_model_and_guide():
    x = _data()
    model, guide = _user_model(nn.Linear(D, F)), _guide()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    assert torch.isfinite(torch.tensor(svi.step(x, subsample_size=5)))
    gtr = poutine.trace(guide).get_trace(x, subsample_size=5)
    mtr = poutine.trace(poutine.replay(model, trace=gtr)).get_trace(x, subsample_size=5)
    idx = gtr.nodes["data"]["value"]
    assert idx.shape == (5,) and torch.equal(mtr.nodes["data"]["value"], idx)
    q = gtr.nodes["z"]["fn"]
    assert q.batch_shape == (5,) and gtr.nodes["z"]["value"].shape == (5, D)
    # the forest the tree induces on the subsample, as with idx=
    torch.testing.assert_close(
        q.log_prob(gtr.nodes["z"]["value"]).sum(),
        guide.distribution(x, idx).log_prob(gtr.nodes["z"]["value"]),
    )
    # an explicit idx is the plate's subsample
    tr = poutine.trace(guide).get_trace(x, idx=torch.tensor([3, 1, 7]))
    assert tr.nodes["data"]["value"].tolist() == [3, 1, 7]


def test_mixture_guide_refuses_a_plate_over_instances():
    x = _data()
    guide = TreeVIMixtureGuide(
        GaussianEncoder(F, D), torch.stack([CHAIN, CHAIN]), pair_net=PairNet(F, D), plate="data"
    )
    with pytest.raises(ValueError, match="plate over instances"):
        guide(x)


def test_default_pair_net_is_built_at_the_first_call():
    from pyro_trees.guides import GroupEncoder
    from pyro_trees.models import SyntheticGraphVAE

    x = _data()
    guide = TreeVIGuide(GaussianEncoder(F, D, (8,)), CHAIN)  # instance-level: no offsets
    assert guide.pair_net is None
    assert guide.distribution(x).rho.shape == (N, D)
    assert isinstance(guide.pair_net, PairNet) and guide.pair_net.offsets is None
    groups = SyntheticGraphVAE().generate(5).double()
    guide = TreeVIGuide(GroupEncoder(4, 4, 4), [-1, 0, 1, 0], plate="groups")
    guide(groups)
    assert guide.pair_net.offsets == "child" and guide.pair_net.edge_bias.shape == (4, 4)
    assert all(p.dtype == torch.float64 for p in guide.parameters())
    with pytest.raises(ValueError, match="edge_features"):
        TreeVIGuide(GaussianEncoder(F, D), CHAIN, edge_features=torch.ones(N, 1)).distribution(x)
