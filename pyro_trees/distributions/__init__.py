"""Distributions of pyro_trees: real ``TorchDistribution`` subclasses."""

from pyro_trees.distributions.split_indicator import RelaxedSplitIndicator, SplitIndicator

__all__ = ["RelaxedSplitIndicator", "SplitIndicator"]
