"""The fits of the VaRT estimators (:class:`~pyro_trees.estimators.VaRTRegressor`, its
forest and :class:`~pyro_trees.estimators.VaRTClassifier`): the hooks of the
:class:`~pyro_trees.estimators._template.SVIEstimator` template that they share.

Fit :math:`j` of ``num_fits`` holds out fold ``_member_fold(j)`` of the held-out split,
starts its guide from a generator seeded ``seed_ + j * MEMBER_SEED`` (the first from the
generator that drew the split), trains with :func:`~pyro_trees.estimators._template.run_svi`
under the annealed Gumbel-softmax temperature, early-stopped on the family's held-out
score of the guide's central tree, and records its split importances. The pool of fits
then gives ``guides_``, ``fit_results_`` and the mean ``feature_importances_``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pyro
import torch
from pyro.infer import Trace_ELBO

from pyro_trees.estimators._constraints import (
    EARLY_STOPPING,
    SEED_AND_DEVICE,
    Integer,
    OneOf,
    Real,
)
from pyro_trees.estimators._distributed import RankRows, RankVaRTELBO
from pyro_trees.estimators._missing import MissingInputs
from pyro_trees.estimators._rng import MEMBER_SEED
from pyro_trees.estimators._template import VART_HELD_OUT, HeldOut, SVIEstimator, run_svi
from pyro_trees.estimators._vart_export import _split_importances
from pyro_trees.estimators.vart_memory import check_prediction_memory as _check_prediction_memory
from pyro_trees.estimators.vart_memory import check_training_memory as _check_training_memory
from pyro_trees.guides.vart import TemperatureSchedule, VaRTGuide
from pyro_trees.infer.compiled import should_compile
from pyro_trees.infer.fit import EarlyStopping
from pyro_trees.infer.vart_elbo import VaRTELBO

__all__ = ["VART_CONSTRAINTS", "VaRTFits", "clip_to_training_range", "training_range"]

_REFIT_SEED = 104729  # refit=True: offset of the fresh fit's seed from ``seed_``

#: the parameters every VaRT estimator shares, and what each may be
VART_CONSTRAINTS = {
    **SEED_AND_DEVICE,
    **EARLY_STOPPING,
    "depth": Integer(1),
    "kl_weight": Real(0, low_open=True),
    "num_steps": Integer(0),
    "lr": Real(0, low_open=True),
    "num_fits": Integer(1),
    "batch_size": Integer(1, none=True),
    "temperature_start": Real(0, low_open=True),
    "temperature_end": Real(0, low_open=True),
    "num_samples": Integer(1),
    "init": OneOf("data", "random"),
    "init_split_prob": Real(0, 1, low_open=True, high_open=True),
    "elbo": OneOf("vectorised", "trace"),
    "clip_margin": Real(0, none=True),
    "split_alpha": Real(0, 1, low_open=True),
    "split_beta": Real(0),
    "split_scale": Real(0, low_open=True),
    "leaf_scale": Real(0, low_open=True),
}


def training_range(ranks, Xtr: torch.Tensor):
    """``(x_min, x_max)`` ``(L,)``: each feature's range over the training rows ``Xtr``
    (all ranks' rows, :meth:`Ranks.min <pyro_trees.estimators._distributed.Ranks.min>`),
    missing values (NaN) left out; a feature with no observed value has range
    ``[0, 0]`` (its standardised mean), so that new values of it are clipped there."""
    missing = torch.isnan(Xtr)
    if not bool(missing.any()):
        return ranks.min(Xtr.min(0).values), ranks.max(Xtr.max(0).values)
    lo = torch.where(missing, math.inf, Xtr).min(0).values
    hi = torch.where(missing, -math.inf, Xtr).max(0).values
    seen = ~missing.all(0)
    zero = torch.zeros_like(lo)
    return ranks.min(torch.where(seen, lo, zero)), ranks.max(torch.where(seen, hi, zero))


def clip_to_training_range(est, Xs: torch.Tensor) -> torch.Tensor:
    """Standardised inputs clipped to the training rows' range (``est.x_min_``,
    ``est.x_max_``) widened by ``est.clip_margin`` times its width on each side
    (``clip_margin=None``, or no range yet: unchanged)."""
    if est.clip_margin is not None and getattr(est, "x_min_", None) is not None:
        pad = float(est.clip_margin) * (est.x_max_ - est.x_min_)
        Xs = torch.minimum(torch.maximum(Xs, est.x_min_ - pad), est.x_max_ + pad)
    return Xs


class VaRTFits(MissingInputs, SVIEstimator):
    """The hooks the VaRT estimators share; a family adds its model and guide
    (``_model``, ``_guide_cls``), its held-out score (``_held_out_score``), its loss
    (``_loss``) and its after-fit step."""

    _held_out_rule = VART_HELD_OUT
    _seed_whole_fit = False  # each fit seeds its start and its training itself
    _label = "VaRT"

    def _seed(self) -> int:
        """The seed of the fit and of prediction sampling: ``seed_`` (set by ``fit``);
        estimators pickled before ``seed_`` existed used ``random_state``, 0 for
        ``None``."""
        seed = getattr(self, "seed_", None)
        if seed is None:
            return 0 if self.random_state is None else int(self.random_state)
        return int(seed)

    def _check_params_together(self, sharded: bool) -> None:
        if int(self.num_fits) > int(self.num_samples):
            raise ValueError(
                f"num_fits ({self.num_fits}) must not exceed num_samples ({self.num_samples}): "
                "every fit gives at least one posterior draw"
            )
        if sharded and self.elbo == "trace":
            raise ValueError("sharded=True needs elbo='vectorised' (the default)")

    def _num_fits(self, split: HeldOut) -> int:
        return int(self.num_fits)

    def _member_fold(self, j: int, split: HeldOut) -> int:
        """The fold fit ``j`` holds out: its own (wrapping around past the last)."""
        return j % split.num_folds

    def _fit_one(self, j: int, X, y, split: HeldOut, generator):
        """Fit ``j``: holds out its fold, starts from ``generator`` (the first fit) or
        one seeded ``seed_ + j * MEMBER_SEED``, trains with those draws. Returns
        ``(guide, result, importances, (x_min, x_max), (Xva, yva), stopped)``;
        ``stopped`` is the early-stopped result a refit replaced, else ``None``."""
        val_idx, train_idx = split.fold(self._member_fold(j, split))
        seed = self._seed() + j * MEMBER_SEED
        gen = generator if j == 0 else torch.Generator().manual_seed(seed)
        # the progress bar names the fit among several: "VaRT fit 2/3"
        label = self._label + (f" fit {j + 1}/{self.num_fits}" if int(self.num_fits) > 1 else "")
        held = self._fit_split(X, y, val_idx, train_idx, gen, seed=seed, label=label)
        stopped = None
        if split.n_val and getattr(self, "refit", False):
            # refit=True: a fresh guide, seeded seed_ + _REFIT_SEED + j * MEMBER_SEED,
            # trained on the same rows for the steps early stopping chose (at least 1),
            # replaces the stopped one
            stopped = self.fit_result_
            seed = self._seed() + _REFIT_SEED + j * MEMBER_SEED
            steps = max(int(stopped.best_step or 0), 1)
            gen = torch.Generator().manual_seed(seed)
            self._fit_split(
                X, y, val_idx, train_idx, gen, seed=seed, num_steps=steps, label=label + " refit"
            )
        # the importances of the guide the fit keeps (the refit's, where there is one)
        importances = _split_importances(self.guide_, X[train_idx][:4096], self.ranks_)
        ranges = (self.x_min_, self.x_max_)
        return self.guide_, self.fit_result_, importances, ranges, held, stopped

    def _pool(self, fits: list) -> list:
        """Set ``guides_`` (``guide_`` the first), ``fit_results_``,
        ``stopping_results_`` (``stopping_result_`` the first; empty and ``None``
        without refits), the mean ``feature_importances_`` and the clipping range of
        every fit's training rows; return each fit's held-out rows, standardised and
        clipped as it saw them."""
        self.guides_ = [f[0] for f in fits]
        self.fit_results_ = [f[1] for f in fits]
        self.guide_, self.fit_result_ = self.guides_[0], self.fit_results_[0]
        self.stopping_results_ = [f[5] for f in fits if f[5] is not None]
        self.stopping_result_ = self.stopping_results_[0] if self.stopping_results_ else None
        self.feature_importances_ = np.mean([f[2] for f in fits], axis=0)
        self.x_min_ = functools.reduce(torch.minimum, [f[3][0] for f in fits])
        self.x_max_ = functools.reduce(torch.maximum, [f[3][1] for f in fits])
        return [f[4] for f in fits]

    def _memory_width(self, num_features: int) -> int:
        """The input width the memory checks count (``L``)."""
        return num_features

    def _fit_split(self, X, y, val_idx, train_idx, gen, *, seed=None, num_steps=None, label=None):
        """Fit on rows ``train_idx`` with ``val_idx`` held out (early stopping);
        ``gen`` seeds the guide's start and ``seed`` (default ``seed_``) the training
        draws. With ``num_steps`` (the refit of ``refit=True``) it trains exactly that
        many steps of the ``self.num_steps`` temperature schedule, without early
        stopping. ``label`` names the progress bar (default the family's). Sets
        ``model_``, ``guide_``, ``fit_result_`` and the clipping range; returns the
        held-out rows, standardised and clipped."""
        n, num_features = X.shape
        ranks = self.ranks_
        n_val = len(val_idx)
        n_train = ranks.count(n - n_val)  # over every rank's rows
        batch = min(n_train, 2048) if self.batch_size is None else int(self.batch_size)
        batch = min(batch, n_train)
        width = self._memory_width(num_features)
        depth = _check_training_memory(self.depth, batch, width, X.device)
        _check_prediction_memory(depth, int(self.num_samples), width, X.device)
        Xtr, ytr, yva = X[train_idx], y[train_idx], y[val_idx]
        self.x_min_, self.x_max_ = training_range(ranks, Xtr)  # the rows it learns from
        Xva = clip_to_training_range(self, X[val_idx])  # scored as new rows would be
        # inputs are checked above; Pyro's per-site validation only costs time here
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            self.model_, self.guide_ = self._start(num_features, depth, Xtr, gen)
            guide = self.guide_
            ranks.broadcast_modules(guide)  # sharded: rank 0's start
            guide.to(X.device, X.dtype)  # the model and guide compute in X's dtype
            self.model_.to(X.device, X.dtype)
            schedule = TemperatureSchedule(
                max(int(self.num_steps), 1), self.temperature_start, self.temperature_end
            )
            stopping = None
            if n_val and num_steps is None:
                stopping = EarlyStopping(
                    lambda: self._held_out_score(guide, Xva, yva),
                    eval_every=int(self.eval_every),
                    patience=self.patience,
                )
            seed = self._seed() if seed is None else int(seed)
            rows = RankRows(ranks, seed) if ranks.size > 1 else None
            steps = int(self.num_steps) if num_steps is None else int(num_steps)
            self.fit_result_ = run_svi(
                ranks,
                self.model_,
                guide,
                Xtr,
                ytr,
                seed=seed,
                batch=batch,
                n_rows=n_train,
                num_steps=steps,
                loss=self._loss(
                    rows, (Xtr, ytr), compile=should_compile(X.device, self.num_steps, batch)
                ),
                optim="clipped_adam",
                lr=self.lr,
                lr_scheduler=self._lr_scheduler(),
                progress=self.progress and (label or self._label),
                callback=schedule.callback(guide),
                early_stopping=stopping,
            )
        return Xva, yva

    def _lr_scheduler(self):
        """``lr_decay``'s geometric schedule over ``num_steps`` (``None`` when constant
        or without ``lr_decay``)."""
        if float(getattr(self, "lr_decay", 1.0)) == 1.0:
            return None
        gamma = float(self.lr_decay) ** (1.0 / max(int(self.num_steps), 1))
        return functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=gamma)

    #: the family's vectorised loss and its data-parallel variant
    _losses = (VaRTELBO, RankVaRTELBO)

    def _loss(self, rows=None, data=None, compile: bool = False):
        """The training objective; with ``rows`` (several processes) it reads this rank's
        rows of ``data``; ``compile``: the vectorised loss of one process compiles
        (:func:`~pyro_trees.infer.should_compile` decides)."""
        if self.elbo != "vectorised":
            return Trace_ELBO()
        single, ranked = self._losses
        return single(compile=compile) if rows is None else ranked(rows, data=data)

    def _start(self, num_features: int, depth: int, Xtr, gen):
        """The model (:meth:`_model`) and a guide of ``_guide_cls`` at
        ``temperature_start``, its split rules started from ``gen``: random
        hyperplanes, then (``init="data"``) through random training rows of ``Xtr``."""
        model = self._model(num_features, depth)
        guide = self._guide_cls(
            model,
            *self._guide_args(depth),
            temperature=self.temperature_start,
            init="random",  # the data-driven start follows, from ``gen``
            init_split_prob=self.init_split_prob,
            generator=gen,
        )
        if self.init == "data":
            guide.init_splits_from_data(Xtr, generator=gen)
        return model, guide

    # -- the family's hooks ----------------------------------------------------------------
    _guide_cls = VaRTGuide

    def _guide_args(self, depth: int) -> tuple:
        """``_guide_cls``'s arguments after the model: the truncation depth."""
        return (depth,)

    def _model(self, num_features: int, depth: int):
        """The model of a fit (no data: the guide's start reads them)."""
        raise NotImplementedError

    def _held_out_score(self, guide, Xva, yva) -> float:
        """The early-stopping criterion of ``guide`` on the held-out rows (lower is
        better)."""
        raise NotImplementedError
