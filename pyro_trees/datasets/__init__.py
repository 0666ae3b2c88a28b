"""Synthetic generators from the papers and loaders of cached public data."""

from pyro_trees.datasets.vart import make_vart_causal_toy, simulate_ihdp_surface

__all__ = ["make_vart_causal_toy", "simulate_ihdp_surface"]
