"""pyro_trees: tree-structured probabilistic models and variational guides for Pyro."""

from pyro_trees import (
    datasets,
    distributions,
    estimators,
    guides,
    infer,
    models,
    topology,
    trees,
)
from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTRegressor,
)
from pyro_trees.infer import fit, fit_restarts
from pyro_trees.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "BayesianHMERegressor",
    "HeteroscedasticGPRegressor",
    "RNNTreeClassifier",
    "RNNTreeRegressor",
    "Topology",
    "VaRTCausal",
    "VaRTRegressor",
    "__version__",
    "datasets",
    "distributions",
    "estimators",
    "fit",
    "fit_restarts",
    "guides",
    "infer",
    "models",
    "topology",
    "trees",
]
