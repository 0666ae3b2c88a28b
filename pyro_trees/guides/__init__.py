"""Guide families, each with the signature of its model."""

from pyro_trees.guides.base import (
    TreeGuide,
)
from pyro_trees.guides.bayesian_hme import (
    BayesianHMEGuide,
    RestartPlate,
)
from pyro_trees.guides.dgp import (
    DGPFactorisedGuide,
    DGPIntermediateGuide,
    DGPJointGuide,
)
from pyro_trees.guides.heteroscedastic_gp import (
    HeteroscedasticGPGuide,
)
from pyro_trees.guides.hme import (
    RNNTreeGuide,
)
from pyro_trees.guides.rnn_tree import (
    RNNTree,
)
from pyro_trees.guides.stacked import (
    StackedGuides,
)
from pyro_trees.guides.tree_vi import (
    TreeVIGuide,
    induced_forest,
    tree_batches,
)
from pyro_trees.guides.tree_vi_mixture import (
    TreeVIMixtureGuide,
)
from pyro_trees.guides.tree_vi_nets import (
    GaussianEncoder,
    GroupEncoder,
    PairNet,
)
from pyro_trees.guides.vart import (
    TemperatureSchedule,
    VaRTGuide,
)
from pyro_trees.guides.vart_forest import (
    VaRTForestGuide,
)

__all__ = [
    "BayesianHMEGuide",
    "DGPFactorisedGuide",
    "DGPIntermediateGuide",
    "DGPJointGuide",
    "GaussianEncoder",
    "GroupEncoder",
    "HeteroscedasticGPGuide",
    "PairNet",
    "RNNTree",
    "RNNTreeGuide",
    "RestartPlate",
    "StackedGuides",
    "TemperatureSchedule",
    "TreeGuide",
    "TreeVIGuide",
    "TreeVIMixtureGuide",
    "VaRTForestGuide",
    "VaRTGuide",
    "induced_forest",
    "tree_batches",
]
