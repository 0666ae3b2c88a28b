"""CollapsedELBO's tensor program (eager and compiled) equals the bound through the
guide's trace, in value and gradients; where it does not apply it steps aside."""

import pickle

import gpytorch
import pyro
import pytest
import torch
from pyro.infer import SVI

from pyro_trees.guides import HeteroscedasticGPGuide
from pyro_trees.infer import CollapsedELBO, collapsed_elbo
from pyro_trees.models import HeteroscedasticGP

# "aot_eager": one traced graph differentiated by AOTAutograd, without generating code
# (seconds, no C++ compiler), as in test_compiled.py
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _scope():
    with pyro.get_param_store().scope():
        yield


def _pair(sparse=0, kernel=None, feedback="hard", n=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(2 * x[:, 0]) + 0.1 * (1 + (x[:, 1] > 0)) * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    z = x[:sparse].clone() if sparse else None
    kwargs = {} if kernel is None else {"kernel": kernel}
    model = HeteroscedasticGP(3, 2, inducing_points=z, **kwargs).to(torch.float64)
    guide = HeteroscedasticGPGuide(model, feedback=feedback, hidden_size=8).to(torch.float64)
    CollapsedELBO().loss(model, guide, x, y)  # the start, and every parameter registered
    with torch.no_grad():  # away from the start, so that every gradient is non-trivial
        for _, p in pyro.get_param_store().named_parameters():
            if p.requires_grad and p.dtype.is_floating_point:
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, guide, x, y


def _value_and_grads(loss, model, guide, x, y, traced=False):
    named = [(k, p) for k, p in pyro.get_param_store().named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    pyro.set_rng_seed(1)  # soft feedback draws its routing noise
    if traced:  # the general path: the guide traced, its leaf logits to the model
        value = -loss._traced_bound(model, guide, (x, y), {})
    else:
        value = loss.differentiable_loss(model, guide, x, y)
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return value.detach(), {k: g for (k, _), g in zip(named, grads, strict=True)}


def _assert_same(a, b, rtol=1e-10, atol=1e-10):
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=0)
    assert a[1].keys() == b[1].keys()
    for key, g in a[1].items():
        h = b[1][key]
        assert (g is None) == (h is None)
        if g is not None:
            torch.testing.assert_close(g, h, rtol=rtol, atol=atol)


def _matern(nu):
    kernels = gpytorch.kernels
    return kernels.ScaleKernel(kernels.MaternKernel(nu=nu, ard_num_dims=3))


@pytest.mark.parametrize("sparse", [0, 8], ids=["exact", "sparse"])
@pytest.mark.parametrize("kernel", [None, 0.5, 1.5, 2.5], ids=["rbf", "m12", "m32", "m52"])
def test_the_program_equals_the_traced_bound(sparse, kernel):
    model, guide, x, y = _pair(sparse, None if kernel is None else _matern(kernel))
    loss = CollapsedELBO()
    program = _value_and_grads(loss, model, guide, x, y)
    traced = _value_and_grads(loss, model, guide, x, y, traced=True)
    # Matern 1/2's kink at r = 0 turns the rounding of k(x, x)'s diagonal distances
    # into ~1e-9 of the gradients (gp.TensorKernel); elsewhere the last digits
    tol = 1e-6 if kernel == 0.5 else 1e-10
    _assert_same(program, traced, rtol=tol, atol=tol)


@pytest.mark.parametrize("sparse", [0, 8], ids=["exact", "sparse"])
def test_the_compiled_program_equals_the_traced_bound(sparse):
    model, guide, x, y = _pair(sparse)
    loss = CollapsedELBO(compile=BACKEND, balance_weight=0.5, entropy_weight=-1.0)
    compiled = _value_and_grads(loss, model, guide, x, y)
    assert loss._compiled.failed is None  # it ran compiled
    _assert_same(compiled, _value_and_grads(loss, model, guide, x, y, traced=True))


@pytest.mark.parametrize("case", ["periodic kernel", "soft feedback"])
def test_what_the_program_does_not_cover_goes_the_traced_way(case, monkeypatch):
    if case == "periodic kernel":
        model, guide, x, y = _pair(kernel=gpytorch.kernels.PeriodicKernel())
    else:
        model, guide, x, y = _pair(feedback="soft")

    def no_program(*args, **kwargs):
        raise AssertionError("the tensor program ran")

    monkeypatch.setattr(HeteroscedasticGP, "bound_of", staticmethod(no_program))
    loss = CollapsedELBO()
    _assert_same(
        _value_and_grads(loss, model, guide, x, y),
        _value_and_grads(loss, model, guide, x, y, traced=True),
    )


def test_a_failed_factorisation_is_scored_again_the_traced_way(monkeypatch):
    """The compiled program tries the jitter once; a step whose factorisation failed is
    scored by the general path, whose factorisation retries with more jitter."""

    class Failing(collapsed_elbo._FirstTry):
        def __call__(self, K, jitter):
            L = super().__call__(K, jitter)
            self.failed = torch.ones((), dtype=torch.bool)
            return L

    monkeypatch.setattr(collapsed_elbo, "_FirstTry", Failing)
    model, guide, x, y = _pair()
    calls = []
    traced = CollapsedELBO._traced_bound

    def counted(self, *args):
        calls.append(1)
        return traced(self, *args)

    monkeypatch.setattr(CollapsedELBO, "_traced_bound", counted)
    loss = CollapsedELBO(compile="eager")  # dynamo's capture only: fast, same program
    value = loss.differentiable_loss(model, guide, x, y)
    assert calls == [1]
    expected = -traced(loss, model, guide, (x, y), {}).detach()
    assert float(value.detach()) == pytest.approx(float(expected), rel=1e-12)


def test_plain_svi_trains_through_the_program_and_the_guide_keeps_the_data():
    model, guide, x, y = _pair()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), CollapsedELBO())
    before = [svi.step(x, y) for _ in range(3)]
    after = [svi.step(x, y) for _ in range(40)]
    assert after[-1] < before[0]
    x_kept, y_kept = guide.training_data()  # what the exact posterior conditions on
    assert torch.equal(x_kept, x) and torch.equal(y_kept, y)
    loss = pickle.loads(pickle.dumps(CollapsedELBO(compile=BACKEND)))
    assert loss.compile == BACKEND


def test_the_data_are_checked_once_per_tensor_and_again_after_an_edit():
    model, guide, x, y = _pair()
    loss = CollapsedELBO()
    loss.differentiable_loss(model, guide, x, y)
    x[0, 0] = float("nan")  # in place: a new version of the same tensor
    with pytest.raises(ValueError, match="NaN"):
        loss.differentiable_loss(model, guide, x, y)
    with pytest.raises(ValueError, match="shape"):
        loss.differentiable_loss(model, guide, x[:, :2].clone(), y)
