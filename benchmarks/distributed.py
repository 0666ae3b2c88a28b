"""Data-parallel VaRT with ``torchrun``: wall time per epoch and final RMSE at 1, 2 and 4
processes on 1M synthetic rows.

Run from the repository root: ``python -m benchmarks.distributed`` (about 5 to 10
minutes on 2 CPU cores; ``--rows``, ``--epochs``, ``--procs`` to change the defaults,
``--device cuda`` for GPUs, one per process, NCCL). For each number of processes ``W``
it launches ``python -m torch.distributed.run --standalone --nproc_per_node=W`` on this
file's worker, which trains ``fit(VaRT(8), VaRTGuide(model), Stream(rows, num_rows=N))``
with every default (depth 3, ClippedAdam, lr 0.01), each rank streaming its own shard
of synthetic rows generated batch by batch (``SyntheticRows`` of ``benchmarks/_common.py``), 1024
rows per rank and step: an epoch is ``N / (1024 W)`` steps. Time per epoch: ``fit``'s
loop seconds (start-up excluded) over the epochs. RMSE: rank 0's posterior mean
(``Predictive``, 32 draws, site ``mean``) on 20,000 held-out rows (noise sd 0.1).
Speed-up: time per epoch at 1 process over that at ``W``, in the same run. One torch
thread per process; the machine's cores are shared with other jobs, and 4 processes
on 2 cores oversubscribe them, so the 4-process figure measures contention, not
scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BATCH = 1024
HELD_OUT = 20_000


def worker(rows: int, epochs: int, out: str, device: str | None) -> None:
    import torch
    from pyro.infer import Predictive

    from benchmarks._common import IN_FEATURES, SyntheticRows, synthetic_rows
    from pyro_trees.guides import VaRTGuide
    from pyro_trees.infer import Stream, fit, is_main, world
    from pyro_trees.models import VaRT

    torch.set_num_threads(1)
    rank, size = world(device)
    steps = epochs * (rows // (BATCH * size))
    model = VaRT(IN_FEATURES)
    guide = VaRTGuide(model)
    data = Stream(SyntheticRows(rows, BATCH, seed=0, rank=rank, world_size=size), rows)
    t0 = time.perf_counter()
    result = fit(model, guide, data, num_steps=steps, seed=0, device=device, progress=False)
    total = time.perf_counter() - t0
    if not is_main():
        return
    x, y = synthetic_rows(0, HELD_OUT, seed=1)
    dev = next(guide.parameters()).device
    with torch.no_grad():
        pred = Predictive(model, guide=guide, num_samples=32, return_sites=["mean"])
        mean = pred(x.to(dev))["mean"].mean(0).cpu()
    record = {
        "processes": size,
        "steps": steps,
        "epochs": epochs,
        "seconds_per_epoch": result.seconds / epochs,
        "seconds_with_startup": total,
        "rmse": float((mean - y).pow(2).mean().sqrt()),
        "final_loss_per_row": sum(result.losses[-20:]) / 20 / rows,
    }
    with open(out, "w") as f:
        json.dump(record, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--device", default=None)
    parser.add_argument("--worker", metavar="OUT")
    args = parser.parse_args()
    if args.worker:
        worker(args.rows, args.epochs, args.worker, args.device)
        return

    from benchmarks._common import markdown_table, write_results

    records = []
    load_before = os.getloadavg()[0]
    for w in [int(p) for p in args.procs.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={w}",
                "-m",
                "benchmarks.distributed",
                "--rows",
                str(args.rows),
                "--epochs",
                str(args.epochs),
                "--worker",
                out,
            ]
            if args.device:
                cmd += ["--device", args.device]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            subprocess.run(cmd, check=True, env=env, timeout=1800)
            with open(out) as f:
                records.append(json.load(f))
        records[-1]["load_average_after"] = os.getloadavg()[0]
        print(records[-1], flush=True)
    base = records[0]["seconds_per_epoch"]
    for r in records:
        r["speedup"] = base / r["seconds_per_epoch"]
    md = markdown_table(
        records,
        [
            "processes",
            "steps",
            "seconds_per_epoch",
            "speedup",
            "rmse",
            "final_loss_per_row",
            "seconds_with_startup",
            "load_average_after",
        ],
    )
    cores = os.cpu_count()
    backend = "NCCL on one GPU per process" if args.device else "gloo on CPU"
    md += (
        f"\nVaRT (depth 3, every default) on {args.rows:,} synthetic rows (8 inputs), "
        f"{args.epochs} epoch(s), {BATCH} rows per process and step, each process "
        f"streaming its own shard; {backend}, one torch thread per "
        f"process, {cores} cores (other jobs show in the load averages)"
        + (", so 4 processes oversubscribe them" if cores and cores < 4 else "")
        + ". Speed-up: seconds per epoch at 1 process over those at W processes. With W "
        "processes an epoch takes W times fewer steps, so the RMSE after one epoch "
        "reflects fewer (larger-batch) updates. The RMSE floor is the noise sd, 0.1. "
        f"Load average (1 min) before the run: {load_before:.1f}, on {cores} cores.\n"
    )
    payload = {
        "rows": args.rows,
        "epochs": args.epochs,
        "batch_per_process": BATCH,
        "device": args.device or "cpu",
        "load_average_before": load_before,
        "records": records,
    }
    print(write_results("distributed", payload, md, device=args.device))


if __name__ == "__main__":
    main()
