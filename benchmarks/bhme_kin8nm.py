"""Bayesian HME on kin8nm (Bishop & Svensén 2003, Section 5.3).

1024 training and 1024 test points drawn with a fixed seed from Delve kin-8nm, inputs
and target standardised on the training set. Every topology with 2-8 experts, ``50``
random starts each, deterministic annealing (temperature 5.85, x0.97 per cycle, floored
at 1, then cycles at 1; 800 cycles in all); the model with the highest bound is kept and
its most probable expert's mean is the prediction.

Paper: best bound at 4 experts, standardised test MSE 0.249 (Waterhouse's HMEs
0.262-0.378, best MLP 0.094, linear 0.569). Targets: MSE <= 0.24, search <= 5 minutes on 2
CPU cores.

Run: ``python -m benchmarks.bhme_kin8nm [--restarts 50] [--max-experts 8] [--smoke]``
(needs the data cache: ``PYRO_TREES_DATA`` pointing at a folder with ``kin8nm/data.txt``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.estimators import BayesianHMERegressor
from pyro_trees.topology import enumerate_topologies

PAPER = {"bhme": 0.249, "waterhouse_hme": (0.262, 0.378), "mlp": 0.094, "linear": 0.569}


def _load_kin8nm() -> np.ndarray:
    """Private reader of the cached kin8nm file (until pyro_trees.datasets lands)."""
    home = Path(os.environ.get("PYRO_TREES_DATA", Path.home() / ".cache" / "pyro_trees"))
    path = home / "kin8nm" / "data.txt"
    if not path.exists():
        raise SystemExit(
            f"kin8nm not found at {path}: set PYRO_TREES_DATA to the data cache "
            "(a folder with kin8nm/data.txt, from the Delve kin-8nm set)"
        )
    return np.loadtxt(path)


def split(data: np.ndarray, n_train: int = 1024, n_test: int = 1024, seed: int = 0):
    perm = np.random.default_rng(seed).permutation(len(data))
    tr, te = data[perm[:n_train]], data[perm[n_train : n_train + n_test]]
    mx, sx = tr[:, :-1].mean(0), tr[:, :-1].std(0)
    my, sy = tr[:, -1].mean(), tr[:, -1].std()
    return (
        (tr[:, :-1] - mx) / sx,
        (tr[:, -1] - my) / sy,
        (te[:, :-1] - mx) / sx,
        (te[:, -1] - my) / sy,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--restarts", type=int, default=50)
    parser.add_argument("--iters", type=int, default=800)
    parser.add_argument("--min-experts", type=int, default=2)
    parser.add_argument("--max-experts", type=int, default=8)
    parser.add_argument("--prune-after", type=int, default=100)
    parser.add_argument("--keep", type=int, default=5)
    parser.add_argument("--tag", default="", help="suffix of the result files' name")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.restarts, args.iters, args.max_experts, args.prune_after = 4, 40, 3, 20
    xtr, ytr, xte, yte = split(_load_kin8nm())

    # peers measured in the same run: least squares and scikit-learn's MLP
    design = np.c_[xtr, np.ones(len(xtr))]
    w = np.linalg.lstsq(design, ytr, rcond=None)[0]
    linear_mse = float(np.mean((np.c_[xte, np.ones(len(xte))] @ w - yte) ** 2))
    from sklearn.neural_network import MLPRegressor

    t0 = time.perf_counter()
    mlp = MLPRegressor(hidden_layer_sizes=(64, 64), max_iter=2000, random_state=0)
    mlp.fit(xtr, ytr)
    mlp_seconds = time.perf_counter() - t0
    mlp_mse = float(np.mean((mlp.predict(xte) - yte) ** 2))

    tops = enumerate_topologies(args.max_experts, args.min_experts)
    est = BayesianHMERegressor(
        topologies=tops,
        n_restarts=args.restarts,
        n_iter=args.iters,
        anneal=True,
        prune_after=args.prune_after,
        keep=args.keep,
        standardize=False,
        random_state=0,
    )
    t0 = time.perf_counter()
    est.fit(xtr, ytr)
    seconds = time.perf_counter() - t0
    mse_expert = float(np.mean((est.predict(xte) - yte) ** 2))
    mse_mixture = float(np.mean((est.predict(xte, mode="mixture") - yte) ** 2))
    best_per_e = {}
    for top, b in zip(est.topologies_, est.bounds_, strict=True):
        best_per_e[top.num_experts] = max(best_per_e.get(top.num_experts, -np.inf), float(b))

    rows = [
        {"model": "Bayesian HME (ours, bound-selected)", "test MSE": mse_expert, "paper": 0.249},
        {"model": "Bayesian HME mixture mean (ours)", "test MSE": mse_mixture, "paper": None},
        {"model": "linear least squares (ours)", "test MSE": linear_mse, "paper": 0.569},
        {"model": "MLP 64-64 (scikit-learn, ours)", "test MSE": mlp_mse, "paper": 0.094},
    ]
    print(markdown_table(rows))
    print(f"selected {est.topology_} ({est.topology_.num_experts} experts; paper: 4)")
    print(f"best bound per number of experts: {best_per_e}")
    print(
        f"search: {seconds:.1f} s for {len(tops)} topologies x {args.restarts} starts "
        f"(target <= 300 s); MLP fit {mlp_seconds:.1f} s"
    )
    md = markdown_table(rows)
    md += (
        f"\nSelected topology {est.topology_} with {est.topology_.num_experts} experts (paper: 4). "
        f"Best bound per number of experts: "
        + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(best_per_e.items()))
        + f".\n\nSearch time {seconds:.1f} s for {len(tops)} topologies with "
        f"{args.min_experts}-{args.max_experts} experts x {args.restarts} starts x up to "
        f"{args.iters} cycles (annealed; the best {args.keep} starts per topology continue "
        f"after {args.prune_after} cycles); target <= 300 s on 2 cores. "
        f"Speed ratio search / MLP fit: {seconds / mlp_seconds:.1f}. "
        "Timings on a shared, contended 2-core machine.\n"
    )
    if not args.smoke:
        write_results(
            "bhme_kin8nm" + (f"_{args.tag}" if args.tag else ""),
            {
                "rows": rows,
                "paper": PAPER,
                "selected_topology": str(est.topology_),
                "selected_experts": est.topology_.num_experts,
                "best_bound_per_experts": best_per_e,
                "bounds": [float(b) for b in est.bounds_],
                "topologies": [str(t) for t in est.topologies_],
                "search_seconds": seconds,
                "mlp_seconds": mlp_seconds,
                "settings": vars(args),
                "torch_threads": torch.get_num_threads(),
            },
            md,
        )


if __name__ == "__main__":
    main()
