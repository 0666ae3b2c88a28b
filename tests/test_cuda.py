"""The GPU contract: every estimator and every model + guide pair of the Pyro contract
trains on ``cuda`` and predicts there, finite and close to the CPU fit; the compiled VaRT
and HME losses, the heteroscedastic GP's bound program, the Bayesian HME's compiled VB
cycle and the TreeVI, deep GP and Bayesian HME program losses equal the eager (or Pyro's)
ones on the GPU. Every test is marked ``cuda`` and skips without
a CUDA device (tests/conftest.py)."""

import numpy as np
import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive
from sklearn.base import is_classifier

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)
from pyro_trees.guides import VaRTForestGuide, VaRTGuide
from pyro_trees.infer import VaRTELBO, VaRTForestELBO
from pyro_trees.models import VaRT, VaRTForest
from tests.test_pyro_contract import CASES, IDS

pytestmark = pytest.mark.cuda

SMALL = {
    RNNTreeClassifier: {"depth": 2, "num_steps": 60},
    RNNTreeRegressor: {"depth": 2, "num_steps": 60},
    BayesianHMERegressor: {"max_experts": 2, "num_restarts": 2, "num_cycles": 30, "grow": 0},
    VaRTRegressor: {"depth": 2, "num_steps": 150, "num_samples": 20},
    VaRTClassifier: {"depth": 2, "num_steps": 150, "num_samples": 20, "num_fits": 1},
    VaRTForestRegressor: {"num_trees": 5, "depth": 2, "num_steps": 150, "num_samples": 20},
    HeteroscedasticGPRegressor: {"depth": 1, "num_steps": 60, "init_steps": 20},
}


def _table(classification: bool):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    f = np.sin(2 * X[:, 0]) + X[:, 1]
    if classification:
        return X, (f > 0).astype(int)
    return X, f + 0.1 * rng.normal(size=200)


@pytest.mark.parametrize("est_cls", list(SMALL), ids=lambda c: c.__name__)
def test_every_estimator_fits_on_cuda_as_on_the_cpu(est_cls):
    classification = is_classifier(est_cls())
    X, y = _table(classification)
    scores = {}
    for device in ("cpu", "cuda"):
        est = est_cls(random_state=0, device=device, **SMALL[est_cls]).fit(X, y)
        pred = est.predict(X)
        assert np.all(np.isfinite(pred)), device
        if classification:
            scores[device] = float(np.mean(pred == y))
        else:
            scores[device] = 1 - float(np.mean((pred - y) ** 2) / np.var(y))
            lower, upper = est.predict_interval(X[:20], level=0.9)
            assert np.all(np.isfinite(lower)) and np.all(lower <= upper)
    # other random streams on each device: the same quality, not the same numbers
    assert scores["cuda"] > scores["cpu"] - 0.15, scores


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_model_and_guide_trains_and_predicts_on_cuda(case):
    def to_cuda(value):
        if isinstance(value, torch.Tensor):
            return value.cuda()
        if isinstance(value, tuple | list):
            return type(value)(to_cuda(v) for v in value)
        if isinstance(value, dict):
            return {k: to_cuda(v) for k, v in value.items()}
        return value

    pyro.set_rng_seed(0)
    with pyro.settings.context(module_local_params=True):
        model, guide = case.build(dtype=torch.float32)
        for module in (model, guide):
            if isinstance(module, torch.nn.Module):
                module.cuda()
        args, kwargs = to_cuda(case.data(torch.float32))
        svi = SVI(model, guide, pyro.optim.Adam({"lr": case.lr}), case.loss())
        losses = [svi.step(*args, **kwargs) for _ in range(5)]
        assert all(np.isfinite(losses)), losses
        pred_args, pred_kwargs = to_cuda(case.predict_args(args, kwargs))
        out = Predictive(model, guide=guide, num_samples=3)(*pred_args, **pred_kwargs)
    for site in case.observed:
        assert out[site].is_cuda and bool(torch.isfinite(out[site]).all()), site


@pytest.mark.parametrize("forest", [False, True], ids=["tree", "forest"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_vart_losses_equal_the_eager_ones_on_cuda(forest, backend):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 3, device="cuda", generator=gen)
    y = x[:, 0].sin()
    with pyro.settings.context(module_local_params=True):
        if forest:
            model = VaRTForest(3, num_trees=4, depth=3)
            guide, loss_cls = VaRTForestGuide(model), VaRTForestELBO
        else:
            model = VaRT(3)
            guide, loss_cls = VaRTGuide(model, 3), VaRTELBO
        guide.params(x)
        values = []
        for loss in (loss_cls(), loss_cls(compile=backend)):
            pyro.set_rng_seed(5)
            guide.zero_grad()
            value = loss.differentiable_loss(model, guide, x, y, 64)
            value.backward()
            values.append((value.detach(), [p.grad.clone() for p in guide.parameters()]))
        assert loss._compiled.failed is None
    (a, grad_a), (b, grad_b) = values
    assert torch.allclose(a, b, rtol=1e-4)
    for ga, gb in zip(grad_a, grad_b, strict=True):
        assert torch.allclose(ga, gb, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_hme_loss_equals_the_eager_one_on_cuda(backend):
    from pyro import poutine

    from pyro_trees.guides import RNNTreeGuide
    from pyro_trees.infer import HMEELBO
    from pyro_trees.infer.fit import isolated_params
    from pyro_trees.models import HME

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 3, device="cuda", generator=gen)
    y = x[:, 0].sin()
    with isolated_params():
        model, guide = HME(3, 3), RNNTreeGuide(3, 3)
        poutine.trace(guide).get_trace(x, y)  # the data-driven start, on x's device
        poutine.trace(model).get_trace(x, y)
        params = [*model.parameters(), *guide.parameters()]
        values = []
        for loss in (HMEELBO(entropy_weight=-1.0), HMEELBO(entropy_weight=-1.0, compile=backend)):
            pyro.set_rng_seed(5)
            value = loss.differentiable_loss(model, guide, x, y, 128)
            grads = torch.autograd.grad(value, params, allow_unused=True)
            values.append((value.detach(), grads))
        assert loss._compiled.failed is None
    (a, grad_a), (b, grad_b) = values
    assert a.is_cuda and torch.allclose(a, b, rtol=1e-4)
    for ga, gb in zip(grad_a, grad_b, strict=True):
        if ga is not None:
            assert torch.allclose(ga, gb, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("sparse", [0, 32], ids=["exact", "sparse"])
@pytest.mark.parametrize("backend", [False, "aot_eager", "inductor"])
def test_the_collapsed_bound_program_equals_the_traced_one_on_cuda(sparse, backend):
    from pyro_trees.guides import HeteroscedasticGPGuide
    from pyro_trees.infer import CollapsedELBO
    from pyro_trees.infer.fit import isolated_params
    from pyro_trees.models import HeteroscedasticGP

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 3, device="cuda", dtype=torch.float64, generator=gen)
    y = x[:, 0].sin()
    with isolated_params():
        z = x[:sparse].clone() if sparse else None
        model = HeteroscedasticGP(3, 2, inducing_points=z).to("cuda", torch.float64)
        guide = HeteroscedasticGPGuide(model, hidden_size=8).to("cuda", torch.float64)
        loss = CollapsedELBO(compile=backend)
        loss.loss(model, guide, x, y)  # the start
        named = [(k, p) for k, p in pyro.get_param_store().named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        ours = loss.differentiable_loss(model, guide, x, y)
        traced = -loss._traced_bound(model, guide, (x, y), {})
        grads = [torch.autograd.grad(v, params, allow_unused=True) for v in (ours, traced)]
        if backend:
            assert loss._compiled.failed is None
    assert ours.is_cuda and torch.allclose(ours, traced, rtol=1e-8)
    for ga, gb in zip(*grads, strict=True):
        if ga is not None:
            assert torch.allclose(ga, gb, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_compiled_vb_cycle_equals_the_eager_one_on_cuda(backend):
    from pyro_trees.infer import bayesian_hme_vb as vb
    from pyro_trees.topology import enumerate_topologies

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(400, 1, device="cuda", dtype=torch.float64, generator=gen)
    t = x[:, 0] + 0.3 * torch.sin(6 * x[:, 0])
    tops = enumerate_topologies(3, 1)
    sels = [
        vb.select_topology(
            x,
            t,
            tops,
            num_restarts=4,
            num_cycles=40,
            compile=c,
            generator=torch.Generator().manual_seed(0),
        )
        for c in (False, backend)
    ]
    assert torch.allclose(sels[0].bounds, sels[1].bounds, rtol=1e-9)


def _program_loss_case(name: str, backend, device: str):
    """Pyro's loss and ours on ``device`` from the same seed: (theirs, ours, gradients of
    each, the loss)."""
    from pyro.infer import Trace_ELBO, TraceMeanField_ELBO

    from pyro_trees.infer import DGPELBO, BayesianHMEELBO, TreeVIELBO
    from pyro_trees.infer.fit import isolated_params
    from tests.infer import test_bayesian_hme_elbo as bhme
    from tests.infer import test_dgp_elbo as dgp
    from tests.infer import test_tree_vi_elbo as treevi

    with isolated_params():
        if name == "treevi":
            parents, x = treevi._data()
            model, guide = treevi._model("clustering"), treevi._guide("tree", parents)
            args, kwargs = (x.to(device),), {"idx": treevi.BATCH}
            theirs, ours = Trace_ELBO(), TreeVIELBO(compile=backend)
        elif name == "deep gp":
            x, y = dgp._data()
            model, guide = dgp._pair("batched", True)
            args, kwargs = (x.to(device), y.to(device)), {}
            theirs = TraceMeanField_ELBO(
                num_particles=3, vectorize_particles=True, max_plate_nesting=1
            )
            ours = DGPELBO(3, compile=backend)
        else:
            x, y = bhme._data()
            model, guide = bhme._pair("balanced, 4 experts", 3)
            args, kwargs = (x.to(device), y.to(device)), {"subsample_size": 15}
            theirs, ours = Trace_ELBO(max_plate_nesting=2), BayesianHMEELBO(compile=backend)
        model, guide = model.to(device), guide.to(device)
        theirs.differentiable_loss(model, guide, *args)  # lazy starts
        params = [p for p in (*model.parameters(), *guide.parameters()) if p.requires_grad]
        values, grads = [], []
        for loss in (theirs, ours):
            torch.manual_seed(5)
            value = loss.differentiable_loss(model, guide, *args, **kwargs)
            values.append(value)
            grads.append(torch.autograd.grad(value, params, allow_unused=True))
    return values, grads, ours


@pytest.mark.parametrize("backend", [False, "aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["treevi", "deep gp", "bayesian hme"])
def test_the_program_losses_equal_pyros_on_cuda(name, backend):
    (theirs, ours), grads, loss = _program_loss_case(name, backend, "cuda")
    assert ours.is_cuda and torch.allclose(ours, theirs, rtol=1e-9)
    for ga, gb in zip(*grads, strict=True):
        if ga is not None:
            assert torch.allclose(ga, gb, rtol=1e-7, atol=1e-9)
    if backend:
        assert loss._compiled.failed is None
