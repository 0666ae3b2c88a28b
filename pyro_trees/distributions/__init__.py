"""Distributions of pyro_trees: real ``TorchDistribution`` subclasses."""

from pyro_trees._forest import (
    tree_depths,
    validate_parents,
)
from pyro_trees.distributions.joint_gaussian_slice import (
    JointGaussianSlice,
)
from pyro_trees.distributions.kronecker_normal import (
    KroneckerNormal,
)
from pyro_trees.distributions.mixture_quantiles import (
    compact_mixture_rows,
    gaussian_mixture_quantiles,
    row_mixture_quantiles,
)
from pyro_trees.distributions.soft_tree_normal import (
    SoftTreeNormal,
)
from pyro_trees.distributions.split_indicator import (
    RelaxedSplitIndicator,
    SplitIndicator,
)
from pyro_trees.distributions.tree_balance import (
    BalancedLeaf,
    TreeBalance,
    TreeRouting,
    expected_log_coupling,
    tree_balance_kl,
)
from pyro_trees.distributions.tree_mixture import (
    MixtureOfTreeNormals,
)
from pyro_trees.distributions.tree_normal import (
    TreeNormal,
    TreeNormalInstances,
)

__all__ = [
    "BalancedLeaf",
    "JointGaussianSlice",
    "KroneckerNormal",
    "MixtureOfTreeNormals",
    "RelaxedSplitIndicator",
    "SoftTreeNormal",
    "SplitIndicator",
    "TreeBalance",
    "TreeNormal",
    "TreeNormalInstances",
    "TreeRouting",
    "compact_mixture_rows",
    "expected_log_coupling",
    "gaussian_mixture_quantiles",
    "row_mixture_quantiles",
    "tree_balance_kl",
    "tree_depths",
    "validate_parents",
]
