"""``DGPELBO`` is ``TraceMeanField_ELBO`` of the deep GP with the factorised guide as one
tensor program: the same value and gradients on the same draws, eager and compiled,
with particles, minibatches and ``num_data``; a warned fallback elsewhere."""

import pickle
import warnings

import gpytorch
import pyro
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO

from pyro_trees.guides import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide
from pyro_trees.infer import DGPELBO
from pyro_trees.infer import dgp_elbo as dgp_elbo_module
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models import DeepGP

# see tests/infer/test_compiled.py: the compiler's capture without code generation
BACKEND = "aot_eager"


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(30, generator=gen, dtype=torch.float64)
    return x, y


def _kernel(kind: str, d: int, p: int):
    shape = torch.Size([p]) if kind == "batched" and p > 1 else torch.Size([])
    if kind == "batched":
        base = gpytorch.kernels.RBFKernel(ard_num_dims=d, batch_shape=shape)
        return gpytorch.kernels.ScaleKernel(base, batch_shape=shape)
    return gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d)


def _pair(kernel: str, whiten: bool, layers: int = 2):
    gen = torch.Generator().manual_seed(1)
    widths = [2] * (layers - 1) + [1]
    dims = [3, *widths]
    kernels = [_kernel(kernel, dims[i], dims[i + 1]) for i in range(layers)]
    zs = [torch.randn(5, d, generator=gen, dtype=torch.float64) for d in dims[:-1]]
    means = [torch.nn.Linear(3, 2).double()] + ["identity"] * (layers - 2) + ["zero"]
    model = DeepGP(kernels, zs, output_dims=widths, mean_functions=means, whiten=whiten, noise=0.3)
    guide = DGPFactorisedGuide(model)
    with torch.no_grad():  # away from the start, where every site is the prior's
        for p in [*guide.parameters(), *model.parameters()]:
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, guide


def _grads(value, params):
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


CALLS = {"full batch": {}, "subsample_size": {"subsample_size": 10}, "num_data": {"num_data": 90}}


def _check_against_trace_mean_field(model, guide, particles, kwargs, compiles):
    """DGPELBO (eager and each of ``compiles``) against TraceMeanField_ELBO on the same
    draws: values and every parameter's gradient."""
    x, y = _data()
    reference = TraceMeanField_ELBO(
        num_particles=particles, vectorize_particles=True, max_plate_nesting=1
    )
    params = [*model.parameters(), *guide.parameters()]
    torch.manual_seed(4)
    a = reference.differentiable_loss(model, guide, x, y, **kwargs)
    expected = _grads(a, params)
    for compile in [False, *compiles]:
        loss = DGPELBO(particles, compile=compile)
        torch.manual_seed(4)
        b = loss.differentiable_loss(model, guide, x, y, **kwargs)
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)
        for gb, ga in zip(_grads(b, params), expected, strict=True):
            torch.testing.assert_close(gb, ga, rtol=1e-9, atol=1e-9)
        assert loss.fallback is None
        if compile:
            assert loss._compiled.failed is None


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("particles", [1, 3])
@pytest.mark.parametrize("whiten", [True, False], ids=["whitened", "not whitened"])
@pytest.mark.parametrize("kernel", ["batched", "shared"])
def test_equals_trace_mean_field_elbo_on_the_same_draws(kernel, whiten, particles, call):
    compiles = [BACKEND] if call == "full batch" else []
    with isolated_params():
        model, guide = _pair(kernel, whiten)
        _check_against_trace_mean_field(model, guide, particles, CALLS[call], compiles)


def _propagated(whiten: bool, kernel: str, layers: int):
    gen = torch.Generator().manual_seed(2)
    x, _ = _data()
    widths = [3] * (layers - 1) + [1]  # identity means inside: the input's width
    dims = [3, *widths]
    kernels = [_kernel(kernel, dims[i], dims[i + 1]) for i in range(layers)]
    means = ["identity"] * (layers - 1) + ["zero"]
    model = DeepGP(
        kernels,
        x[:6].clone(),
        output_dims=widths,
        mean_functions=means,
        inducing="propagated",
        noise=0.3,
        jitter=None if whiten else 1e-4,
    )
    guide = DGPIntermediateGuide(model, whiten=whiten)
    with torch.no_grad():
        for p in [*guide.parameters(), *model.parameters()]:
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, guide


@pytest.mark.parametrize("call", ["full batch", "subsample_size"])
@pytest.mark.parametrize("particles", [1, 3])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("whiten", [True, False], ids=["whitened guide", "free-form guide"])
def test_the_intermediate_guide_equals_trace_mean_field_on_the_same_draws(
    whiten, layers, particles, call
):
    compiles = [BACKEND] if call == "full batch" and particles == 3 else []
    kernel = "batched" if layers == 2 else "shared"
    with isolated_params():
        model, guide = _propagated(whiten, kernel, layers)
        _check_against_trace_mean_field(model, guide, particles, CALLS[call], compiles)


@pytest.mark.parametrize("relative", [True, False], ids=["relative cross", "absolute cross"])
@pytest.mark.parametrize("particles", [1, 3])
@pytest.mark.parametrize("whiten", [True, False], ids=["whitened", "not whitened"])
def test_the_joint_guide_equals_trace_mean_field_on_the_same_draws(whiten, particles, relative):
    compiles = [BACKEND] if particles == 3 and relative else []
    for layers, kernel in ((2, "batched"), (3, "shared")):
        with isolated_params():
            model, _ = _pair(kernel, whiten, layers)
            guide = DGPJointGuide(model, cross_scale=0.3, cross_relative=relative)
            with torch.no_grad():  # away from the start, cross entries included
                gen = torch.Generator().manual_seed(5)
                for p in guide.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            _check_against_trace_mean_field(model, guide, particles, {}, compiles)


@pytest.mark.parametrize("particles", [1, 2])
def test_three_layers(particles):
    x, y = _data()
    reference = TraceMeanField_ELBO(
        num_particles=particles, vectorize_particles=True, max_plate_nesting=1
    )
    for kernel in ("batched", "shared"):
        with isolated_params():
            model, guide = _pair(kernel, True, layers=3)
            torch.manual_seed(7)
            a = reference.differentiable_loss(model, guide, x, y)
            torch.manual_seed(7)
            b = DGPELBO(particles).differentiable_loss(model, guide, x, y)
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)


def test_a_failed_factorisation_is_scored_again_eagerly(monkeypatch):
    x, y = _data()

    class Failing(dgp_elbo_module._FirstTry):
        def __call__(self, K, jitter):
            L = super().__call__(K, jitter)
            self.failed = torch.ones((), dtype=torch.bool)
            return 2 * L  # a failed factor is garbage: the step must not use it

    with isolated_params():
        model, guide = _pair("batched", True)
        torch.manual_seed(3)
        a = DGPELBO(2).differentiable_loss(model, guide, x, y)
        monkeypatch.setattr(dgp_elbo_module, "_FirstTry", Failing)
        torch.manual_seed(3)
        b = DGPELBO(2, compile="eager").differentiable_loss(model, guide, x, y)
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)


def test_other_models_and_guides_train_with_trace_mean_field_after_one_warning():
    x, y = _data()
    with isolated_params():
        model = DeepGP([gpytorch.kernels.RBFKernel() for _ in range(2)], x[:5])
        guide = DGPJointGuide(model, rank=2)
        loss = DGPELBO(2)
        with pytest.warns(RuntimeWarning, match="low-rank factor"):
            torch.manual_seed(1)
            a = loss.differentiable_loss(model, guide, x, y)
        torch.manual_seed(1)
        reference = TraceMeanField_ELBO(
            num_particles=2, vectorize_particles=True, max_plate_nesting=1
        )
        torch.testing.assert_close(a, reference.differentiable_loss(model, guide, x, y))
    with isolated_params():
        kernels = [gpytorch.kernels.PeriodicKernel(), gpytorch.kernels.RBFKernel()]
        model = DeepGP(kernels, x[:5, :1].clone())
        with pytest.warns(RuntimeWarning, match="kernel is not one TensorKernel covers"):
            DGPELBO().differentiable_loss(model, DGPFactorisedGuide(model), x[:, :1], y)
    with pytest.raises(ValueError, match="num_particles"):
        DGPELBO(0)


def test_plain_svi_trains_and_the_loss_pickles():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("batched", False)
        loss = DGPELBO(2, compile=BACKEND)
        svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), loss)
        losses = [svi.step(x, y) for _ in range(30)]
    assert losses[-1] < losses[0]
    again = pickle.loads(pickle.dumps(loss))
    assert again.num_particles == 2 and again.compile == BACKEND and again.fallback is None


def test_bad_sizes_raise_and_x_and_y_may_be_keywords():
    x, y = _data()
    with isolated_params():
        model, guide = _pair("batched", True)
        loss = DGPELBO(2)
        for kwargs in ({"subsample_size": -5}, {"subsample_size": 31}, {"num_data": 0}):
            with pytest.raises(ValueError, match="subsample_size|num_data"):
                loss.differentiable_loss(model, guide, x, y, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            torch.manual_seed(2)
            a = loss.differentiable_loss(model, guide, x, y=y)
        torch.manual_seed(2)
        torch.testing.assert_close(a, loss.differentiable_loss(model, guide, x, y))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            torch.manual_seed(2)
            torch.testing.assert_close(a, loss.differentiable_loss(model, guide, x=x, y=y))
    same = TraceMeanField_ELBO(num_particles=2, vectorize_particles=True, max_plate_nesting=1)
    assert loss.vectorize_particles and loss.max_plate_nesting == same.max_plate_nesting


def test_each_new_reason_to_fall_back_warns_once_at_the_callers_line():
    x, y = _data()
    loss = DGPELBO()
    with isolated_params():
        model = DeepGP([gpytorch.kernels.RBFKernel() for _ in range(2)], x[:5])
        with pytest.warns(RuntimeWarning, match="low-rank factor") as caught:
            loss.differentiable_loss(model, DGPJointGuide(model, rank=2), x, y)
        assert caught[0].filename == __file__
    with isolated_params():  # another model, under the same names
        kernels = [gpytorch.kernels.PeriodicKernel(), gpytorch.kernels.RBFKernel()]
        other = DeepGP(kernels, x[:5, :1].clone())
        with pytest.warns(RuntimeWarning, match="TensorKernel covers"):
            loss.differentiable_loss(other, DGPFactorisedGuide(other), x[:, :1], y)
    with isolated_params(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loss.differentiable_loss(model, DGPJointGuide(model, rank=2), x, y)  # seen before
    assert "low-rank factor" in loss.fallback


def test_a_mean_function_must_be_a_module():
    x, _ = _data()
    kernels = [gpytorch.kernels.RBFKernel() for _ in range(2)]
    with pytest.raises(ValueError, match="wrap a function of your own in a torch.nn.Module"):
        DeepGP(kernels, x[:5], mean_functions=[lambda f: 0 * f, "zero"])
