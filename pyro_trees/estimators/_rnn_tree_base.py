"""The shared base of :class:`~pyro_trees.estimators.RNNTreeRegressor` and
:class:`~pyro_trees.estimators.RNNTreeClassifier`: fitting with restarts and the choice of
the initial tree, the loss (:class:`~pyro_trees.infer.HMEELBO`), routing and rules.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from sklearn.utils.validation import check_is_fitted

from pyro_trees import trees
from pyro_trees.estimators._constraints import (
    EARLY_STOPPING,
    SEED_AND_DEVICE,
    Anything,
    Checked,
    Integer,
    OneOf,
    Real,
)
from pyro_trees.estimators._distributed import RankHMEELBO, RankRows
from pyro_trees.estimators._missing import MissingInputs
from pyro_trees.estimators._template import HeldOut, HeldOutRule, SVIEstimator, run_svi
from pyro_trees.guides.hme import RNNTreeGuide
from pyro_trees.infer.compiled import should_compile
from pyro_trees.infer.fit import EarlyStopping, isolated_params
from pyro_trees.infer.hme_elbo import HMEELBO
from pyro_trees.models.hme import HME
from pyro_trees.validation import resolve_dtype

_ROUTINGS = ("hard", "posterior")
#: Fewest held-out rows worth a validation split.
_MIN_VALIDATION = 5
_START_MARGIN = 0.05
_AUTO_STEPS = 300
_AUTO_PATIENCE = 5


class _RNNTreeBase(MissingInputs, SVIEstimator):
    _likelihood = "gaussian"

    def __init__(
        self,
        depth: int = 3,
        *,
        hidden_size: int = 32,
        feedback: str = "hard",
        experts: str = "constant",
        init: str = "auto",
        num_steps: int | None = None,
        lr: float = 0.03,
        lr_decay: float = 0.1,
        optim: str = "adam",
        batch_size: int | None = None,
        validation_fraction: float = 0.2,
        patience: int | None = None,
        eval_every: int = 10,
        routing: str = "hard",
        num_noise_samples: int = 32,
        balance_weight: float = 1.0,
        entropy_weight: float = -1.0,
        refit_leaves: bool | str = "auto",
        random_state: int | None = None,
        device=None,
        dtype: str = "float32",
        progress: bool = False,
    ):
        self.depth = depth
        self.hidden_size = hidden_size
        self.feedback = feedback
        self.experts = experts
        self.init = init
        self.num_steps = num_steps
        self.lr = lr
        self.lr_decay = lr_decay
        self.optim = optim
        self.batch_size = batch_size
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.routing = routing
        self.num_noise_samples = num_noise_samples
        self.balance_weight = balance_weight
        self.entropy_weight = entropy_weight
        self.refit_leaves = refit_leaves
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.progress = progress

    # -- hooks for the two subclasses ---------------------------------------------------
    def _model_kwargs(self) -> dict:
        raise NotImplementedError

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    _parameter_constraints = {
        **SEED_AND_DEVICE,
        **EARLY_STOPPING,
        "depth": Integer(1),
        "hidden_size": Integer(1),
        "feedback": OneOf("hard", "soft"),
        "experts": OneOf("constant", "linear"),
        "init": OneOf("auto", "balanced", "greedy", "random"),
        "num_steps": Integer(0, none=True),
        "lr": Real(0, low_open=True),
        "lr_decay": Real(0, low_open=True),
        "optim": Anything("pyro_trees.infer.make_optimizer"),
        "batch_size": Integer(1, none=True),
        "routing": OneOf(*_ROUTINGS),
        "num_noise_samples": Integer(1),
        "balance_weight": Real(),
        "entropy_weight": Real(),
        "refit_leaves": OneOf(True, False, "auto"),
        "dtype": Checked(resolve_dtype),
    }
    #: a validation split only where it holds out at least ``_MIN_VALIDATION`` rows
    #: (fewer make the choice of a step noise)
    _held_out_rule = HeldOutRule(min_expected=_MIN_VALIDATION)

    def _check_params_together(self, sharded: bool) -> None:
        self._check_early_stopping_options()

    # -- the fit template's hooks --------------------------------------------------------
    def _num_fits(self, split: HeldOut) -> int:
        """The starts: ``"greedy"`` then ``"balanced"`` for ``init="auto"`` (the first
        alone without a validation split), else ``init``."""
        return 2 if self.init == "auto" and split.n_val else 1

    def _fit_one(self, j: int, X, y, split: HeldOut, generator):
        """Train start ``j`` on the training rows; returns ``(held-out error or None,
        start, (model_, guide_, hard_leaf_loc_, fit_result_))``."""
        init = ("greedy", "balanced")[j] if self.init == "auto" else self.init
        n_all = self.n_global_rows_  # every rank's rows
        width = getattr(self, "n_classes_", None) or getattr(self, "n_outputs_", 1)
        depth = trees.check_depth(
            self.depth,
            num_points=min(n_all, self.batch_size or n_all),
            width=max(width, X.shape[1]),
            dtype=X.dtype,
            device=X.device,
        )
        val, train = split.fold(0)
        X_val, y_val = (X[val], y[val]) if split.n_val else (None, None)
        self._train(X[train], y[train], X_val, y_val, depth, init)
        err = self._error(X_val, y_val) if split.n_val else None
        factor = self._held_out_factor(X_val, y_val) if split.n_val else None
        state = (self.model_, self.guide_, self.hard_leaf_loc_, self.fit_result_, factor)
        return err, init, state

    def _after_fit(self, X, y, split: HeldOut, fits: list) -> None:
        """Keep the start of least held-out error (a later start must beat an earlier
        one clearly: :meth:`_start_margin`), then grow a greedy start that training
        never beat on all the rows, or refit the hard tree's leaves on them, and cure a
        degenerate tree."""
        best = None
        n_val = self.ranks_.count(split.n_val)
        for err, init, state in fits:
            if err is None:
                break
            margin = self._start_margin(best[0], n_val) if best else 0.0
            if best is None or err + margin < best[0]:
                best = (err, init, state)
        self.validation_error_ = None
        factor = None
        if best is not None:
            err, init, state = best
            self.model_, self.guide_, self.hard_leaf_loc_, self.fit_result_, factor = state
            self.validation_error_ = err
            self._rules = None
        self._set_noise_factor(factor)
        self.start_ = init
        if split.n_val and self.fit_result_.best_step == 0 and init == "greedy":
            # Training never beat the greedy start on the held-out points: the start
            # is what the data chose, so grow it on all of them.
            self._init_tree(X, y, init)
        elif self.hard_leaf_loc_ is not None or (split.n_val and self.refit_leaves is True):
            self._refit_hard_leaves(X, y)
        self._check_collapse(X, y)
        self._rules = None
        _ = self.rules_  # the hard tree, made here once: predicting changes no attribute

    def _held_out_factor(self, X_val: torch.Tensor, y_val: torch.Tensor) -> float | None:
        """The regressor's noise calibration from the held-out rows (the classifier has
        none)."""
        return None

    def _set_noise_factor(self, factor: float | None) -> None:
        """Keep the calibration of the chosen start (the regressor's hook)."""

    def _num_steps(self, validated: bool) -> int:
        """``num_steps``, or by default ``_AUTO_STEPS`` (early stopping ends most runs
        sooner), none where too few rows were left to hold some out."""
        if self.num_steps is not None:
            return int(self.num_steps)
        return _AUTO_STEPS if validated or self.validation_fraction == 0 else 0

    def _new_modules(self, depth: int, like: torch.Tensor) -> None:
        n_features = self.n_features_in_
        # init=None: _init_tree starts them; a later call (e.g. Predictive) must not
        model = HME(n_features, depth, experts=self.experts, init=None, **self._model_kwargs())
        guide = RNNTreeGuide(
            n_features,
            depth,
            hidden_size=self.hidden_size,
            feedback=self.feedback,
            init=None,
            missing=self._fit_missing(),
        )
        model.to(device=like.device, dtype=like.dtype)
        guide.to(device=like.device, dtype=like.dtype)
        self.model_, self.guide_ = model, guide
        self._rules = None
        self.hard_leaf_loc_ = None

    @torch.no_grad()
    def _init_tree(self, Xs: torch.Tensor, y: torch.Tensor, init: str) -> None:
        """The data-driven start ``init`` (``"greedy"`` or ``"balanced"``): the tree's
        splits, then one M-step of the experts on its hard routing (soft routing would
        smear every expert towards the global mean)."""
        self._rules = None
        self.hard_leaf_loc_ = None
        if init == "random":
            return
        model, guide = self.model_, self.guide_
        depth = model.depth
        with isolated_params():
            guide.tree.init_balanced(Xs, y, cuts=init)
            leaf = guide.tree.hard_leaf(Xs)
            model.init_experts(Xs, y, torch.nn.functional.one_hot(leaf, 2**depth))
        self.ranks_.broadcast_modules(model, guide)  # sharded: rank 0's start
        self._rules = None

    def _train(self, Xs, y, X_val, y_val, depth: int, init: str) -> None:
        """Initialise and train ``model_`` and ``guide_`` on ``(Xs, y)``; with a
        held-out split, keep the state (the start included) of lowest held-out error
        and, with ``refit_leaves="auto"``, the leaf refit only where it lowers it."""
        self._new_modules(depth, Xs)
        self._init_tree(Xs, y, init)
        model, guide = self.model_, self.guide_

        val_metric = None
        if X_val is not None:
            n_val = self.ranks_.count(y_val.shape[0])
            first = [True]

            def val_metric():
                self._rules = None
                self.hard_leaf_loc_ = None
                if self.refit_leaves is True:
                    self._refit_hard_leaves(Xs, y)
                err = self._error(X_val, y_val)
                if first[0] and init != "random":
                    # the data-driven start is kept unless training beats it clearly
                    first[0] = False
                    err = err - self._start_margin(err, n_val)
                return err

        num_steps = self._num_steps(X_val is not None)
        patience = None
        if X_val is not None:
            patience = _AUTO_PATIENCE if self.patience is None else self.patience
        gamma = float(self.lr_decay) ** (1.0 / max(1, num_steps))
        self.fit_result_ = run_svi(
            self.ranks_,
            model,
            guide,
            Xs,
            y,
            batch=self.batch_size,  # under torchrun: per rank
            loss=self._loss((Xs, y)),
            num_steps=num_steps,
            optim=self.optim,
            lr=self.lr,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma),
            early_stopping=None
            if val_metric is None
            else EarlyStopping(val_metric, eval_every=self.eval_every, patience=patience),
            progress=self.progress and type(self).__name__,
        )
        model.eval()
        guide.eval()
        self._rules = None
        self.hard_leaf_loc_ = None
        if self.refit_leaves is True:
            self._refit_hard_leaves(Xs, y)
        elif self.refit_leaves == "auto" and X_val is not None:
            # keep the refit only where it lowers the held-out error of the hard tree
            trained = self._error(X_val, y_val)
            self._refit_hard_leaves(Xs, y)
            if self.hard_leaf_loc_ is not None and not self._error(X_val, y_val) < trained:
                self.hard_leaf_loc_ = None
                self._rules = None

    def _start_margin(self, err: float, n_val: int) -> float:
        """How much lower a later candidate's held-out error must be to replace the
        data-driven start: ``_START_MARGIN`` of it, and at least one standard error of
        the held-out estimate (on a hundred held-out rows a difference of one or two
        rows is chance, and a tree chosen by chance loses on new data)."""
        return max(_START_MARGIN * err, self._standard_error(err, n_val))

    def _standard_error(self, err: float, n_val: int) -> float:
        raise NotImplementedError

    def _loss(self, data=None):
        """The closed-form loss (:class:`~pyro_trees.infer.HMEELBO`), compiled where
        :func:`~pyro_trees.infer.should_compile` says; under ``torchrun`` it reads this
        rank's rows of ``data`` (:class:`~pyro_trees.estimators._distributed.RankRows`)."""
        weights = {"balance_weight": self.balance_weight, "entropy_weight": self.entropy_weight}
        ranks = self.ranks_
        if ranks.size > 1:
            return RankHMEELBO(RankRows(ranks, self.seed_), data, **weights)
        steps = self._num_steps(True)
        return HMEELBO(**weights, compile=should_compile(self.device_, steps, self.batch_size))

    @torch.no_grad()
    def _collapse(self, Xs: torch.Tensor, y: torch.Tensor) -> str | None:
        """Why the fitted hard tree is degenerate on the training rows, or ``None``:
        non-finite predictions, every row in one leaf, one prediction for all rows
        whose targets differ, or a training error no lower than a constant's."""
        out = self._predict_hard(Xs)
        if not torch.isfinite(out).all():
            return "it predicts NaN or infinite values"
        if torch.unique(self.rules_.route(Xs)).numel() == 1:
            return "every training row falls in the same leaf"
        if self._targets_vary(y) and torch.unique(out, dim=0).shape[0] == 1:
            return f"it predicts {self._constant_name()} for every training row"
        if self._targets_vary(y) and self._error(Xs, y) >= self._constant_error(y) * (1 - 1e-6):
            return "its training error is no lower than a constant prediction's"
        return None

    def _check_collapse(self, Xs: torch.Tensor, y: torch.Tensor) -> None:
        """Detect a degenerate fit; cure it with the greedy start grown on all rows,
        and warn if that is degenerate too."""
        self.collapse_ = reason = self.ranks_.first(self._collapse(Xs, y))
        if reason is None:
            return
        self._init_tree(Xs, y, "greedy")
        self.start_ = "greedy"
        reason = self.ranks_.first(self._collapse(Xs, y))
        if reason is not None:
            warnings.warn(
                f"{type(self).__name__}: the fitted tree is degenerate: {reason}, even "
                "when grown greedily as CART would. The inputs may hold no split that "
                "separates the targets (constant or duplicated features, too few rows "
                "for the depth); check X, or try a smaller depth.",
                UserWarning,
                stacklevel=4,
            )

    @torch.no_grad()
    def _refit_hard_leaves(self, Xs: torch.Tensor, y: torch.Tensor) -> None:
        """One exact M-step of the constant experts on the most likely tree's partition.

        The experts are trained under soft routing, in which the points near a cut pull
        each leaf towards its neighbour's value; the hard tree predicts best with the
        values its own partition of the training points gives (leaf means, or class
        frequencies with one pseudo-count per class: :meth:`HME.expert_m_step`).
        Leaves that receive no training point keep the trained expert. Sets
        ``hard_leaf_loc_`` ``(2**D, width)``; posterior routing keeps the trained
        experts.
        """
        if self.experts != "constant":
            return
        with isolated_params():
            loc = self.model_.leaf_loc.detach().clone()
            self._rules = None
            leaf = self.guide_.tree.hard_leaf(Xs)
        onehot = torch.nn.functional.one_hot(leaf, loc.shape[0]).to(loc.dtype)
        ranks = self.ranks_
        new, mass = self.model_.expert_m_step(Xs.to(loc.dtype), y, onehot, reduce=ranks.sum)
        self.hard_leaf_loc_ = torch.where((mass > 0).unsqueeze(-1), new, loc)
        self._rules = None

    # -- routing -----------------------------------------------------------------------------
    @property
    def rules_(self) -> trees.DecisionRules:
        """The single most likely tree (thresholds in standardised units)."""
        check_is_fitted(self, "model_")
        if self._rules is None:
            with isolated_params():
                self._rules = self.guide_.tree.rules(self._leaf_labels())
        return self._rules

    def _leaf_probs(self, Xs: torch.Tensor, routing: str | None) -> torch.Tensor:
        routing = self.routing if routing is None else routing
        if routing not in _ROUTINGS:
            raise ValueError(f"routing must be one of {_ROUTINGS}, got {routing!r}")
        if routing == "hard":
            leaf = self.rules_.route(Xs)
            return torch.nn.functional.one_hot(leaf, trees.num_leaves(self.model_.depth)).to(
                Xs.dtype
            )
        gen = torch.Generator().manual_seed(0 if self.random_state is None else self.random_state)
        with isolated_params(), torch.no_grad():
            return self.guide_.tree.leaf_probs(
                Xs, num_samples=self.num_noise_samples, generator=gen
            )

    def _leaf_outputs(self, Xs: torch.Tensor, routing: str | None = None) -> torch.Tensor:
        routing = self.routing if routing is None else routing
        hard_loc = getattr(self, "hard_leaf_loc_", None)
        if routing == "hard" and hard_loc is not None:
            return hard_loc.to(Xs.dtype).expand(Xs.shape[0], -1, -1)
        with isolated_params(), torch.no_grad():
            return self.model_.leaf_outputs(Xs).detach()  # (N, 2**D, width)

    @property
    def leaf_loc_(self) -> torch.Tensor:
        """The most likely tree's leaf values, ``(2**depth, width)``, a copy on the CPU,
        in standardised units: a regressor's expert means (``width`` outputs; with
        ``experts="linear"``, the experts' intercepts, their slopes being
        ``model_.leaf_weight``), a classifier's class logits. After a fit that refit the
        hard tree's leaves, those refitted values."""
        check_is_fitted(self, "model_")
        hard_loc = getattr(self, "hard_leaf_loc_", None)
        if hard_loc is not None:
            return hard_loc.detach().to("cpu", copy=True)
        with isolated_params(), torch.no_grad():
            return self.model_.leaf_loc.detach().to("cpu", copy=True)

    def apply(self, X) -> np.ndarray:
        """Leaf index ``(N,)`` of each input under the most likely tree."""
        return self.rules_.route(self._validate_predict(X)).cpu().numpy()

    def predict_leaf_proba(self, X) -> np.ndarray:
        """The routing posterior ``q(leaf | x)`` of each input, ``(N, 2**depth)``."""
        return self._leaf_probs(self._validate_predict(X), "posterior").cpu().numpy()

    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The most likely tree as text (thresholds in the units of ``X``; after a fit
        with missing values, ``or missing`` marks the side a missing value takes).

        :param feature_names: ``L`` names of the inputs (default: the column names of a
            frame passed to ``fit``, else ``x_0``, ``x_1``, ...).
        :param int decimals: printed digits.
        """
        rules = self.rules_
        f = rules.feature.cpu()
        mean = torch.as_tensor(self.x_scaler_.mean)[f].to(rules.threshold.dtype)
        scale = torch.as_tensor(self.x_scaler_.scale)[f].to(rules.threshold.dtype)
        missing_right = None if rules.missing_right is None else rules.missing_right.cpu()
        raw = trees.DecisionRules(
            f,
            rules.threshold.cpu() * scale + mean,
            rules.greater.cpu(),
            rules.leaf_values,
            missing_right,
        )
        return raw.export_text(
            feature_names=self._feature_names(feature_names),
            decimals=decimals,
            show_missing=self._fit_missing(),
        )
