"""What :func:`pyro_trees.infer.keep_freed_memory` saves: one training step per family on
one CPU thread, with the freed memory kept (the default) and returned to the system
(``PYRO_TREES_KEEP_FREED_MEMORY=0``, glibc's own settings), in the same run.

Run from the repository root: ``python -m benchmarks.freed_memory`` (about 5 minutes on
2 cores; Linux with glibc, where the setting exists); ``--families``, ``--rows`` choose
the cells, ``--repeats`` the processes per setting and cell. Results:
``results/freed_memory.{json,md}``.

Each cell (a family at a row count, as :mod:`benchmarks.step_cost` builds and times it)
runs in a fresh process per setting, the two settings in turn, ``--repeats`` times: a
process that has already freed large blocks has moved glibc's own thresholds, so cells
sharing one process would not show what a user's first fit pays. Columns: the median of
the processes' step times (each the median of its timed steps, wall clock), their ratio,
and the process's minor page faults and system CPU time per step (medians over the
steps, profiled ones included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks._common import markdown_table, write_results
from benchmarks.step_cost import FAMILIES

ROWS = (1000, 16384)

# the cell's process: step_cost's measure, with the process's page faults and system
# time read at every step's callback (the median of the per-step differences)
_CELL = """
import json, resource, statistics, sys
from benchmarks import step_cost
family, rows = sys.argv[1], int(sys.argv[2])
marks = []
call = step_cost._Clock.__call__
def marked(self, step, loss):
    use = resource.getrusage(resource.RUSAGE_SELF)
    marks.append((use.ru_minflt, use.ru_stime))
    return call(self, step, loss)
step_cost._Clock.__call__ = marked
rec = step_cost.measure(family, rows, threads=1)
diffs = list(zip(marks[1:], marks))
rec["faults_per_step"] = statistics.median(a[0] - b[0] for a, b in diffs)
rec["sys_ms_per_step"] = 1000 * statistics.median(a[1] - b[1] for a, b in diffs)
from pyro_trees.infer import keep_freed_memory
rec["kept"] = keep_freed_memory()  # whether the process's allocator settings are in force
print("RECORD " + json.dumps(rec, default=float))
"""


def run_cell(family: str, rows: int, keep: bool) -> dict:
    """One process: ``family`` at ``rows`` rows, the freed memory kept or not."""
    env = dict(os.environ, PYRO_TREES_KEEP_FREED_MEMORY="1" if keep else "0")
    out = subprocess.run(
        [sys.executable, "-c", _CELL, family, str(rows)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(v for v in out.splitlines() if v.startswith("RECORD "))
    return json.loads(line[len("RECORD ") :])


def _median(recs: list, key: str) -> float:
    return statistics.median(r[key] for r in recs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="freed_memory")
    args = p.parse_args(argv)
    rows_list = [int(v) for v in args.rows.split(",")]
    table, records = [], []
    for family in [f for f in args.families.split(",") if f]:
        for rows in rows_list:
            runs = {True: [], False: []}
            for _ in range(args.repeats):
                for keep in (False, True):
                    runs[keep].append(run_cell(family, rows, keep))
            recs = {k: [r for r in v if r.get("status") == "ok"] for k, v in runs.items()}
            records.append({"family": family, "rows": rows, "kept": runs[True], "off": runs[False]})
            if not recs[True] or not recs[False]:
                reason = next(r.get("reason", r.get("status")) for r in runs[True] + runs[False])
                table.append({"family": family, "rows": rows, "status": reason})
                continue

            off, kept = _median(recs[False], "ms_per_step"), _median(recs[True], "ms_per_step")
            row = {
                "family": family,
                "rows": rows,
                "rows/step": recs[True][0]["batch"],
                "ms/step, returned": off,
                "ms/step, kept": kept,
                "kept / returned": kept / off,
                "faults/step, returned": _median(recs[False], "faults_per_step"),
                "faults/step, kept": _median(recs[True], "faults_per_step"),
                "sys ms/step, returned": _median(recs[False], "sys_ms_per_step"),
                "sys ms/step, kept": _median(recs[True], "sys_ms_per_step"),
                "status": "ok",
            }
            table.append(row)
            print(markdown_table([row]).splitlines()[-1], flush=True)
    md = (
        "One `fit` step per family on one CPU thread (as `benchmarks/step_cost.py` builds and "
        "times it), with the memory a step frees kept in the process "
        "(`keep_freed_memory`, the default of `fit` and every estimator) and returned to the "
        "system (`PYRO_TREES_KEEP_FREED_MEMORY=0`: glibc's own settings). Each cell runs in "
        f"a fresh process per setting, the settings in turn, {args.repeats} processes each; "
        "ms/step: the median over the processes of each one's median step (wall clock); "
        "faults and sys ms: the process's minor page faults and system CPU time per step "
        "(medians over its steps). The computed values are the same "
        "under both settings (allocation only).\n\n" + markdown_table(table)
    )
    path = write_results(args.name, {"records": records}, md, "cpu", args=vars(args))
    print(f"written {path}")


if __name__ == "__main__":
    main()
