"""Scikit-learn style estimators on top of the Pyro models and guides."""

from pyro_trees.estimators.vart import VaRTRegressor
from pyro_trees.estimators.vart_causal import VaRTCausal

__all__ = ["VaRTCausal", "VaRTRegressor"]
