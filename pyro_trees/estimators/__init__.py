"""Scikit-learn style estimators on top of the Pyro models and guides."""

from pyro_trees.estimators._vart_calibration import (
    SCORE_GRID,
    coverage_factor,
    noise_factor_from_curve,
    noise_factor_from_scores,
)
from pyro_trees.estimators._vart_export import most_probable_tree
from pyro_trees.estimators.bayesian_hme import (
    BayesianHMERegressor,
)
from pyro_trees.estimators.heteroscedastic_gp import (
    HeteroscedasticGPRegressor,
)
from pyro_trees.estimators.rnn_tree import (
    RNNTreeClassifier,
    RNNTreeRegressor,
)
from pyro_trees.estimators.vart import (
    VaRTRegressor,
)
from pyro_trees.estimators.vart_causal import (
    VaRTCausal,
)
from pyro_trees.estimators.vart_classifier import (
    VaRTClassifier,
)
from pyro_trees.estimators.vart_forest import (
    VaRTForestRegressor,
)

__all__ = [
    "SCORE_GRID",
    "BayesianHMERegressor",
    "HeteroscedasticGPRegressor",
    "RNNTreeClassifier",
    "RNNTreeRegressor",
    "VaRTCausal",
    "VaRTClassifier",
    "VaRTForestRegressor",
    "VaRTRegressor",
    "coverage_factor",
    "most_probable_tree",
    "noise_factor_from_curve",
    "noise_factor_from_scores",
]
