"""Distributions of pyro_trees: real ``TorchDistribution`` subclasses."""

from pyro_trees.distributions.tree_balance import (
    BalancedLeaf,
    TreeBalance,
    TreeRouting,
    expected_log_coupling,
    tree_balance_kl,
)

__all__ = [
    "BalancedLeaf",
    "TreeBalance",
    "TreeRouting",
    "expected_log_coupling",
    "tree_balance_kl",
]
