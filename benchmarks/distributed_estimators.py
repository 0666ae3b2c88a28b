"""VaRTRegressor on one and on two processes (``torchrun``, gloo on CPU): test RMSE and
fit time.

Run from the repository root: ``python -m benchmarks.distributed_estimators``. The
script launches ``python -m torch.distributed.run --nproc_per_node=P`` on itself for
``P = 1, 2``; each rank loads the same rows (the cached UCI set, split 0 of its test
masks), fits ``VaRTRegressor`` with its defaults but ``random_state=0``, and rank 0 reports
the test RMSE and the fit time; every rank reports a checksum of its predictions (the
fitted estimator must be the same on every rank). With two processes every rank trains
on half of each global minibatch of 2048 rows and the gradients are averaged, so both
runs take the same number of steps of the same global batch size. One torch thread per
process; the machine may be shared (load printed): compare the ratio, not seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _worker(args) -> None:
    import torch

    from pyro_trees.datasets import load_uci
    from pyro_trees.estimators import VaRTRegressor
    from pyro_trees.infer.distributed import world

    torch.set_num_threads(1)
    rank, size = world()
    X, y, mask = load_uci(args.dataset)
    te = mask[:, 0]
    est = VaRTRegressor(random_state=0)
    t0 = time.perf_counter()
    est.fit(X[~te], y[~te])
    seconds = time.perf_counter() - t0
    pred = est.predict(X[te])
    out = {
        "rank": rank,
        "processes": size,
        "fit_s": seconds,
        "rmse": float(np.sqrt(np.mean((pred - y[te]) ** 2))),
        "steps": len(est.fit_result_.losses),
        "stopping_steps": None
        if est.stopping_result_ is None
        else len(est.stopping_result_.losses),
        "train_s": est.fit_result_.seconds
        + (0.0 if est.stopping_result_ is None else est.stopping_result_.seconds),
        "checksum": hashlib.sha1(np.ascontiguousarray(pred).tobytes()).hexdigest(),
        "n_train": int((~te).sum()),
        "n_test": int(te.sum()),
    }
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(procs: int, dataset: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={procs}",
            "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}",
            "-m",
            "benchmarks.distributed_estimators",
            "--worker",
            out,
            "--dataset",
            dataset,
        ]
        subprocess.run(cmd, env=env, check=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(procs)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="kin40k")
    p.add_argument("--processes", default="1,2")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--name", default="distributed_estimators")
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(args)
    from benchmarks._common import markdown_table, write_results

    rows = []
    for procs in (int(v) for v in args.processes.split(",")):
        ranks = _launch(procs, args.dataset)
        first = ranks[0]
        rows.append(
            {
                "processes": procs,
                "n train": first["n_train"],
                "test RMSE": first["rmse"],
                "fit s": first["fit_s"],
                "steps (final fit)": first["steps"],
                "steps (early stopping)": first["stopping_steps"],
                "train ms/step": 1000
                * first["train_s"]
                / (first["steps"] + (first["stopping_steps"] or 0)),
                "same on every rank": len({r["checksum"] for r in ranks}) == 1,
            }
        )
        print(rows[-1], flush=True)
    base = rows[0]["fit s"], rows[0]["train ms/step"]
    for row in rows:
        row["speed-up (fit)"] = base[0] / row["fit s"]
        row["speed-up (per step)"] = base[1] / row["train ms/step"]
    md = (
        f"`VaRTRegressor(random_state=0)` (defaults) on `uci/{args.dataset}` (split 0), "
        "fitted on P processes launched by `torchrun` (gloo, CPU, one torch thread "
        "each); every rank passes the same rows and trains on its part of each global "
        "minibatch of 2048 rows. `fit s` is rank 0's wall time of `fit` (early stopping, "
        "refit and the noise calibration included); `train ms/step` is the time of the "
        "gradient steps of both fits (early stopping's and the refit's) per step; the "
        "speed-ups are the one-process figures over P processes' in this run (early "
        "stopping may stop the runs after different numbers of steps). 1-minute load "
        "average at the end: "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine: the "
        "processes compete with other work, compare ratios, not seconds).\n\n"
        + markdown_table(rows)
    )
    path = write_results(args.name, {"args": vars(args), "rows": rows}, md)
    print(md)
    print(f"written {path}")


if __name__ == "__main__":
    main()
