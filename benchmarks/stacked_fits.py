"""What training the forest's pooled fits as one stacked program saves on a CPU (issue 38,
item 3), and where it stops paying: the rule behind ``VaRTForestRegressor.stack_max_rows``.

Run from the repository root: ``python -m benchmarks.stacked_fits`` (about four minutes on
one thread); ``--rows`` chooses the table sizes. Results: ``results/stacked_fits.{json,md}``.

Each cell fits ``VaRTForestRegressor`` (its defaults: 20 trees of depth 3, three fits,
each holding out its own tenth of the rows) on a synthetic table of 8 inputs, once with
the fits stacked (``stack_max_rows`` above the rows) and once one after another
(``stack_max_rows = 0``), in alternating rounds, one CPU thread, freed memory kept. Two
arguments are not the defaults, and the table says so: ``num_steps=200`` and
``patience=None``, so that both ways train every fit for the same 200 steps and the
ratio is the cost of a step, not of where early stopping happened to end. (At the
defaults a stacked program runs until its last fit stops, which the UCI benchmark
``vart_forest`` measures.) ``ratio``: stacked over sequential seconds, medians of the
rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.estimators import VaRTForestRegressor
from pyro_trees.infer import keep_freed_memory

ROWS = (100, 200, 400, 600, 800, 1000, 1500, 2000)
#: the non-default arguments of every fit (named in the results)
FIXED = {"num_steps": 200, "patience": None}


def _table(rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 8))
    y = np.sin(X[:, 0]) + X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=rows)
    return X, y


def _fit_seconds(X, y, stacked: bool) -> float:
    est = VaRTForestRegressor(random_state=0, **FIXED)
    est.stack_max_rows = 10**9 if stacked else 0
    start = time.perf_counter()
    est.fit(X, y)
    return time.perf_counter() - start


def cell(rows: int, rounds: int) -> dict:
    """Stacked against sequential fit seconds on ``rows`` rows, ``rounds`` rounds each."""
    X, y = _table(rows)
    est = VaRTForestRegressor(random_state=0, **FIXED)
    train = rows - max(int(round(0.1 * rows)), min(10, rows // 5))  # the fits' rows
    stacked, sequential = [], []
    for _ in range(rounds):
        stacked.append(_fit_seconds(X, y, True))
        sequential.append(_fit_seconds(X, y, False))
    s, q = statistics.median(stacked), statistics.median(sequential)
    return {
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
    p.add_argument("--name", default="stacked_fits")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    _fit_seconds(*_table(100), True)  # the process's first fit pays for imports
    table = []
    for rows in [int(v) for v in args.rows.split(",")]:
        table.append(cell(rows, args.rounds))
        print(markdown_table(table[-1:]).splitlines()[-1], flush=True)
    limit = VaRTForestRegressor.stack_max_rows
    md = (
        "`VaRTForestRegressor` at its defaults (20 trees, depth 3, `num_fits=3`) except "
        f"`num_steps=200` and `patience=None` (every fit trains the same 200 steps both "
        f"ways), on synthetic tables of 8 inputs: the three fits stacked into one program "
        f"against one after another. One CPU thread, freed memory kept; medians of "
        f"{args.rounds} alternating rounds of whole fits (prediction draws and "
        f"calibration included). `training rows`: each fit's; `stacks by default`: "
        f"whether they are at most `stack_max_rows` ({limit}); `ratio`: stacked over "
        "sequential seconds.\n\n" + markdown_table(table)
    )
    path = write_results(args.name, {"cells": table, "fixed": FIXED}, md, "cpu", args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
