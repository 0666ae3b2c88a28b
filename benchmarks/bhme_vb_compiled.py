"""The Bayesian HME's VB search with its cycles compiled, against the eager search, on
kin8nm (issue 38: a compiled step for every family).

Protocol: the defaults panel's kin8nm split (``benchmarks.defaults``: a seeded 75/25
split, seed 0; 6,144 training rows), inputs and target standardised on the training
rows, and the search ``BayesianHMERegressor()`` runs at its defaults: every topology with
1 to 5 experts (23), 20 random starts each, up to 200 cycles with each start stopping
once its bound moves by at most ``1e-4 N``, float64, then the grown starts (3 gate
directions per split, up to 100 cycles; :func:`~pyro_trees.infer.grow_selection`).
Three searches in one process on one torch thread: eager; compiled (``compile=True``,
inductor), whose time includes compiling its programs; and compiled again, which reuses
them (a grid search or a refit in the same process). Reported: wall seconds, the cycles
run (restart-cycles summed), seconds per thousand restart-cycles, the programs compiled,
the best topology and the largest difference of any topology's bound from the eager
search's.

Run: ``python -m benchmarks.bhme_vb_compiled`` (about 3 minutes on a 2-core CPU;
``--backend``, ``--max-experts``, ``--restarts``, ``--device cuda`` with ``--name``
for a variant); needs the data cache
(``PYRO_TREES_DATA`` with ``kin8nm``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch._dynamo

from benchmarks._common import markdown_table, write_results
from benchmarks.defaults import load_dataset
from pyro_trees.infer import grow_selection, select_topology
from pyro_trees.topology import enumerate_topologies


def _data(seed: int = 0):
    from sklearn.model_selection import train_test_split

    X, y, _ = load_dataset("kin8nm", None)
    Xtr, _, ytr, _ = train_test_split(X, y, test_size=0.25, random_state=seed)
    Xtr, ytr = np.asarray(Xtr, dtype=np.float64), np.asarray(ytr, dtype=np.float64)
    Xtr = (Xtr - Xtr.mean(0)) / Xtr.std(0)
    ytr = (ytr - ytr.mean()) / ytr.std()
    return torch.as_tensor(Xtr), torch.as_tensor(ytr)


def search(x, t, tops, args, compile):
    """Select, then grow, as ``BayesianHMERegressor`` does; ``(selection, seconds)``."""
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    sel = select_topology(
        x,
        t,
        tops,
        num_restarts=args.restarts,
        num_cycles=200,
        tol=1e-4,
        generator=g,
        compile=compile,
    )
    sel = grow_selection(
        x, t, sel, starts_per_split=3, num_cycles=100, tol=1e-4, generator=g, compile=compile
    )
    return sel, time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--max-experts", type=int, default=5)
    p.add_argument("--restarts", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--name", default="bhme_vb_compiled")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    x, t = (v.to(args.device) for v in _data())
    tops = enumerate_topologies(args.max_experts, 1)
    runs = [("eager", False), ("compiled", args.backend), ("compiled again", args.backend)]
    records, eager_bounds = [], None
    for label, compile in runs:
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        sel, secs = search(x, t, tops, args, compile)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        bounds = sel.bounds.detach()
        if eager_bounds is None:
            eager_bounds = bounds
        records.append(
            {
                "run": label,
                "seconds": secs,
                "cycles": int(sel.cycles),
                "s per 1k cycles": 1000 * secs / max(1, int(sel.cycles)),
                "programs compiled": int(graphs),
                "best topology": str(sel.topologies[sel.best]),
                "largest bound difference from eager": float((bounds - eager_bounds).abs().max()),
            }
        )
        print(records[-1], flush=True)
    md = (
        f"kin8nm, {x.shape[0]} training rows, {len(tops)} topologies (1-{args.max_experts} "
        f"experts), {args.restarts} starts each, one torch thread, device {args.device}; backend "
        f"`{args.backend}`. Protocol in `benchmarks/bhme_vb_compiled.py`.\n\n"
        + markdown_table(records, list(records[0]))
    )
    path = write_results(args.name, {"records": records}, md, args.device, args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
