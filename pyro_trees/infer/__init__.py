"""Training: the ``fit`` loop and ELBO pieces that Pyro lacks."""

from pyro_trees.infer.fit import FitResult, fit, isolated_params, make_optimizer
from pyro_trees.infer.tree_elbo import TreeELBO

__all__ = ["FitResult", "TreeELBO", "fit", "isolated_params", "make_optimizer"]
