"""Bayesian HME on the two-link robot arm (Bishop & Svensén 2003, Section 5.2).

Inverse kinematics (end-effector position -> joint angles), bimodal where both the
elbow-up and the elbow-down configuration lie in the joint ranges. A 16-expert HME
(balanced, 4 levels of gates), best bound over ``--restarts`` starts (paper: 100),
predicts the mean of its most probable expert; an MLP trained by least squares averages
the two solutions. Errors are end-effector distances after mapping the predicted angles
forward. Target: the HME's mean error in the bimodal region at most a quarter of the
MLP's.

Run: ``python -m benchmarks.bhme_robot_arm [--restarts 100] [--smoke]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks._common import RESULTS, markdown_table, write_results
from pyro_trees.datasets.bayesian_hme import robot_arm, robot_arm_forward
from pyro_trees.estimators import BayesianHMERegressor
from pyro_trees.topology import Topology


def bimodal(angles: np.ndarray) -> np.ndarray:
    """True where the mirrored (other elbow) configuration is also in the joint ranges."""
    pos = robot_arm_forward(angles)
    phi = np.arctan2(pos[:, 1], pos[:, 0])
    other = 2 * phi - angles[:, 0]
    return (other >= 0.3) & (other <= 1.2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--restarts", type=int, default=100)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.restarts, args.iters, args.n = 2, 20, 200
    pos, ang = robot_arm(args.n, seed=0)
    pos_te, ang_te = robot_arm(args.n, seed=1)
    mask = bimodal(ang_te)

    t0 = time.perf_counter()
    hme = BayesianHMERegressor(
        topologies=[Topology.balanced(4)],
        num_restarts=args.restarts,
        num_cycles=args.iters,
        tol=1e-6,
        routing="hard",
        random_state=0,
    ).fit(pos, ang)
    hme_seconds = time.perf_counter() - t0
    from sklearn.neural_network import MLPRegressor

    t0 = time.perf_counter()
    mlp = MLPRegressor(hidden_layer_sizes=(20,), max_iter=3000, random_state=0)
    mlp.fit(pos, ang)
    mlp_seconds = time.perf_counter() - t0

    def errors(pred):
        return np.linalg.norm(robot_arm_forward(pred) - pos_te, axis=-1)

    e_hme, e_mlp = errors(hme.predict(pos_te)), errors(mlp.predict(pos_te))
    rows = []
    for name, e in (
        ("Bayesian HME, 16 experts (ours)", e_hme),
        ("MLP 20 tanh, least squares (ours)", e_mlp),
    ):
        rows.append(
            {
                "model": name,
                "mean error (all)": float(e.mean()),
                "mean error (bimodal region)": float(e[mask].mean()),
                "mean error (unimodal region)": float(e[~mask].mean()),
            }
        )
    ratio = rows[0]["mean error (bimodal region)"] / rows[1]["mean error (bimodal region)"]
    print(markdown_table(rows))
    print(f"HME / MLP error in the bimodal region: {ratio:.3f} (target <= 0.25)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    vmax = float(max(e_mlp.max(), e_hme.max()))
    for ax, e, name in zip(
        axes, (e_mlp, e_hme), ("MLP (least squares)", "Bayesian HME"), strict=True
    ):
        sc = ax.scatter(pos_te[:, 0], pos_te[:, 1], c=e, s=4, vmin=0, vmax=vmax)
        ax.set_title(f"{name}: mean error {e.mean():.3f}")
        ax.set_xlabel("x1")
    axes[0].set_ylabel("x2")
    fig.colorbar(sc, ax=axes, label="end-effector error")
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.smoke:
        fig.savefig(RESULTS / "bhme_robot_arm.png", dpi=120)
        md = markdown_table(rows) + (
            f"\nHME / MLP mean end-effector error in the bimodal region: {ratio:.3f} "
            f"(target <= 0.25; the paper shows the errors as figures 9-10, no number). "
            f"{int(mask.sum())} of {len(mask)} test points are in the bimodal region. "
            f"HME: best bound {hme.elbo_:.1f} over {args.restarts} starts x {args.iters} "
            f"cycles ({hme_seconds:.1f} s; paper: 100 starts); MLP {mlp_seconds:.1f} s "
            f"(speed ratio {hme_seconds / mlp_seconds:.1f}; contended 2-core machine).\n\n"
            "![errors](bhme_robot_arm.png)\n"
        )
        write_results(
            "bhme_robot_arm",
            {
                "rows": rows,
                "bimodal_ratio": ratio,
                "target_ratio": 0.25,
                "bimodal_points": int(mask.sum()),
                "hme_seconds": hme_seconds,
                "mlp_seconds": mlp_seconds,
                "elbo": hme.elbo_,
                "args": vars(args),
            },
            md,
        )


if __name__ == "__main__":
    main()
