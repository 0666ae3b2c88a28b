"""Matplotlib figures of fitted models (imported lazily: matplotlib loads on first use)."""

from .dgp import plot_dgp_layers

__all__ = ["plot_dgp_layers"]
