"""Conditional and average treatment effects with a VaRT outcome model (Sec. 4.2).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023, eqs. 33-34.
* J. Hill, *Bayesian nonparametric modeling for causal inference*, JCGS 2011.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.utils.validation import check_is_fitted, validate_data

from pyro_trees.estimators._base import renamed_state
from pyro_trees.estimators._constraints import (
    SEED_AND_DEVICE,
    Anything,
    Integer,
    validate_params,
)
from pyro_trees.estimators._fit_guard import guarded_fit
from pyro_trees.estimators.vart import VaRTRegressor
from pyro_trees.estimators.vart_forest import VaRTForestRegressor
from pyro_trees.validation import check_level

__all__ = ["VaRTCausal"]


class VaRTCausal(BaseEstimator):
    """Treatment effects from one VaRT fitted on ``(X, A)``, in the manner of Hill (2011).

    The outcome model :math:`E[Y \\mid A, X]` is a :class:`VaRTRegressor` whose inputs are
    the covariates with the treatment appended as the last column. Under overlap,
    conditional exchangeability and consistency,

    .. math::
        \\mathrm{CATE}(x) = E[Y \\mid A=1, x] - E[Y \\mid A=0, x] \\quad (33), \\qquad
        \\mathrm{ATE} = E_X[\\mathrm{CATE}(X)] \\quad (34).

    Each posterior tree gives one draw of both regression functions at the same tree,
    so the posterior of the CATE (and of the ATE, averaged over the given ``X``) comes
    from the same tree draws; intervals are equal-tailed posterior quantiles.

    These bands are the variational posterior's and are not calibrated: the regressor's
    noise calibration (``noise_factor_``) widens its predictive intervals, not the
    function draws, and a mean-field guide is narrower than the exact posterior. On the
    paper's toy data the 80 % bands of the two surfaces covered the truth on 0.43-0.61
    of the rows (``benchmarks/results/vart_causal.md``); read them as the model's
    uncertainty, not as confidence intervals.

    :param regressor: an unfitted :class:`VaRTRegressor`, or a
        :class:`~pyro_trees.estimators.VaRTForestRegressor` for a forest (each posterior
        forest then gives one draw of both regression functions), cloned by ``fit`` (default:
        ``VaRTRegressor(depth=3, kl_weight=1.0, validation_fraction=0.0, init="random")``,
        the paper's causal :math:`\\lambda`, trained on every row as in the paper).
    :param num_trees: ``None`` (default) for the single tree above; an integer for a forest
        of that many trees as the default outcome model,
        ``VaRTForestRegressor(num_trees, validation_fraction=0.0, num_fits=1)`` (its other
        defaults: depth 3, lambda 1e-3; every row trains, as above; one fit, as the IHDP
        figures of the VaRT guide page were measured: without held-out rows every
        further fit of ``num_fits`` trains all ``num_steps``). Only without ``regressor``.
    :param random_state: seed of the default regressor, and of a given regressor whose
        own ``random_state`` is ``None`` (one with a seed of its own keeps it).
    :param device: torch device of the default regressor.
    :param bool progress: show the default regressor's progress bar.

    The fitted outcome model is ``regressor_``; ``arms_`` holds the two treatment labels
    (control first, see :meth:`fit`).

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTCausal, VaRTRegressor
    >>> rng = np.random.default_rng(0)
    >>> X, A = rng.normal(size=(40, 2)), rng.integers(0, 2, size=40)
    >>> outcome = VaRTRegressor(depth=2, num_steps=3, num_samples=5, validation_fraction=0)
    >>> causal = VaRTCausal(outcome).fit(X, A, X[:, 0] + 2.0 * A)
    >>> sorted(causal.ate())
    ['draws', 'lower', 'mean', 'std', 'upper']
    >>> causal.sample_cate(X[:3]).shape  # one CATE draw per posterior tree
    (5, 3)
    """

    def __init__(
        self,
        regressor: VaRTRegressor | None = None,
        *,
        num_trees: int | None = None,
        random_state: int | None = None,
        device=None,
        progress: bool = False,
    ):
        self.regressor = regressor
        self.num_trees = num_trees
        self.random_state = random_state
        self.device = device
        self.progress = progress

    _parameter_constraints = {
        **SEED_AND_DEVICE,
        "regressor": Anything("fit (an unfitted VaRTRegressor or VaRTForestRegressor)"),
        "num_trees": Integer(1, none=True),
    }

    @guarded_fit
    def fit(self, X, A, y, *, sharded: bool = False):
        """Fit on covariates ``X`` ``(N, L)``, treatments ``A`` ``(N,)`` and ``y``.

        ``A`` holds two arms of any labels (0/1, booleans, strings, 1/2, ...). Sorted,
        they are ``arms_``: ``arms_[0]`` is the control and ``arms_[1]`` the treatment
        (as scikit-learn's ``classes_[1]`` is a binary classifier's positive class), so
        the CATE is the second arm's mean minus the first's. 0/1 and booleans keep their
        meaning.

        :param bool sharded: under ``torchrun``, each rank passes only its own rows
            (:meth:`VaRTRegressor.fit`); :meth:`ate` then needs its ``X``. A rank may hold
            one arm only, so sharded arms must be 0/1 or booleans.
        """
        validate_params(self)
        X, y = validate_data(self, X, y, dtype=np.float64, ensure_min_samples=2, y_numeric=True)
        A = np.asarray(A)
        if A.ndim != 1 or A.shape[0] != X.shape[0]:
            raise ValueError(
                f"A must be 1-D with one entry per row of X ({X.shape[0]}); "
                f"got shape {tuple(A.shape)}"
            )
        A = self._encode_arms(A, sharded)
        if self.num_trees is not None and self.regressor is not None:
            raise ValueError("num_trees chooses the default regressor; give one or the other")
        common = {"random_state": self.random_state, "device": self.device}
        common["progress"] = self.progress
        if self.num_trees is not None:
            self.regressor_ = VaRTForestRegressor(
                num_trees=self.num_trees, validation_fraction=0.0, num_fits=1, **common
            )
        elif self.regressor is None:
            self.regressor_ = VaRTRegressor(
                depth=3,
                kl_weight=1.0,
                validation_fraction=0.0,
                init="random",
                **common,
            )
        else:
            if not isinstance(self.regressor, VaRTRegressor):
                raise TypeError(
                    f"regressor must be a VaRTRegressor, got {type(self.regressor).__name__}"
                )
            self.regressor_ = clone(self.regressor)
            if self.regressor_.random_state is None and self.random_state is not None:
                # a regressor without a seed of its own takes this estimator's
                self.regressor_.set_params(random_state=self.random_state)
        XA = np.concatenate([X, A[:, None]], axis=1)
        self.regressor_.fit(XA, y, sharded=sharded)
        self.sharded_ = sharded and self.regressor_.ranks_.size > 1
        self.X_train_ = X
        return self

    def _encode_arms(self, A: np.ndarray, sharded: bool) -> np.ndarray:
        """Set ``arms_`` (the two labels, sorted) and return ``A`` as 0/1 floats."""
        if A.dtype.kind == "f" and np.isnan(A).any():
            raise ValueError("A contains NaN: every row needs its treatment arm")
        indicator = A.dtype.kind == "b" or (A.dtype.kind in "iuf" and np.isin(A, (0, 1)).all())
        if sharded or indicator:
            if not indicator:
                raise ValueError("with sharded=True, A must hold treatment indicators 0 or 1")
            arms = np.array([False, True]) if A.dtype.kind == "b" else np.array([0, 1])
            if A.min() == A.max() and not sharded:
                raise ValueError("A holds a single treatment arm; both arms are needed")
        else:
            arms = np.unique(A)
            if len(arms) == 1:
                raise ValueError("A holds a single treatment arm; both arms are needed")
            if len(arms) != 2:
                shown = ", ".join(repr(a) for a in arms[:5].tolist())
                more = ", ..." if len(arms) > 5 else ""
                raise ValueError(
                    "A must hold two treatment arms (control and treatment); got "
                    f"{len(arms)} distinct values: {shown}{more}"
                )
        self.arms_ = arms
        return (A == arms[1]).astype(np.float64)

    def __setstate__(self, state):
        super().__setstate__(renamed_state(state))
        if "regressor_" in self.__dict__ and "arms_" not in self.__dict__:
            self.arms_ = np.array([0, 1])  # fitted before arms were encoded: 0/1 only

    def _arms(self, X, *, checked: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Function draws of both arms at ``X`` (``checked``: ``X`` is the validated
        training array, not passed through the input checks again)."""
        check_is_fitted(self, "regressor_")
        if not checked:
            X = validate_data(self, X, reset=False, dtype=np.float64)
        n = X.shape[0]
        both = np.concatenate(
            [
                np.concatenate([X, np.zeros((n, 1))], axis=1),
                np.concatenate([X, np.ones((n, 1))], axis=1),
            ]
        )
        f = self.regressor_.sample_function(both)  # (S, 2n), the same trees for both arms
        return f[:, :n], f[:, n:]

    def potential_outcomes(self, X, level: float = 0.8) -> dict:
        """Posterior mean and equal-tailed band of :math:`E[Y(a) \\mid x]` for both arms.

        :returns: dict ``{arm: (mean, lower, upper)}`` keyed by the labels of ``arms_``
            (``{0: ..., 1: ...}`` for 0/1 treatments).
        """
        level = check_level(level)
        q = [(1 - level) / 2, (1 + level) / 2]
        out = {}
        for a, f in zip(self.arms_.tolist(), self._arms(X), strict=True):
            lo, hi = np.quantile(f, q, axis=0)
            out[a] = (f.mean(0), lo, hi)
        return out

    def sample_cate(self, X) -> np.ndarray:
        """Posterior draws of the CATE at each row of ``X``: ``(num_samples, N)``."""
        f0, f1 = self._arms(X)
        return f1 - f0

    def cate(self, X, level: float = 0.9):
        """Posterior mean CATE and its equal-tailed interval: ``(mean, lower, upper)``."""
        level = check_level(level)
        draws = self.sample_cate(X)
        lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0)
        return draws.mean(0), lo, hi

    def ate(self, X=None, level: float = 0.9) -> dict:
        """Posterior of the ATE averaged over ``X`` (default: the training covariates).

        :returns: dict with ``mean``, ``std``, ``lower``, ``upper`` and ``draws``.
        """
        level = check_level(level)
        check_is_fitted(self, "regressor_")
        if X is None and getattr(self, "sharded_", False):
            raise ValueError("fitted on sharded rows: ate needs the covariates X to average over")
        if X is None:  # the stored training array, already validated
            f0, f1 = self._arms(self.X_train_, checked=True)
            draws = (f1 - f0).mean(1)
        else:
            draws = self.sample_cate(X).mean(1)
        lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
        return {
            "mean": float(draws.mean()),
            "std": float(draws.std()),
            "lower": float(lo),
            "upper": float(hi),
            "draws": draws,
        }
