"""pyro_trees: tree-structured probabilistic models and variational guides for Pyro."""

from pyro_trees import distributions, guides, infer, models, trees
from pyro_trees.infer import fit

__version__ = "0.1.0"

__all__ = ["__version__", "distributions", "fit", "guides", "infer", "models", "trees"]
