"""Synthetic generators from the papers and loaders of cached public data.

(Minimal placeholder package created by the Bayesian HME branch for its generators; the
full subpackage with the cached loaders is written separately and merged.)
"""

from pyro_trees.datasets.bayesian_hme import robot_arm, robot_arm_forward, toy_inverse

__all__ = ["robot_arm", "robot_arm_forward", "toy_inverse"]
