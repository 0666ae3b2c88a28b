"""One rank of the multi-process tests of test_distributed.py, started as a plain
process with the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``): ``python _distributed_worker.py MODE OUT_DIR``.

Modes: ``fit`` (VaRT trained by ``fit`` on tensors, then through a Stream of this
rank's shard; writes the parameters) and ``errors`` (rank 1 passes one row fewer, then
exits; rank 0 then trains again, alone). Errors are written to
``OUT_DIR/rank<r>.err`` instead of being raised.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

from pyro_trees.guides import VaRTGuide
from pyro_trees.infer import Stream, fit, world
from pyro_trees.models import VaRT

N, L = 64, 2


def data(n: int = N):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, L, generator=gen)
    y = torch.where(x[:, 0] > 0, 1.0, -1.0) + 0.1 * torch.randn(n, generator=gen)
    return x, y


def train(x, y, batch: int, steps: int = 6, checkpoint=None):
    model = VaRT(L)
    guide = VaRTGuide(model, depth=2)
    result = fit(
        model,
        guide,
        x,
        y,
        subsample_size=batch,
        num_steps=steps,
        seed=1,
        progress=False,
        checkpoint=checkpoint,
    )
    return {"params": dict(guide.state_dict()), "losses": result.losses}


def stream_train(rank: int, size: int, batch: int, steps: int = 6):
    x, y = data()  # the rows of this rank's batches: rank r takes blocks r, r + size, ...
    shard = [(x[i : i + batch], y[i : i + batch]) for i in range(rank * batch, N, size * batch)]
    model = VaRT(L)
    guide = VaRTGuide(model, depth=2, init="random")  # a data start would see one shard
    result = fit(model, guide, Stream(shard, num_rows=N), num_steps=steps, seed=2, progress=False)
    return {"params": dict(guide.state_dict()), "losses": result.losses}


def _record(out: str, name: str, fn) -> None:
    try:
        fn()
    except Exception:
        with open(os.path.join(out, name), "w") as f:
            f.write(traceback.format_exc())


def main(mode: str, out: str) -> None:
    if os.environ.get("FORCE_GROUP"):  # a group of one process: fit's data-parallel path
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    rank, size = world()
    if mode == "fit":
        batch = int(os.environ.get("BATCH", "8"))

        def run():
            ck = os.path.join(out, f"checkpoint{rank}.pt")  # only rank 0 writes
            state = {"fit": train(*data(), batch, checkpoint=ck)}
            state["stream"] = stream_train(rank, size, batch)
            torch.save(state, os.path.join(out, f"rank{rank}.pt"))

        _record(out, f"rank{rank}.err", run)
    elif mode == "errors":
        _record(out, f"rank{rank}.err", lambda: train(*data(N - rank), 8))
        if rank == 1:
            os._exit(3)
        _record(out, f"rank{rank}.dead.err", lambda: train(*data(), 8, steps=50))
        # leave without the interpreter's teardown: destroying a gloo group whose peer
        # has died can end in std::terminate (SIGABRT) after the error was recorded
        # (about one run in 20 on a loaded machine)
        os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
