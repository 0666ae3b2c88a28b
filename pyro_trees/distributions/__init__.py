"""Distributions of pyro_trees: real ``TorchDistribution`` subclasses."""

__all__: list[str] = []
