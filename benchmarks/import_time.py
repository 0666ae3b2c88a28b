"""What importing pyro_trees costs: fresh interpreters, median wall seconds.

Run from the repository root: ``python -m benchmarks.import_time``. Each statement runs
``--repeats`` times in a new interpreter (``python -X importtime`` would double count
shared dependencies); the table gives the median and the range, beside the peers that
every use of the library loads anyway (torch, Pyro, scikit-learn, GPyTorch), measured
in the same run, and whether the statement passes under ``-W error::DeprecationWarning``.
The goal of the reliability issue: ``import pyro_trees`` under 2 s on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from benchmarks._common import markdown_table, write_results

STATEMENTS = {
    "import pyro_trees": "import pyro_trees",
    "import pyro_trees.models": "import pyro_trees.models",
    "from pyro_trees.estimators import VaRTRegressor": (
        "from pyro_trees.estimators import VaRTRegressor"
    ),
    "HeteroscedasticGP(1, 2) (GPyTorch loaded)": (
        "from pyro_trees.models import HeteroscedasticGP; HeteroscedasticGP(1, 2)"
    ),
    "peer: import torch": "import torch",
    "peer: import pyro": "import pyro",
    "peer: import sklearn.base": "import sklearn.base",
    "peer: import gpytorch": "import gpytorch",
}


def _time(code: str, repeats: int) -> tuple[list[float], bool]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t)
    strict = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True
    )
    return times, strict.returncode == 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--name", default="import_time")
    args = p.parse_args(argv)
    empty, _ = _time("pass", args.repeats)
    rows = []
    for label, code in STATEMENTS.items():
        times, strict = _time(code, args.repeats)
        rows.append(
            {
                "statement": label,
                "median s": statistics.median(times),
                "min s": min(times),
                "max s": max(times),
                "clean under -W error::DeprecationWarning": "yes" if strict else "no",
            }
        )
        print(rows[-1], flush=True)
    md = (
        f"Fresh interpreter per run, {args.repeats} runs each; an empty interpreter takes "
        f"{statistics.median(empty):.3f} s (median), included in every figure. "
        "Goal: `import pyro_trees` under 2 s on 2 cores.\n\n" + markdown_table(rows)
    )
    write_results(args.name, {"repeats": args.repeats, "rows": rows}, md, args=vars(args))
    print(md)


if __name__ == "__main__":
    main()
