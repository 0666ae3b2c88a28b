"""What training the VaRT estimators' pooled fits as one stacked program saves on a CPU
(issue 38, item 3), and where it stops paying: the rule behind ``stack_max_rows``.

Run from the repository root: ``python -m benchmarks.stacked_fits`` (about eight minutes
on one thread); ``--rows`` chooses the table sizes, ``--estimators`` the estimators.
Results: ``results/stacked_fits.{json,md}``.

Each cell fits an estimator with three pooled fits on a synthetic table of 8 inputs
(classes: the sign of the regression target), once with the fits stacked
(``stack_max_rows`` above the rows) and once one after another (``stack_max_rows = 0``),
in alternating rounds, one CPU thread, freed memory kept: ``VaRTForestRegressor`` (20
trees of depth 3, three fits each holding out its own fold) and ``VaRTClassifier``
(depth 5, three fits holding out the same rows) at their defaults, and
``VaRTRegressor`` with ``num_fits=3, refit=False`` (its defaults are one fit and a
refit, which never stack). Two arguments are not the defaults for any of them, and the
table says so: ``num_steps=200`` and ``patience=None``, so that both ways train every
fit for the same 200 steps and the ratio is the cost of a step, not of where early
stopping happened to end. (At the defaults a stacked program runs until its last fit
stops, which the UCI benchmark ``vart_forest`` measures.) ``ratio``: stacked over
sequential seconds, medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.estimators import VaRTClassifier, VaRTForestRegressor, VaRTRegressor
from pyro_trees.infer import keep_freed_memory

ROWS = (100, 200, 400, 600, 800, 1000, 1500, 2000)
#: the non-default arguments of every fit (named in the results)
FIXED = {"num_steps": 200, "patience": None}
#: estimator name: (class, its own non-default arguments, task)
ESTIMATORS = {
    "VaRTForestRegressor": (VaRTForestRegressor, {}, "regression"),
    "VaRTClassifier": (VaRTClassifier, {}, "classification"),
    "VaRTRegressor": (VaRTRegressor, {"num_fits": 3, "refit": False}, "regression"),
}


def _table(rows: int, task: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 8))
    y = np.sin(X[:, 0]) + X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=rows)
    return (X, (y > 0).astype(int)) if task == "classification" else (X, y)


def _estimator(name: str, stacked: bool | None = None):
    cls, own, _ = ESTIMATORS[name]
    est = cls(random_state=0, **FIXED, **own)
    if stacked is not None:
        est.stack_max_rows = 10**9 if stacked else 0
    return est


def _fit_seconds(name: str, X, y, stacked: bool) -> float:
    est = _estimator(name, stacked)
    start = time.perf_counter()
    est.fit(X, y)
    return time.perf_counter() - start


def cell(name: str, rows: int, rounds: int) -> dict:
    """Stacked against sequential fit seconds on ``rows`` rows, ``rounds`` rounds each."""
    X, y = _table(rows, ESTIMATORS[name][2])
    est = _estimator(name)
    held = max(int(round(0.1 * rows)), min(10, rows // 5))  # the estimators' rule:
    train = rows - (held if held >= 4 else 0)  # none held out below 4 rows; the fits' rows
    stacked, sequential = [], []
    for _ in range(rounds):
        stacked.append(_fit_seconds(name, X, y, True))
        sequential.append(_fit_seconds(name, X, y, False))
    s, q = statistics.median(stacked), statistics.median(sequential)
    own = ", ".join(f"{k}={v}" for k, v in ESTIMATORS[name][1].items())
    return {
        "estimator": name + (f" ({own})" if own else ""),
        "rows": rows,
        "training rows": train,
        "stacks by default": train <= est.stack_max_rows,
        "sequential s": q,
        "stacked s": s,
        "ratio": s / q,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--estimators", default=",".join(ESTIMATORS))
    p.add_argument("--name", default="stacked_fits")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    table = []
    for name in args.estimators.split(","):
        _fit_seconds(name, *_table(100, ESTIMATORS[name][2]), True)  # first-fit costs
        for rows in [int(v) for v in args.rows.split(",")]:
            table.append(cell(name, rows, args.rounds))
            print(markdown_table(table[-1:]).splitlines()[-1], flush=True)
    limits = ", ".join(f"{n} {ESTIMATORS[n][0].stack_max_rows}" for n in ESTIMATORS)
    md = (
        "Three pooled fits stacked into one program against one after another, on "
        "synthetic tables of 8 inputs (classes: the sign of the target). Every estimator "
        "at its defaults except `num_steps=200` and `patience=None` (every fit trains the "
        "same 200 steps both ways), and `VaRTRegressor` also with `num_fits=3, "
        f"refit=False`. One CPU thread, freed memory kept; medians of {args.rounds} "
        "alternating rounds of whole fits (prediction draws and calibration included). "
        "`training rows`: each fit's; `stacks by default`: whether they are at most the "
        f"estimator's `stack_max_rows` ({limits}); `ratio`: stacked over sequential "
        "seconds.\n\n" + markdown_table(table)
    )
    path = write_results(args.name, {"cells": table, "fixed": FIXED}, md, "cpu", args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
