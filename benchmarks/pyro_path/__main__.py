"""Runs every system's plain-SVI snippet and writes results/pyro_path.{json,md}."""

from __future__ import annotations

import argparse
import importlib
import statistics

from benchmarks._common import markdown_table, write_results
from benchmarks.pyro_path import SYSTEMS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    records, rows = [], []
    for system in args.only.split(","):
        module = importlib.import_module(f"benchmarks.pyro_path.{system}")
        runs = []
        for seed in range(args.seeds):
            out = module.run(seed)
            runs.extend(out if isinstance(out, list) else [out])
        records.extend(runs)
        for key in sorted({r["figure"] for r in runs}):
            mine = [r for r in runs if r["figure"] == key]
            ours = [r["ours"] for r in mine]
            rows.append(
                {
                    "system": system,
                    "figure": key,
                    "paper": mine[0]["paper"],
                    "ours (mean)": statistics.fmean(ours),
                    "ours (per seed)": ", ".join(f"{v:.4g}" for v in ours),
                    "steps": mine[0]["steps"],
                    "seconds (mean)": statistics.fmean(r["seconds"] for r in mine),
                }
            )
            print(markdown_table([rows[-1]]), flush=True)
    text = (
        "# The Pyro user's path: documented plain-SVI snippets at their defaults\n\n"
        "Each row runs a system's snippet as the docs print it (model and guide with their "
        "defaults, `pyro.infer.SVI` with Adam) on the paper's toy problem.\n"
        "Command: `python -m benchmarks.pyro_path --seeds "
        f"{args.seeds}`.\n\n" + markdown_table(rows)
    )
    write_results("pyro_path", {"rows": rows, "records": records}, text)


if __name__ == "__main__":
    main()
