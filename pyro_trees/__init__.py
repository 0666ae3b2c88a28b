"""pyro_trees: tree-structured probabilistic models and variational guides for Pyro."""

from pyro_trees import datasets, distributions, estimators, guides, infer, models, trees
from pyro_trees.estimators import (
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTRegressor,
)
from pyro_trees.infer import fit

__version__ = "0.1.0"

__all__ = [
    "RNNTreeClassifier",
    "RNNTreeRegressor",
    "VaRTCausal",
    "VaRTRegressor",
    "__version__",
    "datasets",
    "distributions",
    "estimators",
    "fit",
    "guides",
    "infer",
    "models",
    "trees",
]
