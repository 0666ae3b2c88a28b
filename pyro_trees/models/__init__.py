"""Pyro models: ``PyroModule`` classes whose ``forward(x, y=None)`` samples inside plates."""

from pyro_trees.models.bayesian_hme import (
    BayesianHME,
)
from pyro_trees.models.constrained_clustering import (
    ConstrainedClusteringVAE,
)
from pyro_trees.models.dgp import (
    DeepGP,
)
from pyro_trees.models.graph_prior import (
    GraphPriorVAE,
)
from pyro_trees.models.heteroscedastic_gp import (
    HeteroscedasticGP,
)
from pyro_trees.models.hgp_prediction import (
    HGPPrediction,
)
from pyro_trees.models.hme import (
    HME,
)
from pyro_trees.models.synthetic_graph import (
    SYNTHETIC_AFFINITY,
    SyntheticGraphVAE,
)
from pyro_trees.models.vart import (
    VaRT,
)
from pyro_trees.models.vart_classification import (
    VaRTClassification,
)
from pyro_trees.models.vart_forest import (
    VaRTForest,
    forest_mean,
)
from pyro_trees.models.vart_mixture import (
    leaf_mixtures,
    leaf_tree,
    mixture_params,
    row_mixtures,
    stack_trees,
    tree_likelihood,
    tree_mean,
    with_bias,
)

__all__ = [
    "BayesianHME",
    "ConstrainedClusteringVAE",
    "DeepGP",
    "GraphPriorVAE",
    "HGPPrediction",
    "HME",
    "HeteroscedasticGP",
    "SYNTHETIC_AFFINITY",
    "SyntheticGraphVAE",
    "VaRT",
    "VaRTClassification",
    "VaRTForest",
    "forest_mean",
    "leaf_mixtures",
    "leaf_tree",
    "mixture_params",
    "row_mixtures",
    "stack_trees",
    "tree_likelihood",
    "tree_mean",
    "with_bias",
]
