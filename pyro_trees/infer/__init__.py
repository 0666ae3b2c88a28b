"""Training: the ``fit`` loop and ELBO pieces that Pyro lacks."""

from pyro_trees.infer.dgp import collapse_ratio, dgp_predict, layer_samples
from pyro_trees.infer.fit import FitResult, fit, isolated_params, make_optimizer
from pyro_trees.infer.tree_elbo import TreeELBO

__all__ = [
    "FitResult",
    "TreeELBO",
    "collapse_ratio",
    "dgp_predict",
    "fit",
    "isolated_params",
    "layer_samples",
    "make_optimizer",
]
