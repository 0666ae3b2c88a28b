"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

from pyro_trees.models.vart import VaRT

__all__ = ["VaRT"]
