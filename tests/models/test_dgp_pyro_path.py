"""DeepGP on the Pyro user's path: float32, Predictive, names, autoguides, save/load."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_trees.guides import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide
from pyro_trees.infer import dgp_predict
from pyro_trees.models import DeepGP

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import gpytorch

GUIDES = {
    "factorised": (DGPFactorisedGuide, "layer"),
    "joint": (DGPJointGuide, "layer"),
    "intermediate": (DGPIntermediateGuide, "propagated"),
}


def _data(dtype=torch.float64, n=40):
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-1, 1, n, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(7 * torch.exp(x[:, 0])) + 0.05 * torch.randn(n, generator=g, dtype=x.dtype)
    return x.to(dtype), y.to(dtype)


def _build(kind, dtype=torch.float64, layers=2, name=""):
    """The documented snippet: GPyTorch's default kernels, the classes' defaults."""
    cls, inducing = GUIDES[kind]
    kernels = [gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) for _ in range(layers)]
    kernels[-1] = gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel())
    Z = torch.linspace(-1, 1, 10, dtype=dtype).unsqueeze(-1)
    model = DeepGP(kernels, Z, inducing=inducing, name=name)
    return model, cls(model, name=name)


def _train(model, guide, x, y, steps, lr=0.01, loss=Trace_ELBO):
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss())
    return [svi.step(x, y) for _ in range(steps)]


@pytest.mark.parametrize("kind", list(GUIDES))
def test_float32_trains_without_nan(kind):
    # before the variance floor and the float32 jitter every guide's parameters went NaN
    # within 35 steps of this loop
    x, y = _data(torch.float32)
    model, guide = _build(kind, torch.float32)
    assert model.jitter == 1e-4 and model.min_variance == 1e-6
    losses = _train(model, guide, x, y, 60, loss=TraceMeanField_ELBO)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    for name, value in pyro.get_param_store().items():
        assert torch.isfinite(value).all(), name
        assert value.dtype == torch.float32, name


def test_conditional_variance_at_the_inducing_inputs_has_finite_gradients():
    # at x = Z the conditional variance is k(z, z) - k(z, z) = 0 up to rounding: clamped
    # at exactly 0, its square root had an infinite derivative and the chain rule gave NaN
    model, _ = _build("factorised", torch.float32)
    z = model.inducing_inputs[0].detach()
    u = torch.zeros(1, z.shape[0])
    loc, var = model.layer(0, z, u)
    assert (var >= model.min_variance).all()
    var.sqrt().sum().backward()
    grads = [p.grad for p in model.kernels[0].parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_unsupported_dtype_is_refused_with_the_supported_ones_named():
    kernels = [gpytorch.kernels.RBFKernel()]
    with pytest.raises(ValueError, match="float32 or float64"):
        DeepGP(kernels, torch.zeros(3, 1, dtype=torch.float16))


def test_kernels_follow_the_inducing_inputs_dtype():
    model, _ = _build("factorised", torch.float64)
    assert all(p.dtype == torch.float64 for p in model.kernels.parameters())


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("kind", list(GUIDES))
def test_predictive_draws_y_and_the_inner_layers_around_the_fit(kind, parallel):
    x, y = _data()
    model, guide = _build(kind)
    _train(model, guide, x, y, 150, lr=0.02)
    S = 64
    pyro.set_rng_seed(3)
    s = Predictive(model, guide=guide, num_samples=S, parallel=parallel)(x)
    assert s["obs"].shape == (S, len(x))
    assert s["f_1"].shape == (S, len(x), 1)
    assert s["f_loc"].shape == s["f_var"].shape == (S, len(x))
    # y draws are N(f_loc, f_var + noise^2) per draw: their mean and spread match the
    # fit's predictive (draws from the prior would miss it by many standard errors).
    # Measured over 10 seeds x 3 guides x both modes: mean |z| 0.48-1.25, spread ratio
    # 0.92-1.05, whether the 150 steps fit y well or not (the correlation with y ranged
    # 0.10-0.98: fit quality is the contract tests' figure, with restarts, not this one's)
    pred = dgp_predict(model, guide, x, num_samples=400)
    sd = pred["var"].sqrt()
    z = (s["obs"].mean(0) - pred["mean"]) / (sd / math.sqrt(S))
    assert z.abs().mean() < 1.6
    assert 0.5 < float(s["obs"].std(0).mean() / sd.mean()) < 1.5


def test_two_named_models_of_different_depths_share_one_store():
    x, y = _data()
    a = _build("factorised", layers=2, name="shallow")
    b = _build("intermediate", layers=3, name="deep")
    _train(*a, x, y, 2)
    store = pyro.get_param_store()
    first = {k: v.detach().clone() for k, v in store.items()}
    _train(*b, x, y, 2)
    keys = list(store.keys())
    assert all(k.startswith(("shallow.", "deep.")) for k in keys), keys
    assert any(k.startswith("shallow.kernels$$$") for k in keys)
    assert any(k.startswith("deep.kernels$$$2") for k in keys)
    for k, v in first.items():
        assert torch.equal(store[k].detach(), v), k


@pytest.mark.parametrize("kind", list(GUIDES))
def test_save_load_of_the_store_restores_kernels_and_predictions(kind, tmp_path):
    x, y = _data()
    model, guide = _build(kind, name="m")
    _train(model, guide, x, y, 20, lr=0.05)

    def predict(m, g):
        pyro.set_rng_seed(1)
        return Predictive(m, guide=g, num_samples=4)(x)

    before = predict(model, guide)
    pyro.get_param_store().save(tmp_path / "p.pt")
    pyro.clear_param_store()
    model2, guide2 = _build(kind, name="m")
    pyro.get_param_store().load(tmp_path / "p.pt")
    after = predict(model2, guide2)
    for site in ("obs", "f_1", "f_loc"):
        assert torch.equal(after[site], before[site]), site
    # the fresh model's kernels read the loaded hyperparameters, not their own start
    for p, q in zip(model.kernels.parameters(), model2.kernels.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("loss", [Trace_ELBO, TraceMeanField_ELBO])
@pytest.mark.parametrize("kind", list(GUIDES))
def test_guide_composes_with_an_autonormal_and_replays(kind, loss):
    x, y = _data()
    model, guide = _build(kind)

    def user_model(x, y=None):
        shift = pyro.sample("shift", dist.Normal(0.0, 1.0))
        return model(x, None if y is None else y - shift)

    parts = [guide, AutoNormal(poutine.block(user_model, expose=["shift"]))]
    if loss is TraceMeanField_ELBO:  # it checks that the guide samples in the model's order
        parts.reverse()
    guides = AutoGuideList(user_model)
    for part in parts:
        guides.append(part)
    losses = _train(user_model, guides, x, y, 3, loss=loss)
    assert all(math.isfinite(v) for v in losses)
    assert any(k.startswith("AutoGuideList.") and "shift" in k for k in pyro.get_param_store())
    s = Predictive(user_model, guide=guides, num_samples=2)(x)
    assert {"shift", "obs", "f_1"} <= set(s)
    tr = poutine.trace(guide).get_trace(x, y)
    mtr = poutine.trace(poutine.replay(model, trace=tr)).get_trace(x, y)
    for name in model.site_names():
        assert mtr.nodes[name]["value"] is tr.nodes[name]["value"]
    assert math.isfinite(float(mtr.log_prob_sum().detach()))
