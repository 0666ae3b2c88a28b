"""Scikit-learn style heteroscedastic GP regression with an RNN-Tree noise model.

Wraps :class:`~pyro_trees.models.HeteroscedasticGP` and
:class:`~pyro_trees.guides.HeteroscedasticGPGuide`, trained by :func:`~pyro_trees.infer.fit`:
the exact GP or the sparse one (inducing points, Titsias' bound), both with
:class:`~pyro_trees.infer.CollapsedELBO` (chosen by the number of rows unless
``num_inducing`` says), or the sparse model with :class:`~pyro_trees.infer.TreeELBO` and
minibatches (``batch_size``).
Inputs and targets are standardised internally; predictions, noise levels and rules
are in the original units.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.base import RegressorMixin
from sklearn.utils.validation import check_is_fitted

from pyro_trees import trees
from pyro_trees.estimators._constraints import (
    EARLY_STOPPING,
    SEED_AND_DEVICE,
    Checked,
    Integer,
    OneOf,
    Real,
)
from pyro_trees.estimators._rng import local_seed
from pyro_trees.estimators._template import SVIEstimator, run_svi
from pyro_trees.guides.heteroscedastic_gp import HeteroscedasticGPGuide
from pyro_trees.infer.collapsed_elbo import CollapsedELBO
from pyro_trees.infer.compiled import should_compile
from pyro_trees.infer.fit import EarlyStopping, isolated_params
from pyro_trees.infer.tree_elbo import TreeELBO
from pyro_trees.models.heteroscedastic_gp import HeteroscedasticGP
from pyro_trees.validation import check_level, resolve_dtype

__all__ = ["HeteroscedasticGPRegressor"]

_ROUTINGS = ("hard", "posterior")
# num_inducing=None: the exact GP up to this many training rows, else the sparse one
# (the exact GP was the more accurate wherever it was tried up to 2,000 rows; with the
# closed-form gradient of its evidence a fit of 1,500 rows takes a few seconds)
_EXACT_MAX_ROWS = 1500
# num_inducing=None above _EXACT_MAX_ROWS: this many inducing points
_AUTO_INDUCING = 256
# training stops once the loss fell by less than _PLATEAU_TOL nats per point over
# _PLATEAU_WINDOW steps (without a validation split)
_PLATEAU_WINDOW = 20
_PLATEAU_TOL = 1e-3
# new inputs are clipped to the training range widened by this many times its width on
# each side (standardised units): far enough out that a stationary kernel is ~0 there
# for any lengthscale up to a few widths, near enough that squared distances cannot
# overflow (in float32 too)
_CLIP_MARGIN = 10.0


class HeteroscedasticGPRegressor(RegressorMixin, SVIEstimator):
    """GP regression whose input-dependent noise is an RNN-Tree (Antorán et al., Sec. 5.2).

    :param int depth: depth of the noise tree (``2**depth`` noise levels).
    :param num_inducing: ``None`` (default, automatic): the exact GP for at most 1,500
        training rows, else the sparse model with ``min(N, 256)`` inducing points;
        ``0``: the exact GP (collapsed bound, ``O(N^3)`` per step); an integer ``M``: the
        sparse model with ``M`` inducing points (``O(N M^2)`` per step; started at ``M``
        random rows, at quantiles for one feature; learnt), trained by the collapsed
        bound with the optimal ``q(u)`` (or, with ``batch_size``, by ``TreeELBO`` on
        minibatches with a learnt ``q(u)``).
    :param int num_steps: optimisation steps at most; without a validation split the
        training stops earlier once the loss fell by less than ``0.001 * N`` nats over
        20 steps.
    :param float lr: learning rate of the GP and the noise levels.
    :param float tree_lr: learning rate of the RNN-Tree.
    :param batch_size: minibatch size (sparse model only; ``None``: full batch).
    :param int init_steps: steps of the homoscedastic GP fit used for the balanced start.
    :param int hidden_size: GRU width of the RNN-Tree.
    :param str routing: default noise at prediction: ``"hard"`` (most likely tree) or
        ``"posterior"`` (mixture over the routing posterior).
    :param float balance_weight: weight of the tree-balance coupling.
    :param float entropy_weight: weight of the per-point routing KL (1: the bound).
    :param float validation_fraction: share of the points held out (drawn with
        ``random_state``) for early stopping on their mean negative log predictive
        density under the default ``routing``; 0 (default) trains on every point.
    :param patience: evaluations without improvement before stopping (``None``: run
        every step, keeping the best state seen); needs ``validation_fraction > 0``.
    :param int eval_every: steps between evaluations on the held-out points.
    :param random_state: seed of the fit and of :meth:`sample`.
    :param dtype: ``"float64"`` (default; exact GPs need it) or ``"float32"`` (or the
        ``torch.dtype``).
    :param device: torch device of the fit (default: the CPU).
    :param bool progress: show a progress bar with the loss.

    Inputs and targets are standardised inside; predictions, noise levels, intervals
    and rules are in the units of ``X`` and ``y``.

    Each row's prediction does not depend on the other rows of the batch (up to the
    last bits of the matrix products). New inputs are clipped, feature by feature, to
    the training range widened by 10 times its width on each side, so that the
    predictions are finite for inputs of any finite magnitude: a row that far out has
    a kernel of about 0 to every training row under a stationary kernel and gets
    about the prior (the constant mean and the prior variance of ``f``) plus its
    leaf's noise.

    Fitted attributes: ``num_inducing_`` (inducing points used; 0 for the exact GP),
    ``x_min_`` and ``x_max_`` (the standardised training range, ``(L,)`` each),
    ``fit_result_`` (the :class:`~pyro_trees.infer.FitResult`), ``model_``, ``guide_``.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import HeteroscedasticGPRegressor
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1)
    >>> y = np.sin(3 * X[:, 0])
    >>> reg = HeteroscedasticGPRegressor(depth=1, num_steps=2, init_steps=2, random_state=0)
    >>> reg = reg.fit(X, y)
    >>> mean, std = reg.predict(X[:3], return_std=True)
    >>> mean.shape, std.shape
    ((3,), (3,))
    """

    def __init__(
        self,
        depth: int = 2,
        *,
        num_inducing: int | None = None,
        num_steps: int = 50,
        lr: float = 0.05,
        tree_lr: float = 0.0125,
        batch_size: int | None = None,
        init_steps: int = 60,
        hidden_size: int = 16,
        routing: str = "hard",
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        validation_fraction: float = 0.0,
        patience: int | None = None,
        eval_every: int = 20,
        random_state: int | None = None,
        dtype: str = "float64",
        device=None,
        progress: bool = False,
    ):
        self.depth = depth
        self.num_inducing = num_inducing
        self.num_steps = num_steps
        self.lr = lr
        self.tree_lr = tree_lr
        self.batch_size = batch_size
        self.init_steps = init_steps
        self.hidden_size = hidden_size
        self.routing = routing
        self.balance_weight = balance_weight
        self.entropy_weight = entropy_weight
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.random_state = random_state
        self.dtype = dtype
        self.device = device
        self.progress = progress

    _parameter_constraints = {
        **SEED_AND_DEVICE,
        **EARLY_STOPPING,
        "depth": Integer(1),
        "num_inducing": Integer(0, none=True),
        "num_steps": Integer(0),
        "lr": Real(0, low_open=True),
        "tree_lr": Real(0, low_open=True),
        "batch_size": Integer(1, none=True),
        "init_steps": Integer(0),
        "hidden_size": Integer(1),
        "routing": OneOf(*_ROUTINGS),
        "balance_weight": Real(),
        "entropy_weight": Real(),
        "dtype": Checked(resolve_dtype),
    }

    # -- checks ------------------------------------------------------------------------------
    def _check_params_together(self, sharded: bool) -> None:
        if self.batch_size is not None and self.num_inducing == 0:
            raise ValueError("batch_size needs the sparse model: num_inducing=0 is exact")
        self._check_early_stopping_options()
        if sharded:
            raise ValueError(
                "HeteroscedasticGPRegressor does not train on sharded rows; pass every "
                "row on every rank (sharded=False) with num_inducing and batch_size set"
            )

    def _num_inducing(self, n: int) -> int:
        """Inducing points for ``n`` training rows (0: the exact GP); see ``num_inducing``."""
        if self.num_inducing is not None:
            return min(self.num_inducing, n)
        if n <= _EXACT_MAX_ROWS and self.batch_size is None:
            return 0
        return min(n, _AUTO_INDUCING)

    def _check_parallel(self, n: int) -> None:
        """Under ``torchrun``: only the sparse minibatch model is data-parallel."""
        if self.ranks_.size == 1:
            return
        if self._num_inducing(n) == 0 or self.batch_size is None:
            raise ValueError(
                f"HeteroscedasticGPRegressor under torchrun ({self.ranks_.size} processes): "
                "the exact GP and the collapsed sparse bound need every row at every step "
                "and cannot be trained data-parallel; use its sparse form on minibatches, "
                "e.g. HeteroscedasticGPRegressor(num_inducing=256, batch_size=256)"
            )

    # -- the fit template's hooks ---------------------------------------------------------
    def _before_fits(self, Xs: torch.Tensor, ys: torch.Tensor, split) -> None:
        """Under ``torchrun`` only the sparse model trained on minibatches is
        data-parallel (``num_inducing=M`` and ``batch_size``, every rank passing the same
        rows; the start is computed on every rank from the same rows). Sets the range
        that new inputs are clipped to (:meth:`_clip`)."""
        self._check_parallel(Xs.shape[0])
        self.x_min_, self.x_max_ = Xs.min(0).values, Xs.max(0).values

    def _fit_one(self, j: int, Xs: torch.Tensor, ys: torch.Tensor, split, generator) -> None:
        """The GP and its RNN-Tree noise model: started from a homoscedastic fit, trained
        by the collapsed bound (or ``TreeELBO`` on minibatches), early-stopped on the
        held-out negative log predictive density, else stopped on a plateau."""
        dtype = self.dtype_
        n, n_features = Xs.shape
        depth = trees.check_depth(self.depth, num_points=n, dtype=dtype)
        X_val = y_val = None
        if split.n_val:
            val, train = split.fold(0)
            if len(train) < 2:
                raise ValueError(
                    f"validation_fraction={self.validation_fraction} leaves {len(train)} "
                    "training points; need at least 2"
                )
            X_val, y_val = Xs[val], ys[val]
            Xs, ys = Xs[train], ys[train]
            n = Xs.shape[0]
        z = None
        num_inducing = self._num_inducing(n)
        self.num_inducing_ = num_inducing
        if num_inducing:
            z = _inducing_inputs(Xs, num_inducing)
        model = HeteroscedasticGP(n_features, depth, inducing_points=z).to(Xs.device, dtype)
        guide = HeteroscedasticGPGuide(
            n_features,
            depth,
            num_inducing=0 if z is None else z.shape[0],
            hidden_size=self.hidden_size,
        ).to(Xs.device, dtype)
        with isolated_params():
            model.init_from_data(Xs, ys, guide, num_steps=self.init_steps)
        tree_ids = {id(p) for p in guide.tree.parameters()}

        def optimizer(params):
            params = list(params)
            groups = [
                {"params": [p for p in params if id(p) in tree_ids], "lr": self.tree_lr},
                {"params": [p for p in params if id(p) not in tree_ids], "lr": self.lr},
            ]
            return torch.optim.Adam([g for g in groups if g["params"]])

        collapsed = z is None or self.batch_size is None
        weights = {"balance_weight": self.balance_weight, "entropy_weight": self.entropy_weight}
        if collapsed:  # compiled where it pays (should_compile: never at the defaults)
            compile = should_compile(Xs.device, self.num_steps)
            loss = CollapsedELBO(**weights, compile=compile)
        else:
            loss = TreeELBO(**weights)
        val_metric = None
        if X_val is not None:
            X_cond, y_cond = (Xs, ys) if z is None else (None, None)

            def val_metric():
                with torch.no_grad():
                    if z is not None and collapsed:
                        model.set_optimal_inducing_posterior(Xs, ys, guide)
                    pred = model.predict(X_val, guide, X_cond, y_cond, routing=self.routing)
                    return -float(pred.log_prob(y_val).mean())

        callback = None
        if X_val is None:
            callback = _plateau(n)
        self.fit_result_ = run_svi(
            self.ranks_,
            model,
            guide,
            Xs,
            ys,
            batch=None if collapsed else self.batch_size,  # under torchrun: per rank
            loss=loss,
            num_steps=self.num_steps,
            optim=optimizer,
            early_stopping=None
            if val_metric is None
            else EarlyStopping(val_metric, eval_every=self.eval_every, patience=self.patience),
            progress=self.progress and "HeteroscedasticGP",
            callback=callback,
        )
        if z is not None and collapsed:
            with isolated_params():
                model.set_optimal_inducing_posterior(Xs, ys, guide)
        self.model_, self.guide_ = model, guide
        self._X_train, self._y_train = (Xs, ys) if z is None else (None, None)

    # -- prediction ----------------------------------------------------------------------------
    def _predict(self, X, routing):
        routing = self.routing if routing is None else routing
        if routing not in _ROUTINGS:
            raise ValueError(f"routing must be one of {_ROUTINGS}, got {routing!r}")
        Xs = self._clip(self._validate_predict(X))
        with isolated_params():
            return self.model_.predict(
                Xs, self.guide_, self._X_train, self._y_train, routing=routing
            )

    def _clip(self, Xs: torch.Tensor) -> torch.Tensor:
        """Standardised new inputs ``(N, L)`` clipped to the training range widened by
        ``_CLIP_MARGIN`` times its width on each side (infinities from the conversion to
        ``dtype`` included); estimators pickled without the range are left as they are."""
        lo, hi = getattr(self, "x_min_", None), getattr(self, "x_max_", None)
        if lo is None or hi is None:
            return Xs
        pad = _CLIP_MARGIN * (hi - lo)
        return torch.minimum(torch.maximum(Xs, lo - pad), hi + pad)

    def predict(self, X, *, return_std: bool = False, routing: str | None = None):
        """Predictive mean ``(N,)`` (and the standard deviation of ``y`` with ``return_std``).

        :param routing: ``"hard"`` or ``"posterior"``; default: the ``routing`` option.
        """
        pred = self._predict(X, routing)
        mean = self._outputs(pred.mean)
        if return_std:
            return mean, self._output_scale(pred.variance.sqrt())
        return mean

    def predict_noise(self, X, *, routing: str | None = None) -> np.ndarray:
        """The noise level ``log sigma(x)`` ``(N,)`` in the units of ``y``."""
        log_sigma = self._predict(X, routing).log_sigma.to("cpu", torch.float64).numpy()
        return log_sigma + math.log(float(self.y_scaler_.scale))

    def predict_interval(self, X, level: float = 0.9, *, routing: str | None = None):
        """Gaussian predictive interval ``(lower, upper)``, each ``(N,)``.

        With ``routing="posterior"`` the predictive is a mixture; the interval then uses
        its mean and variance (a Gaussian approximation).
        """
        level = check_level(level)
        mean, std = self.predict(X, return_std=True, routing=routing)
        zq = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + level / 2)))
        return mean - zq * std, mean + zq * std

    def sample(
        self, X, num_samples: int | None = None, *, routing: str | None = None
    ) -> np.ndarray:
        """Draws of ``y`` from each row's predictive distribution, ``(num_samples, N)``:
        a leaf from the routing weights, then ``f + noise`` from that leaf's Gaussian
        (rows drawn independently; seeded by ``random_state``).

        :param num_samples: draws per row (default ``None``: 100).
        """
        num_samples = 100 if num_samples is None else int(num_samples)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        pred = self._predict(X, routing)
        with local_seed(self.random_state, self.device_):
            leaf = torch.distributions.Categorical(probs=pred.leaf_probs).sample((num_samples,))
            var = pred.f_var + torch.exp(2 * pred.leaf_log_scale)[leaf]  # (S, N)
            draws = pred.mean + var.sqrt() * torch.randn_like(var)
        return self._outputs(draws)

    def log_likelihood(self, X, y, *, routing: str | None = None) -> float:
        """Mean log predictive density per point of ``y`` (units of ``y``)."""
        pred = self._predict(X, routing)
        ys = self._scaled_targets(y, pred.mean.shape[0])
        return float(pred.log_prob(ys).mean()) - math.log(float(self.y_scaler_.scale))

    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The noise function as rules in the units of ``X`` and ``y``.

        :param feature_names: ``L`` names of the inputs (default: the column names of a
            frame passed to ``fit``, else ``x_0``, ``x_1``, ...).
        :param int decimals: printed digits.
        """
        check_is_fitted(self, "model_")
        with isolated_params():
            rules = self.model_.noise_rules(self.guide_)
        f = rules.feature
        mean = torch.as_tensor(self.x_scaler_.mean)[f.cpu()].to(rules.threshold.dtype)
        scale = torch.as_tensor(self.x_scaler_.scale)[f.cpu()].to(rules.threshold.dtype)
        shift = math.log(float(self.y_scaler_.scale))
        labels = [
            f"log sigma = {v + shift:.{decimals}f} (sigma = {math.exp(v + shift):.{decimals}g})"
            for v in self.model_.leaf_log_scale.detach().tolist()
        ]
        raw = trees.DecisionRules(
            f.cpu(), rules.threshold.cpu() * scale + mean, rules.greater.cpu(), labels
        )
        return raw.export_text(feature_names=self._feature_names(feature_names), decimals=decimals)


def _plateau(n: int, window: int = _PLATEAU_WINDOW, tol: float = _PLATEAU_TOL):
    """A :func:`~pyro_trees.infer.fit` callback that stops once the loss fell by less
    than ``tol * n`` nats over the last ``window`` steps (and ``2 * window`` were run)."""
    losses = []

    def callback(step, loss):
        losses.append(loss)
        t = len(losses)
        return t >= 2 * window and losses[t - 1 - window] - losses[t - 1] < tol * n

    return callback


def _inducing_inputs(X: torch.Tensor, m: int) -> torch.Tensor:
    """``m`` starting inducing inputs ``(m, L)`` from the rows of ``X`` ``(N, L)``.

    One feature: evenly spaced quantiles. Several: ``m`` distinct rows drawn at random
    (torch's global generator, seeded by ``fit``).
    """
    n = X.shape[0]
    m = min(m, n)
    if X.shape[1] == 1:
        idx = torch.linspace(0, n - 1, m).round().long()
        return X[X[:, 0].argsort()[idx]].clone()
    return X[torch.randperm(n)[:m]].clone()
