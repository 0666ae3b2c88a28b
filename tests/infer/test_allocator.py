"""keep_freed_memory: freed blocks stay with the process (no page faults on reuse), once
per process, and never where the process chose its own allocator settings."""

import resource
import sys

import numpy as np
import pytest
import torch

from pyro_trees.infer import allocator, keep_freed_memory

glibc = pytest.mark.skipif(
    allocator._glibc() is None or allocator._leave_alone() is not None,
    reason="needs Linux with glibc (mallopt), its settings left to pyro_trees",
)


def _faults_of_reused_blocks(rounds: int = 20, blocks: int = 6, mib: int = 4) -> int:
    """Minor page faults while a loop allocates and writes ``blocks`` blocks of ``mib`` MiB
    together and frees them, ``rounds`` times (as a training step does)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        live = [torch.empty(mib << 18).fill_(1.0) for _ in range(blocks)]  # 4 bytes each
        del live
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    assert keep_freed_memory()
    _faults_of_reused_blocks(2)  # the heap grows once
    pages = 20 * 6 * (4 << 20) // resource.getpagesize()  # what fresh pages would fault
    assert _faults_of_reused_blocks() < pages // 10


def test_once_per_process(monkeypatch):
    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(allocator, "_state", {"done": None})
    monkeypatch.setattr(allocator, "_glibc", lambda: FakeLibc())
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD", allocator.ENV):
        monkeypatch.delenv(name, raising=False)
    assert keep_freed_memory() and keep_freed_memory()
    assert calls == [(-3, 32 << 20), (-1, 256 << 20)]


@pytest.mark.parametrize(
    "name, value",
    [
        (allocator.ENV, "0"),
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
    ],
)
def test_leaves_the_process_own_choice_alone(monkeypatch, name, value):
    def refuse(*args):
        raise AssertionError("mallopt must not be called")

    monkeypatch.setattr(allocator, "_state", {"done": None})
    monkeypatch.setattr(allocator, "_glibc", lambda: type("Libc", (), {"mallopt": refuse})())
    monkeypatch.setenv(name, value)
    assert keep_freed_memory() is False


def test_nothing_outside_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "_state", {"done": None})
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator._glibc() is None
    assert keep_freed_memory() is False


@glibc
def test_every_estimator_fit_sets_it(monkeypatch):
    from pyro_trees.estimators import VaRTRegressor

    monkeypatch.setattr(allocator, "_state", {"done": None})
    X = np.random.default_rng(0).normal(size=(20, 2))
    VaRTRegressor(num_steps=2, num_samples=2, random_state=0).fit(X, X[:, 0])
    assert allocator._state["done"] is True
