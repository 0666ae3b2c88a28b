"""BayesianHMEGuide: the Gamma shapes stay above the prior's shape under SVI."""

import math

import pyro
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO

from pyro_trees.guides import BayesianHMEGuide
from pyro_trees.models import BayesianHME
from pyro_trees.topology import Topology


def _line(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=g)
    return x, 2 * x[:, 0] + 0.1 * torch.randn(n, generator=g)


def test_unused_expert_noise_shape_does_not_run_away():
    # Two experts for a straight line: the VB start leaves one without data, q(tau) at
    # about the prior's shape 1e-3. Most draws then underflow to finfo.tiny, where the
    # single-sample ELBO reads a spurious gain growing as the shape falls; Adam followed
    # it (shape 1e-6 after 150 steps at lr 0.05, a NaN concentration after ~1,200)
    # before the guide kept every shape above prior_a.
    x, y = _line()
    pyro.set_rng_seed(0)
    model = BayesianHME(1, 1, Topology.balanced(1))
    guide = BayesianHMEGuide(model, init_restarts=4, init_cycles=50)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(150)]
    assert all(math.isfinite(v) for v in losses)
    assert float(guide.tau_conc.detach().min()) < 1e-2  # an expert is unused (the case tested)
    for key in ("tau_conc", "alpha_conc", "beta_conc"):
        assert float(getattr(guide, key).detach().min()) > model.prior_a, key


@pytest.mark.parametrize("prior_a", [1e-3, 2.0])
def test_every_start_is_inside_the_shape_floor(prior_a):
    x, y = _line(n=20)
    model = BayesianHME(1, 1, Topology.balanced(1), prior_a=prior_a)
    for init in ("random", "data", "vb"):
        pyro.clear_param_store()
        guide = BayesianHMEGuide(model, init=init, init_restarts=2, init_cycles=5)
        guide(x, y)
        for key in ("tau_conc", "alpha_conc", "beta_conc"):
            value = getattr(guide, key).detach()
            assert torch.isfinite(value).all() and bool((value > prior_a).all()), (init, key)
    pyro.clear_param_store()
