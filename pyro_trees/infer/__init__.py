"""Training: the ``fit`` loop, ELBO pieces that Pyro lacks, and tree structures for TreeVI."""

from pyro_trees._exclusive import (
    exclusive,
)
from pyro_trees._interrupts import (
    deferred_interrupts,
    raise_if_interrupted,
)
from pyro_trees.infer.allocator import (
    keep_freed_memory,
)
from pyro_trees.infer.bayesian_hme_elbo import (
    BayesianHMEELBO,
)
from pyro_trees.infer.bayesian_hme_svi import (
    SVIRestarts,
    fit_svi_restarts,
    restart_elbos,
)
from pyro_trees.infer.bayesian_hme_vb import (
    ModelSelection,
    VBData,
    VBState,
    grow_selection,
    select_topology,
)
from pyro_trees.infer.checkpoint import (
    Checkpoint,
    resume_from,
)
from pyro_trees.infer.collapsed_elbo import (
    CollapsedELBO,
)
from pyro_trees.infer.compiled import (
    CompiledLoss,
    should_compile,
)
from pyro_trees.infer.dgp import (
    collapse_ratio,
    dgp_predict,
    layer_samples,
)
from pyro_trees.infer.dgp_elbo import (
    DGPELBO,
)
from pyro_trees.infer.distributed import (
    RankSubsample,
    all_reduce_sum,
    average_gradients,
    broadcast_parameters,
    check_same_across_ranks,
    collective,
    comm_device,
    is_main,
    rank_subsample,
    world,
)
from pyro_trees.infer.fit import (
    EarlyStopping,
    FitResult,
    fit,
    isolated_params,
    make_optimizer,
    train_steps,
)
from pyro_trees.infer.fused_adam import (
    FusedClippedAdam,
)
from pyro_trees.infer.hme_elbo import (
    HMEELBO,
)
from pyro_trees.infer.restarts import (
    RestartsResult,
    elbo_estimate,
    fit_restarts,
)
from pyro_trees.infer.stacked_stopping import (
    StackedEarlyStopping,
)
from pyro_trees.infer.stream import (
    Stream,
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
    parents_to_probs,
    similarity_dfs_tree,
)
from pyro_trees.infer.tree_vi_elbo import (
    MixtureTreeELBO,
    PairwiseELBO,
    TreeVIELBO,
)
from pyro_trees.infer.tree_vi_structure import (
    learn_guide_tree,
    model_log_joint,
    soft_tree_elbo,
)
from pyro_trees.infer.vart_elbo import (
    VaRTELBO,
)
from pyro_trees.infer.vart_forest_elbo import (
    VaRTForestELBO,
)

__all__ = [
    "BayesianHMEELBO",
    "Checkpoint",
    "DGPELBO",
    "CollapsedELBO",
    "CompiledLoss",
    "EarlyStopping",
    "FitResult",
    "FusedClippedAdam",
    "HMEELBO",
    "LearnedTree",
    "MixtureTreeELBO",
    "ModelSelection",
    "PairwiseELBO",
    "TreeVIELBO",
    "RankSubsample",
    "RestartsResult",
    "SVIRestarts",
    "StackedEarlyStopping",
    "Stream",
    "TreeELBO",
    "VBData",
    "VBState",
    "VaRTELBO",
    "VaRTForestELBO",
    "acyclicity",
    "all_reduce_sum",
    "average_gradients",
    "broadcast_parameters",
    "check_same_across_ranks",
    "collective",
    "comm_device",
    "collapse_ratio",
    "deferred_interrupts",
    "dgp_predict",
    "elbo_estimate",
    "exclusive",
    "fit",
    "fit_restarts",
    "fit_svi_restarts",
    "grow_selection",
    "is_main",
    "isolated_params",
    "keep_freed_memory",
    "layer_samples",
    "learn_guide_tree",
    "learn_tree_structure",
    "make_optimizer",
    "resume_from",
    "maximum_spanning_tree",
    "model_log_joint",
    "parents_from_edges",
    "parents_to_adjacency",
    "parents_to_probs",
    "raise_if_interrupted",
    "rank_subsample",
    "restart_elbos",
    "select_topology",
    "should_compile",
    "similarity_dfs_tree",
    "soft_tree_elbo",
    "train_steps",
    "world",
]
