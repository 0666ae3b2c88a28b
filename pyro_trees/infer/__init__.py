"""Training: the ``fit`` loop, ELBO pieces that Pyro lacks, and tree structures for TreeVI."""

from pyro_trees.infer.fit import (
    FitResult,
    fit,
    isolated_params,
    make_optimizer,
)
from pyro_trees.infer.tree_elbo import (
    TreeELBO,
)
from pyro_trees.infer.tree_structure import (
    LearnedTree,
    acyclicity,
    learn_tree_structure,
    maximum_spanning_tree,
    parents_from_edges,
    parents_to_adjacency,
    similarity_dfs_tree,
)

__all__ = [
    "FitResult",
    "LearnedTree",
    "TreeELBO",
    "acyclicity",
    "fit",
    "isolated_params",
    "learn_tree_structure",
    "make_optimizer",
    "maximum_spanning_tree",
    "parents_from_edges",
    "parents_to_adjacency",
    "similarity_dfs_tree",
]
