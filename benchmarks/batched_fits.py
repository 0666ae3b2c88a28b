"""Whether several fits trained as one batched program would pay on a CPU (issue 38, item 3:
the forest's ``num_fits`` pooled fits as a leading batch dimension).

Run from the repository root: ``python -m benchmarks.batched_fits`` (about a minute on one
thread); ``--rows``, ``--fits``, ``--trees`` choose the cells. Results:
``results/batched_fits.{json,md}``.

A batched program of ``F`` forests of ``K`` trees does the arithmetic of one forest of
``F K`` trees and dispatches its operations once. So each cell times, on one CPU thread,
``F`` eager steps of a ``K``-tree forest one after another (what ``num_fits`` does
today) against one eager step of an ``F K``-tree forest on the same rows (an upper bound
on what batching the fits could save: a batched program would also carry each fit's own
rows and noise scale). A step is :class:`~pyro_trees.infer.VaRTForestELBO`'s loss, its
backward pass and the fused Adam step, full batch, depth 3, 8 inputs. Rounds of the two
alternate; the medians are reported, and ``saving`` is one minus their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pyro
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.guides import VaRTForestGuide
from pyro_trees.infer import FusedClippedAdam, VaRTForestELBO, keep_freed_memory
from pyro_trees.models import VaRTForest

ROWS = (200, 1000, 2048)


def _stepper(num_trees: int, x: torch.Tensor, y: torch.Tensor):
    """One eager training step of a forest of ``num_trees`` trees on ``(x, y)`` (call it
    under ``module_local_params``, as the estimators train: each guide its own
    parameters)."""
    model = VaRTForest(x.shape[1], num_trees=num_trees, depth=3)
    guide = VaRTForestGuide(model)
    guide(x[:10], y[:10])
    trees = guide.params(x)["split_logits"].shape[0]
    if trees != num_trees:  # parameters shared through Pyro's global store
        raise RuntimeError(f"the guide has {trees} trees, not {num_trees}")
    optim = FusedClippedAdam(list(guide.parameters()), lr=1e-3)
    loss = VaRTForestELBO()

    def step():
        optim.zero_grad()
        loss.differentiable_loss(model, guide, x, y).backward()
        optim.step()

    return step


def _sequence(steps: list):
    """The steps one after another."""

    def run():
        for step in steps:
            step()

    return run


def _seconds(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def cell(rows: int, fits: int, trees: int, rounds: int = 7, steps: int = 20) -> dict:
    """``fits`` sequential ``trees``-tree steps against one ``fits * trees``-tree step."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=gen)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(rows, generator=gen)
    local = pyro.settings.context(module_local_params=True)
    with local, pyro.validation_enabled(False):
        singles = [_stepper(trees, x, y) for _ in range(fits)]
        wide = _stepper(fits * trees, x, y)
        sequential = _sequence(singles)
        for fn in (sequential, wide):  # warm-up
            _seconds(fn, 3)
        seq, bat = [], []
        for _ in range(rounds):
            seq.append(_seconds(sequential, steps))
            bat.append(_seconds(wide, steps))
    s, b = statistics.median(seq), statistics.median(bat)
    return {
        "rows": rows,
        "fits": fits,
        "trees": trees,
        "sequential ms": 1000 * s,
        "one batched ms": 1000 * b,
        "saving": 1 - b / s,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--fits", type=int, default=3)
    p.add_argument("--trees", type=int, default=20)
    p.add_argument("--name", default="batched_fits")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    table = []
    for rows in [int(v) for v in args.rows.split(",")]:
        table.append(cell(rows, args.fits, args.trees))
        print(markdown_table(table[-1:]).splitlines()[-1], flush=True)
    md = (
        f"{args.fits} eager training steps of a {args.trees}-tree VaRT forest (depth 3, 8 "
        f"inputs, full batch), one after another as `num_fits={args.fits}` runs them, "
        f"against one step of a {args.fits * args.trees}-tree forest on the same rows (the "
        "arithmetic of a batched program of the fits, its operations dispatched once: an "
        "upper bound on what batching saves). One CPU thread, freed memory kept; medians "
        "of 7 alternating rounds of 20 steps. `saving`: one minus the ratio.\n\n"
        + markdown_table(table)
    )
    path = write_results(args.name, {"cells": table}, md, "cpu", args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
