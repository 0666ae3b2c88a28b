"""8-level pulse (Antorán et al., F.1): the RNN-Tree at depth 3 vs CART at depth 3.

Run: ``python -m benchmarks.hme_pulse [--seeds 10] [--steps 600]``. Writes
``benchmarks/results/hme_pulse.{json,md}``.

Test MSE is measured on a dense grid of 4,001 points. The training inputs are a grid of
400 points, so each boundary lies in a gap of width 8/399 that no training point
resolves; the "oracle" row is the best any tree can do from these data (thresholds at
the midpoints of those gaps), a floor under every test MSE.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks._common import make_peer, markdown_table, write_results
from pyro_trees.datasets import make_pulse, pulse_function
from pyro_trees.estimators import RNNTreeRegressor

PAPER = "RNN-Tree fits all 8 regions 'almost perfectly'; CART at depth 3 uses 5 regions"


def oracle_mse(x_train: np.ndarray, x_test: np.ndarray) -> float:
    edges = np.arange(-3, 4)
    thresholds = []
    for e in edges:
        below = x_train[x_train < e].max()
        above = x_train[x_train >= e].min()
        thresholds.append(0.5 * (below + above))
    bins = np.searchsorted(np.asarray(thresholds), x_test, side="right")
    levels = pulse_function(np.arange(-4, 4) + 0.5)
    return float(np.mean((levels[bins] - pulse_function(x_test)) ** 2))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    X, y = make_pulse(400)
    x_test = np.linspace(-4, 4, 4001)
    y_test = pulse_function(x_test)
    rows, runs = [], []
    configs = {
        "RNN-Tree (entropy_weight=-1, eq. 22 sign)": dict(entropy_weight=-1.0),
        "RNN-Tree (eq. 22 sign, refit_leaves=True)": dict(entropy_weight=-1.0, refit_leaves=True),
        "RNN-Tree (entropy_weight=1, the ELBO)": dict(entropy_weight=1.0),
        "RNN-Tree (paper's soft feedback, eq. 14)": dict(entropy_weight=-1.0, feedback="soft"),
        "RNN-Tree (no balanced init)": dict(entropy_weight=-1.0, init="random"),
    }
    for name, cfg in configs.items():
        n_seeds = args.seeds if "eq. 22 sign" in name else max(1, args.seeds // 2)
        for seed in range(n_seeds):
            t0 = time.perf_counter()
            est = RNNTreeRegressor(3, random_state=seed, num_steps=args.steps, **cfg).fit(X, y)
            seconds = time.perf_counter() - t0
            runs.append(
                {
                    "method": name,
                    "seed": seed,
                    "regions": len(set(est.apply(x_test[:, None]).tolist())),
                    "train_mse": float(np.mean((est.predict(X) - y) ** 2)),
                    "test_mse": float(np.mean((est.predict(x_test[:, None]) - y_test) ** 2)),
                    "seconds": seconds,
                }
            )
    t0 = time.perf_counter()
    cart = make_peer("CART", "regression", seed=0, depth=3).fit(X, y)
    cart_seconds = time.perf_counter() - t0
    runs.append(
        {
            "method": "CART depth 3",
            "seed": 0,
            "regions": len(set(cart.apply(x_test[:, None]).tolist())),
            "train_mse": float(np.mean((cart.predict(X) - y) ** 2)),
            "test_mse": float(np.mean((cart.predict(x_test[:, None]) - y_test) ** 2)),
            "seconds": cart_seconds,
        }
    )
    floor = oracle_mse(X[:, 0], x_test)
    for name in list(configs) + ["CART depth 3"]:
        rs = [r for r in runs if r["method"] == name]
        ok = sum(r["regions"] == 8 and r["test_mse"] <= 0.01 for r in rs)
        ok_train = sum(r["regions"] == 8 and r["train_mse"] <= 0.01 for r in rs)
        ok_floor = sum(r["regions"] == 8 and r["test_mse"] <= floor + 0.01 for r in rs)
        rows.append(
            {
                "method": name,
                "runs": len(rs),
                "8 regions": sum(r["regions"] == 8 for r in rs),
                "median train MSE": float(np.median([r["train_mse"] for r in rs])),
                "median test MSE": float(np.median([r["test_mse"] for r in rs])),
                "runs train MSE <= 0.01": ok_train,
                "runs test MSE <= 0.01": ok,
                "runs test MSE <= oracle + 0.01": ok_floor,
                "median seconds": float(np.median([r["seconds"] for r in rs])),
            }
        )
    rows.append(
        {
            "method": "oracle tree (thresholds mid-gap)",
            "runs": 1,
            "8 regions": 1,
            "median train MSE": 0.0,
            "median test MSE": floor,
        }
    )
    md = (
        f"Paper: {PAPER}.\n\nGoal (issue): all 8 regions and test MSE <= 0.01 in >= 8 of 10 "
        f"seeds. The test-MSE floor that these 400 training inputs allow is {floor:.4f}: "
        "test MSE is measured on a dense grid of 4,001 points, so no tree fitted to "
        "these data can reach 0.01 there; 'train MSE' is the MSE on the 400 inputs F.1 "
        "defines. `refit_leaves=True` gives the hard tree's leaves the means of its own "
        "partition of the training points; the other rows keep the experts as trained "
        "under soft routing (the paper).\n\n" + markdown_table(rows)
    )
    write_results(
        "hme_pulse",
        {"rows": rows, "runs": runs, "oracle_test_mse": floor},
        md,
        args=vars(args),
    )
    print(md)
    return {"rows": rows}


if __name__ == "__main__":
    main()
