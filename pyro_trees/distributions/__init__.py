"""Distributions of pyro_trees: real ``TorchDistribution`` subclasses."""

from pyro_trees.distributions.kronecker_normal import KroneckerNormal
from pyro_trees.distributions.tree_mixture import MixtureOfTreeNormals
from pyro_trees.distributions.tree_normal import TreeNormal, validate_parents

__all__ = ["KroneckerNormal", "MixtureOfTreeNormals", "TreeNormal", "validate_parents"]
