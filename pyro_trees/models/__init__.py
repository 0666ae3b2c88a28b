"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

from pyro_trees.models.bayesian_hme import BayesianHME

__all__ = ["BayesianHME"]
