"""Scikit-learn style estimators on top of the Pyro models and guides."""

from pyro_trees.estimators.rnn_tree import RNNTreeClassifier, RNNTreeRegressor

__all__ = ["RNNTreeClassifier", "RNNTreeRegressor"]
