"""Scikit-learn style estimators on top of the Pyro models and guides."""

from pyro_trees.estimators.bayesian_hme import BayesianHMERegressor

__all__ = ["BayesianHMERegressor"]
