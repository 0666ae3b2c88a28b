"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

from pyro_trees.models.latent import (
    SYNTHETIC_AFFINITY,
    ConstrainedClusteringVAE,
    GraphPriorVAE,
    SyntheticGraphVAE,
)

__all__ = ["SYNTHETIC_AFFINITY", "ConstrainedClusteringVAE", "GraphPriorVAE", "SyntheticGraphVAE"]
