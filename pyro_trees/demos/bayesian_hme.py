"""Demo: the Bayesian HME on the toy inverse problem and the two-link robot arm."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pyro_trees.datasets.bayesian_hme import robot_arm, robot_arm_forward, toy_inverse
from pyro_trees.estimators import BayesianHMERegressor
from pyro_trees.topology import Topology

__all__ = ["run", "robot_arm_errors"]


def robot_arm_errors(est, positions: np.ndarray) -> np.ndarray:
    """End-effector error of each prediction: ``|forward(predicted angles) - position|``."""
    return np.linalg.norm(robot_arm_forward(est.predict(positions)) - positions, axis=-1)


def run(out_dir: Path, smoke: bool = False) -> list[dict]:
    """Fit the toy inverse problem (model selection over 1-5 experts) and the robot arm
    (16 experts); save ``bayesian_hme_toy.png`` and ``bayesian_hme_robot_arm.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []

    # toy inverse problem: the bound selects the number of experts
    x, t = toy_inverse(200, seed=0)
    t0 = time.perf_counter()
    est = BayesianHMERegressor(
        max_experts=3 if smoke else 5,
        num_restarts=6 if smoke else 20,
        num_cycles=60 if smoke else 150,
        tol=1e-6,
        routing="hard",
        random_state=0,
    ).fit(x, t)
    seconds = time.perf_counter() - t0
    forward_err = float(
        np.mean(np.abs(est.predict(x) + 0.3 * np.sin(2 * np.pi * est.predict(x)) - x[:, 0]))
    )
    rows.append(
        {
            "model": "Bayesian HME (VB)",
            "task": "toy inverse problem",
            "metric": "experts selected by the bound",
            "paper": 3,
            "ours": float(est.topology_.num_experts),
            "seconds": seconds,
        }
    )
    rows.append(
        {
            "model": "Bayesian HME (VB)",
            "task": "toy inverse problem",
            "metric": "mean |forward(prediction) - input|",
            "paper": None,
            "ours": forward_err,
            "seconds": seconds,
        }
    )
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ks = [top.num_experts for top in est.topologies_]
    axes[0].plot(ks, est.bounds_, "o")
    axes[0].set_xlabel("number of experts (one point per topology)")
    axes[0].set_ylabel("best lower bound")
    grid = np.linspace(x.min(), x.max(), 300)[:, None]
    axes[1].plot(x[:, 0], t, ".", color="0.6", ms=3, label="data")
    axes[1].plot(grid[:, 0], est.predict(grid), ".", ms=2, label="most probable expert")
    lo, hi = est.predict_interval(grid, level=0.9)
    axes[1].fill_between(grid[:, 0], lo, hi, alpha=0.2, label="90% interval")
    axes[1].set_xlabel("t")
    axes[1].set_ylabel("x")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out_dir / "bayesian_hme_toy.png", dpi=100)
    plt.close(fig)

    # robot arm: 16 experts against the least-squares (single-valued) fit
    pos, ang = robot_arm(300 if smoke else 1000, seed=0)
    pos_te, ang_te = robot_arm(200 if smoke else 1000, seed=1)
    t0 = time.perf_counter()
    arm = BayesianHMERegressor(
        topologies=[Topology.balanced(2 if smoke else 4)],
        num_restarts=3 if smoke else 8,
        num_cycles=40 if smoke else 120,
        tol=1e-6,
        routing="hard",
        random_state=0,
    ).fit(pos, ang)
    seconds = time.perf_counter() - t0
    err = robot_arm_errors(arm, pos_te)
    design = np.c_[pos, np.ones(len(pos))]
    w = np.linalg.lstsq(design, ang, rcond=None)[0]
    lin_err = np.linalg.norm(
        robot_arm_forward(np.c_[pos_te, np.ones(len(pos_te))] @ w) - pos_te, axis=-1
    )
    rows.append(
        {
            "model": "Bayesian HME (VB), 16 experts",
            "task": "robot arm",
            "metric": "mean end-effector error / linear least squares'",
            "paper": None,
            "ours": float(err.mean() / lin_err.mean()),
            "seconds": seconds,
        }
    )
    fig, ax = plt.subplots(figsize=(5, 4))
    sc = ax.scatter(pos_te[:, 0], pos_te[:, 1], c=err, s=6, cmap="viridis")
    fig.colorbar(sc, ax=ax, label="end-effector error")
    ax.set_title("Bayesian HME: error of the predicted angles")
    fig.tight_layout()
    fig.savefig(out_dir / "bayesian_hme_robot_arm.png", dpi=100)
    plt.close(fig)
    return rows
