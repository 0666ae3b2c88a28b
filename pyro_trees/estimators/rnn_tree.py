"""Scikit-learn style RNN-Tree estimators: an HME with the tree-balance prior and the
RNN-Tree guide, trained by :func:`~pyro_trees.infer.fit` with
:class:`~pyro_trees.infer.HMEELBO` (:class:`~pyro_trees.infer.TreeELBO` in closed form).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.base import ClassifierMixin, RegressorMixin

from pyro_trees.estimators._constraints import Real
from pyro_trees.estimators._rng import local_seed
from pyro_trees.estimators._rnn_tree_base import _RNNTreeBase
from pyro_trees.estimators._vart_calibration import noise_factor_from_scores
from pyro_trees.infer.fit import isolated_params
from pyro_trees.validation import check_level

__all__ = ["RNNTreeClassifier", "RNNTreeRegressor"]

# the predictive intervals' noise factor is calibrated for this level on held-out rows
_CALIBRATION_LEVEL = 0.9


def _normal_quantile(p: float) -> float:
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(p, dtype=torch.float64)))


class RNNTreeRegressor(RegressorMixin, _RNNTreeBase):
    """Regression with an HME of constant (or linear) Gaussian experts, the tree-balance
    prior and the RNN-Tree guide (Antorán et al.).

    :param int depth: tree depth (``2**depth`` experts).
    :param int hidden_size: GRU width of the RNN-Tree.
    :param str feedback: ``"hard"`` (per-node GRU states; default) or ``"soft"`` (the
        paper's single roll-out with quantisation noise, eq. 14).
    :param str experts: ``"constant"`` (the paper) or ``"linear"``.
    :param str init: the start of training. ``"auto"`` (default): two starts, ``"greedy"``
        then ``"balanced"``, each trained, the held-out error picking one (a later start
        must beat an earlier one by 5 %); without a validation split, the greedy start.
        ``"greedy"``: the tree CART would grow (impurity-reducing cuts); ``"balanced"``
        (:meth:`~pyro_trees.guides.RNNTree.init_balanced`): median cuts, split dimensions
        chosen with the targets; each followed by one M-step for the experts.
        ``"random"``: no data-driven start.
    :param noise_scale: fixed observation noise, or ``None`` (default) to learn it.
    :param num_steps: most gradient steps per start; ``None`` (default): 300, or none
        when the rows are too few to hold out the validation split (fewer than 5 held
        out). ``lr``, ``lr_decay`` (total factor over the run, exponential), ``optim``
        (``"adam"``, ``"radam"``, ``"clipped_adam"``...).
    :param batch_size: minibatch size (``None``: full batch).
    :param float validation_fraction: share of the rows held out (default 0.2; used
        only if that holds out at least 5) to choose the start, the step (every
        ``eval_every`` steps, the start included) and the leaf refit by the hard tree's
        error. A data-driven start is kept unless training lowers that error by 5 %;
        a greedy start kept is then grown again on all the rows. ``0``: no held-out
        rows; the last step is kept.
    :param patience: stop after this many evaluations without improvement; ``None``
        (default): 5 with a validation split.
    :param float entropy_weight: weight of the per-point routing KL in the objective
        (:class:`~pyro_trees.infer.TreeELBO`); ``-1`` (default) is eq. 22 of Antorán et
        al., which rewards confident routing; ``1`` is the ELBO, under which vague
        routing (a tree that predicts one value) can win.
    :param str routing: ``"hard"`` (the single most likely tree, as the paper) or
        ``"posterior"`` (average over the routing posterior) for predictions.
    :param refit_leaves: give the hard tree's leaves the values its own partition of
        the training points gives them (one exact M-step of the constant experts under
        hard routing, which makes the hard tree exact on noise-free data; the trained
        experts, fitted under soft routing, are pulled towards their neighbours near
        every cut). ``True``: always, early-stopping checks included; ``False``: never
        (the paper); ``"auto"`` (default): after training, only where it lowers the
        error on the validation split (never without one). A refit kept is redone on
        all the rows. Posterior routing always uses the trained experts.
    :param random_state: seed; fits and predictions are then reproducible.
    :param device: where to fit (``"cuda"``...); default: the CPU.
    :param str dtype: ``"float32"`` (default) or ``"float64"`` computation.
    :param bool progress: show a progress bar with the loss.

    **Missing values.** ``X`` may hold NaN (``y`` may not), at fit, at prediction or both:
    each node of the RNN-Tree has, per input, the log-odds that a point missing it goes
    right (:class:`~pyro_trees.guides.RNNTree`), started by the greedy or balanced start
    (the side the greedy search found best for the missing points, else the side most
    observed points take) and trained when training values are missing; the hard tree
    sends a missing value one way (``export_text`` marks it ``or missing``), posterior
    routing both ways, and linear experts read it as its training mean.
    ``missing_fraction_`` records the share of training rows missing each feature.

    **What training adds at the defaults: mostly nothing.** With its defaults this
    estimator is, on most tables, a Bayesian CART with calibrated leaves: the tree CART
    would grow to ``depth`` (or the balanced tree, if the held-out rows prefer it), its
    leaves set by one exact M-step (leaf means under a learnt noise scale; class
    frequencies with one pseudo-count per class), and an RNN-Tree posterior around it.
    Gradient training replaces that start only if it lowers the held-out error by 5 % and
    one standard error of the held-out estimate, and stops after 5 evaluations (50 steps)
    without doing so. On the defaults panel (12 sets, 3 splits,
    ``benchmarks/results/hme_rnn_tree_start.md``) the trained tree beat its own start by
    one standard error on 1 set of 12 (Digits), and early stopping kept the start (step 0)
    on 34 of 36 fits; its predictions there are, on most sets, CART's at the same
    depth. The margin is not what holds training back: letting any lower held-out error
    win (and waiting 30 evaluations) lowers the test error on 6 sets (Wine 0.104 to
    0.052) and raises it on the other 6 (Breast cancer 0.075 to 0.103), and the exact
    ELBO (``entropy_weight=1``) beats the start on none; from CART's cuts, the steps that
    lower the soft objective move the hard tree's error by less than the held-out rows
    can resolve, in either direction.

    **Predictive.** ``predict(X, return_std=True)``, ``predict_interval`` and ``sample``
    use each row's leaf Gaussian under hard routing (a mixture over the leaves under
    posterior routing): the leaf's value and the experts' noise scale times
    ``noise_factor_``, the split-conformal factor that puts 90 % of the held-out rows
    inside the hard tree's 90 % intervals (``1`` without a validation split). The noise
    is one scale for all leaves, so on tables whose noise differs between regions the
    intervals are too wide in the quiet ones and too narrow in the noisy ones.

    After fitting, ``start_`` names the start kept, ``validation_error_`` is its
    held-out error (``None`` without a validation split) and ``collapse_`` says why
    the trained tree was degenerate on the training rows (every row in one leaf, a
    constant or non-finite prediction) and replaced by the greedy start, or is
    ``None``; a greedy start that is degenerate too raises a ``UserWarning``.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import RNNTreeRegressor
    >>> X = np.linspace(-1, 1, 40).reshape(-1, 1)
    >>> y = np.where(X[:, 0] > 0, 1.0, -1.0)
    >>> reg = RNNTreeRegressor(depth=1, hidden_size=4, num_steps=3, random_state=0)
    >>> reg = reg.fit(X, y)
    >>> reg.predict(X[:3]).shape
    (3,)
    """

    _multi_output = True
    _parameter_constraints = {
        **_RNNTreeBase._parameter_constraints,
        "noise_scale": Real(0, low_open=True, none=True),
    }

    def __init__(
        self,
        depth: int = 3,
        *,
        noise_scale: float | None = None,
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
        super().__init__(
            depth,
            hidden_size=hidden_size,
            feedback=feedback,
            experts=experts,
            init=init,
            num_steps=num_steps,
            lr=lr,
            lr_decay=lr_decay,
            optim=optim,
            batch_size=batch_size,
            validation_fraction=validation_fraction,
            patience=patience,
            eval_every=eval_every,
            routing=routing,
            num_noise_samples=num_noise_samples,
            balance_weight=balance_weight,
            entropy_weight=entropy_weight,
            refit_leaves=refit_leaves,
            random_state=random_state,
            device=device,
            dtype=dtype,
            progress=progress,
        )
        self.noise_scale = noise_scale

    def _standard_error(self, err: float, n_val: int) -> float:
        """Standard error of a held-out RMSE: about ``err / sqrt(2 n)``."""
        return err / math.sqrt(2 * max(n_val, 1))

    def _model_kwargs(self) -> dict:
        return {
            "likelihood": "gaussian",
            "num_outputs": self.n_outputs_,
            "noise_scale": self.noise_scale,
        }

    def _leaf_labels(self) -> list[str]:
        loc = self.leaf_loc_
        if self.experts == "linear":
            return [f"value: linear expert {i}" for i in range(loc.shape[0])]
        loc = self.y_scaler_.inverse(loc.double())  # the leaf values in the units of y
        return ["value: " + ", ".join(f"{v:.3f}" for v in row.tolist()) for row in loc]

    def _predict_std(self, Xs: torch.Tensor, routing=None) -> torch.Tensor:
        probs = self._leaf_probs(Xs, routing)  # (N, 2**D)
        out = self._leaf_outputs(Xs, routing)  # (N, 2**D, K)
        return (probs.unsqueeze(-1) * out).sum(-2)

    def _predictive(self, Xs: torch.Tensor, routing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance ``(N, K)`` of ``y`` (standardised): the leaves' values under
        the routing, plus the experts' noise times ``noise_factor_``."""
        probs = self._leaf_probs(Xs, routing).unsqueeze(-1)  # (N, 2**D, 1)
        out = self._leaf_outputs(Xs, routing)  # (N, 2**D, K)
        mean = (probs * out).sum(-2)
        spread = (probs * (out - mean.unsqueeze(-2)) ** 2).sum(-2)  # between the leaves
        return mean, spread + self._noise_scale(Xs.dtype) ** 2

    def _noise_scale(self, dtype) -> torch.Tensor:
        """The predictive's noise scale ``(K,)`` (standardised): the experts' noise times
        ``noise_factor_``."""
        with isolated_params():
            scale = self.model_.scale().detach().to(dtype)
        return float(getattr(self, "noise_factor_", 1.0)) * scale

    def _held_out_factor(self, X_val: torch.Tensor, y_val: torch.Tensor) -> float | None:
        """Split-conformal noise factor from the held-out rows (every rank's) at the
        ``0.9`` level: each row's least factor on the experts' noise that puts it inside
        the hard tree's Gaussian interval, :func:`noise_factor_from_scores` over them."""
        with torch.no_grad(), isolated_params():
            mean = self._predict_std(X_val, "hard")
            scale = self.model_.scale().detach().to(mean.dtype)
        z = _normal_quantile(0.5 + _CALIBRATION_LEVEL / 2)
        scores = ((y_val.reshape(mean.shape) - mean).abs() / (z * scale)).reshape(-1)
        return noise_factor_from_scores(self.ranks_.gather(scores), _CALIBRATION_LEVEL)

    def _set_noise_factor(self, factor: float | None) -> None:
        self.noise_factor_ = 1.0 if factor is None else float(factor)

    def predict(self, X, *, return_std: bool = False, routing: str | None = None):
        """Predicted mean ``(N,)`` (``(N, K)`` for multi-output), and with
        ``return_std`` the predictive standard deviation of ``y`` of the same shape.

        :param routing: ``"hard"`` or ``"posterior"``; default: the ``routing`` option.
        """
        Xs = self._validate_predict(X)
        if not return_std:
            pred = self._outputs(self._predict_std(Xs, routing))
            return pred[:, 0] if self.n_outputs_ == 1 else pred
        mean, var = self._predictive(Xs, routing)
        mean, std = self._outputs(mean), self._output_scale(var.sqrt())
        if self.n_outputs_ == 1:
            return mean[:, 0], std[:, 0]
        return mean, std

    def sample(
        self, X, num_samples: int | None = None, *, routing: str | None = None
    ) -> np.ndarray:
        """Draws of ``y`` from each row's predictive distribution, ``(num_samples, N)``
        (``(num_samples, N, K)`` for multi-output): a leaf from the routing weights,
        then its value plus the experts' noise times ``noise_factor_`` (rows drawn
        independently; seeded by ``seed_``).

        :param num_samples: draws per row (default ``None``: 100).
        """
        num_samples = 100 if num_samples is None else int(num_samples)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        Xs = self._validate_predict(X)
        probs = self._leaf_probs(Xs, routing)  # (N, 2**D)
        out = self._leaf_outputs(Xs, routing)  # (N, 2**D, K)
        scale = self._noise_scale(Xs.dtype)
        with local_seed(getattr(self, "seed_", self.random_state), self.device_):
            leaf = torch.distributions.Categorical(probs=probs).sample((num_samples,))  # (S, N)
            loc = out[torch.arange(Xs.shape[0], device=Xs.device), leaf]  # (S, N, K)
            draws = loc + scale * torch.randn_like(loc)
        draws = self._outputs(draws)
        return draws[..., 0] if self.n_outputs_ == 1 else draws

    def predict_interval(self, X, level: float = 0.9, *, routing: str | None = None):
        """Central predictive interval ``(lower, upper)`` of probability ``level``, each
        ``(N,)`` (``(N, K)`` for multi-output), in the units of ``y``.

        Under hard routing (the default ``routing``) the predictive of a row is its
        leaf's Gaussian: the leaf's value, and the experts' noise scale times
        ``noise_factor_``, which the held-out rows calibrate (split conformal at the
        ``0.9`` level; ``1`` without a validation split). Under posterior routing it is
        a mixture over the leaves; the interval then uses its mean and variance (a
        Gaussian approximation).
        """
        level = check_level(level)
        mean, std = self.predict(X, return_std=True, routing=routing)
        z = _normal_quantile(0.5 + level / 2)
        return mean - z * std, mean + z * std

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        pred = self._predict_std(X, "hard")
        sq = (pred - y.reshape(pred.shape)) ** 2
        if not self.ranks_.spread:
            return float(sq.mean().sqrt())
        sse = float(sq.reshape(y.shape[0], -1).mean(-1).sum())  # sharded: every rank's rows
        return self.ranks_.mean_error(sse, y.shape[0]) ** 0.5

    def _predict_hard(self, Xs: torch.Tensor) -> torch.Tensor:
        return self._predict_std(Xs, "hard")

    @staticmethod
    def _targets_vary(y: torch.Tensor) -> bool:
        return bool((y != y[:1]).any())

    def _constant_name(self) -> str:
        return "the same value"

    @staticmethod
    def _constant_error(y: torch.Tensor) -> float:
        """RMSE of the training mean."""
        y2 = y.reshape(y.shape[0], -1)
        return float(((y2 - y2.mean(0)) ** 2).mean().sqrt())


class RNNTreeClassifier(ClassifierMixin, _RNNTreeBase):
    """Classification with an HME of categorical experts, the tree-balance prior and the
    RNN-Tree guide (Antorán et al.). Options as :class:`RNNTreeRegressor`, without
    ``noise_scale``; ``classes_`` holds the sorted class labels. At its defaults it is,
    on most tables, a Bayesian CART with calibrated leaves (class frequencies with one
    pseudo-count per class): training kept the untrained start on 10 of 12 fits on the
    panel's four classification sets (see "What training adds" in
    :class:`RNNTreeRegressor`).

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import RNNTreeClassifier
    >>> X = np.linspace(-1, 1, 40).reshape(-1, 1)
    >>> y = (X[:, 0] > 0).astype(int)
    >>> clf = RNNTreeClassifier(depth=1, hidden_size=4, num_steps=3, random_state=0)
    >>> clf = clf.fit(X, y)
    >>> clf.predict_proba(X[:3]).shape
    (3, 2)
    """

    def _standard_error(self, err: float, n_val: int) -> float:
        """Binomial standard error of a held-out error rate (one row at least)."""
        n = max(n_val, 1)
        p = min(max(err, 1.0 / n), 1.0 - 1.0 / n)
        return math.sqrt(p * (1.0 - p) / n)

    def _model_kwargs(self) -> dict:
        return {"likelihood": "categorical", "num_classes": self.n_classes_}

    def _leaf_labels(self) -> list[str]:
        probs = self.leaf_loc_.softmax(-1)
        out = []
        for row in probs:
            k = int(row.argmax())
            out.append(f"class: {self.classes_[k]} (p = {float(row[k]):.2f})")
        return out

    def _proba(self, Xs: torch.Tensor, routing=None) -> torch.Tensor:
        probs = self._leaf_probs(Xs, routing)
        leaf_p = self._leaf_outputs(Xs, routing).softmax(-1)  # (N, 2**D, C)
        return (probs.unsqueeze(-1) * leaf_p).sum(-2)

    def predict_proba(self, X, *, routing: str | None = None) -> np.ndarray:
        """Class probabilities ``(N, n_classes)`` in the order of ``classes_``; each row
        sums to one in float64 (renormalised after the cast from the fit's dtype, as
        scikit-learn's metrics check)."""
        proba = self._proba(self._validate_predict(X), routing).to("cpu", torch.float64)
        return (proba / proba.sum(-1, keepdim=True)).numpy()

    def predict(self, X, *, routing: str | None = None) -> np.ndarray:
        """Predicted class labels ``(N,)``."""
        proba = self.predict_proba(X, routing=routing)
        return self.classes_[proba.argmax(-1)]

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        pred = self._proba(X, "hard").argmax(-1)
        if not self.ranks_.spread:
            return float((pred != y).to(torch.float64).mean())
        return self.ranks_.mean_error(float((pred != y).sum()), y.shape[0])

    def _predict_hard(self, Xs: torch.Tensor) -> torch.Tensor:
        proba = self._proba(Xs, "hard")
        if not torch.isfinite(proba).all():
            return proba
        return proba.argmax(-1)

    @staticmethod
    def _targets_vary(y: torch.Tensor) -> bool:
        return True  # fit() requires two classes

    def _constant_name(self) -> str:
        return "a single class"

    def _constant_error(self, y: torch.Tensor) -> float:
        """Error of the majority class."""
        counts = torch.bincount(y.long(), minlength=self.n_classes_)
        return 1.0 - float(counts.max()) / y.shape[0]
