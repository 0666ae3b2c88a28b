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
from pyro_trees.guides.stacked import StackedGuides
from pyro_trees.guides.vart import TemperatureSchedule, VaRTGuide
from pyro_trees.infer.compiled import should_compile
from pyro_trees.infer.fit import EarlyStopping, FitResult
from pyro_trees.infer.stacked_stopping import StackedEarlyStopping
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

    def _fit_all(self, X, y, split: HeldOut, generator) -> list:
        """The ``num_fits`` fits as one stacked program where :meth:`_stacks_fits` says
        so, else one after another (:meth:`_fit_one`)."""
        if self._stacks_fits(X, split):
            return self._fit_stacked(X, y, split, generator)
        return [self._fit_one(j, X, y, split, generator) for j in range(self._num_fits(split))]

    #: the most training rows at which the pooled fits train as one stacked program (a
    #: tree's: every full batch, measured faster at 100-2,000 rows; the forest sets its
    #: own; ``benchmarks/results/stacked_fits.md``)
    stack_max_rows = 2048

    def _stacks_fits(self, X, split: HeldOut) -> bool:
        """Whether the ``num_fits`` fits train as one stacked program
        (:class:`~pyro_trees.guides.StackedGuides`): several fits, full batches of at
        most ``stack_max_rows`` training rows, one process, complete inputs, the
        vectorised loss run eagerly, no ``refit``, and memory for the stack's step
        (every fit over every row). Elsewhere they train one after another. Without
        held-out rows (tiny tables) every fit learns from every row for ``num_steps``
        steps, as one after another they would."""
        n_train = X.shape[0] - split.n_val
        full_batch = self.batch_size is None or int(self.batch_size) >= n_train
        stacks = (
            int(self.num_fits) > 1
            and full_batch
            and n_train <= int(self.stack_max_rows)
            and self.elbo == "vectorised"
            and self.ranks_.size == 1
            and not getattr(self, "refit", False)
            and not self._fit_missing()
            and not should_compile(X.device, self.num_steps, n_train)
        )
        if not stacks:
            return False
        rows = X.shape[0] * int(self.num_fits)  # the stack's step, as rows of one fit
        try:
            _check_training_memory(self.depth, rows, self._memory_width(X.shape[1]), X.device)
        except ValueError:  # too large stacked: one fit after another, each checked alone
            return False
        return True

    def _fit_start(self, j: int, split: HeldOut, generator) -> tuple:
        """Fit ``j``'s rows, seed and generator: it holds out its own fold and starts
        from ``generator`` (the first fit) or one seeded ``seed_ + j * MEMBER_SEED``."""
        val_idx, train_idx = split.fold(self._member_fold(j, split))
        seed = self._seed() + j * MEMBER_SEED
        gen = generator if j == 0 else torch.Generator().manual_seed(seed)
        return val_idx, train_idx, seed, gen

    def _fit_stacked(self, X, y, split: HeldOut, generator) -> list:
        """The ``num_fits`` fits as one program: each starts as it would alone
        (:meth:`_prepare_fit`: its own rows, range, held-out fold and start), the guides
        are stacked, and every step draws all of them at once from ``seed_``'s stream,
        each fit's likelihood over its own training rows (row weights), each fit
        early-stopped on its own fold (:class:`~pyro_trees.infer.StackedEarlyStopping`).
        Returns what :meth:`_fit_one` returns, for every fit."""
        num, n = int(self.num_fits), X.shape[0]
        starts, rows = [], []
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            for j in range(num):
                val_idx, train_idx, _, gen = self._fit_start(j, split, generator)
                start = self._prepare_fit(X, y, val_idx, train_idx, gen)
                start["range"] = (self.x_min_, self.x_max_)
                starts.append(start)
                rows.append(train_idx)
            guides = [s["guide"] for s in starts]
            stack = StackedGuides(guides)
            weight = torch.zeros(num, n, dtype=X.dtype, device=X.device)
            for j, train_idx in enumerate(rows):
                weight[j, train_idx] = 1.0
            # rows that every fit holds out (the classifier's fits share their held-out
            # fold) leave the program: the same fits, fewer rows scored at weight 0
            used = weight.any(0)
            Xs, ys = (X, y) if bool(used.all()) else (X[used], y[used])
            weight = weight[:, used]
            loss = self._stacked_loss()
            schedule = self._temperature_schedule()
            callback = schedule.callback(stack)
            if split.n_val:
                stopping = StackedEarlyStopping(
                    lambda j: self._held_out_score(guides[j], starts[j]["Xva"], starts[j]["yva"]),
                    stack,
                    fit_losses=lambda: loss.fit_losses,
                    eval_every=int(self.eval_every),
                    patience=self.patience,
                )
            else:  # every fit runs every step: each one's losses kept without a host read
                stopping, step_losses = None, []

                def callback(step, value, _schedule=callback):
                    step_losses.append(loss.fit_losses.detach())
                    _schedule(step, value)

                callback.reads_loss = False
            self.model_ = starts[-1]["model"]  # as after sequential fits: the last one's
            result = run_svi(
                self.ranks_,
                self.model_,
                stack,
                Xs,
                ys,
                seed=self._seed(),
                num_steps=int(self.num_steps),
                loss=loss,
                optim="clipped_adam",
                lr=self.lr,
                lr_scheduler=self._lr_scheduler(),
                progress=self.progress and f"{self._label} {num} fits",
                callback=callback,
                early_stopping=stopping,
                weight=weight,
            )
        if stopping is None:
            stack.unstack()  # the trained values into the guides
            histories = torch.stack(step_losses).T.tolist() if step_losses else [[]] * num
            results = [
                FitResult(losses=losses, stopped=result.stopped, seconds=result.seconds)
                for losses in histories
            ]
        else:
            results = stopping.results
        fits = []
        for guide, result, start in zip(guides, results, starts, strict=True):
            # the temperature where the fit stopped (its last evaluation, else the end)
            done = result.val_losses[-1][0] if result.val_losses else result.num_steps
            guide.temperature = schedule(done)
            importances = _split_importances(guide, start["Xtr"][:4096], self.ranks_)
            held = (start["Xva"], start["yva"])
            fits.append((guide, result, importances, start["range"], held, None))
        return fits

    def _stacked_loss(self):
        """The family's loss of a stack of fits: its vectorised loss, eager."""
        return self._losses[0]()

    def _fit_one(self, j: int, X, y, split: HeldOut, generator):
        """Fit ``j``: holds out its fold, starts from ``generator`` (the first fit) or
        one seeded ``seed_ + j * MEMBER_SEED``, trains with those draws. Returns
        ``(guide, result, importances, (x_min, x_max), (Xva, yva), stopped)``;
        ``stopped`` is the early-stopped result a refit replaced, else ``None``."""
        val_idx, train_idx, seed, gen = self._fit_start(j, split, generator)
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

    def _prepare_fit(self, X, y, val_idx, train_idx, gen) -> dict:
        """What a fit on rows ``train_idx`` with ``val_idx`` held out starts from: the
        memory checks, the clipping range of its rows (set as ``x_min_``, ``x_max_``),
        its held-out rows (standardised and clipped, as new rows would be), and its
        model and guide, started from ``gen`` and moved to ``X``'s device and dtype.
        Call it under ``module_local_params``."""
        n, num_features = X.shape
        ranks = self.ranks_
        n_train = ranks.count(n - len(val_idx))  # over every rank's rows
        batch = min(n_train, 2048) if self.batch_size is None else int(self.batch_size)
        batch = min(batch, n_train)
        width = self._memory_width(num_features)
        depth = _check_training_memory(self.depth, batch, width, X.device)
        _check_prediction_memory(depth, int(self.num_samples), width, X.device)
        Xtr = X[train_idx]
        self.x_min_, self.x_max_ = training_range(ranks, Xtr)  # the rows it learns from
        Xva = clip_to_training_range(self, X[val_idx])  # scored as new rows would be
        model, guide = self._start(num_features, depth, Xtr, gen)
        ranks.broadcast_modules(guide)  # sharded: rank 0's start
        guide.to(X.device, X.dtype)  # the model and guide compute in X's dtype
        model.to(X.device, X.dtype)
        return {
            "model": model,
            "guide": guide,
            "Xtr": Xtr,
            "ytr": y[train_idx],
            "Xva": Xva,
            "yva": y[val_idx],
            "batch": batch,
            "n_train": n_train,
        }

    def _fit_split(self, X, y, val_idx, train_idx, gen, *, seed=None, num_steps=None, label=None):
        """Fit on rows ``train_idx`` with ``val_idx`` held out (early stopping);
        ``gen`` seeds the guide's start and ``seed`` (default ``seed_``) the training
        draws. With ``num_steps`` (the refit of ``refit=True``) it trains exactly that
        many steps of the ``self.num_steps`` temperature schedule, without early
        stopping. ``label`` names the progress bar (default the family's). Sets
        ``model_``, ``guide_``, ``fit_result_`` and the clipping range; returns the
        held-out rows, standardised and clipped."""
        ranks = self.ranks_
        # inputs are checked above; Pyro's per-site validation only costs time here
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            start = self._prepare_fit(X, y, val_idx, train_idx, gen)
            self.model_, self.guide_ = start["model"], start["guide"]
            guide, Xva, yva = self.guide_, start["Xva"], start["yva"]
            schedule = self._temperature_schedule()
            stopping = None
            if len(val_idx) and num_steps is None:
                stopping = EarlyStopping(
                    lambda: self._held_out_score(guide, Xva, yva),
                    eval_every=int(self.eval_every),
                    patience=self.patience,
                )
            seed = self._seed() if seed is None else int(seed)
            rows = RankRows(ranks, seed) if ranks.size > 1 else None
            steps = int(self.num_steps) if num_steps is None else int(num_steps)
            data = (start["Xtr"], start["ytr"])
            compile = should_compile(X.device, self.num_steps, start["batch"])
            self.fit_result_ = run_svi(
                ranks,
                self.model_,
                guide,
                *data,
                seed=seed,
                batch=start["batch"],
                n_rows=start["n_train"],
                num_steps=steps,
                loss=self._loss(rows, data, compile=compile),
                optim="clipped_adam",
                lr=self.lr,
                lr_scheduler=self._lr_scheduler(),
                progress=self.progress and (label or self._label),
                callback=schedule.callback(guide),
                early_stopping=stopping,
            )
        return Xva, yva

    def _temperature_schedule(self) -> TemperatureSchedule:
        """The annealing of the split indicators' temperature over ``num_steps``."""
        return TemperatureSchedule(
            max(int(self.num_steps), 1), self.temperature_start, self.temperature_end
        )

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
