"""What one training step costs, family by family (issue 38, item 6): milliseconds per
step, operators per step and host reads per step, on synthetic rows, at 1,000, 16,384
and 131,072 rows, on CPU with 1 thread and with all threads (and, untested so far, on
CUDA: kernels, host synchronisations and the GPU's busy share).

Run from the repository root: ``python -m benchmarks.step_cost`` (about 10 minutes on
2 cores); ``--quick`` for a smoke run (64 rows, few steps; prints its table, writes a
file only with ``--name``); ``--families``, ``--rows``, ``--threads``, ``--device``,
``--modes`` choose the cells. Results: ``results/step_cost.{json,md}`` (any other
``--name``: a variant).

**A step** is :func:`pyro_trees.infer.fit`'s own step, measured inside ``fit``: every
cell calls ``fit`` (its warm-up creates the parameters) with a callback that reads the
clock after each step, so the time between two callbacks is ``zero_grad``, the loss,
``backward``, reading the loss as a float, the optimiser's and the scheduler's steps and
the family's per-step callback, exactly as a training run pays them. Steps 1 and 2 are
warm-up; then up to 20 steps (at least 3, fewer for slow cells: about 2 s of timed
steps) give the median wall time and the median CPU time of the process; then 2 more
steps (1 where a step takes over 2 s) run under :mod:`torch.profiler` for the counts
(profiled steps are not timed).

**Counts, per step** (profiled steps' totals over their number):

* ``ops``: ``aten::`` operator calls with no ``aten::`` operator above them, forward,
  backward (autograd's functions are not ``aten::``, so each backward op counts) and
  optimiser alike: every call the dispatcher receives from Python or from autograd,
  whatever it decomposes into. On a GPU each launches no kernel (a view, an
  allocation), one, or a few (a composite); each costs a dispatch and, in eager mode,
  a pass over memory, which is what a compiler fuses away: the CPU stand-in for
  "kernels per step".
* ``leaf ops``: ``aten::`` calls with no ``aten::`` call inside (the work that runs
  once composites are decomposed; views and allocations included).
* ``host reads``: ``aten::_local_scalar_dense`` calls (``.item()``, ``float(t)``,
  ``bool(t)``...), each a device-to-host copy and a synchronisation on CUDA; on CPU
  they are cheap but counted the same.
* CUDA only (written, not yet run on a GPU): ``kernels`` (GPU activities of the
  profile other than memcpy/memset), ``syncs`` (``cuda*Synchronize`` and blocking
  ``cudaMemcpy`` calls) and ``gpu busy`` (the union of the kernels' intervals over the
  profiled steps' wall time).

**Families** (model, guide, loss, optimiser and schedule as the estimator or the
documented path trains them; float32 unless said): HME + RNN-Tree guide, Bayesian HME
(its SVI path; ``bayesian_hme_program``: the same through
:class:`~pyro_trees.infer.BayesianHMEELBO`), VaRT, VaRT forest, VaRT classification,
heteroscedastic GP, deep GP
(factorised guide; ``deep_gp_program``: the same through
:class:`~pyro_trees.infer.DGPELBO`; ``deep_gp_joint``, ``deep_gp_intermediate`` and their
``_program``: the joint and intermediate guides), TreeVI (``Trace_ELBO``, and
``treevi_program``: the same through :class:`~pyro_trees.infer.TreeVIELBO`);
``benchmarks/_step_cost_families.py`` builds them, each
builder's docstring saying what it follows and leaves out. Rows are
:func:`benchmarks._common.synthetic_rows` (8 features, seed 0); full batch unless the
family's estimator minibatches by default (the VaRT families: ``min(N, 2048)`` rows per
step, as their estimators do).

**Caps** (never silent: each capped or skipped cell is a row of the table saying why):
a cell whose second step takes more than ``--max-step-s`` seconds (default 15) stops
there (``capped``: that one step's time, no median, no counts); a cell whose step is
predicted over that limit is not run (``skipped``), the prediction being the smaller
of the same family's time at the same rows on other thread counts and its time at the
last row count on these threads scaled by the rows per step; a cell that
raises (e.g. out of memory) is a ``failed`` row with the error.

**Modes**: ``eager``, the family's training as its estimator runs it on the CPU; and
``compiled``, the same with the family's loss compiled (``compile=True``, the default
``inductor`` backend: :mod:`pyro_trees.infer.compiled`), where it has a compiled loss
(the VaRT families, the HME, the heteroscedastic GP and the ``_program`` families; the
others are ``n/a`` rows). A compiled
cell's ``first s`` is its first step, compilation included; its steps are timed after the
warm-up steps, as the eager cells'. Rows of one batch size share one program, so a later
cell of the same family and batch compiles nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import re
import statistics
import time
import warnings

import pyro
import torch

from benchmarks._common import markdown_table, write_results
from benchmarks._step_cost_families import FAMILIES, rows_per_step
from pyro_trees.infer import fit, isolated_params
from pyro_trees.infer.compiled import CompilesLoss

ROWS = (1_000, 16_384, 131_072)
QUICK_ROWS = (64,)
MAX_TIMED = 20
MIN_TIMED = 3
WARMUP = 2
PROFILED = 2
TIMED_BUDGET_S = 2.0
MAX_STEP_S = 15.0
#: the modes of the module docstring
MODES = ("eager", "compiled")


def mode_kwargs(mode: str, fit_kwargs: dict) -> dict | None:
    """``fit``'s keyword arguments of a family in ``mode`` (``None``: the family has no
    compiled loss)."""
    if mode == "eager":
        return fit_kwargs
    loss = fit_kwargs.get("loss")
    if not isinstance(loss, CompilesLoss):
        return None
    weights = {
        k: getattr(loss, k)
        for k in ("balance_weight", "entropy_weight", "num_particles")
        if hasattr(loss, k) and k in inspect.signature(type(loss)).parameters
    }
    return {**fit_kwargs, "loss": type(loss)(**weights, compile=True)}


# ----------------------------------------------------------------------------- counts


def _is_aten(event) -> bool:
    return event.name.startswith("aten::")


def op_counts(events) -> dict:
    """Totals over a profile's ``events`` (:meth:`torch.profiler.profile.events`): outermost
    ``aten::`` calls, leaf ``aten::`` calls and host reads (see the module docstring)."""
    outer = leaf = reads = 0
    for e in events:
        if not _is_aten(e):
            continue
        parent = e.cpu_parent
        while parent is not None and not _is_aten(parent):
            parent = parent.cpu_parent
        outer += parent is None
        leaf += not any(_is_aten(c) for c in e.cpu_children)
        reads += e.name == "aten::_local_scalar_dense"
    return {"ops": outer, "leaf_ops": leaf, "host_reads": reads}


_OWN_SYNC = "step_cost::drain"  # the benchmark's own synchronisation, not counted


def cuda_counts(events, wall_us: float) -> dict:
    """GPU kernels, host synchronisations and the GPU's busy share of ``wall_us``
    microseconds, from a profile's ``events`` (the benchmark's own synchronisation at
    the end of the profile left out). Untested: written for CUDA runs, never run on a
    GPU yet."""
    from torch.autograd import DeviceType

    spans, kernels, syncs = [], 0, 0
    for e in events:
        if e.device_type == DeviceType.CUDA:
            if not e.name.startswith(("Memcpy", "Memset")):
                kernels += 1
                spans.append((e.time_range.start, e.time_range.end))
        elif "Synchronize" in e.name or e.name == "cudaMemcpy":
            own = e.cpu_parent is not None and e.cpu_parent.name == _OWN_SYNC
            syncs += not own
    busy, end = 0.0, -math.inf
    for lo, hi in sorted(spans):  # the union of the kernels' intervals
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return {"kernels": kernels, "syncs": syncs, "gpu_busy": busy / wall_us if wall_us else None}


# ----------------------------------------------------------------------------- one cell


class _Clock:
    """``fit``'s callback for one cell: warm-up steps, timed steps, profiled steps.

    Step ``k``'s time is the interval between the callbacks after steps ``k - 1`` and
    ``k``. The second step decides: over ``max_step_s`` the fit stops (capped); else
    it fixes the number of timed steps (about ``TIMED_BUDGET_S`` of them, between
    ``MIN_TIMED`` and ``MAX_TIMED``) and the profiler runs over the ``profiled`` steps
    after them."""

    def __init__(self, family_cb, cuda: bool, max_step_s: float, max_timed: int, profiled: int):
        self.family_cb, self.cuda = family_cb, cuda
        self.max_step_s, self.max_timed, self.profiled = max_step_s, max_timed, profiled
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.capped = None
        self.timed = None
        self.prof = None
        self.events = None
        self.wall_us = 0.0
        self.last = self.start = time.perf_counter()
        self.last_cpu = time.process_time()
        self.first_s = None

    def _now(self) -> float:
        if self.cuda and self.prof is None:
            torch.cuda.synchronize()
        return time.perf_counter()

    def __call__(self, step: int, loss: float) -> bool:
        if self.family_cb is not None:
            self.family_cb(step, loss)
        now, cpu = self._now(), time.process_time()
        span, self.last = now - self.last, now
        cpu_span, self.last_cpu = cpu - self.last_cpu, cpu
        last_timed = WARMUP - 1 + (self.timed or 0)
        if step == 0:
            self.first_s = now - self.start  # fit's warm-up evaluation and step 1
        elif step == WARMUP - 1:
            if span > self.max_step_s:
                self.capped = span
                return True
            fits = int(TIMED_BUDGET_S / max(span, 1e-9))
            self.timed = max(min(MIN_TIMED, self.max_timed), min(self.max_timed, fits))
            if span > TIMED_BUDGET_S:  # a slow cell: its counts from one step
                self.profiled = 1
            last_timed = WARMUP - 1 + self.timed
        elif step <= last_timed:
            self.times.append(span)
            self.cpu_times.append(cpu_span)
        if step == last_timed and step >= WARMUP - 1:
            self._start_profile()
        elif step == last_timed + self.profiled:
            if self.cuda:  # the last step's kernels end inside the profile
                with torch.profiler.record_function(_OWN_SYNC):
                    torch.cuda.synchronize()
            self.prof.stop()
            self.wall_us = (time.perf_counter() - self.prof_t0) * 1e6
            self.events = self.prof.events()
            self.prof = None
            return True
        return False

    def _start_profile(self):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts)
        self.prof.start()
        self.prof_t0 = time.perf_counter()


def measure(
    family: str,
    rows: int,
    *,
    threads: int,
    device: str = "cpu",
    mode: str = "eager",
    quick: bool = False,
    max_step_s: float = MAX_STEP_S,
    max_timed: int = MAX_TIMED,
    profiled: int = PROFILED,
) -> dict:
    """One cell: ``family`` at ``rows`` rows on ``threads`` CPU threads (restored
    afterwards); the record of the module docstring."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cuda = torch.device(device).type == "cuda"
    record = {"family": family, "mode": mode, "device": device, "rows": rows, "threads": threads}
    record["load"] = os.getloadavg()[0]  # other work on the machine at the cell's start
    clock = None
    try:
        pyro.set_rng_seed(0)
        with isolated_params():
            t0 = time.perf_counter()
            setup = FAMILIES[family](rows, quick)
            record.update(batch=setup.batch, note=setup.note, setup_s=time.perf_counter() - t0)
            kwargs = mode_kwargs(mode, setup.fit_kwargs)
            if kwargs is None:
                record.update(status="n/a", reason=f"{family} has no compiled loss yet")
                return record
            clock = _Clock(setup.callback, cuda, max_step_s, max_timed, profiled)
            context = setup.context() if setup.context is not None else contextlib.nullcontext()
            with context, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fit(
                    setup.model,
                    setup.guide,
                    *setup.args,
                    num_steps=WARMUP + max_timed + profiled,
                    callback=clock,
                    seed=0,
                    device=device if cuda else None,
                    progress=False,
                    **kwargs,
                )
    except Exception as err:  # one failing cell (out of memory...) is a row, not the end
        if clock is not None and clock.prof is not None:
            clock.prof.stop()
        record.update(status="failed", reason=f"{type(err).__name__}: {err}"[:200])
        return record
    finally:
        torch.set_num_threads(before)
    record["first_s"] = clock.first_s
    if clock.capped is None and clock.events is None:  # fit ended early: a non-finite loss
        record.update(status="failed", reason=f"fit stopped after {len(clock.times)} timed steps")
        return record
    if clock.capped is not None:
        record.update(status="capped", ms_per_step=1000 * clock.capped, steps_timed=1)
        return record
    per = clock.profiled
    counts = {k: v / per for k, v in op_counts(clock.events).items()}
    if cuda:
        gpu = cuda_counts(clock.events, clock.wall_us)
        counts.update(kernels=gpu["kernels"] / per, syncs=gpu["syncs"] / per)
        counts["gpu_busy"] = gpu["gpu_busy"]
    record.update(
        status="ok",
        ms_per_step=1000 * statistics.median(clock.times),
        ms_min=1000 * min(clock.times),
        cpu_ms_per_step=1000 * statistics.median(clock.cpu_times),
        steps_timed=len(clock.times),
        steps_profiled=per,
        **counts,
    )
    return record


def predicted_s(done: list[dict], family: str, rows: int, threads: int, batch: int):
    """The smallest prediction of a cell's seconds per step from the cells measured
    (or capped) before it: the same family and rows at other thread counts, as
    measured, and the same family and threads at the last row count, scaled linearly
    by rows per step; ``None`` without any."""
    mine = [r for r in done if r["family"] == family and r.get("ms_per_step") is not None]
    guesses = [r["ms_per_step"] / 1000 for r in mine if r["rows"] == rows]
    prev = [r for r in mine if r["threads"] == threads and r["rows"] < rows]
    if prev:
        guesses.append(prev[-1]["ms_per_step"] / 1000 * batch / prev[-1]["batch"])
    return min(guesses) if guesses else None


# ----------------------------------------------------------------------------- table

COLUMNS = [
    "family",
    "mode",
    "rows",
    "rows/step",
    "threads",
    "first s",
    "ms/step",
    "cpu ms/step",
    "ops/step",
    "leaf ops/step",
    "host reads/step",
    "load",
    "status",
]
CUDA_COLUMNS = ["kernels/step", "syncs/step", "gpu busy"]


def table_row(r: dict) -> dict:
    status = r["status"]
    if status == "capped":
        status = f"capped: one step took {r['ms_per_step'] / 1000:.1f} s"
    elif status in ("skipped", "failed", "n/a"):
        status = f"{status}: {r['reason']}"
    elif r.get("note"):
        status = f"ok ({r['steps_timed']} steps; {r['note']})"
    row = {
        "family": r["family"],
        "mode": r["mode"],
        "rows": r["rows"],
        "rows/step": r.get("batch"),
        "threads": r["threads"],
        "first s": r.get("first_s"),
        "ms/step": r.get("ms_per_step"),
        "cpu ms/step": r.get("cpu_ms_per_step"),
        "ops/step": r.get("ops"),
        "leaf ops/step": r.get("leaf_ops"),
        "host reads/step": r.get("host_reads"),
        "load": r.get("load"),
        "status": status,
    }
    if "kernels" in r:
        row.update({"kernels/step": r["kernels"], "syncs/step": r["syncs"]})
        row["gpu busy"] = r["gpu_busy"]
    return row


def _markdown(doc: str) -> str:
    """A docstring on one line, its reST roles and double backquotes as markdown code."""
    doc = re.sub(r":\w+:`~?([^`]+)`", lambda m: "`" + m.group(1).split(".")[-1] + "`", doc)
    return " ".join(doc.replace("``", "`").split())


# ----------------------------------------------------------------------------- main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 64 rows, 2 timed steps")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--rows", default=None, help="comma-separated (default 1000,16384,131072)")
    p.add_argument("--threads", default=None, help="comma-separated (default 1 and all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-step-s", type=float, default=MAX_STEP_S)
    p.add_argument("--name", default=None, help="result name (default step_cost; --quick: none)")
    args = p.parse_args(argv)
    all_threads = torch.get_num_threads()
    rows = [int(v) for v in args.rows.split(",")] if args.rows else None
    rows = rows or list(QUICK_ROWS if args.quick else ROWS)
    threads = [int(v) for v in args.threads.split(",")] if args.threads else [1, all_threads]
    threads = sorted(set(threads))
    if torch.device(args.device).type == "cuda":
        threads = [all_threads]  # the host threads matter little next to the GPU
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose among {sorted(FAMILIES)}")
    name = args.name or (None if args.quick else "step_cost")
    limits = dict(max_step_s=args.max_step_s)
    if args.quick:
        limits.update(max_timed=2, profiled=1)
    print(
        f"cap: a cell stops after its second step if that step took over {args.max_step_s} s; "
        "a cell predicted over that (from the same rows at other threads, and the last "
        "row count at these threads scaled by rows per step: the smaller) is skipped",
        flush=True,
    )
    records = []
    for mode in args.modes.split(","):
        for family in families:
            for t in threads:
                for n in rows:
                    batch = rows_per_step(family, n)
                    guess = predicted_s(records, family, n, t, batch)
                    if guess is not None and guess > args.max_step_s:
                        reason = f"predicted {guess:.1f} s per step > {args.max_step_s} s"
                        rec = dict(family=family, mode=mode, device=args.device, rows=n)
                        rec.update(threads=t, batch=batch, status="skipped", reason=reason)
                    else:
                        rec = measure(
                            family, n, threads=t, device=args.device, mode=mode,
                            quick=args.quick, **limits,
                        )  # fmt: skip
                    records.append(rec)
                    print(markdown_table([table_row(rec)]).splitlines()[-1], flush=True)
    columns = COLUMNS + (CUDA_COLUMNS if any("kernels" in r for r in records) else [])
    md = (
        f"Cost of one `fit` step per family, {args.device}, modes {args.modes}; threads "
        f"{threads} (all: {all_threads}); cap {args.max_step_s} s per step (see "
        "`benchmarks/step_cost.py` for what is counted). Median over the timed steps after "
        f"{WARMUP} warm-up steps; counts per step over {PROFILED} profiled steps (1 where "
        f"a step takes over {TIMED_BUDGET_S:g} s). "
        "`ops`: outermost `aten::` calls (forward, backward, optimiser); `leaf ops`: "
        "`aten::` calls with none inside; `host reads`: `aten::_local_scalar_dense` "
        "calls; `cpu ms/step`: the process's CPU time per step (median; every thread's "
        "time summed, spinning included), which other work on the machine inflates less "
        "than the wall time; `load`: the 1-minute load average at the cell's start, on "
        f"{os.cpu_count()} CPUs (a shared machine: where other work holds a core, the "
        "all-threads column waits on it and can be many times slower than one thread).\n\n"
        + markdown_table([table_row(r) for r in records], columns)
    )
    md += "\nFamilies (`benchmarks/_step_cost_families.py`):\n\n" + "".join(
        f"* `{f}`: {_markdown(FAMILIES[f].__doc__)}\n" for f in families
    )
    if name is None:  # --quick without --name: the table only
        print(md)
        return
    path = write_results(name, {"records": records}, md, args.device, args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
