"""Guide families, each with the signature of its model."""

from pyro_trees.guides.bayesian_hme import BayesianHMEGuide

__all__ = ["BayesianHMEGuide"]
