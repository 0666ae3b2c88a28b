import math

import numpy as np
import pytest

from pyro_trees.datasets.bayesian_hme import robot_arm, robot_arm_forward, toy_inverse


def test_toy_inverse():
    t, x = toy_inverse(50, noise=0.0, seed=1)
    assert t.shape == (50, 1) and x.shape == (50,)
    assert np.allclose(t[:, 0], x + 0.3 * np.sin(2 * math.pi * x))
    with pytest.raises(ValueError):
        toy_inverse(0)


def test_robot_arm_ranges_and_bimodality():
    pos, ang = robot_arm(500, seed=0)
    assert pos.shape == ang.shape == (500, 2)
    assert ang[:, 0].min() >= 0.3 and ang[:, 0].max() <= 1.2
    assert ang[:, 1].min() >= math.pi / 2 and ang[:, 1].max() <= 3 * math.pi / 2
    assert np.allclose(robot_arm_forward(ang), pos)
    # elbow-up and elbow-down configurations reach the same point: reflect the arm about
    # the line from the base to the end effector
    theta = np.array([0.8, 2.5])
    p = robot_arm_forward(theta)
    phi = math.atan2(p[1], p[0])
    other = np.array([2 * phi - theta[0], -theta[1]])
    assert np.allclose(robot_arm_forward(other), p)
