"""Training: the ``fit`` loop and ELBO pieces that Pyro lacks."""

from pyro_trees.infer.fit import FitResult, fit, make_optimizer

__all__ = ["FitResult", "fit", "make_optimizer"]
