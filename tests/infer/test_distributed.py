"""Data-parallel training: rank_subsample and RankSubsample in one process, and real
multi-process gloo runs of ``fit`` (processes started as torchrun starts them)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyro
import pytest
import torch

from pyro_trees.infer import (
    RankSubsample,
    Stream,
    all_reduce_sum,
    average_gradients,
    check_same_across_ranks,
    rank_subsample,
    world,
)

WORKER = Path(__file__).with_name("_distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]


# --- one process -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rank_subsample_disjoint_and_covering(world_size):
    size, batch = 24, 4
    per_epoch = size // (world_size * batch)
    for epoch in range(2):
        seen = torch.cat(
            [
                rank_subsample(size, batch, step, 7, rank, world_size)
                for step in range(epoch * per_epoch, (epoch + 1) * per_epoch)
                for rank in range(world_size)
            ]
        )
        assert len(seen) == len(set(seen.tolist()))  # disjoint
        if size % (world_size * batch) == 0:
            assert sorted(seen.tolist()) == list(range(size))  # covers the rows


def test_rank_subsample_deterministic_and_union_of_ranks():
    a = rank_subsample(100, 5, 3, seed=1, rank=0, world_size=2)
    assert torch.equal(a, rank_subsample(100, 5, 3, seed=1, rank=0, world_size=2))
    assert not torch.equal(a, rank_subsample(100, 5, 3, seed=2, rank=0, world_size=2))
    both = torch.cat([rank_subsample(100, 5, 3, 1, r, 2) for r in range(2)])
    assert torch.equal(both, rank_subsample(100, 10, 3, 1, rank=0, world_size=1))
    # a new epoch, a new permutation
    assert not torch.equal(rank_subsample(10, 5, 0, 1, 0, 1), rank_subsample(10, 5, 2, 1, 0, 1))


def test_rank_subsample_errors():
    with pytest.raises(ValueError, match="exceed the 10 rows"):
        rank_subsample(10, 6, 0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank must lie"):
        rank_subsample(10, 2, 0, rank=2, world_size=2)


def test_rank_subsample_handler_same_rows_in_model_and_guide():
    def model():
        with pyro.plate("data", 20, subsample_size=4) as idx:
            pass
        with pyro.plate("nodes", 3) as nodes:  # not subsampled: untouched
            pass
        return idx, nodes

    handler = RankSubsample(seed=3, rank=1, world_size=2)
    with handler:
        handler.step = 2
        idx, nodes = model()
        idx2, _ = model()
    assert torch.equal(idx, rank_subsample(20, 4, 2, 3, 1, 2)) and torch.equal(idx, idx2)
    assert nodes.tolist() == [0, 1, 2] and handler.used


def test_primitives_in_one_process():
    assert world() == (0, 1)
    w = torch.nn.Parameter(torch.ones(2))
    (2 * w).sum().backward()
    assert average_gradients([w], 1.5) == 1.5 and w.grad.tolist() == [2.0, 2.0]
    assert all_reduce_sum(torch.ones(1)).tolist() == [1.0]
    check_same_across_ranks(3, "anything")


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL may be usable here")
def test_an_unavailable_backend_is_an_error_naming_the_rank(monkeypatch):
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PYRO_TREES_DIST_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match=r"rank 1: backend 'nccl' unavailable"):
        world()
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="RANK unset"):
        world()
    monkeypatch.setenv("PYRO_TREES_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="PYRO_TREES_DIST_TIMEOUT"):
        from pyro_trees.infer.distributed import timeout

        timeout()


def test_stream_needs_a_plate_and_a_reiterable():
    from pyro.infer.autoguide import AutoNormal

    from pyro_trees.infer import fit

    def model(y):
        mu = pyro.sample("mu", pyro.distributions.Normal(0.0, 1.0))
        with pyro.plate("rows", len(y)):
            pyro.sample("obs", pyro.distributions.Normal(mu, 1.0), obs=y)

    with pytest.raises(ValueError, match="re-iterable"):
        Stream(iter([torch.zeros(2)]), num_rows=4)
    with pytest.raises(ValueError, match="plate named 'data'"):
        fit(model, AutoNormal(model), Stream([torch.zeros(2)], 4), num_steps=1, progress=False)


def test_stream_scales_to_the_global_rows():
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoDelta

    def model(y):
        mu = pyro.sample("mu", pyro.distributions.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", pyro.distributions.Normal(mu, 1.0), obs=y)

    y = torch.arange(8.0)
    guide = AutoDelta(model)
    with pyro.get_param_store().scope():
        full = Trace_ELBO().differentiable_loss(model, guide, y)
        with Stream([y[:4]], num_rows=8).scale():
            half = Trace_ELBO().differentiable_loss(model, guide, y[:4])
        with Stream([y[4:]], num_rows=8).scale():
            other = Trace_ELBO().differentiable_loss(model, guide, y[4:])
    # the two halves, each scaled to 8 rows, average to the full loss
    assert torch.allclose((half + other) / 2, full)


# --- several processes ---------------------------------------------------------------


def _start(mode: str, world_size: int, out: Path, **env) -> list:
    """Start ``world_size`` worker processes as torchrun would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    base.update(WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    base.update({"PYRO_TREES_DIST_TIMEOUT": "20", **env})
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    procs = []
    for r in range(world_size):
        with open(logs[r], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), mode, str(out)],
                    env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _wait(procs, mode: str, out: Path, timeout: float = 60) -> list:
    """The workers' return codes (failing the test when a ``fit`` worker failed)."""
    world_size = len(procs)
    logs = [out / f"rank{r}.log" for r in range(world_size)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r in range(world_size):
        err = out / f"rank{r}.err"
        if mode == "fit" and (err.exists() or codes[r] != 0):
            text = err.read_text() if err.exists() else ""
            pytest.fail(f"rank {r} failed:\n{text}\n{logs[r].read_text()}")
    return codes


def _launch(mode: str, world_size: int, out: Path, timeout: float = 60, **env) -> list:
    return _wait(_start(mode, world_size, out, **env), mode, out, timeout)


def test_fit_two_ranks_equal_one_process_on_the_same_global_batches(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    # two ranks of 8 rows a step, and one process (a group of one) with 16
    procs_two = _start("fit", 2, two, BATCH="8")
    procs_one = _start("fit", 1, one, BATCH="16", FORCE_GROUP="1")
    assert _wait(procs_two, "fit", two) == [0, 0]
    assert _wait(procs_one, "fit", one) == [0]
    assert (two / "checkpoint0.pt").exists() and not (two / "checkpoint1.pt").exists()
    r0, r1 = (torch.load(two / f"rank{r}.pt") for r in range(2))
    ref = torch.load(one / "rank0.pt")
    for key, value in r0["fit"]["params"].items():
        assert torch.equal(value, r1["fit"]["params"][key]), key  # identical on the ranks
        assert torch.allclose(value, ref["fit"]["params"][key], atol=1e-5), key
    assert r0["fit"]["losses"] == r1["fit"]["losses"]
    assert r0["fit"]["losses"] == pytest.approx(ref["fit"]["losses"], rel=1e-5)
    for key, value in r0["stream"]["params"].items():  # a Stream of each rank's shard
        assert torch.equal(value, r1["stream"]["params"][key]), key
        assert torch.allclose(value, ref["stream"]["params"][key], atol=1e-5), key


def test_mismatched_rows_and_a_dead_rank_are_errors_naming_the_rank(tmp_path):
    # rank 1 passes one row fewer (both ranks raise), then exits; rank 0 trains again
    # and must fail within the timeout instead of waiting for it forever
    codes = _launch("errors", 2, tmp_path, PYRO_TREES_DIST_TIMEOUT="10")
    assert codes == [0, 3]
    for r in range(2):
        err = (tmp_path / f"rank{r}.err").read_text()
        assert "differs across ranks" in err and "rank 1 has" in err
    err = (tmp_path / "rank0.dead.err").read_text()
    assert "rank 0 of 2" in err and "failed" in err
