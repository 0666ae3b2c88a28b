"""pyro_trees: tree-structured probabilistic models and variational guides for Pyro.

The subpackages and the names re-exported here load on first use (PEP 562), so that
``import pyro_trees`` costs next to nothing and neither scikit-learn (the estimators)
nor GPyTorch (the Gaussian-process models) is imported before it is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

#: subpackages and modules, imported on first attribute access
_SUBMODULES = (
    "datasets",
    "distributions",
    "estimators",
    "guides",
    "infer",
    "models",
    "plotting",
    "topology",
    "trees",
)

#: public names re-exported at the top, and the module each comes from
_NAMES = {
    "BayesianHMERegressor": "pyro_trees.estimators",
    "HeteroscedasticGPRegressor": "pyro_trees.estimators",
    "RNNTreeClassifier": "pyro_trees.estimators",
    "RNNTreeRegressor": "pyro_trees.estimators",
    "VaRTCausal": "pyro_trees.estimators",
    "VaRTClassifier": "pyro_trees.estimators",
    "VaRTForestRegressor": "pyro_trees.estimators",
    "VaRTRegressor": "pyro_trees.estimators",
    "Topology": "pyro_trees.topology",
    "fit": "pyro_trees.infer",
    "fit_restarts": "pyro_trees.infer",
}

__all__ = sorted([*_NAMES, *_SUBMODULES, "__version__"])


def __getattr__(name: str):
    if name in _SUBMODULES:
        module = importlib.import_module(f"pyro_trees.{name}")
    elif name in _NAMES:
        module = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'pyro_trees' has no attribute {name!r}")
    globals()[name] = module  # later look-ups skip this function
    return module


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what static tools see: the same names, imported eagerly
    from pyro_trees import (  # noqa: F401
        datasets,
        distributions,
        estimators,
        guides,
        infer,
        models,
        plotting,
        topology,
        trees,
    )
    from pyro_trees.estimators import (  # noqa: F401
        BayesianHMERegressor,
        HeteroscedasticGPRegressor,
        RNNTreeClassifier,
        RNNTreeRegressor,
        VaRTCausal,
        VaRTClassifier,
        VaRTForestRegressor,
        VaRTRegressor,
    )
    from pyro_trees.infer import fit, fit_restarts  # noqa: F401
    from pyro_trees.topology import Topology  # noqa: F401
