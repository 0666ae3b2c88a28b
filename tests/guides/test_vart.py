"""VaRT model and truncated guide: log densities by hand, shapes, gradients, save/load."""

import io
import math

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive, Trace_ELBO

from pyro_trees.guides import TemperatureSchedule, VaRTGuide
from pyro_trees.models import VaRT, mixture_params, with_bias


def _normal_lp(v, loc, scale):
    return -0.5 * ((v - loc) / scale) ** 2 - math.log(scale) - 0.5 * math.log(2 * math.pi)


def _data(n=7, L=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, L, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    return x, y


def _setup(depth=2, kl_weight=0.3, temperature=0.7):
    model = VaRT(
        2, kl_weight=kl_weight, split_alpha=0.8, split_beta=1.5, split_scale=1.3, leaf_scale=0.9
    )
    guide = VaRTGuide(model, depth, temperature=temperature, init="random").double()
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model, guide


@torch.no_grad()
def _hand_log_densities(model, guide, tr, x, y):
    """Eqs. 23-27 written node by node with explicit ancestors (no vectorisation)."""
    D = guide.depth
    kl_weight = model.kl_weight
    s, beta, theta, ls = {}, {}, {}, {}
    for d in range(D + 1):
        n = 1 << d
        for k in range(n):
            i = n + k
            s[i] = float(tr.nodes[f"split_{d}"]["value"][k])
            theta[i] = tr.nodes[f"theta_{d}"]["value"][k].detach()
            ls[i] = float(tr.nodes[f"log_sigma_{d}"]["value"][k])
            if d < D:
                beta[i] = tr.nodes[f"beta_{d}"]["value"][k].detach()

    def exist(i):
        a = 1.0
        while i > 1:
            i //= 2
            a *= s[i]
        return a

    gamma_q = torch.sigmoid(guide.split_logits.detach()).tolist()
    log_p = log_q = 0.0
    for i in range(1, 1 << (D + 1)):
        d = i.bit_length() - 1
        A = exist(i)
        psi, kappa = A * s[i], A * (1 - s[i])
        g = model.split_prob(d)
        log_p += A * (s[i] * math.log(g) + (1 - s[i]) * math.log(1 - g))
        lp_leaf = sum(_normal_lp(float(t), 0.0, model.leaf_scale) for t in theta[i])
        lp_leaf += _normal_lp(ls[i], model.noise_prior_loc, model.noise_prior_scale)
        log_p += kappa * lp_leaf
        j = i - 1
        lq_leaf = sum(
            _normal_lp(float(t), float(m), float(sd))
            for t, m, sd in zip(theta[i], guide.theta_loc[j], guide.theta_scale[j], strict=True)
        )
        lq_leaf += _normal_lp(ls[i], float(guide.log_sigma_loc[j]), float(guide.log_sigma_scale[j]))
        log_q += kappa * lq_leaf
        if d < D:
            log_p += psi * sum(_normal_lp(float(b), 0.0, model.split_scale) for b in beta[i])
            gq = gamma_q[j]
            log_q += A * (s[i] * math.log(gq) + (1 - s[i]) * math.log(1 - gq))
            log_q += psi * sum(
                _normal_lp(float(b), float(m), float(sd))
                for b, m, sd in zip(beta[i], guide.beta_loc[j], guide.beta_scale[j], strict=True)
            )
    # likelihood: sum over nodes of kappa_i * P(x reaches i) * N(y; theta_i^T x, sigma_i)
    loglik = 0.0
    for n in range(x.shape[0]):
        x1 = torch.cat([x[n], torch.ones(1, dtype=x.dtype)])
        total = 0.0
        for i in range(1, 1 << (D + 1)):
            reach, node = 1.0, i
            while node > 1:
                par = node // 2
                p_left = float(torch.sigmoid(beta[par] @ x1))
                reach *= p_left if node % 2 == 0 else 1 - p_left
                node = par
            kappa = exist(i) * (1 - s[i])
            mean = float(theta[i] @ x1)
            total += kappa * reach * math.exp(_normal_lp(float(y[n]), mean, math.exp(ls[i])))
        loglik += math.log(total)
    return kl_weight * log_p + loglik, kl_weight * log_q


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_log_densities_match_hand_computed_tree(temperature):
    model, guide = _setup(depth=2, temperature=temperature)
    x, y = _data()
    torch.manual_seed(3)
    guide_tr = poutine.trace(guide).get_trace(x, y)
    model_tr = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(x, y)
    expected_p, expected_q = _hand_log_densities(model, guide, guide_tr, x, y)
    assert float(guide_tr.log_prob_sum().detach()) == pytest.approx(expected_q, rel=1e-9, abs=1e-9)
    assert float(model_tr.log_prob_sum().detach()) == pytest.approx(expected_p, rel=1e-9, abs=1e-9)


def test_leaf_path_probabilities_sum_to_one():
    model, guide = _setup(depth=3)
    x, _ = _data(11)
    for tau in (1.0, 0.2, 0.0):
        with guide.temperature_set_to(tau):
            guide_tr = poutine.trace(guide).get_trace(x)
        model_tr = poutine.trace(poutine.replay(model.sample_tree, trace=guide_tr)).get_trace()
        tree = model_tr.nodes["_RETURN"]["value"]
        logits, _, _ = mixture_params(tree, with_bias(x))
        assert torch.allclose(logits.logsumexp(-1), torch.zeros(11, dtype=x.dtype), atol=1e-10)


def test_prior_draws_are_finite_trees():
    model = VaRT(2)
    x, _ = _data(4)
    depths = []
    for _ in range(200):
        tr = poutine.trace(model).get_trace(x.float())
        assert tr.nodes["obs"]["value"].shape == (4,)
        tree = model.sample_tree(like=x.float())
        depths.append(tree["split"].shape[-1].bit_length() - 1)  # 2**(D + 1) - 1 nodes
    assert max(depths) <= 6 and min(depths) == 0 and max(depths) >= 1


def test_every_parameter_receives_a_gradient():
    x, y = _data(9)
    with pyro.settings.context(module_local_params=True):
        model, guide = _setup(depth=3)
        elbo = Trace_ELBO()(model, guide)
        loss = elbo(x, y)
        loss.backward()
        params = dict(guide.named_parameters())
    assert len(params) == 7
    for name, p in params.items():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert (p.grad != 0).any(), name


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("subsample_size", [None, 3])
def test_predictive_shapes_under_plates_and_subsampling(parallel, subsample_size):
    model, guide = _setup(depth=2)
    x, y = _data(8)
    pred = Predictive(
        model,
        guide=guide,
        num_samples=5,
        parallel=parallel,
        return_sites=["obs", "mean", "beta_0", "theta_2"],
    )
    out = pred(x, subsample_size=subsample_size)
    b = 8 if subsample_size is None else subsample_size
    assert out["obs"].shape == (5, b)
    assert out["mean"].shape == (5, b)
    assert out["beta_0"].shape == (5, 1, 3)
    assert out["theta_2"].shape == (5, 4, 3)
    assert torch.isfinite(out["obs"]).all()


def test_subsampled_likelihood_is_rescaled_exactly():
    model, guide = _setup(depth=2, temperature=0.5)
    x, y = _data(40)
    guide_tr = poutine.trace(guide).get_trace(x, y)
    full = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(x, y)
    sub = poutine.trace(poutine.replay(model, trace=guide_tr)).get_trace(x, y, subsample_size=8)
    full.compute_log_prob()
    sub.compute_log_prob()
    idx = sub.nodes["data"]["value"]
    assert idx.shape == (8,)
    per_point = full.nodes["obs"]["log_prob"].detach()
    assert torch.allclose(sub.nodes["obs"]["log_prob_sum"].detach(), per_point[idx].sum() * 40 / 8)
    assert torch.allclose(sub.nodes["obs"]["log_prob"].detach(), per_point[idx] * 40 / 8)


def test_save_load_exact():
    model, guide = _setup(depth=2)
    x, _ = _data(6)
    buf = io.BytesIO()
    torch.save({"model": model, "guide": guide}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    outs = []
    for m, g in ((model, guide), (loaded["model"], loaded["guide"])):
        pyro.set_rng_seed(5)
        outs.append(Predictive(m, guide=g, num_samples=4, return_sites=["obs"])(x)["obs"])
    assert torch.equal(outs[0], outs[1])
    assert loaded["guide"].temperature == guide.temperature
    assert "depth=2" in repr(loaded["guide"])


def test_temperature_schedule_and_validation():
    sched = TemperatureSchedule(100, start=1.0, end=0.01)
    taus = [sched(t) for t in range(0, 150, 10)]
    assert taus[0] == 1.0 and math.isclose(taus[-1], 0.01)
    assert all(a >= b for a, b in zip(taus[:-1], taus[1:], strict=True))
    model, guide = _setup()
    sched.callback(guide)(49, 0.0)
    assert math.isclose(guide.temperature, 0.1)
    with pytest.raises(ValueError, match="temperature"):
        guide.temperature = -1
    with pytest.raises(ValueError, match="depth"):
        VaRTGuide(model, 0)
    with pytest.raises(ValueError, match="x must have shape"):
        guide(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="kl_weight"):
        VaRT(2, kl_weight=0.0)


def test_most_probable_structure_dynamic_programme():
    model = VaRT(1)
    guide = VaRTGuide(model, 2)
    with torch.no_grad():
        # root splits w.p. 0.6; its children split w.p. 0.9 and 0.2
        guide.split_logits.copy_(torch.logit(torch.tensor([0.6, 0.9, 0.2])))
    # leaf: 0.4; split: 0.6 * max(0.1, 0.9) * max(0.8, 0.2) = 0.432 -> split
    assert guide.most_probable_structure().tolist() == [True, True, False]
    psi, kappa = guide.node_probs()
    assert torch.allclose(psi + kappa, torch.tensor([1, 0.6, 0.6, 0.54, 0.54, 0.12, 0.12]))


@pytest.mark.cuda
def test_cuda_svi_step_and_predictive():
    x, y = _data(16)
    x, y = x.float().cuda(), y.float().cuda()
    with pyro.settings.context(module_local_params=True):
        model = VaRT(2)
        guide = VaRTGuide(model, 3).cuda()
        loss = Trace_ELBO()(model, guide)(x, y)
        loss.backward()
    assert all(p.grad.is_cuda for p in guide.parameters())
    out = Predictive(model, guide=guide, num_samples=3, parallel=True)(x)
    assert out["obs"].is_cuda and out["obs"].shape == (3, 16)


def test_data_driven_split_init_cuts_through_data_points():
    x, _ = _data(30, L=2)
    model = VaRT(2)
    guide = VaRTGuide(model, 3).double()
    guide.init_splits_from_data(x, sharpness=1.5, generator=torch.Generator().manual_seed(3))
    loc = guide.beta_loc.detach()
    assert loc.shape == (7, 3)
    # every rule's boundary passes through one of the rows ...
    margins = (with_bias(x) @ loc.T).abs()  # (rows, nodes)
    assert (margins.min(0).values < 1e-5).all()
    # ... along one dominant feature of weight +-sharpness
    assert torch.allclose(loc[:, :2].abs().max(-1).values, torch.full((7,), 1.5, dtype=loc.dtype))
    with pytest.raises(ValueError, match="sharpness"):
        guide.init_splits_from_data(x, sharpness=0.0)
    with pytest.raises(ValueError, match="x must have shape"):
        guide.init_splits_from_data(torch.zeros(4, 3))


def test_mean_tree_matches_a_hard_guide_draw_with_tiny_scales():
    model, guide = _setup(depth=2)
    with torch.no_grad():
        guide.split_logits.copy_(torch.tensor([30.0, -30.0, 30.0]))
        for name in ("beta_scale", "theta_scale", "log_sigma_scale"):
            setattr(guide, name, getattr(guide, name).detach() * 1e-9)
    x, _ = _data(9)
    tree = guide.mean_tree()
    assert tree["split"].tolist() == [1, 0, 1, 0, 0, 0, 0]
    logits, means, _ = mixture_params(tree, with_bias(x))
    assert torch.allclose(logits.logsumexp(-1), torch.zeros(9, dtype=x.dtype), atol=1e-6)
    with guide.temperature_set_to(0.0):
        draw = Predictive(model, guide=guide, num_samples=1, return_sites=["mean"])(x)["mean"]
    mean = (logits.softmax(-1) * means).sum(-1)
    assert torch.allclose(draw[0], mean, atol=1e-6)


def test_guide_memory_check_counts_its_parameters():
    guide = VaRTGuide(VaRT(4), 3)
    assert VaRTGuide.num_parameters(3, 4) == sum(p.numel() for p in guide.parameters())
    # 2**20 positions with 2**20 + 1 weights each: about 24 TiB of parameters, although
    # one point through 2**20 leaves would take only 16 MiB
    with pytest.raises(ValueError, match=r"depth 20 .* guide's parameters .* would need about"):
        VaRTGuide(VaRT(2**20), 20)


def test_prior_draws_follow_per_node_priors():
    # root always splits, its children never; the root's split weights sit at mu_1
    mu = torch.tensor([[3.0, -2.0, 0.5]])
    model = VaRT(
        2,
        node_split_prob=torch.tensor([1 - 1e-7, 1e-7, 1e-7]),
        node_split_loc=mu,
        node_split_scale=torch.full((1, 3), 1e-4),
        node_leaf_loc=torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0]]),
        site_depth=1,
    )
    x, _ = _data(4)
    for _ in range(20):
        tr = poutine.trace(model).get_trace(x.float())
        assert tr.nodes["split_0"]["value"].tolist() == [1.0]
        assert tr.nodes["split_1"]["value"].tolist() == [0.0, 0.0]
        assert "split_2" not in tr.nodes
        assert torch.allclose(tr.nodes["beta_0"]["value"], mu, atol=1e-3)
        # node 2 (row 1) has its own leaf mean; node 3 keeps N(0, leaf_scale^2 I)
        lp = tr.nodes["theta_1"]["fn"].log_prob(torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
        assert torch.allclose(lp, torch.full((2,), -1.5 * math.log(2 * math.pi)))


def test_per_node_prior_bad_input():
    with pytest.raises(ValueError, match=r"node_split_prob must have shape \(K,\)"):
        VaRT(2, node_split_prob=torch.ones(2, 2) / 2)
    with pytest.raises(ValueError, match="node_split_prob must lie in"):
        VaRT(2, node_split_prob=torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"node_leaf_loc must have shape \(K, 3\)"):
        VaRT(2, node_leaf_loc=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="node_split_loc contains NaN"):
        VaRT(2, node_split_loc=torch.tensor([[0.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="standard deviations must be > 0"):
        VaRT(2, node_leaf_scale=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="lower triangular with a positive diagonal"):
        VaRT(2, node_split_scale=torch.ones(1, 3, 3))
