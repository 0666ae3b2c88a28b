"""The families of :mod:`benchmarks.step_cost`: for each, the model, guide, data and
:func:`~pyro_trees.infer.fit` arguments of one cell, as the family's estimator (or its
documented training path) sets them up. Each builder takes ``(rows, quick)`` and returns
a :class:`Setup`; its docstring says what it follows and what it leaves out."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pyro
import torch

from benchmarks._common import synthetic_rows

__all__ = ["FAMILIES", "VART_BATCH", "Setup", "rows_per_step"]

#: rows per step of the VaRT estimators (``min(N, 2048)`` without ``batch_size``)
VART_BATCH = 2048


@dataclass
class Setup:
    """What ``fit`` receives for one cell: model, guide, positional data, ``fit``'s
    keyword arguments, a context around the fit (the estimator's settings), a per-step
    callback of the family (or ``None``), rows per step, and a note."""

    model: object
    guide: object
    args: tuple
    fit_kwargs: dict
    context: object = None
    callback: object = None
    batch: int | None = None
    note: str = ""


def _data(rows: int, dtype=torch.float32):
    x, y = synthetic_rows(0, rows, seed=0)
    return x.to(dtype), y.to(dtype)


def hme(rows: int, quick: bool) -> Setup:
    """HME + RNN-Tree guide at ``RNNTreeRegressor``'s defaults (depth 3, GRU width 32,
    hard feedback, constant experts, Adam at 0.03 with its exponential decay to 0.1x,
    full batch). Loss: :class:`~pyro_trees.infer.HMEELBO` (entropy weight -1, balance
    weight 1), the closed-form :class:`~pyro_trees.infer.TreeELBO` the estimator
    trains with."""
    from pyro_trees.guides import RNNTreeGuide
    from pyro_trees.infer import HMEELBO
    from pyro_trees.models import HME

    x, y = _data(rows)
    model, guide = HME(8, 3), RNNTreeGuide(8, 3, hidden_size=32, feedback="hard")
    gamma = 0.1 ** (1 / 300)  # lr_decay over the estimator's 300 steps
    return Setup(
        model,
        guide,
        (x, y),
        dict(
            loss=HMEELBO(balance_weight=1.0, entropy_weight=-1.0),
            optim="adam",
            lr=0.03,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma),
        ),
        batch=rows,
        note="HMEELBO",
    )


def bayesian_hme(rows: int, quick: bool) -> Setup:
    """Bayesian HME on its SVI path (:func:`~pyro_trees.infer.fit_svi_restarts`'s
    training): ``BayesianHME`` in ``RestartPlate`` with a ``BayesianHMEGuide`` of 100
    restarts (its default; 4 in ``--quick``) from ``init_from_data``, ``Trace_ELBO``
    (``max_plate_nesting=2``), ClippedAdam at 0.1 with its decay to 0.002 over 3000
    steps, non-finite gradient entries zeroed by a hook, as there. Topology: the
    balanced tree of 4 experts (``BayesianHMERegressor`` searches up to 5)."""
    from pyro.infer import Trace_ELBO
    from pyro.optim.clipped_adam import ClippedAdam

    from pyro_trees.guides import BayesianHMEGuide, RestartPlate
    from pyro_trees.models import BayesianHME
    from pyro_trees.topology import Topology

    restarts = 4 if quick else 100
    x, y = _data(rows)
    model = BayesianHME(8, 1, Topology.balanced(2))
    guide = BayesianHMEGuide(model, num_restarts=restarts)
    guide.init_from_data(x, y, generator=torch.Generator().manual_seed(0))
    for p in guide.parameters():
        p.register_hook(lambda g: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0))
    lrd = (0.002 / 0.1) ** (1 / 3000)
    return Setup(
        RestartPlate(model, restarts),
        guide,
        (x, y),
        dict(
            loss=Trace_ELBO(max_plate_nesting=2),
            optim=lambda params: ClippedAdam(params, lr=0.1, lrd=lrd),
        ),
        batch=rows,
        note=f"{restarts} restarts, 4 experts",
    )


@contextlib.contextmanager
def _vart_context():
    """The VaRT estimators' settings around their fits."""
    with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
        yield


def _vart_setup(rows, model, data, guide_cls, guide_args, loss, lr_decay, num_steps=1000):
    """A VaRT family's cell as ``VaRTFits._fit_split`` trains it: the guide at the
    starting temperature from random hyperplanes, then through random training rows,
    ClippedAdam at 0.03, minibatches of ``min(N, 2048)``, the temperature schedule
    1 -> 0.1 over ``num_steps`` as callback (``lr_decay != 1``: its exponential decay)."""
    from pyro_trees.guides import TemperatureSchedule

    gen = torch.Generator().manual_seed(0)
    with _vart_context():
        guide = guide_cls(
            model, *guide_args, temperature=1.0, init="random", init_split_prob=0.99, generator=gen
        )
        guide.init_splits_from_data(data[0], generator=gen)
    batch = min(rows, VART_BATCH)
    kwargs = dict(loss=loss, optim="clipped_adam", lr=0.03)
    if batch < rows:
        kwargs["subsample_size"] = batch
    if lr_decay != 1.0:
        gamma = lr_decay ** (1 / num_steps)
        kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma)
    return Setup(
        model,
        guide,
        data,
        kwargs,
        context=_vart_context,
        callback=TemperatureSchedule(num_steps, 1.0, 0.1).callback(guide),
        batch=batch,
        note=f"batches of {batch}" if batch < rows else "full batch",
    )


def vart(rows: int, quick: bool) -> Setup:
    """VaRT at ``VaRTRegressor``'s defaults: depth 5, ``kl_weight`` 1e-3,
    :class:`~pyro_trees.infer.VaRTELBO`, ClippedAdam at 0.03 (constant), minibatches of
    ``min(N, 2048)``, the temperature schedule 1 -> 0.1 over 1000 steps as ``fit``'s
    callback, the splits started through random rows, Pyro's validation off and
    module-local parameters (the VaRT estimators' training, the other VaRT families
    alike)."""
    from pyro_trees.guides import VaRTGuide
    from pyro_trees.infer import VaRTELBO
    from pyro_trees.models import VaRT

    with _vart_context():
        model = VaRT(8, kl_weight=1e-3)
    return _vart_setup(rows, model, _data(rows), VaRTGuide, (5,), VaRTELBO(), 1.0)


def vart_forest(rows: int, quick: bool) -> Setup:
    """VaRT forest at ``VaRTForestRegressor``'s defaults: 20 trees of depth 3,
    ``kl_weight`` 1e-3, :class:`~pyro_trees.infer.VaRTForestELBO`, the learning rate
    decaying to 0.05x over 1000 steps; otherwise as ``vart``."""
    from pyro_trees.guides import VaRTForestGuide
    from pyro_trees.infer import VaRTForestELBO
    from pyro_trees.models import VaRTForest

    with _vart_context():
        model = VaRTForest(8, num_trees=20, depth=3, kl_weight=1e-3)
    return _vart_setup(rows, model, _data(rows), VaRTForestGuide, (), VaRTForestELBO(), 0.05)


def vart_classification(rows: int, quick: bool) -> Setup:
    """VaRT classification at ``VaRTClassifier``'s defaults: two classes (the sign of
    the synthetic target), depth 5, ``kl_weight`` 1, the default link,
    :class:`~pyro_trees.infer.VaRTELBO`; otherwise as ``vart``. The base-rate offset of
    the leaves is left at its default (it changes values, not cost)."""
    from pyro_trees.guides import VaRTGuide
    from pyro_trees.infer import VaRTELBO
    from pyro_trees.models import VaRTClassification

    x, y = _data(rows)
    with _vart_context():
        model = VaRTClassification(8, 2, kl_weight=1.0)
    return _vart_setup(rows, model, (x, (y > 0).long()), VaRTGuide, (5,), VaRTELBO(), 1.0)


def heteroscedastic_gp(rows: int, quick: bool) -> Setup:
    """Heteroscedastic GP at ``HeteroscedasticGPRegressor``'s defaults for more than
    1,500 rows: the sparse GP with 256 inducing inputs (random rows; ``min(N, 256)``),
    noise tree of depth 2 (GRU width 16), :class:`~pyro_trees.infer.CollapsedELBO`,
    full batch, float64, Adam at 0.05 (0.0125 for the tree). The estimator's
    homoscedastic start (``init_from_data``, 60 steps) is left out: it changes the
    values, not the cost, of a step."""
    from pyro_trees.guides import HeteroscedasticGPGuide
    from pyro_trees.infer import CollapsedELBO
    from pyro_trees.models import HeteroscedasticGP

    x, y = _data(rows, torch.float64)
    m = min(rows, 256)
    z = x[torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:m]].clone()
    model = HeteroscedasticGP(8, 2, inducing_points=z).to(torch.float64)
    guide = HeteroscedasticGPGuide(8, 2, num_inducing=m, hidden_size=16).to(torch.float64)
    tree = {id(p) for p in guide.tree.parameters()}

    def optim(params):
        params = list(params)
        groups = [
            {"params": [p for p in params if id(p) in tree], "lr": 0.0125},
            {"params": [p for p in params if id(p) not in tree], "lr": 0.05},
        ]
        return torch.optim.Adam([g for g in groups if g["params"]])

    return Setup(
        model,
        guide,
        (x, y),
        dict(loss=CollapsedELBO(balance_weight=1.0, entropy_weight=1.0), optim=optim),
        batch=rows,
        note=f"sparse, M = {m}, float64",
    )


def _deep_gp_setup(model, guide, x, y, note: str) -> Setup:
    """A deep GP family's cell as ``benchmarks/dgp_uci.py`` trains it:
    ``TraceMeanField_ELBO`` with 4 vectorised samples, Adam at 0.01, full batch,
    module-local parameters."""
    from pyro.infer import TraceMeanField_ELBO

    loss = TraceMeanField_ELBO(num_particles=4, vectorize_particles=True, max_plate_nesting=1)
    return Setup(
        model,
        guide,
        (x, y),
        dict(loss=loss, optim="adam", lr=0.01),
        context=lambda: pyro.settings.context(module_local_params=True),
        batch=x.shape[0],
        note=note,
    )


def deep_gp(rows: int, quick: bool) -> Setup:
    """Deep GP with the factorised guide, as ``benchmarks/dgp_uci.py`` trains it: two
    layers (width 4, linear mean inside, ARD RBF kernels), 64 inducing inputs per
    layer, ``TraceMeanField_ELBO`` with 4 vectorised samples, Adam at 0.01, full batch
    (no estimator: no default minibatch)."""
    import gpytorch

    from pyro_trees.guides import DGPFactorisedGuide
    from pyro_trees.models import DeepGP

    x, y = _data(rows)
    gen = torch.Generator().manual_seed(0)
    m = min(rows, 64)
    z1 = x[torch.randperm(rows, generator=gen)[:m]].clone()
    z2 = torch.randn(m, 4, generator=gen)

    def kernel(d, p):
        shape = torch.Size([p]) if p > 1 else torch.Size([])
        rbf = gpytorch.kernels.RBFKernel(ard_num_dims=d, batch_shape=shape)
        return gpytorch.kernels.ScaleKernel(rbf, batch_shape=shape)

    with pyro.settings.context(module_local_params=True):
        model = DeepGP(
            [kernel(8, 4), kernel(4, 1)],
            [z1, z2],
            output_dims=[4, 1],
            mean_functions=[torch.nn.Linear(8, 4), "zero"],
            noise=math.sqrt(0.1),
        )
        guide = DGPFactorisedGuide(model)
    return _deep_gp_setup(model, guide, x, y, f"M = {m}, 4 samples")


def treevi(rows: int, quick: bool) -> Setup:
    """TreeVI: ``ConstrainedClusteringVAE`` (10 clusters, latent width 10, one hidden
    layer of 256: its defaults) on the rows binarised at 0 with ``0.6 N`` random
    constraint pairs (weight +-10; the MNIST benchmark's density), and ``TreeVIGuide``
    with a ``GaussianEncoder`` of the same widths over a random recursive tree of the
    N rows (node i's parent drawn among 0..i-1), ``Trace_ELBO``, Adam at 0.01 (the
    contract test's loop for this model), full batch (no estimator)."""
    from pyro.infer import Trace_ELBO

    from pyro_trees.guides import GaussianEncoder, TreeVIGuide
    from pyro_trees.models import ConstrainedClusteringVAE

    x, _ = _data(rows)
    x = (x > 0).to(torch.float32)
    gen = torch.Generator().manual_seed(0)
    pairs = torch.randint(0, rows, (max(int(0.6 * rows), 1), 2), generator=gen)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    weights = torch.where(torch.rand(len(pairs), generator=gen) < 0.5, 10.0, -10.0)
    parents = (torch.rand(rows, generator=gen) * torch.arange(rows)).long()
    parents[0] = -1
    model = ConstrainedClusteringVAE(8, 10, constraints=pairs, weights=weights)
    guide = TreeVIGuide(GaussianEncoder(8, 10, (256,)), parents)
    return Setup(
        model,
        guide,
        (x,),
        dict(loss=Trace_ELBO(), optim="adam", lr=0.01),
        batch=rows,
        note=f"{len(pairs)} constraints",
    )


def deep_gp_joint(rows: int, quick: bool) -> Setup:
    """Deep GP as ``deep_gp`` with the full-factor joint guide (its defaults) instead of
    the factorised one."""
    from pyro_trees.guides import DGPJointGuide

    setup = deep_gp(rows, quick)
    with pyro.settings.context(module_local_params=True):
        setup.guide = DGPJointGuide(setup.model)
    setup.note += ", joint guide"
    return setup


def deep_gp_joint_program(rows: int, quick: bool) -> Setup:
    """``deep_gp_joint`` trained with :class:`~pyro_trees.infer.DGPELBO` (4 particles)."""
    from pyro_trees.infer import DGPELBO

    setup = deep_gp_joint(rows, quick)
    setup.fit_kwargs = {**setup.fit_kwargs, "loss": DGPELBO(4)}
    setup.note += "; DGPELBO"
    return setup


def deep_gp_intermediate(rows: int, quick: bool) -> Setup:
    """Deep GP with propagated inducing outputs and the whitened intermediate guide (eq.
    4), as ``benchmarks/dgp_composition.py`` builds it but with RBF kernels in both
    layers (its last layer's periodic kernel has no tensor form): two layers of width 1,
    15 inducing inputs, ``TraceMeanField_ELBO`` with 4 vectorised samples, Adam at
    0.01, full batch, float64."""
    import gpytorch

    from pyro_trees.guides import DGPIntermediateGuide
    from pyro_trees.models import DeepGP

    x, y = _data(rows, torch.float64)
    x = x[:, :1]
    kernels = [gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) for _ in range(2)]
    z = torch.linspace(float(x.min()), float(x.max()), 15, dtype=torch.float64).unsqueeze(-1)
    with pyro.settings.context(module_local_params=True):
        model = DeepGP(kernels, z, inducing="propagated", noise=0.1)
        guide = DGPIntermediateGuide(model, whiten=True)
    return _deep_gp_setup(model, guide, x, y, "propagated, M = 15, 4 samples")


def deep_gp_intermediate_program(rows: int, quick: bool) -> Setup:
    """``deep_gp_intermediate`` trained with :class:`~pyro_trees.infer.DGPELBO` (4
    particles): the same estimator on the same draws as one tensor program."""
    from pyro_trees.infer import DGPELBO

    setup = deep_gp_intermediate(rows, quick)
    setup.fit_kwargs = {**setup.fit_kwargs, "loss": DGPELBO(4)}
    setup.note += "; DGPELBO"
    return setup


def bayesian_hme_program(rows: int, quick: bool) -> Setup:
    """Bayesian HME as ``bayesian_hme``, trained with
    :class:`~pyro_trees.infer.BayesianHMEELBO` instead of ``Trace_ELBO``: the same ELBO on
    the same draws as one tensor program (the ``compiled`` mode compiles it)."""
    from pyro_trees.infer import BayesianHMEELBO

    setup = bayesian_hme(rows, quick)
    setup.fit_kwargs = {**setup.fit_kwargs, "loss": BayesianHMEELBO()}
    setup.note += "; BayesianHMEELBO"
    return setup


def deep_gp_program(rows: int, quick: bool) -> Setup:
    """Deep GP as ``deep_gp``, trained with :class:`~pyro_trees.infer.DGPELBO` (4
    particles) instead of ``TraceMeanField_ELBO``: the same estimator on the same draws
    as one tensor program (the ``compiled`` mode compiles it)."""
    from pyro_trees.infer import DGPELBO

    setup = deep_gp(rows, quick)
    setup.fit_kwargs = {**setup.fit_kwargs, "loss": DGPELBO(4)}
    setup.note += "; DGPELBO"
    return setup


def treevi_program(rows: int, quick: bool) -> Setup:
    """TreeVI as ``treevi``, trained with :class:`~pyro_trees.infer.TreeVIELBO` instead of
    ``Trace_ELBO``: the same ELBO on the same draws as one tensor program (the
    ``compiled`` mode compiles it)."""
    from pyro_trees.infer import TreeVIELBO

    setup = treevi(rows, quick)
    setup.fit_kwargs = {**setup.fit_kwargs, "loss": TreeVIELBO()}
    setup.note += "; TreeVIELBO"
    return setup


FAMILIES = {
    "hme": hme,
    "bayesian_hme": bayesian_hme,
    "bayesian_hme_program": bayesian_hme_program,
    "vart": vart,
    "vart_forest": vart_forest,
    "vart_classification": vart_classification,
    "heteroscedastic_gp": heteroscedastic_gp,
    "deep_gp": deep_gp,
    "deep_gp_program": deep_gp_program,
    "deep_gp_joint": deep_gp_joint,
    "deep_gp_joint_program": deep_gp_joint_program,
    "deep_gp_intermediate": deep_gp_intermediate,
    "deep_gp_intermediate_program": deep_gp_intermediate_program,
    "treevi": treevi,
    "treevi_program": treevi_program,
}


def rows_per_step(family: str, rows: int) -> int:
    """Rows per step of ``family`` at ``rows`` rows, without building it."""
    return min(rows, VART_BATCH) if family.startswith("vart") else rows
