"""The heteroscedastic GP on the Pyro user's path: ``HeteroscedasticGPGuide(model)`` and the
plain SVI loop with ``Trace_ELBO`` (regression tests for the traps of issue 24)."""

import copy
import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_trees.guides import HeteroscedasticGPGuide
from pyro_trees.infer import CollapsedELBO
from pyro_trees.models import HeteroscedasticGP


def _data(n=40, dtype=torch.float64):
    x = torch.linspace(-1, 1, n, dtype=dtype).unsqueeze(-1)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    y = torch.sin(3 * x[:, 0]) + 0.05 * (1 + 4 * (x[:, 0] > 0)) * noise
    return x, y


def _pair(sparse=0, depth=2, name=None):
    z = torch.linspace(-1, 1, sparse).unsqueeze(-1) if sparse else None
    model = HeteroscedasticGP(1, depth, inducing_points=z, name=name)
    return model, HeteroscedasticGPGuide(model)


def _train(model, guide, x, y, steps, lr=0.02, **kwargs):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), Trace_ELBO())
    return [svi.step(x, y, **kwargs) for _ in range(steps)]


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_exact_predictive_is_the_posterior_predictive(parallel):
    model, guide = _pair()
    x, y = _data()
    _train(model, guide, x, y, 30)
    pred = model.predict(x, guide, routing="posterior")
    samples = Predictive(model, guide=guide, num_samples=400, parallel=parallel)(x)
    f = samples["f"].reshape(400, -1)
    obs = samples["obs"].reshape(400, -1)
    assert samples["leaf"].shape == (400, 40)
    # centred on the fit (the prior's draws average to the constant mean)
    tol = 5 * (pred.f_var.sqrt() / 20).max() + 1e-3
    assert (f.mean(0) - pred.mean).abs().max() < tol
    assert torch.corrcoef(torch.stack([f.mean(0), y]))[0, 1] > 0.95
    # the spread of y is the function's plus the routed noise
    ratio = obs.var(0) / pred.variance
    assert 0.75 < float(ratio.mean()) < 1.3


def test_predictive_before_training_says_what_to_do():
    model, guide = _pair()
    x, _ = _data()
    with pytest.raises(ValueError, match="has not seen training data"):
        Predictive(model, guide=guide, num_samples=2)(x)
    prior = Predictive(model, num_samples=2)(x)  # without the guide: prior draws
    assert prior["obs"].shape == (2, 40)


def test_exact_model_on_data_needs_the_guide_built_from_it():
    model = HeteroscedasticGP(1, 2).double()
    guide = HeteroscedasticGPGuide(1, 2).double()
    x, y = _data()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    with pytest.raises(ValueError, match=r"HeteroscedasticGPGuide\(model\)"):
        svi.step(x, y)
    with pytest.raises(ValueError, match="depth=3 differs"):
        HeteroscedasticGPGuide(model, 3)
    with pytest.raises(ValueError, match="already has a guide"):
        HeteroscedasticGPGuide(HeteroscedasticGPGuide(model).model)


def test_trace_elbo_is_minus_the_collapsed_bound():
    model, guide = _pair()
    x, y = _data()
    _train(model, guide, x, y, 3)
    loss = Trace_ELBO().loss(model, guide, x, y)
    with torch.no_grad():
        bound = float(model.collapsed_bound(x, y, guide.tree(x)))
    assert loss == pytest.approx(-bound, rel=1e-10)
    assert CollapsedELBO().loss(model, guide, x, y) == pytest.approx(loss, rel=1e-10)


def test_sparse_factor_sums_the_enumerated_terms():
    model, guide = _pair(sparse=5)
    x, y = _data()
    _train(model, guide, x, y, 2)
    u = torch.randn(5, dtype=x.dtype)
    guide_trace = poutine.trace(guide).get_trace(x, y)
    tr = poutine.trace(
        poutine.replay(poutine.condition(model, {"u": u}), trace=guide_trace)
    ).get_trace(x, y)
    ell = tr.nodes["expected_log_lik"]["fn"].log_factor
    unbound = copy.deepcopy(model)
    unbound.__dict__["_guide"] = None
    with torch.no_grad():
        log_q = guide.tree(x)
    terms = []
    for leaf in range(4):
        data = {"u": u, "leaf": torch.full((40,), leaf)}
        t = poutine.trace(poutine.condition(unbound, data)).get_trace(x, y)
        terms.append(t.nodes["obs"]["fn"].log_prob(y) + t.nodes["f_var"]["fn"].log_factor)
    q = log_q.exp()
    expected = (q * torch.stack(terms, -1)).sum(-1) - ((q * log_q).sum(-1) + 2 * math.log(2))
    torch.testing.assert_close(ell.detach(), expected.detach())


def test_two_named_instances_of_different_sizes_share_the_store():
    x, y = _data()
    a, ga = _pair(name="a")
    b, gb = _pair(sparse=4, depth=3, name="b")
    _train(a, ga, x, y, 3)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pred_a = a.predict(x, ga)
    _train(b, gb, x, y, 3, subsample_size=16)
    store = pyro.get_param_store()
    assert all(k.startswith("a.") for k in before), sorted(before)
    assert {"a.data_x", "a.data_y", "a.kernel$$$raw_outputscale"} <= set(before)
    assert all(k.startswith("b.") for k in store.keys() if k not in before)
    for k, v in before.items():
        assert torch.equal(store[k].detach(), v), k
    for u, v in zip(pred_a, a.predict(x, ga), strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("sparse", [0, 4], ids=["exact", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_trains_in_the_dtype_of_the_data(dtype, sparse):
    model, guide = _pair(sparse=sparse)
    x, y = _data(dtype=dtype)
    losses = _train(model, guide, x, y, 10)
    assert all(math.isfinite(v) for v in losses)
    for name, value in pyro.get_param_store().items():
        assert value.dtype == dtype and torch.isfinite(value).all(), name
    samples = Predictive(model, guide=guide, num_samples=4, parallel=True)(x)
    assert samples["obs"].dtype == dtype and torch.isfinite(samples["obs"]).all()


@pytest.mark.parametrize("user_first", [True, False], ids=["user-first", "ours-first"])
@pytest.mark.parametrize("sparse", [0, 4], ids=["exact", "sparse"])
def test_composes_in_autoguidelist(sparse, user_first):
    model, guide = _pair(sparse=sparse)
    x, y = _data()
    kwargs = {"subsample_size": 16} if sparse else {}

    def user_model(x, y=None, **kw):
        pyro.sample("user_offset", dist.Normal(0.0, 1.0))
        return model(x, y, **kw)

    guides = AutoGuideList(user_model)
    user = AutoNormal(poutine.block(user_model, expose=["user_offset"]))
    for part in (user, guide) if user_first else (guide, user):
        guides.append(part)
    svi = SVI(user_model, guides, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    assert all(math.isfinite(svi.step(x, y, **kwargs)) for _ in range(3))
    for parallel in (False, True):
        samples = Predictive(user_model, guide=guides, num_samples=3, parallel=parallel)(x)
        assert samples["user_offset"].shape[0] == 3
        assert samples["obs"].shape == (3, 40)


@pytest.mark.parametrize("sparse", [0, 4], ids=["exact", "sparse"])
def test_param_store_save_load_reproduces_predictions(sparse, tmp_path):
    model, guide = _pair(sparse=sparse, name="hgp")
    x, y = _data()
    _train(model, guide, x, y, 5)

    def predictions(m, g):  # predict first: fresh objects adopt the store there too
        pred, rules = m.predict(x, g), m.noise_rules(g).export_text(["x"])
        pyro.set_rng_seed(3)
        return Predictive(m, guide=g, num_samples=3)(x), pred, rules

    before = predictions(model, guide)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    m2, g2 = _pair(sparse=sparse, name="hgp")
    pyro.get_param_store().load(tmp_path / "params.pt")
    after = predictions(m2, g2)
    for site, value in before[0].items():
        assert torch.equal(after[0][site], value), site
    for u, v in zip(before[1], after[1], strict=True):
        assert torch.equal(u, v)
    assert after[2] == before[2]
    # training on from the loaded store: no fresh start over the stored parameters
    stored = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    _train(m2, g2, x, y, 1, lr=0.0)
    for k, v in stored.items():
        assert torch.equal(pyro.get_param_store()[k].detach(), v), k


@pytest.mark.parametrize("sparse", [0, 4], ids=["exact", "sparse"])
def test_guide_trace_replays_through_the_model(sparse):
    model, guide = _pair(sparse=sparse)
    x, y = _data()
    _train(model, guide, x, y, 2)
    guide_trace = poutine.trace(guide).get_trace(x, y)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(x, y)
    for name in ("leaf", "u") if sparse else ("leaf",):
        assert model_trace.nodes[name]["value"] is guide_trace.nodes[name]["value"]
    # the routing's expectation is inside the model's factor: the drawn leaf scores 0
    assert (
        float(
            model_trace.nodes["leaf"]["fn"].log_prob(guide_trace.nodes["leaf"]["value"]).abs().sum()
        )
        == 0
    )
    assert math.isfinite(float(model_trace.log_prob_sum().detach()))


def test_predict_keeps_its_own_parameters_outside_their_store():
    x, y = _data()
    with pyro.get_param_store().scope():
        a, guide_a = _pair()
        _train(a, guide_a, x, y, 2)
        inside = a.predict(x, guide_a)
    b, guide_b = _pair()  # another unnamed pair, trained in the global store
    _train(b, guide_b, x, y, 4, lr=0.05)
    outside = a.predict(x, guide_a, x, y)
    for u, v in zip(inside, outside, strict=True):
        torch.testing.assert_close(u, v)


def test_an_unbound_guide_starts_in_the_datas_dtype():
    """init_from_data with an unbound guide moves both to the data's dtype (float32
    modules, float64 data used to fail inside the RNN-Tree's linear layers)."""
    x, y = _data()  # float64
    model = HeteroscedasticGP(1, 2)
    guide = HeteroscedasticGPGuide(1, depth=2, hidden_size=4)
    model.init_from_data(x, y, guide, num_steps=3)
    assert model.leaf_log_scale.dtype == torch.float64
    assert next(guide.parameters()).dtype == torch.float64
    loss = CollapsedELBO().loss(model, guide, x, y)
    assert math.isfinite(loss)


@pytest.mark.parametrize("kernel", ["rbf", "periodic"])
def test_a_sparse_model_trained_collapsed_warns_until_q_u_is_set(kernel):
    """The collapsed bound integrates q(u) out: predicting from the guide's start was
    silently off (new-user trial); predict and Predictive warn until
    set_optimal_inducing_posterior, after which they are quiet."""
    import gpytorch

    x, y = _data()
    kwargs = {"kernel": gpytorch.kernels.PeriodicKernel()} if kernel == "periodic" else {}
    model = HeteroscedasticGP(1, 2, inducing_points=x[::8].clone(), **kwargs).double()
    guide = HeteroscedasticGPGuide(model).double()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), CollapsedELBO())
    for _ in range(3):
        svi.step(x, y)
    with pytest.warns(UserWarning, match="set_optimal_inducing_posterior"):
        model.predict(x, guide)
    with pytest.warns(UserWarning, match="set_optimal_inducing_posterior"):
        Predictive(model, guide=guide, num_samples=2)(x)
    model.set_optimal_inducing_posterior(x, y, guide)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.predict(x, guide)
        Predictive(model, guide=guide, num_samples=2)(x)
