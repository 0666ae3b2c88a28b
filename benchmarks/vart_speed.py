"""VaRT training cost: ``Trace_ELBO`` against the vectorised ``VaRTELBO``, paired.

Run from the repository root: ``python -m benchmarks.vart_speed``. For each data set and
depth, ``VaRTRegressor`` is fitted twice with the same seed and a fixed number of steps
(no early stopping), once with ``elbo="trace"`` (Pyro's per-site ``Trace_ELBO``, the
training path before the vectorised ELBO) and once with ``elbo="vectorised"``; the
table gives the milliseconds per step of each and their ratio. Both estimate the same
lambda-weighted ELBO (tests check equal values and gradients on the same draws); the
runs differ only in the order of the random draws, so the RMSE columns agree up to
Monte Carlo noise. Single-threaded; the machine may be shared (load printed).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.datasets import load_uci
from pyro_trees.estimators import VaRTRegressor


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default="servo,autompg,concrete,skillcraft")
    p.add_argument("--depths", default="3,5")
    p.add_argument("--num-steps", type=int, default=200)
    p.add_argument("--name", default="vart_speed")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.datasets.split(","):
        X, y, mask = load_uci(name)
        y = (y - y.min()) / (y.max() - y.min())
        te = mask[:, 0]
        for depth in (int(d) for d in args.depths.split(",")):
            row = {"dataset": name, "n train": int((~te).sum()), "depth": depth}
            for elbo in ("trace", "vectorised"):
                est = VaRTRegressor(
                    depth=depth,
                    num_steps=args.num_steps,
                    patience=None,
                    refit=False,  # one fit: the per-step time of the ELBO alone
                    elbo=elbo,
                    random_state=0,
                )
                t = time.perf_counter()
                est.fit(X[~te], y[~te])
                secs = time.perf_counter() - t
                rmse = float(np.sqrt(np.mean((est.predict(X[te]) - y[te]) ** 2)))
                ms = 1000 * est.fit_result_.seconds / est.fit_result_.num_steps
                row[f"{elbo} ms/step"] = ms
                row[f"{elbo} fit s"] = secs
                row[f"{elbo} RMSE"] = rmse
            row["speed-up per step"] = row["trace ms/step"] / row["vectorised ms/step"]
            rows.append(row)
            print(row, flush=True)
    md = (
        f"{args.num_steps} ClippedAdam steps per fit (no early stopping), split 0, 1 "
        "thread; `fit s` includes the held-out noise calibration and the first step. "
        f"1-minute load average at the end: {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs (a shared machine: compare ratios, not seconds).\n\n"
        + markdown_table(rows)
    )
    path = write_results(args.name, {"args": vars(args), "rows": rows}, md)
    print(md)
    print(f"written {path}")


if __name__ == "__main__":
    main()
