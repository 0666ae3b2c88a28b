"""``python -m pyro_trees.demo``: fit every model on its paper's toy problem.

Prints a summary table with the paper's figure beside ours and writes figures to the
folder given by ``--out`` (default ``demo_output``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import time
import traceback
from pathlib import Path

import torch

import pyro_trees.demos

__all__ = ["main"]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main(argv=None) -> int:
    """Run the demos of :mod:`pyro_trees.demos` and print their summary table.

    :param argv: command-line arguments (``--out DIR``, ``--smoke``, ``--only NAME ...``);
        ``None`` reads ``sys.argv``.
    :returns: the exit status: 0, or 1 when a demo raised (the others still run).
    :rtype: int
    """
    names = sorted(m.name for m in pkgutil.iter_modules(pyro_trees.demos.__path__))
    parser = argparse.ArgumentParser(
        prog="python -m pyro_trees.demo", description=__doc__.replace("``", "")
    )
    parser.add_argument("--out", default="demo_output", help="folder for figures")
    parser.add_argument("--smoke", action="store_true", help="tiny runs (for tests)")
    parser.add_argument(
        "--only",
        nargs="*",
        choices=names,
        metavar="NAME",
        help=f"demos to run (default: all): {', '.join(names)}",
    )
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()  # the caller's, put back at the end
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    try:
        return _run_demos(args, names)
    finally:
        torch.set_num_threads(threads)


def _run_demos(args, names) -> int:
    """Run the demos ``names`` with the parsed ``args``; the exit status of :func:`main`."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        names = [n for n in names if n in args.only]
    rows, failed = [], []
    start = time.perf_counter()
    for name in names:
        print(f"== {name}", flush=True)
        try:
            module = importlib.import_module(f"pyro_trees.demos.{name}")
            rows += module.run(out / name, smoke=args.smoke)
        except Exception:  # a demo that breaks must not hide the others
            traceback.print_exc()
            failed.append(name)
    header = ["model", "task", "metric", "paper", "ours", "seconds"]
    table = [header] + [[_fmt(r.get(h)) for h in header] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for k, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\nfigures and rules in {out.resolve()}  ({time.perf_counter() - start:.0f} s)")
    if failed:
        print(f"demos that failed: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
