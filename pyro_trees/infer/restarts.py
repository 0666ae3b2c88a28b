"""``fit_restarts``: several fits from different seeds, the best kept by its ELBO.

Variational objectives of tree and deep-GP models have poor local optima: a deep GP
whose inner layer locks onto a bad warping, a soft tree whose splits settle on the wrong
inputs. The usual remedy is to train a few times from different starts and keep the fit
with the highest ELBO. The ELBO is the right criterion because it is the objective the
fits maximise and needs no held-out data; it ranks restarts of the *same* model and
guide family, not different families.

:func:`fit_restarts` does this for any model and guide that :func:`~pyro_trees.infer.fit`
trains: a factory builds a fresh (model, guide) from a seed, each restart is trained by
:func:`~pyro_trees.infer.fit`, and each is scored by a Monte Carlo ELBO estimate drawn
from one fixed seed (common random numbers, so the ranking does not depend on which
restart drew luckier noise). The Bayesian HME's batched restarts in one guide are
:func:`~pyro_trees.infer.fit_svi_restarts`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import Trace_ELBO

from pyro_trees.infer.fit import FitResult, _to_device, fit, isolated_params

__all__ = ["RestartsResult", "elbo_estimate", "fit_restarts"]

_FIT_OPTIONS = frozenset(inspect.signature(fit).parameters) - {"model", "guide", "args", "kwargs"}


@dataclass
class RestartsResult:
    """What :func:`fit_restarts` found.

    :ivar model: the best restart's model (trained).
    :ivar guide: the best restart's guide (trained).
    :ivar best: index of the best restart.
    :ivar elbos: the ELBO estimate of every restart (``nan`` where it was not finite).
    :ivar seeds: the seed each restart was built and trained from.
    :ivar results: the :class:`~pyro_trees.infer.FitResult` of every restart.
    :ivar fits: with ``keep_all=True``, every restart's ``(model, guide)``; else empty.

    .. rubric:: Examples

    >>> import pyro
    >>> import pyro.distributions as dist
    >>> import torch
    >>> from pyro.infer.autoguide import AutoNormal
    >>> from pyro_trees.infer import fit_restarts
    >>> def model(y):
    ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with pyro.plate("data", len(y)):
    ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
    >>> def make(seed):  # a fresh (model, guide) per restart
    ...     return model, AutoNormal(model)
    >>> out = fit_restarts(make, torch.zeros(5), num_restarts=2, num_steps=2, progress=False)
    >>> out.seeds, len(out.results), out.elbo == max(out.elbos)
    ([0, 1000], 2, True)
    """

    model: object
    guide: object
    best: int
    elbos: list[float]
    seeds: list[int]
    results: list[FitResult]
    fits: list[tuple] = field(default_factory=list)

    @property
    def elbo(self) -> float:
        """The best restart's ELBO estimate: ``elbos[best]``."""
        return self.elbos[self.best]

    @property
    def result(self) -> FitResult:
        """The best restart's :class:`~pyro_trees.infer.FitResult`."""
        return self.results[self.best]

    @property
    def seconds(self) -> float:
        """Training seconds summed over the restarts (scoring not included)."""
        return sum(r.seconds for r in self.results)


@torch.no_grad()
def elbo_estimate(model, guide, *args, loss=None, num_repeats: int = 32, **kwargs) -> float:
    """Monte Carlo ELBO of a trained ``(model, guide)``: minus the mean of ``num_repeats``
    evaluations of ``loss`` (default :class:`~pyro.infer.Trace_ELBO`).

    Each evaluation draws ``loss.num_particles`` particles, so the estimate averages
    ``num_repeats * loss.num_particles`` draws. It runs in a fresh scope of Pyro's param
    store (:func:`~pyro_trees.infer.isolated_params`), as :func:`~pyro_trees.infer.fit`
    trains, and leaves the global store untouched. Seed Pyro first for a reproducible
    value.

    :param args: the model's arguments, as given to :func:`~pyro_trees.infer.fit`.
    :param loss: a :class:`pyro.infer.ELBO` (e.g. the training loss, or one with closed-form
        KL terms such as :class:`~pyro.infer.TraceMeanField_ELBO` for lower variance).
    :param int num_repeats: evaluations averaged.
    :param kwargs: the model's keyword arguments.
    :returns: the estimate (a float; ``-inf`` or ``nan`` when the fit is degenerate).
    """
    if int(num_repeats) != num_repeats or num_repeats < 1:
        raise ValueError(f"num_repeats must be a positive integer, got {num_repeats!r}")
    loss = Trace_ELBO() if loss is None else loss
    total = 0.0
    with isolated_params():
        elbo = loss(model, guide)
        for _ in range(int(num_repeats)):
            total += float(elbo(*args, **kwargs))
    return -total / int(num_repeats)


def _unpack(built, r: int):
    if not isinstance(built, tuple | list) or len(built) not in (2, 3):
        raise ValueError(
            "make(seed) must return (model, guide) or (model, guide, loss); restart "
            f"{r} returned {type(built).__name__}"
        )
    return (*built, None) if len(built) == 2 else tuple(built)


def fit_restarts(
    make: Callable[[int], tuple],
    *args,
    num_restarts: int = 3,
    seed: int = 0,
    seed_stride: int = 1000,
    score: Callable[[object, object], float] | None = None,
    score_repeats: int = 32,
    keep_all: bool = False,
    **fit_kwargs,
) -> RestartsResult:
    """Train ``num_restarts`` fresh fits and keep the one with the highest ELBO.

    Restart ``r`` seeds Pyro with ``seed + r * seed_stride``, calls ``make`` with that
    seed, and trains the result with :func:`~pyro_trees.infer.fit`. So restart 0 is exactly
    ``pyro.set_rng_seed(seed); model, guide = make(seed); fit(model, guide, ...)``, and
    adding restarts never changes the earlier ones. Every restart is then scored with
    Pyro seeded by ``seed`` (the same draws for all) and the highest score wins; a
    non-finite score ranks last.

    .. code-block:: python

        def make(seed):
            model = DeepGP(kernels(seed), Z, inducing="propagated")
            return model, DGPIntermediateGuide(model, whiten=True), TraceMeanField_ELBO()

        out = fit_restarts(make, x, y, num_restarts=3, num_steps=3000, progress=False)
        out.model, out.guide, out.elbos   # the best fit, and every restart's ELBO

    :param make: ``seed -> (model, guide)`` or ``(model, guide, loss)``; it must build new
        modules each call (the seed is also set globally before the call, so modules that
        initialise from torch's generator differ between restarts without using it).
        A returned ``loss`` trains and scores that restart.
    :param args: the model's arguments, passed to :func:`~pyro_trees.infer.fit`.
    :param int num_restarts: number of fits (>= 1).
    :param int seed: seed of restart 0 and of the scoring.
    :param int seed_stride: seed step between restarts.
    :param score: optional ``(model, guide) -> float`` to maximise in place of the
        default, :func:`elbo_estimate` with the restart's loss and ``score_repeats``.
    :param int score_repeats: evaluations of the loss averaged by the default score.
    :param bool keep_all: keep every restart's ``(model, guide)`` in the result.
    :param fit_kwargs: options of :func:`~pyro_trees.infer.fit` (``num_steps``, ``lr``,
        ``loss``, ``lr_scheduler``, ...) and the model's keyword arguments (``seed`` is
        this function's own); ``loss`` may not be given both here and by ``make``;
        a progress bar is labelled ``"restart r/R"`` unless ``progress`` is ``False`` or a
        label.
    :returns: a :class:`RestartsResult`.
    """
    if isinstance(num_restarts, bool) or int(num_restarts) != num_restarts or num_restarts < 1:
        raise ValueError(f"num_restarts must be a positive integer, got {num_restarts!r}")
    if int(score_repeats) != score_repeats or score_repeats < 1:
        raise ValueError(f"score_repeats must be a positive integer, got {score_repeats!r}")
    if not callable(make):
        raise ValueError(f"make must be a callable seed -> (model, guide); got {make!r}")
    num_restarts = int(num_restarts)
    model_kwargs = {k: v for k, v in fit_kwargs.items() if k not in _FIT_OPTIONS}
    device = fit_kwargs.get("device")
    score_args = _to_device(args, device)
    model_kwargs = _to_device(model_kwargs, device)

    elbos, seeds, results, fits = [], [], [], []
    best, best_value = 0, -math.inf
    best_fit = None
    for r in range(num_restarts):
        run_seed = int(seed) + r * int(seed_stride)
        pyro.set_rng_seed(run_seed)
        model, guide, loss = _unpack(make(run_seed), r)
        options = dict(fit_kwargs)
        if loss is not None:
            if "loss" in options:
                raise ValueError("loss given both by make(seed) and as a fit option")
            options["loss"] = loss
        if options.get("progress", True) is True:
            options["progress"] = f"restart {r + 1}/{num_restarts}"
        results.append(fit(model, guide, *args, **options))
        pyro.set_rng_seed(int(seed))
        if score is not None:
            value = float(score(model, guide))
        else:
            value = elbo_estimate(
                model,
                guide,
                *score_args,
                loss=options.get("loss"),
                num_repeats=score_repeats,
                **model_kwargs,
            )
        finite = math.isfinite(value)
        elbos.append(value if finite else math.nan)
        seeds.append(run_seed)
        if keep_all:
            fits.append((model, guide))
        if best_fit is None or (finite and value > best_value):
            best, best_fit = r, (model, guide)
            best_value = value if finite else -math.inf
    if not any(math.isfinite(v) for v in elbos):
        warnings.warn(
            "no restart has a finite ELBO estimate; returning restart 0", RuntimeWarning, 2
        )
    return RestartsResult(
        model=best_fit[0],
        guide=best_fit[1],
        best=best,
        elbos=elbos,
        seeds=seeds,
        results=results,
        fits=fits,
    )
