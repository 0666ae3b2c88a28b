"""Training: the ``fit`` loop and ELBO pieces that Pyro lacks."""

from pyro_trees.infer.dgp import collapse_ratio, dgp_predict, layer_samples
from pyro_trees.infer.fit import FitResult, fit, make_optimizer

__all__ = [
    "FitResult",
    "collapse_ratio",
    "dgp_predict",
    "fit",
    "layer_samples",
    "make_optimizer",
]
