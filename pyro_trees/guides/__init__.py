"""Guide families, each with the signature of its model."""

from pyro_trees.guides.rnn_tree import RNNTree, RNNTreeGuide

__all__ = ["RNNTree", "RNNTreeGuide"]
