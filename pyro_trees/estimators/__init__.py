"""Scikit-learn style estimators on top of the Pyro models and guides."""

from pyro_trees.estimators.vart import VaRTRegressor

__all__ = ["VaRTRegressor"]
