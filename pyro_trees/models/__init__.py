"""Pyro models (``PyroModule``\\ s whose ``forward(x, y=None)`` samples inside plates)."""

from pyro_trees.models.dgp import DeepGP
from pyro_trees.models.hme import HME

__all__ = ["DeepGP", "HME"]
