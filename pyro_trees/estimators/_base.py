"""Scikit-learn style base class shared by the estimators (no scikit-learn needed)."""

from __future__ import annotations

import inspect

import numpy as np
import torch

__all__ = ["TreeEstimatorMixin"]


class TreeEstimatorMixin:
    """``get_params``/``set_params`` from the constructor signature, a ``repr``, and
    ``score`` (accuracy for classifiers, R^2 for regressors) as scikit-learn defines them.

    Subclasses store every constructor argument unchanged under its own name and set
    fitted attributes with a trailing underscore.
    """

    _estimator_type = "regressor"

    @classmethod
    def _defaults(cls) -> dict:
        """Constructor parameters and their defaults, following ``**kwargs`` up the MRO."""
        out: dict = {}
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                    out.setdefault(p.name, p.default)
        return out

    def _check_early_stopping_options(self) -> None:
        """``validation_fraction`` in ``[0, 1)``; ``patience`` only with a validation split."""
        frac = self.validation_fraction
        if not (isinstance(frac, int | float) and 0.0 <= frac < 1.0):
            raise ValueError(f"validation_fraction must lie in [0, 1), got {frac!r}")
        if self.patience is not None and frac == 0:
            raise ValueError("patience needs a validation split: set validation_fraction > 0")

    def _held_out_split(self, n: int):
        """Indices ``(held_out, train)`` of ``n`` points: ``max(1, round(fraction * n))``
        held out, drawn by ``numpy.random.default_rng(random_state)``; ``None`` when
        ``validation_fraction`` is 0."""
        if self.validation_fraction == 0:
            return None
        perm = np.random.default_rng(self.random_state).permutation(n)
        n_val = max(1, int(round(self.validation_fraction * n)))
        return perm[:n_val], perm[n_val:]

    @classmethod
    def _param_names(cls) -> list[str]:
        return list(cls._defaults())

    def get_params(self, deep: bool = True) -> dict:
        return {name: getattr(self, name) for name in self._param_names()}

    def set_params(self, **params):
        valid = self._param_names()
        for key, value in params.items():
            if key not in valid:
                raise ValueError(
                    f"invalid parameter {key!r} for {type(self).__name__}; valid: {valid}"
                )
            setattr(self, key, value)
        return self

    def __repr__(self) -> str:
        changed = []
        for name, default in self._defaults().items():
            value = getattr(self, name)
            if value is not default and not (
                isinstance(value, int | float | str | type(None)) and value == default
            ):
                changed.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(changed)})"

    @staticmethod
    def _check_score_targets(y) -> np.ndarray:
        """``y`` as a 1-D or 2-D array, numeric values finite."""
        if isinstance(y, torch.Tensor):
            y = y.detach().cpu().numpy()
        y = np.asarray(y)
        if y.ndim not in (1, 2):
            raise ValueError(f"y must be 1-D (n_samples,) or 2-D; got shape {y.shape}")
        if y.shape[0] == 0:
            raise ValueError("y has no rows")
        if np.issubdtype(y.dtype, np.number) and not np.isfinite(y).all():
            n_nan = int(np.isnan(y).sum())
            n_inf = int((~np.isfinite(y)).sum()) - n_nan
            raise ValueError(
                f"y contains {n_nan} NaN and {n_inf} infinite values; score needs finite targets"
            )
        return y

    def _check_is_fitted(self) -> None:
        if not getattr(self, "is_fitted_", False):
            raise ValueError(f"this {type(self).__name__} is not fitted yet; call fit first")

    def score(self, X, y) -> float:
        """Accuracy (classifiers) or the coefficient of determination R^2 (regressors).

        :param X: ``(N, L)`` inputs, as for ``predict``.
        :param y: ``(N,)`` targets (``(N, K)`` for a multi-output regressor; a column
            ``(N, 1)`` is taken as ``(N,)``).
        :raises ValueError: naming the cause: ``y`` not an array of one value per row
            of ``X``, of the wrong shape, or (numeric) holding NaN or infinite values.
        """
        y = self._check_score_targets(y)
        pred = np.asarray(self.predict(X))
        if y.shape[0] != pred.shape[0]:
            raise ValueError(
                f"X and y have mismatched lengths: X has {pred.shape[0]} rows, y has {y.shape[0]}"
            )
        if y.ndim == 2 and y.shape[1] == 1 and pred.ndim == 1:
            y = y[:, 0]
        if y.shape != pred.shape:
            want = "(n_samples,)" if pred.ndim == 1 else f"(n_samples, {pred.shape[1]})"
            raise ValueError(f"y must have shape {want} like the predictions; got {y.shape}")
        if self._estimator_type == "classifier":
            return float(np.mean(pred == y))
        ss_res = float(np.sum((y - pred) ** 2))
        ss_tot = float(np.sum((y - y.mean(axis=0)) ** 2))
        return 1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0
