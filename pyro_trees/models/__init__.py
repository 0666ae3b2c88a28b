"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

from .dgp import DeepGP

__all__ = ["DeepGP"]
