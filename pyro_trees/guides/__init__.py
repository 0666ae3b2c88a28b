"""Guide families, each with the signature of its model."""

from pyro_trees.guides.dgp import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide
from pyro_trees.guides.rnn_tree import RNNTree, RNNTreeGuide

__all__ = [
    "DGPFactorisedGuide",
    "DGPIntermediateGuide",
    "DGPJointGuide",
    "RNNTree",
    "RNNTreeGuide",
]
