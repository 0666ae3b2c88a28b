"""Missing input values (NaN) in the estimators that route them natively: the VaRT
estimators and the RNN-Tree estimators. Their ``fit`` and ``predict`` accept NaN in
``X`` (never in ``y``; infinities stay refused), scikit-learn's tags say so
(``allow_nan``), and ``fit`` records where the training values were missing.
"""

from __future__ import annotations

import numpy as np


class MissingInputs:
    """Mixin (before :class:`~pyro_trees.estimators._base.TabularEstimator`) of an
    estimator that routes missing inputs itself: ``_validate_fit`` then accepts NaN in
    ``X`` and records ``missing_fraction_`` ``(L,)``, the share of the training rows
    missing each feature; :meth:`_fit_missing` says whether the model needs its learnt
    missing-value routes (a fit without any missing value builds the model it always
    built)."""

    _allow_nan = True

    def _fit_missing(self) -> bool:
        """Whether some training value was missing (estimators pickled before missing
        values were accepted: none was)."""
        return bool(np.any(getattr(self, "missing_fraction_", 0.0)))
