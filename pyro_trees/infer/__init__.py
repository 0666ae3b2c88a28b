"""Training: the ``fit`` loop, ELBO pieces that Pyro lacks, and closed-form variational
Bayes for the Bayesian HME (:mod:`pyro_trees.infer.bayesian_hme_vb`)."""

from pyro_trees.infer.bayesian_hme_vb import ModelSelection, VBData, VBState, select_topology
from pyro_trees.infer.fit import FitResult, fit, make_optimizer

__all__ = [
    "FitResult",
    "ModelSelection",
    "VBData",
    "VBState",
    "fit",
    "make_optimizer",
    "select_topology",
]
