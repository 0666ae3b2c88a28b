import math

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, TraceEnum_ELBO
from pyro.optim import ClippedAdam

from pyro_trees.distributions import expected_log_coupling
from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import TreeELBO
from pyro_trees.models import HME


def _data(n=40, dtype=torch.float64):
    x = torch.linspace(-2, 2, n, dtype=dtype).unsqueeze(-1)
    y = torch.where(x[:, 0] > 0, 1.5, -1.0).to(dtype) + 0.1 * torch.randn(n, dtype=dtype)
    return x, y


def _closed_form(model, guide, x, y, entropy_weight=1.0, balance_weight=1.0):
    log_q = guide.tree(x)
    q = log_q.exp()
    leaves = torch.arange(model.num_leaves).unsqueeze(-1)
    ll = model.expert(x, leaves).log_prob(y).T  # (N, L)
    kl = (q * (log_q + model.depth * math.log(2))).sum()
    return (
        (q * ll).sum()
        - entropy_weight * kl
        + balance_weight * expected_log_coupling(log_q, model.depth)
    )


@pytest.mark.parametrize("feedback", ["hard", "soft"])
@pytest.mark.parametrize("entropy_weight", [1.0, 0.0, -1.0])
def test_tree_elbo_is_exact_sum_over_leaves(feedback, entropy_weight):
    x, y = _data()
    model = HME(1, 3, noise_scale=None).double()
    guide = RNNTreeGuide(1, 3, feedback=feedback, noise=0.0).double()
    with pyro.get_param_store().scope():
        loss = TreeELBO(entropy_weight=entropy_weight).differentiable_loss(model, guide, x, y)
        expected = _closed_form(model, guide, x, y, entropy_weight)
    torch.testing.assert_close(-loss, expected)


def test_without_balance_it_equals_traceenum_elbo():
    x, y = _data()
    model, guide = HME(1, 2).double(), RNNTreeGuide(1, 2, feedback="hard").double()
    with pyro.get_param_store().scope():
        ours = TreeELBO(balance_weight=0.0).differentiable_loss(model, guide, x, y)
        pyros = TraceEnum_ELBO(max_plate_nesting=1).differentiable_loss(model, guide, x, y)
    torch.testing.assert_close(ours, pyros)


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_every_parameter_receives_a_gradient(feedback):
    x, y = _data()
    x = torch.cat([x, torch.randn_like(x)], -1)  # two dimensions: the split choice matters
    model = HME(2, 3, experts="linear", noise_scale=None).double()
    guide = RNNTreeGuide(2, 3, feedback=feedback).double()
    with pyro.get_param_store().scope():
        elbo = TreeELBO()(model, guide)
        elbo(x, y).backward()
        names = [name for name, _ in elbo.named_parameters()]
        assert any("node_offset" in name for name in names) == (feedback == "hard")
        for name, p in elbo.named_parameters():
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name


def test_plain_svi_loop_trains():
    """The ten-line Pyro loop of the README: global param store, plain SVI."""
    x, y = _data(80, torch.float32)
    pyro.clear_param_store()
    model, guide = HME(1, 2, noise_scale=None), RNNTreeGuide(1, 2)
    svi = SVI(model, guide, ClippedAdam({"lr": 0.03}), loss=TreeELBO())
    losses = [svi.step(x, y) for _ in range(150)]
    assert losses[-1] < losses[0] - 20
    assert len(pyro.get_param_store()) > 0  # parameters went through the param store
    samples = Predictive(model, guide=guide, num_samples=5)(x)
    assert samples["obs"].shape == (5, 80) and samples["leaf"].shape == (5, 80)


def test_subsampling_scales_the_data_terms():
    x, y = _data(60)
    model, guide = HME(1, 2).double(), RNNTreeGuide(1, 2, feedback="hard").double()
    with pyro.get_param_store().scope():
        full = TreeELBO().differentiable_loss(model, guide, x, y)
        pyro.set_rng_seed(0)
        estimates = torch.stack(
            [
                TreeELBO().differentiable_loss(model, guide, x, y, subsample_size=20)
                for _ in range(60)
            ]
        )
    # Likelihood and per-point terms are unbiased; the coupling estimate is consistent.
    gap = float((estimates.mean() - full).detach())
    assert abs(gap) < 0.05 * abs(float(full.detach())) + 1.0


@pytest.mark.filterwarnings("ignore:TraceEnum_ELBO found no sample sites")  # the bad guide
def test_guide_must_give_leaf_logits():
    x, y = _data()
    model = HME(1, 2)

    def bad_guide(x, y=None, subsample_size=None):
        with pyro.plate("data", x.shape[0]):
            value = torch.zeros(x.shape[0], dtype=torch.long)
            pyro.sample("leaf", pyro.distributions.Delta(value))

    with pytest.raises(ValueError, match="leaf logits"):
        TreeELBO().differentiable_loss(model, bad_guide, x.float(), y.float())
