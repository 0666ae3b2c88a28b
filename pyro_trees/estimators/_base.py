"""The contract every estimator shares: scikit-learn's estimator API, one input check
and one scaler.

Every estimator derives from :class:`TabularEstimator` (a
:class:`sklearn.base.BaseEstimator`) together with scikit-learn's
:class:`~sklearn.base.RegressorMixin` or :class:`~sklearn.base.ClassifierMixin`, so
``clone``, ``get_params``/``set_params``, ``Pipeline``, ``GridSearchCV``,
``cross_val_score`` and ``check_estimator`` treat it as any scikit-learn estimator.

``fit`` passes ``X`` and ``y`` through :meth:`TabularEstimator._validate_fit`, which

* checks them with :func:`sklearn.utils.validation.validate_data` (2-D numeric ``X``,
  NumPy arrays, lists or pandas frames with numeric or bool columns, no infinity, no
  NaN unless the estimator routes missing values itself (``_allow_nan``; the error
  of one that does not names the imputer pipeline), no NaN in ``y``, no sparse
  matrices, at least two rows; ``feature_names_in_`` and
  ``n_features_in_``; ``y`` of shape ``(n, 1)`` taken as ``(n,)`` with a
  :class:`~sklearn.exceptions.DataConversionWarning`),
* encodes class labels (any hashable labels; ``classes_`` sorted) for classifiers,
  and refuses a single class or a continuous target,
* standardises ``X`` (and ``y`` for regressors) with one :class:`Standardizer`, in
  float64 so that values around ``1e12`` keep their precision, and returns tensors in
  the estimator's ``dtype`` on its ``device``.

Every ``fit`` is guarded (:func:`~pyro_trees.estimators._fit_guard.guarded_fit`,
applied to each subclass's ``fit``): it holds :func:`~pyro_trees.infer.exclusive` (fits
and seeded draws from several threads run one at a time), takes Ctrl-C only between
training steps (:func:`~pyro_trees.infer.deferred_interrupts`) and, when it does not
finish (Ctrl-C or any error), leaves the estimator unfitted: every attribute it learnt is
removed, so ``predict`` raises :class:`~sklearn.exceptions.NotFittedError` rather than
answering from half a fit.

``predict`` and friends pass ``X`` through :meth:`TabularEstimator._validate_predict`,
which raises :class:`~sklearn.exceptions.NotFittedError` before ``fit`` and a
``ValueError`` for a wrong number of features, and warns, as scikit-learn does, when
feature names differ from those seen in ``fit``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from sklearn.base import BaseEstimator, is_classifier
from sklearn.preprocessing import LabelEncoder
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_trees.estimators._distributed import Ranks
from pyro_trees.estimators._fit_guard import guarded_fit
from pyro_trees.validation import resolve_device, resolve_dtype

__all__ = ["Standardizer", "TabularEstimator"]


class Standardizer:
    """Centre and scale each column to unit standard deviation (float64).

    A column with no spread (or a single row) keeps scale 1, so it maps to zero and
    back exactly.

    :param numpy.ndarray values: ``(N, K)`` or ``(N,)`` values to learn the shift and
        scale from.
    :param ranks: a :class:`~pyro_trees.estimators._distributed.Ranks` whose ranks hold
        different rows (``sharded=True`` under ``torchrun``): the mean and scale are those
        of all ranks' rows together (all-reduced), the same on every rank.
    """

    def __init__(self, values: np.ndarray, ranks=None):
        values = np.asarray(values, dtype=np.float64)
        if np.isnan(values).any():  # missing values: the moments of the observed ones
            if ranks is not None and ranks.spread:
                raise ValueError("missing values (NaN) are not supported with sharded=True")
            self._nan_moments(values)
            return
        if ranks is not None and ranks.spread:
            _, self.mean, std = ranks.moments(values)
        else:
            self.mean = values.mean(axis=0)
            std = values.std(axis=0, ddof=1) if values.shape[0] > 1 else np.zeros_like(self.mean)
        # a spread below 1e-12 of the column's magnitude is rounding, not signal
        tiny = np.abs(std) <= 1e-12 * np.maximum(np.abs(self.mean), 1.0)
        self.scale = np.where(tiny, 1.0, std)

    def _nan_moments(self, values: np.ndarray) -> None:
        """The mean and scale of each column's observed values (NaN left out); a column
        with no observed value gets mean 0 and scale 1, one with a single value scale 1."""
        observed = ~np.isnan(values)
        count = observed.sum(axis=0)
        filled = np.where(observed, values, 0.0)
        self.mean = filled.sum(axis=0) / np.maximum(count, 1)
        dev = np.where(observed, values - self.mean, 0.0)
        std = np.sqrt((dev * dev).sum(axis=0) / np.maximum(count - 1, 1))
        std = np.where(count > 1, std, 0.0)
        tiny = np.abs(std) <= 1e-12 * np.maximum(np.abs(self.mean), 1.0)
        self.scale = np.where(tiny, 1.0, std)

    def transform(self, values: np.ndarray) -> np.ndarray:
        """``(values - mean) / scale``, same shape (NaN stays NaN)."""
        return (np.asarray(values, dtype=np.float64) - self.mean) / self.scale

    def inverse(self, values):
        """``values * scale + mean`` (a NumPy array or a tensor, same shape)."""
        if isinstance(values, torch.Tensor):
            scale = torch.as_tensor(self.scale, dtype=values.dtype, device=values.device)
            mean = torch.as_tensor(self.mean, dtype=values.dtype, device=values.device)
            return values * scale + mean
        return np.asarray(values, dtype=np.float64) * self.scale + self.mean

    def inverse_scale(self, values):
        """``values * scale``: standard deviations and widths back to the data's units."""
        if isinstance(values, torch.Tensor):
            return values * torch.as_tensor(self.scale, dtype=values.dtype, device=values.device)
        return np.asarray(values, dtype=np.float64) * self.scale


#: parameters renamed in version 0.2.0 (one name per idea: the vocabulary of
#: ``docs/guide/estimators.rst``), by their names in version 0.1.0
RENAMED_IN_0_2 = {
    "n_fits": "num_fits",
    "n_trees": "num_trees",
    "n_restarts": "num_restarts",
    "n_iter": "num_cycles",
    "calibrate_noise": "calibrate",
    "lam": "kl_weight",
}


def renamed_state(state: dict) -> dict:
    """The pickled ``state`` of an estimator of version 0.1.0 under today's parameter
    names (:data:`RENAMED_IN_0_2`); today's state is returned as it is."""
    return {RENAMED_IN_0_2.get(k, k): v for k, v in state.items()}


class TabularEstimator(BaseEstimator):
    """Base of every pyro_trees estimator: validation, scaling and conversion to torch.

    Subclasses list every constructor argument explicitly (no ``**kwargs``), store each
    unchanged under its own name, set fitted attributes with a trailing underscore, and
    call :meth:`_validate_fit` at the top of ``fit`` and :meth:`_validate_predict` at
    the top of every method that reads new inputs. They have ``device``,
    ``random_state`` and ``progress`` parameters, and ``dtype`` unless they compute in one
    precision (the Bayesian HME's closed-form updates need ``float64``).
    """

    #: regressors: whether ``y`` may have several columns ``(N, K)``
    _multi_output = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "fit" in cls.__dict__:  # every family's fit finishes or leaves it unfitted
            cls.fit = guarded_fit(cls.__dict__["fit"])

    #: parameters added after this class's estimators were first pickled, with the values
    #: that give the behaviour an older pickle was fitted with
    _pickled_defaults: dict = {}

    def __setstate__(self, state):
        super().__setstate__({**self._pickled_defaults, **renamed_state(state)})

    #: the computation dtype of an estimator without a ``dtype`` parameter
    _default_dtype = "float32"

    #: whether ``X`` may hold missing values (NaN), routed by the estimator itself
    _allow_nan = False

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = self._allow_nan
        if tags.target_tags is not None:
            tags.target_tags.multi_output = self._multi_output
            tags.target_tags.single_output = True
        return tags

    # -- options ----------------------------------------------------------------------
    def _torch_options(self) -> tuple[torch.dtype, torch.device]:
        """The resolved ``dtype`` and ``device`` options (checked, with clear errors)."""
        dtype = resolve_dtype(getattr(self, "dtype", self._default_dtype))
        device = resolve_device(getattr(self, "device", None))
        return dtype, device

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        """``values`` as a tensor in the fitted ``dtype_`` on the fitted ``device_``."""
        arr = np.ascontiguousarray(values)
        if arr.dtype.kind == "f":
            return torch.as_tensor(arr, dtype=self.dtype_, device=self.device_)
        return torch.as_tensor(arr, device=self.device_)

    def _check_early_stopping_options(self) -> None:
        """``patience`` only with a validation split (``validation_fraction > 0``)."""
        if self.patience is not None and self.validation_fraction == 0:
            raise ValueError("patience needs a validation split: set validation_fraction > 0")

    # -- fit ----------------------------------------------------------------------------
    def _validate_fit(self, X, y, *, min_samples: int = 2, sharded: bool = False):
        """Check and standardise the training data; set the fitted input attributes.

        Under ``torchrun`` with ``sharded=True`` each rank passes its own rows: the
        scalers, the classes and ``n_global_rows_`` are those of all ranks' rows together
        (see :mod:`~pyro_trees.estimators._distributed`). Sets ``ranks_`` (the processes
        of the fit), ``n_global_rows_``, ``n_features_in_`` (and ``feature_names_in_``
        for frames with string column names), ``dtype_``, ``device_`` and ``x_scaler_``
        (and ``missing_fraction_`` ``(L,)`` where ``X`` may hold NaN);
        for classifiers ``classes_`` and ``n_classes_``; for regressors ``y_scaler_``
        and ``n_outputs_``.

        :returns: ``(X, y)`` tensors: ``X`` ``(N, L)`` standardised, in ``dtype_`` on
            ``device_``; ``y`` ``(N,)`` class indices (long) for classifiers, else
            standardised targets ``(N,)`` (``(N, K)`` for multi-output regressors).
        :raises ValueError: naming the argument and the cause (NaN or infinity, too
            few rows, a single class, a constant target, non-numeric values...).
        """
        self.dtype_, self.device_ = self._torch_options()
        self.ranks_ = ranks = Ranks(sharded, self.device_)
        classifier = is_classifier(self)
        with self._nan_advice():
            X, y = validate_data(
                self,
                X,
                y,
                reset=True,
                dtype=np.float64,
                ensure_min_samples=min_samples,
                multi_output=self._multi_output and not classifier,
                y_numeric=not classifier,
                ensure_all_finite="allow-nan" if self._allow_nan else True,
            )
        ranks.check_data(X, y)
        if self._allow_nan:  # the share of the rows missing each feature
            self.missing_fraction_ = np.isnan(X).mean(0)
        self.n_global_rows_ = ranks.count(X.shape[0])
        self.x_scaler_ = Standardizer(X, ranks)
        Xs = self._tensor(self.x_scaler_.transform(X))
        if classifier:
            check_classification_targets(y)
            labels = np.unique(y)
            if ranks.spread:  # the classes of every shard
                labels = np.unique(np.concatenate(ranks.gather_object(labels)))
            encoder = LabelEncoder().fit(labels)
            self.classes_ = encoder.classes_
            self.n_classes_ = len(self.classes_)
            if self.n_classes_ < 2:
                raise ValueError(
                    f"y has a single class ({self.classes_[0]!r}); a classifier needs "
                    "at least 2 classes"
                )
            return Xs, torch.as_tensor(encoder.transform(y), device=self.device_)
        y = np.asarray(y, dtype=np.float64)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        self.n_outputs_ = 1 if y.ndim == 1 else y.shape[1]
        if not ranks.max(float(not np.all(y == y[:1]))):
            raise ValueError(
                f"y is constant (every target equals {np.ravel(y[:1])[0]!r}); "
                "a regressor needs targets that vary"
            )
        self.y_scaler_ = Standardizer(y, ranks)
        return Xs, self._tensor(self.y_scaler_.transform(y))

    #: the fitted attributes :meth:`_validate_fit` sets (those a regressor has)
    _INPUT_ATTRS = (
        "dtype_",
        "device_",
        "x_scaler_",
        "y_scaler_",
        "n_features_in_",
        "n_outputs_",
        "ranks_",
        "n_global_rows_",
    )

    def _share_inputs(self, other: TabularEstimator) -> None:
        """Give ``other`` this estimator's fitted input handling (scalers, dtype,
        device, widths), so that it reads the same standardised data."""
        for name in self._INPUT_ATTRS:
            setattr(other, name, getattr(self, name))

    def _scaled_targets(self, y, n_rows: int) -> torch.Tensor:
        """New regression targets ``(n_rows,)`` checked and standardised like the
        training targets, as a tensor in ``dtype_`` on ``device_``.

        :raises ValueError: a length other than ``n_rows``, NaN or infinite values.
        """
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        if y.shape[0] != n_rows:
            raise ValueError(
                f"X and y have mismatched lengths: X has {n_rows} rows, y has {y.shape[0]}"
            )
        if not np.isfinite(y).all():
            raise ValueError("y contains NaN or infinite values")
        return self._tensor(self.y_scaler_.transform(y))

    # -- predict ------------------------------------------------------------------------
    def _validate_predict(self, X) -> torch.Tensor:
        """Check new inputs against the fit and standardise them like the training rows.

        :returns: ``(N, L)`` tensor in ``dtype_`` on ``device_``.
        :raises sklearn.exceptions.NotFittedError: before ``fit``.
        :raises ValueError: a wrong number of features, NaN or infinity, non-numeric
            values, or feature names in another order than in ``fit``.
        """
        check_is_fitted(self, "x_scaler_")
        with self._nan_advice():
            X = validate_data(
                self,
                X,
                reset=False,
                dtype=np.float64,
                ensure_all_finite="allow-nan" if self._allow_nan else True,
            )
        return self._tensor(self.x_scaler_.transform(X))

    def _feature_names(self, feature_names) -> list[str] | None:
        """The names ``export_text`` prints: ``feature_names`` (checked against
        ``n_features_in_``), else ``feature_names_in_`` of a fit on a frame, else
        ``None`` (``x_0``, ``x_1``, ...)."""
        check_is_fitted(self, "n_features_in_")
        if feature_names is None:
            names = getattr(self, "feature_names_in_", None)
            return None if names is None else [str(n) for n in names]
        if len(feature_names) != self.n_features_in_:
            raise ValueError(
                f"feature_names has {len(feature_names)} names for {self.n_features_in_} features"
            )
        return list(feature_names)

    @contextlib.contextmanager
    def _nan_advice(self):
        """Add the fix to scikit-learn's error for NaN in ``X`` (estimators that do not
        route missing values): an imputer in a pipeline."""
        try:
            yield
        except ValueError as err:
            if self._allow_nan or "Input X contains NaN" not in str(err):
                raise
            name = type(self).__name__
            raise ValueError(
                f"{err}\n{name} does not accept missing values (NaN): impute them first, "
                f"e.g. pipe = make_pipeline(SimpleImputer(), {name}()) (from sklearn.pipeline "
                "and sklearn.impute; its intervals are then "
                "pipe[-1].predict_interval(pipe[:-1].transform(X)), as a Pipeline passes "
                "on predict only), or use an estimator that routes them natively "
                "(VaRTRegressor, VaRTForestRegressor, VaRTClassifier, RNNTreeRegressor, "
                "RNNTreeClassifier)."
            ) from err

    def _outputs(self, ys) -> np.ndarray:
        """Standardised regression outputs ``(N,)``/``(..., N, K)`` back in the units of
        ``y``, as float64 NumPy."""
        if isinstance(ys, torch.Tensor):
            ys = ys.detach().to("cpu", torch.float64).numpy()
        return self.y_scaler_.inverse(ys)

    def _output_scale(self, s) -> np.ndarray:
        """Standardised standard deviations or widths back in the units of ``y``."""
        if isinstance(s, torch.Tensor):
            s = s.detach().to("cpu", torch.float64).numpy()
        return self.y_scaler_.inverse_scale(s)
