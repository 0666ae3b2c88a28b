"""The synthetic problems of Bishop & Svensén (2003): a toy inverse problem and the
two-link robot arm. Both return NumPy arrays."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["robot_arm", "robot_arm_forward", "toy_inverse"]


def toy_inverse(n: int = 200, noise: float = 0.05, seed: int | None = 0):
    r"""The toy inverse problem (Bishop, 1995): :math:`x \sim U(0, 1)`,
    :math:`t = x + 0.3 \sin(2\pi x) + \epsilon`, :math:`\epsilon \sim N(0, \mathrm{noise}^2)`.

    The task is the multi-valued inverse map ``t -> x``.

    :returns: ``(inputs, targets)``: ``t`` as a column ``(n, 1)`` and ``x`` ``(n,)``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=n)
    t = x + 0.3 * np.sin(2 * math.pi * x) + noise * rng.normal(size=n)
    return t[:, None], x


def robot_arm_forward(angles: np.ndarray, l1: float = 0.8, l2: float = 0.2) -> np.ndarray:
    r"""End-effector position of the two-link arm from joint ``angles`` ``(..., 2)``
    (:math:`\theta_1, \theta_2`):
    :math:`x_1 = L_1\cos\theta_1 - L_2\cos(\theta_1 + \theta_2)`,
    :math:`x_2 = L_1\sin\theta_1 - L_2\sin(\theta_1 + \theta_2)`."""
    angles = np.asarray(angles, dtype=float)
    t1, t2 = angles[..., 0], angles[..., 1]
    return np.stack(
        [l1 * np.cos(t1) - l2 * np.cos(t1 + t2), l1 * np.sin(t1) - l2 * np.sin(t1 + t2)], -1
    )


def robot_arm(n: int = 1000, seed: int | None = 0):
    r"""The two-link robot arm's inverse kinematics: angles uniform on
    :math:`0.3 \le \theta_1 \le 1.2`, :math:`\pi/2 \le \theta_2 \le 3\pi/2`.

    :returns: ``(positions (n, 2), angles (n, 2))``; the task is positions -> angles,
        which is bimodal in the middle of the workspace.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    theta = np.stack(
        [rng.uniform(0.3, 1.2, size=n), rng.uniform(math.pi / 2, 3 * math.pi / 2, size=n)], -1
    )
    return robot_arm_forward(theta), theta
