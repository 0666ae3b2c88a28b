import math
from dataclasses import fields, replace

import pytest
import torch
import torch.distributions as D

from pyro_trees.infer import bayesian_hme_vb as vb
from pyro_trees.infer.bayesian_hme_vb import selection as vb_selection
from pyro_trees.models import bayesian_hme_vb_updates as vb_updates
from pyro_trees.topology import Topology, enumerate_topologies, mirror_map

TOPS = [
    Topology.from_nested((None, (None, None))),  # unbalanced, 3 experts
    Topology.balanced(2),
    Topology(),  # a single expert, no gate
]


def toy(n=40, d=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dtype=torch.float64, generator=g)
    t = x + 0.3 * torch.sin(2 * math.pi * x) + 0.05 * torch.randn(n, generator=g).double()
    if d == 1:
        return t[:, None], x  # the inverse problem: input t, target x
    return t[:, None], torch.stack([x, x.square() - 0.3 * torch.sin(3 * x)], -1)


def warm_state(data, batch=(3,), cycles=3, temperature=1.0):
    g = torch.Generator().manual_seed(1)
    state = vb.init_state(data, batch, generator=g)
    for _ in range(cycles):
        state = vb.vb_cycle(data, state, temperature)
    return state


@pytest.mark.parametrize("top", TOPS, ids=str)
@pytest.mark.parametrize("d", [1, 2])
@pytest.mark.parametrize("temperature", [0.4, 1.0, 2.5])
def test_bound_never_decreases(top, d, temperature):
    x, t = toy(d=d)
    data = vb.VBData.build(x, t, top)
    g = torch.Generator().manual_seed(2)
    state = vb.init_state(data, (4,), generator=g)
    prev = vb.bound(data, state, temperature)
    for _ in range(12):
        for update in vb.UPDATES:
            state = update(data, state, temperature)
            value = vb.bound(data, state, temperature)
            assert torch.isfinite(value).all()
            slack = 1e-9 * value.abs().clamp_min(1.0)
            assert (value >= prev - slack).all(), (update.__name__, (value - prev).min())
            prev = value


def test_fused_cycle_equals_sequential_updates():
    x, t = toy(d=2)
    data = vb.VBData.build(x, t, TOPS[1])
    state = warm_state(data)
    seq = state
    for update in vb.UPDATES:
        seq = update(data, seq, 1.7)
    fused, _, value = vb.fused_cycle(data, state, 1.7)
    for f in fields(seq):
        assert torch.allclose(getattr(fused, f.name), getattr(seq, f.name), atol=1e-10), f.name
    assert torch.allclose(value, vb.bound(data, seq, 1.7))


def _perturbations(state, name, g):
    """A random direction in the parameters of one factor, keeping the factor valid."""
    groups = {
        "update_experts": ("w_mean", "w_cov"),
        "update_noise": ("tau_a", "tau_b"),
        "update_expert_precisions": ("alpha_a", "alpha_b"),
        "update_xi": ("xi",),
        "update_gates": ("v_mean", "v_cov"),
        "update_gate_precisions": ("beta_a", "beta_b"),
        "update_assignments": ("log_r",),
    }[name]
    out = {}
    for field in groups:
        value = getattr(state, field)
        dirn = torch.randn(value.shape, generator=g, dtype=value.dtype)
        if field.endswith("_cov"):  # L A L^T with |A| < 1 keeps cov + eps * dirn PD
            sym = dirn + dirn.transpose(-1, -2)
            sym = sym / torch.linalg.matrix_norm(sym, 2)[..., None, None] / 2
            chol = torch.linalg.cholesky(value)
            dirn = chol @ sym @ chol.transpose(-1, -2)
        elif field.endswith(("_a", "_b")):  # relative moves keep Gamma parameters positive
            dirn = dirn * value
        out[field] = dirn
    return out


def _moved(state, dirs, eps):
    new = {}
    for field, dirn in dirs.items():
        value = getattr(state, field) + eps * dirn
        if field == "log_r":
            value = value.log_softmax(-1)
        new[field] = value
    return replace(state, **new)


@pytest.mark.parametrize("update", vb.UPDATES, ids=lambda u: u.__name__)
def test_each_update_is_a_stationary_point(update):
    x, t = toy(d=2)
    data = vb.VBData.build(x, t, TOPS[0])
    state = warm_state(data, cycles=4)
    g = torch.Generator().manual_seed(3)
    dirs = _perturbations(state, update.__name__, g)
    eps = 1e-4

    def slope(s):  # central differences with one Richardson step: error O(eps**4)
        up = vb.bound(data, _moved(s, dirs, eps))
        down = vb.bound(data, _moved(s, dirs, -eps))
        up2 = vb.bound(data, _moved(s, dirs, eps / 2))
        down2 = vb.bound(data, _moved(s, dirs, -eps / 2))
        coarse, fine = (up - down) / (2 * eps), (up2 - down2) / eps
        return (4 * fine - coarse) / 3, up, down

    # before the update the bound moves to first order along the direction ...
    perturbed = _moved(state, dirs, 0.05)
    s0, _, _ = slope(perturbed)
    assert s0.abs().max() > 1e-3
    # ... after it, the finite-difference slope vanishes and the bound is a maximum
    optimum = update(data, perturbed)
    s1, up, down = slope(optimum)
    centre = vb.bound(data, optimum)
    assert s1.abs().max() < 1e-5 * max(1.0, float(s0.abs().max()))
    assert (up <= centre + 1e-9).all() and (down <= centre + 1e-9).all()


def test_jj_bound_is_tight_and_gate_terms_are_path_sums():
    # With a point-mass q(v) and xi = |a| the JJ bound is exact: the gate terms equal
    # log pi_j(x) computed from the topology's paths.
    x, t = toy(n=15)
    for top in enumerate_topologies(5, 2):
        data = vb.VBData.build(x, t, top)
        state = warm_state(data, batch=(), cycles=1)
        state = replace(state, v_cov=state.v_cov * 0.0)
        logits = state.v_mean @ data.x.T  # (G, N)
        state = replace(state, xi=logits.abs())
        exact = top.expert_log_probs(logits.T)
        assert torch.allclose(vb.gate_terms(data, state), exact, atol=1e-12)


def test_responsibilities_are_normalised_and_bound_is_logsumexp():
    x, t = toy()
    data = vb.VBData.build(x, t, TOPS[1])
    state = warm_state(data)
    assert torch.allclose(state.log_r.exp().sum(-1), torch.ones(3, 40, dtype=torch.float64))
    # at the optimal q(Z) the assignment part of the bound is sum_n logsumexp_j
    point = vb.gate_terms(data, state) + vb.expected_expert_loglik(data, state)
    glob = vb_updates._global_terms(data, state)
    assert torch.allclose(vb.bound(data, state), point.logsumexp(-1).sum(-1) + glob)


def _mc_elbo(data, state, num_samples, g, jj=True):
    """Monte Carlo estimate of the same ELBO, sampling the global factors from q and
    summing q(Z) exactly."""
    a0, b0 = data.prior_a, data.prior_b
    s = (num_samples,)
    x, t = data.x, data.t

    def gamma(a, b):
        return D.Gamma(a, b)

    qa, qb, qt = (
        gamma(state.alpha_a, state.alpha_b),
        gamma(state.beta_a, state.beta_b),
        gamma(state.tau_a, state.tau_b),
    )
    alpha, beta, tau = qa.sample(s), qb.sample(s), qt.sample(s)
    qv = D.MultivariateNormal(state.v_mean, state.v_cov)
    qw = D.MultivariateNormal(state.w_mean, state.w_cov.unsqueeze(-3))
    v, w = qv.sample(s), qw.sample(s)
    prior = gamma(torch.tensor(a0).double(), torch.tensor(b0).double())
    log_p = prior.log_prob(alpha).sum(-1) + prior.log_prob(beta).sum(-1)
    log_p = log_p + prior.log_prob(tau).sum(-1)
    log_p = log_p + D.Normal(0, beta.rsqrt().unsqueeze(-1)).log_prob(v).sum((-1, -2))
    log_p = log_p + D.Normal(0, alpha.rsqrt()[..., None, None]).log_prob(w).sum((-1, -2, -3))
    log_q = qa.log_prob(alpha).sum(-1) + qb.log_prob(beta).sum(-1) + qt.log_prob(tau).sum(-1)
    log_q = log_q + qv.log_prob(v).sum(-1) + qw.log_prob(w).sum((-1, -2))
    a = v @ x.T  # (S, G, N)
    sg = data.signs
    if jj:
        xi = state.xi
        lam = vb.jj_lambda(xi)
        per = torch.nn.functional.logsigmoid(xi) - 0.5 * xi + lam * xi**2 - lam * a**2
        gate = (0.5 * a).transpose(-1, -2) @ sg + per.transpose(-1, -2) @ sg.abs()
    else:
        ls = torch.nn.functional.logsigmoid(a.unsqueeze(-1) * sg.unsqueeze(-2))
        gate = (ls * sg.abs().unsqueeze(-2)).sum(-3)
    mean = torch.einsum("np,sjdp->snjd", x, w)
    lik = D.Normal(mean, tau.rsqrt()[:, None, :, None]).log_prob(t.unsqueeze(-2)).sum(-1)
    r = state.log_r.exp()
    assign = (r * (gate + lik - state.log_r)).sum((-1, -2))
    sample = assign + log_p - log_q
    return sample.mean(), sample.std() / math.sqrt(num_samples)


def test_closed_form_bound_equals_monte_carlo():
    x, t = toy(n=30, d=2)
    data = vb.VBData.build(x, t, TOPS[0])
    state = warm_state(data, batch=(), cycles=20)
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    mc, se = _mc_elbo(data, state, 20000, g)
    closed = vb.bound(data, state)
    assert abs(float(mc - closed)) < 4 * float(se) + 1e-6, (float(mc), float(closed), float(se))
    # the ELBO of the same q without the JJ bound on the gates is higher
    mc_true, se_true = _mc_elbo(data, state, 20000, g, jj=False)
    assert float(mc_true) > float(closed) - 4 * float(se_true)


def test_temperature_schedule():
    temps = vb.temperature_schedule(800)
    assert temps[0] == 5.85 and temps[-1] == 1.0 and len(temps) == 800
    assert all(a >= b for a, b in zip(temps, temps[1:], strict=False))
    assert 1.0 < temps[199] < 1.02 and temps[200] == 1.0
    floored = vb.temperature_schedule(800, floor=True)
    assert floored[0] == 5.85 and floored[57] > 1.0 and floored[58] == 1.0 == floored[-1]
    inv = vb.temperature_schedule(800, inverse=True)
    assert inv[0] == 1 / 5.85 and inv[-1] == 1.0
    assert all(a <= b for a, b in zip(inv, inv[1:], strict=False))
    with pytest.raises(ValueError):
        vb.temperature_schedule(0)


def test_select_topology_batches_restarts():
    x, t = toy(n=200)
    tops = enumerate_topologies(3, 1)
    g = torch.Generator().manual_seed(0)
    sel = vb.select_topology(x, t, tops, num_restarts=12, num_cycles=120, generator=g)
    assert sel.bounds.shape == (len(tops),)
    assert torch.allclose(sel.weights.sum(), torch.tensor(1.0, dtype=sel.weights.dtype))
    for top, b, st, allb in zip(
        sel.topologies, sel.bounds, sel.states, sel.all_bounds, strict=True
    ):
        assert allb.shape == (12,) and b == allb.max()
        data = vb.VBData.build(x, t, top)
        assert torch.allclose(vb.bound(data, st), b)
    # three experts explain the multimodal inverse problem best (the paper's Ockham hill)
    assert sel.best == 2
    pruned = vb.select_topology(
        x, t, tops[:3], num_restarts=6, num_cycles=40, generator=g, prune_after=10, keep=2
    )
    # pruned starts keep a -inf bound; the two survivors of each topology ran to the end
    assert all(a.shape == (6,) and int(torch.isfinite(a).sum()) == 2 for a in pruned.all_bounds)
    for top, b, st in zip(pruned.topologies, pruned.bounds, pruned.states, strict=True):
        assert torch.allclose(vb.bound(vb.VBData.build(x, t, top), st), b)


def test_run_vb_stops_on_tolerance():
    x, t = toy()
    data = vb.VBData.build(x, t, TOPS[2])
    res = vb.run_vb(data, vb.init_state(data, (2,)), num_cycles=500, tol=1e-8)
    assert res.iterations < 500
    assert res.history.shape == (res.iterations, 2)


@pytest.mark.cuda
def test_cuda_matches_cpu():
    x, t = toy(d=2)
    data = vb.VBData.build(x, t, TOPS[0])
    state = warm_state(data, cycles=2)
    cuda = vb.VBData.build(x.cuda(), t.cuda(), TOPS[0])
    out_cpu = vb.vb_cycle(data, state)
    out_gpu = vb.vb_cycle(cuda, state.to("cuda"))
    assert torch.allclose(vb.bound(cuda, out_gpu).cpu(), vb.bound(data, out_cpu))


def test_race_stops_each_restart_on_its_own():
    # every restart of a batch stops when its own bound has converged, exactly as if it
    # had been run alone
    x, t = toy(n=40)
    top = TOPS[0]
    data = vb.VBData.build(x, t, top)
    flat = data.with_signs(data.signs.expand(3, *data.signs.shape).clone())
    state = vb.init_state(flat, (3,), generator=torch.Generator().manual_seed(4))
    temps = vb.temperature_schedule(150, anneal_cycles=20)
    final, values, work = vb_selection._race(flat, state, temps, 1e-6)
    iters = []
    for i in range(3):
        alone = vb.run_vb(data, state.index(i), temperatures=temps, tol=1e-6)
        iters.append(alone.iterations)
        assert torch.allclose(values[i], alone.bound, rtol=0, atol=1e-9)
        assert torch.allclose(final.index(i).v_mean, alone.state.v_mean, atol=1e-9)
    assert work == sum(iters) and len(set(iters)) > 1


def test_float32_search_is_polished_in_float64():
    x, t = toy(n=120)
    tops = enumerate_topologies(3, 2)
    g = torch.Generator().manual_seed(0)
    sel = vb.select_topology(
        x, t, tops, num_restarts=6, num_cycles=80, generator=g, search_dtype=torch.float32
    )
    assert sel.bounds.dtype == torch.float64
    for top, b, st in zip(sel.topologies, sel.bounds, sel.states, strict=True):
        assert st.v_mean.dtype == torch.float64
        assert torch.allclose(vb.bound(vb.VBData.build(x, t, top), st), b)
        # polishing only raises the bound found in single precision
        assert float(b) >= float(sel.all_bounds[sel.topologies.index(top)].max()) - 1e-3
    assert sel.cycles > 0


def test_failed_cholesky_poisons_only_its_element():
    prec = torch.eye(3, dtype=torch.float64).repeat(3, 1, 1)
    prec[1, 0, 0] = -1.0
    cov, logdet = vb_updates._gauss_from_precision(prec)
    assert torch.isnan(cov[1]).all() and torch.isnan(logdet[1])
    assert torch.allclose(cov[[0, 2]], prec[[0, 2]]) and (logdet[[0, 2]] == 0).all()
    with pytest.raises(torch.linalg.LinAlgError):
        vb_updates._gauss_from_precision(prec[1])


def test_exp_clamp_is_within_tiny():
    for dtype in (torch.float32, torch.float64):
        v = torch.tensor([-1e4, -200.0, -50.0, 0.0, 3.0], dtype=dtype)
        tiny = torch.finfo(dtype).tiny
        assert ((vb_updates._exp(v) - v.exp()).abs() <= 3 * tiny).all()


def test_merge_selections_keeps_the_best_per_topology():
    x, t = toy(n=80)
    tops = enumerate_topologies(3, 2)
    g = torch.Generator().manual_seed(0)
    a = vb.select_topology(x, t, tops, num_restarts=3, num_cycles=30, generator=g)
    b = vb.select_topology(
        x, t, tops, num_restarts=2, temperatures=vb.schedule_by_name("floor", 30), generator=g
    )
    m = vb.merge_selections([a, b])
    assert torch.equal(m.bounds, torch.maximum(a.bounds, b.bounds))
    assert all(len(ab) == 5 for ab in m.all_bounds) and m.cycles == a.cycles + b.cycles
    for k, top in enumerate(tops):
        assert torch.allclose(vb.bound(vb.VBData.build(x, t, top), m.states[k]), m.bounds[k])
    with pytest.raises(ValueError, match="same topologies"):
        vb.merge_selections([a, vb.select_topology(x, t, tops[:1], num_cycles=2)])
    with pytest.raises(ValueError, match="unknown annealing"):
        vb.schedule_by_name("warm")
    assert vb.schedule_by_name("none", 5) == [1.0] * 5


def _mirrors(top):
    """Every mirror image of ``top`` (children of any subset of gates swapped)."""

    def images(tree):
        if tree is None:
            return {None}
        return {p for a in images(tree[0]) for b in images(tree[1]) for p in ((a, b), (b, a))}

    return sorted((Topology.from_nested(t) for t in images(top.to_nested())), key=lambda t: t.gates)


def test_mirror_state_keeps_the_bound_and_the_mixture():
    x, t = toy(d=2)
    src = Topology.from_nested((None, ((None, None), None)))
    data = vb.VBData.build(x, t, src)
    state = warm_state(data, cycles=4)
    value = vb.bound(data, state)
    images = _mirrors(src)
    assert len(images) == 4
    for target in images:
        gate_src, gate_flip, expert_src = mirror_map(src, target)
        assert sorted(gate_src) == list(range(3)) and sorted(expert_src) == list(range(4))
        moved = vb.mirror_state(state, src, target)
        tdata = vb.VBData.build(x, t, target)
        assert torch.allclose(vb.bound(tdata, moved), value, rtol=1e-12, atol=1e-9)
        # the gate probabilities of each expert follow it
        logits_s = (state.v_mean @ data.x.T).transpose(-1, -2)
        logits_t = (moved.v_mean @ data.x.T).transpose(-1, -2)
        pi_s = src.expert_log_probs(logits_s)
        pi_t = target.expert_log_probs(logits_t)
        assert torch.allclose(pi_t, pi_s[..., expert_src])
    assert mirror_map(src, src) == ([0, 1, 2], [False] * 3, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="mirror images"):
        mirror_map(src, Topology.balanced(2))


@pytest.mark.parametrize(
    "top", [Topology(), Topology.from_nested(((None, None), None)), Topology.balanced(2)], ids=str
)
def test_grown_start_changes_the_bound_by_the_split_gain(top):
    # splitting a leaf keeps the fit (same mixture) and costs exactly the new factors'
    # prior terms and the new gate's Jaakkola-Jordan slack: an exact identity
    x, t = toy(d=2)
    data = vb.VBData.build(x, t, top)
    state = warm_state(data, cycles=4)
    before = vb.bound(data, state)
    g = torch.Generator().manual_seed(3)
    for j, leaf in enumerate(top.experts):
        dirs = torch.stack(
            [vb.split_directions(data, state.index(b), j, 1, generator=g)[0] for b in range(3)]
        )
        child, grown = vb.grow_state(data, state, top, leaf, dirs)
        assert child.num_experts == top.num_experts + 1 and leaf in child.gates
        cdata = vb.VBData.build(x, t, child)
        k = child.gates.index(leaf)
        after = vb.bound(cdata, grown)
        gain = vb.split_gain(cdata, state, grown, k, j)
        assert torch.allclose(after, before + gain, rtol=0, atol=1e-9 * before.abs().max())
        assert (gain < 0).all()  # the copy and the gate cost prior terms; the fit is unchanged

        # the gated mixture of expert means is unchanged
        def mix(tp, st, d):
            log_pi = tp.expert_log_probs((st.v_mean @ d.x.T).transpose(-1, -2))
            means = torch.einsum("np,bjdp->bnjd", d.x, st.w_mean)
            return (log_pi.exp().unsqueeze(-1) * means).sum(-2)

        assert torch.allclose(mix(child, grown, cdata), mix(top, state, data))
        r = grown.log_r.exp()
        assert torch.allclose(r.sum(-1), torch.ones_like(r[..., 0]))
        # VB cycles from the grown start never lower its bound
        res = vb.run_vb(cdata, grown, num_cycles=15, tol=None)
        assert (res.history[0] >= after - 1e-9 * after.abs()).all()
        assert (res.history.diff(dim=0) >= -1e-9 * res.history[1:].abs()).all()
    with pytest.raises(ValueError, match="not an expert"):
        vb.grow_state(data, state, top, 99, dirs)


def test_split_directions_cut_the_leaf_data_through_its_mean():
    x, t = toy(n=200, d=2)
    top = Topology.balanced(1)
    data = vb.VBData.build(x, t, top)
    state = warm_state(data, batch=(), cycles=5)
    dirs = vb.split_directions(data, state, 0, 3, sharpness=2.0)
    assert dirs.shape == (3, 2)
    w = state.log_r[:, 0].exp()
    w = w / w.sum()
    logits = data.x @ dirs.T  # (N, 3)
    mean = w @ logits
    sd = (w @ (logits - mean).square()).sqrt()
    assert torch.allclose(mean, torch.zeros(3, dtype=mean.dtype), atol=1e-9)
    assert torch.allclose(sd, torch.full((3,), 2.0, dtype=sd.dtype))


def test_grow_selection_never_lowers_a_bound():
    x, t = toy(n=120)
    tops = enumerate_topologies(4, 1)
    g = torch.Generator().manual_seed(0)
    sel = vb.select_topology(x, t, tops, num_restarts=2, num_cycles=25, generator=g)
    grown = vb.grow_selection(x, t, sel, starts_per_split=2, num_cycles=60, generator=g)
    assert (grown.bounds >= sel.bounds).all()
    assert grown.grown.shape == (len(tops),) and not bool(grown.grown[0])
    assert bool(grown.grown.any())  # two short random starts leave room to improve
    assert torch.equal(grown.grown, grown.bounds > sel.bounds)
    assert grown.cycles > sel.cycles
    for k, top in enumerate(tops):
        data = vb.VBData.build(x, t, top)
        assert torch.allclose(vb.bound(data, grown.states[k]), grown.bounds[k])
        assert len(grown.all_bounds[k]) >= len(sel.all_bounds[k])
    # (E E) has one way to grow from E; ((E E) (E E)) one from (E (E E)); 2 starts each
    assert len(grown.all_bounds[1]) == 2 + 2 and len(grown.all_bounds[4]) == 2 + 2
    # float32 grown starts, polished in float64
    g32 = vb.grow_selection(
        x, t, sel, starts_per_split=1, num_cycles=30, generator=g, search_dtype=torch.float32
    )
    assert all(s.v_mean.dtype == torch.float64 for s in g32.states)
    assert (g32.bounds >= sel.bounds).all()


def test_the_compiled_cycle_equals_the_eager_one():
    """A search and its growth with the cycles compiled (backend ``"eager"``: dynamo's
    capture of one graph per program, no generated code; the cycle needs no gradients)
    give the eager search's bounds and states; an annealed schedule passes its
    temperatures as tensors."""
    x, t = toy(n=80)
    tops = enumerate_topologies(2, 1)

    def search(compile):
        g = torch.Generator().manual_seed(0)
        temps = vb.temperature_schedule(50, initial=4.0, factor=0.8, anneal_cycles=30)
        sel = vb.select_topology(
            x, t, tops, num_restarts=3, temperatures=temps, generator=g, compile=compile
        )
        grown = vb.grow_selection(
            x, t, sel, starts_per_split=1, num_cycles=20, generator=g, compile=compile
        )
        return sel, grown

    eager, compiled = search(False), search("eager")
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a.bounds, b.bounds, rtol=1e-9, atol=1e-9)
        for sa, sb in zip(a.states, b.states, strict=True):
            torch.testing.assert_close(sa.v_mean, sb.v_mean, rtol=1e-7, atol=1e-9)
    cycle = vb.cycle_program("eager")
    data = vb.VBData.build(x, t, tops[1])
    state = vb.init_state(data, (2,), generator=torch.Generator().manual_seed(1))
    _, sq_a, _ = vb.fused_cycle(data, state)
    ours, ref = cycle(data, state, 2.0, sq_a), vb.fused_cycle(data, state, 2.0, sq_a)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-12, atol=1e-12)
    assert cycle.program.failed is None  # it ran compiled, not through the fallback
    assert vb.cycle_program(False) is vb.fused_cycle


def test_with_signs_takes_what_build_takes_and_shares_the_row_statistics():
    """A topology, a batch of them or sign matrices (converted to x's dtype): the same
    data as ``build`` with them, the cached statistics shared; other shapes raise."""
    from pyro_trees.infer import VBData
    from pyro_trees.topology import Topology

    torch.manual_seed(0)
    x, t = torch.randn(9, 2, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    data = VBData.build(x, t, Topology.balanced(1)).precompute()
    for signs in (Topology.balanced(2), [Topology.balanced(2)] * 2):
        new = data.with_signs(signs)
        ref = VBData.build(x, t, signs)
        assert torch.equal(new.signs, ref.signs) and new.signs.dtype == torch.float64
        assert new.__dict__["_pairs"] is data.__dict__["_pairs"]
        cov = torch.eye(3, dtype=torch.float64).expand(4, 3, 3)
        assert torch.equal(new.quad(cov), ref.quad(cov))
    ints = data.with_signs(Topology.balanced(2).sign_matrix().long())
    assert ints.signs.dtype == torch.float64
    with pytest.raises(ValueError, match=r"\(\.\.\., G, G \+ 1\)"):
        data.with_signs(torch.ones(3, 3))
