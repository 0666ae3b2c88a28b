import math

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Trace_ELBO

from pyro_trees.guides import BayesianHMEGuide, RestartPlate
from pyro_trees.infer import bayesian_hme_vb as vb
from pyro_trees.infer import isolated_params
from pyro_trees.infer.bayesian_hme_svi import (
    _LikelihoodTemperature,
    annealing_schedule,
    fit_svi_restarts,
    restart_elbos,
)
from pyro_trees.models import BayesianHME
from pyro_trees.topology import Topology


def toy(n=60, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g, dtype=torch.float64)
    t = x + 0.3 * torch.sin(2 * math.pi * x) + 0.05 * torch.randn(n, generator=g, dtype=x.dtype)
    return t[:, None].to(dtype), x[:, None].to(dtype)


def _log_joint_per_restart(model, guide, x, y):
    g_tr = poutine.trace(guide).get_trace(x, y)
    m_tr = poutine.trace(poutine.replay(model, trace=g_tr)).get_trace(x, y)
    total = 0.0
    for site in m_tr.nodes.values():
        if site["type"] == "sample":
            total = total + site["fn"].log_prob(site["value"]).sum(-1)
    return g_tr, total


def test_restart_plate_is_a_batch_of_independent_models():
    torch.set_default_dtype(torch.float64)
    try:
        x, y = toy(n=13, dtype=torch.float64)
        top = Topology([1, 3])
        model = BayesianHME(1, 1, top)
        guide = BayesianHMEGuide(model, num_restarts=3).init_from_data(
            x, y, generator=torch.Generator().manual_seed(1)
        )
        g_tr, per_restart = _log_joint_per_restart(RestartPlate(model, 3), guide, x, y)
        assert per_restart.shape == (3,)
        for r in range(3):
            values = {
                k: s["value"][r]
                for k, s in g_tr.nodes.items()
                if s["type"] == "sample" and k in ("beta", "v", "alpha", "tau", "W")
            }
            tr = poutine.trace(poutine.condition(model, data=values)).get_trace(x, y)
            assert torch.allclose(tr.log_prob_sum(), per_restart[r], rtol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_mixture_broadcasts_leading_batch_dims():
    model = BayesianHME(2, 2, Topology([1, 3]))
    x, y = torch.randn(5, 2), torch.randn(5, 2)
    v, W, tau = torch.randn(4, 2, 3), torch.randn(4, 3, 2, 3), torch.rand(4, 3) + 0.5
    batched = model.mixture(x, v, W, tau).log_prob(y)
    assert batched.shape == (4, 5)
    for b in range(4):
        one = model.mixture(x, v[b], W[b], tau[b]).log_prob(y)
        assert torch.allclose(batched[b], one, atol=1e-6)


def test_each_restart_gets_only_its_own_gradient():
    x, y = toy(n=20)
    model = BayesianHME(1, 1, Topology([1, 3]))
    guide = BayesianHMEGuide(model, num_restarts=2).init_from_data(x, y)
    wrapped = RestartPlate(model, 2)

    def grads():
        pyro.set_rng_seed(3)
        for p in guide.parameters():
            p.grad = None
        Trace_ELBO(max_plate_nesting=2).differentiable_loss(wrapped, guide, x, y).backward()
        return {n: p.grad[0].clone() for n, p in guide.named_parameters()}

    before = grads()
    with torch.no_grad():
        guide.W_loc_unconstrained[1] += 1.0
        guide.v_loc_unconstrained[1] -= 0.5
    after = grads()
    assert before.keys() == after.keys() and len(before) == 12
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_restart_elbos_match_trace_elbo_of_each_restart():
    torch.set_default_dtype(torch.float64)
    try:
        x, y = toy(n=40, dtype=torch.float64)
        top = Topology([1, 3])
        data = vb.VBData.build(x, y, top)
        res = vb.run_vb(data, vb.init_state(data, (2,)), num_cycles=60, tol=None)
        model = BayesianHME(1, 1, top)
        guide = BayesianHMEGuide(model, num_restarts=2).init_from_data(x, y)
        plain = [BayesianHMEGuide(model).load_vb_state(res.state.index(r)) for r in range(2)]
        with torch.no_grad():
            for name in BayesianHMEGuide._PARAMS:
                setattr(guide, name, torch.stack([getattr(p, name) for p in plain]))
        # each guide in its own param-store scope (they share parameter names)
        with isolated_params():
            got = restart_elbos(RestartPlate(model, 2), guide, x, y, num_particles=2000, chunk=500)
        for r in range(2):
            assert torch.equal(guide.restart(r, model).W_loc, plain[r].W_loc)
            with torch.no_grad(), isolated_params():
                want = -Trace_ELBO(
                    num_particles=2000, vectorize_particles=True, max_plate_nesting=1
                ).loss(model, plain[r], x, y)
            # both are Monte Carlo estimates of the same ELBO (MC error about 0.05 here)
            assert abs(float(got[r]) - want) < 0.5
            assert float(got[r]) > float(res.bound[r])  # the JJ bound is below the ELBO
    finally:
        torch.set_default_dtype(torch.float32)


def test_likelihood_temperature_scales_only_the_observations():
    x, y = toy(n=9)
    model = BayesianHME(1, 1, Topology([1, 2]))
    guide = BayesianHMEGuide(model)
    g_tr = poutine.trace(guide).get_trace(x, y)
    tempering = _LikelihoodTemperature("obs")
    tempering.temperature = 2.5
    plain = poutine.trace(poutine.replay(model, trace=g_tr)).get_trace(x, y)
    tempered = poutine.trace(poutine.replay(tempering(model), trace=g_tr)).get_trace(x, y)
    plain.compute_log_prob()
    tempered.compute_log_prob()
    for name in ("beta", "v", "alpha", "tau", "W", "obs"):
        scale = 1 / 2.5 if name == "obs" else 1.0
        want = plain.nodes[name]["log_prob_sum"] * scale
        assert torch.allclose(tempered.nodes[name]["log_prob_sum"], want), name
    temps = annealing_schedule(100, 5.85, 0.97)
    assert temps[0] == 5.85 and temps[-1] == 1.0 and temps == sorted(temps, reverse=True)


def test_fit_svi_restarts_returns_the_best_restart_as_a_plain_guide():
    x, y = toy(n=40)
    top = Topology([1, 3])
    res = fit_svi_restarts(
        x,
        y,
        top,
        num_restarts=3,
        num_steps=40,
        temperatures=annealing_schedule(20, 3.0, 0.9),
        eval_particles=50,
        generator=torch.Generator().manual_seed(0),
    )
    assert res.elbos.shape == (3,) and torch.isfinite(res.elbos).all()
    assert res.best == int(res.elbos.argmax()) and res.elbo == float(res.elbos.max())
    assert len(res.losses) == 40 and all(math.isfinite(v) for v in res.losses)
    assert res.guide.num_restarts is None and res.guide.W_loc.shape == (3, 1, 2)
    assert torch.equal(res.guide.W_loc, res.batched_guide.W_loc[res.best].detach())
    # a polish of the best two restarts with more samples per step
    pol = fit_svi_restarts(
        x,
        y,
        top,
        num_restarts=3,
        num_steps=20,
        keep=2,
        polish_steps=10,
        polish_particles=4,
        select_particles=20,
        eval_particles=50,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(pol.polished) == 2 and len(pol.losses) == 30
    assert pol.best == int(pol.elbos.argmax()) and torch.isfinite(pol.elbos).all()
    assert pol.guide.num_restarts is None
    if pol.best not in pol.polished:
        assert torch.equal(pol.guide.W_loc, pol.batched_guide.W_loc[pol.best].detach())
    # the best restart trains on with plain SVI
    svi = pyro.infer.SVI(res.model, res.guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
    assert all(math.isfinite(svi.step(x, y)) for _ in range(3))


def test_bad_input():
    model = BayesianHME(1, 1, Topology([1, 2]))
    with pytest.raises(ValueError, match="num_restarts"):
        BayesianHMEGuide(model, num_restarts=0)
    with pytest.raises(ValueError, match="num_restarts"):
        RestartPlate(model, 0)
    with pytest.raises(ValueError, match="needs a guide built with num_restarts"):
        BayesianHMEGuide(model).restart(0, model)
    with pytest.raises(ValueError, match="out of range"):
        BayesianHMEGuide(model, num_restarts=2).restart(2, model)
    with pytest.raises(ValueError, match="indices"):
        BayesianHMEGuide(model, num_restarts=2).subset([0, 2], model)
    x, y = toy(n=10)
    with pytest.raises(ValueError, match="call the guide"):
        BayesianHMEGuide(model, num_restarts=3).subset([2, 0], model)
    sub = BayesianHMEGuide(model, num_restarts=3).init_from_data(x, y).subset([2, 0], model)
    assert sub.num_restarts == 2 and sub.W_loc.shape[0] == 2
    with pytest.raises(ValueError, match="num_steps"):
        fit_svi_restarts(x, y, Topology([1, 2]), num_steps=0)
    with pytest.raises(ValueError, match="polish_steps"):
        fit_svi_restarts(x, y, Topology([1, 2]), num_steps=2, polish_steps=-1)
    with pytest.raises(ValueError, match="temperatures"):
        fit_svi_restarts(x, y, Topology([1, 2]), num_steps=2, temperatures=[0.0])
