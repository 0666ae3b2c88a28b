"""``benchmarks/step_cost.py`` measures what it says: one tiny cell gives a positive time
per step and positive operator counts; a cell over the cap is reported, not dropped."""

from __future__ import annotations

import pytest
import torch

from benchmarks import step_cost


def test_a_tiny_cell_has_positive_time_and_counts():
    threads = torch.get_num_threads()
    record = step_cost.measure("vart", 64, threads=1, max_timed=2, profiled=1)
    assert torch.get_num_threads() == threads  # restored
    assert record["status"] == "ok", record
    assert record["ms_per_step"] > 0 and record["steps_timed"] == 2
    assert record["ops"] > 0 and record["leaf_ops"] >= record["ops"] * 0.5
    assert record["host_reads"] >= 1  # fit reads the loss as a float at every step
    row = step_cost.table_row(record)
    assert row["ms/step"] == record["ms_per_step"] and row["status"].startswith("ok")


def test_a_cell_over_the_cap_is_a_row_saying_so():
    record = step_cost.measure("vart", 64, threads=1, max_step_s=0.0, max_timed=2, profiled=1)
    assert record["status"] == "capped" and record["ms_per_step"] > 0
    assert "capped: one step took" in step_cost.table_row(record)["status"]


def test_counts_read_the_profile():
    from torch.profiler import profile

    x = torch.ones(4)
    with profile() as prof:
        float((x * 2).sum())
    counts = step_cost.op_counts(prof.events())
    # mul, sum, item (with _local_scalar_dense inside): three outermost calls
    assert counts["ops"] == 3 and counts["host_reads"] == 1
    assert counts["leaf_ops"] >= 3


@pytest.mark.cuda
def test_a_tiny_cell_on_cuda_counts_kernels():
    record = step_cost.measure("vart", 64, threads=1, device="cuda", max_timed=2, profiled=1)
    assert record["status"] == "ok", record
    assert record["kernels"] > 0 and record["syncs"] >= 1
    assert 0 < record["gpu_busy"] <= 1


def test_the_prediction_is_the_smaller_of_other_threads_and_scaled_rows():
    done = [
        {"family": "f", "rows": 1000, "threads": 1, "batch": 1000, "ms_per_step": 100.0},
        {"family": "f", "rows": 8000, "threads": 1, "batch": 8000, "ms_per_step": 2000.0},
        {"family": "f", "rows": 1000, "threads": 2, "batch": 1000, "ms_per_step": 600.0},
        {"family": "f", "rows": 64000, "threads": 1, "batch": 64000, "status": "skipped"},
    ]
    assert step_cost.predicted_s(done, "f", 8000, 2, 8000) == 2.0  # 1 thread, same rows
    assert step_cost.predicted_s(done, "f", 64000, 1, 64000) == 16.0  # 8000 rows, x8
    assert step_cost.predicted_s(done, "g", 1000, 1, 1000) is None


def test_the_compiled_mode_swaps_in_the_compiled_loss_or_says_there_is_none():
    from pyro_trees.infer import HMEELBO, TreeELBO, VaRTForestELBO

    kwargs = step_cost.mode_kwargs("compiled", {"loss": VaRTForestELBO(), "lr": 0.03})
    assert kwargs["loss"].compile is True and kwargs["lr"] == 0.03
    loss = step_cost.mode_kwargs("compiled", {"loss": HMEELBO(entropy_weight=-1.0)})["loss"]
    assert loss.compile is True and loss.entropy_weight == -1.0  # the family's weights kept
    assert step_cost.mode_kwargs("compiled", {"loss": TreeELBO()}) is None
    assert step_cost.mode_kwargs("eager", {"loss": TreeELBO()})["loss"].__class__ is TreeELBO
    record = step_cost.measure("treevi", 64, threads=1, mode="compiled", max_timed=2, profiled=1)
    assert record["status"] == "n/a" and "no compiled loss" in step_cost.table_row(record)["status"]
