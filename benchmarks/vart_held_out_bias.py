"""Are VaRT's held-out rows fitted better than new rows? Read off the committed fits.

Run from the repository root: ``python -m benchmarks.vart_held_out_bias`` (seconds; no
fitting). ``VaRTRegressor`` holds out 10 % of the training rows; early stopping picks a
checkpoint on them and the noise factor is calibrated on them. If picking the checkpoint
fits those rows better than rows the model has never seen, the factor they set is too small
and the intervals under-cover new rows.

Each ten-split run of ``benchmarks/vart_uci.py`` stores, for every fit, the coverage scores
of its held-out rows and of its test rows (:meth:`VaRTRegressor.coverage_scores`: the least
factor on the fitted leaf noise from which the row lies inside the central 90 % interval).
A row lies inside the uncalibrated interval (factor 1) iff its score is at most 1. This
script compares, per depth and data set, the share of held-out rows and of test rows inside
that interval, pooled over the splits, for

* ``refit=False`` (``vart_uci_*_cov.json``): the early-stopped guide is the model, so the
  held-out rows chose its checkpoint;
* ``refit=True`` (``vart_uci_d*_refit*.json``, the estimator's default since 2026-11-22): a
  fresh guide trained for the chosen number of steps is the model; the held-out rows chose
  nothing of it but that number.

Held-out and test rows are both random subsets of the data set, so without selection the two
shares differ only by sampling noise.
"""

from __future__ import annotations

import numpy as np

from benchmarks._common import markdown_table, record_paths, write_results
from benchmarks.vart_calibration_rules import scored_fits

VARIANTS = {"refit=False": "vart_uci_*_cov.json", "refit=True": "vart_uci_d*_refit*.json"}


def _pooled(pattern: str) -> dict[tuple[int, str], dict[str, list[float]]]:
    cells: dict[tuple[int, str], dict[str, list[float]]] = {}
    for _, dataset, depth, fit in scored_fits(record_paths(pattern)):
        cell = cells.setdefault((depth, dataset), {"held": [], "test": []})
        cell["held"] += fit["held_out_scores"]
        cell["test"] += fit["test_scores"]
    return cells


def main():
    rows, summary = [], []
    for variant, pattern in VARIANTS.items():
        cells = _pooled(pattern)
        for depth in sorted({d for d, _ in cells}):
            gaps = []
            for name in sorted(n for d, n in cells if d == depth):
                held = np.asarray(cells[(depth, name)]["held"])
                test = np.asarray(cells[(depth, name)]["test"])
                h, t = float(np.mean(held <= 1.0)), float(np.mean(test <= 1.0))
                gaps.append(h - t)
                rows.append(
                    {
                        "variant": variant,
                        "depth": depth,
                        "dataset": name,
                        "held-out rows": held.size,
                        "test rows": test.size,
                        "held-out inside": h,
                        "test inside": t,
                        "gap": h - t,
                    }
                )
            gaps = np.asarray(gaps)
            summary.append(
                {
                    "variant": variant,
                    "depth": depth,
                    "sets": gaps.size,
                    "held-out covered more often": int((gaps > 0).sum()),
                    "mean gap": float(gaps.mean()),
                    "largest gap": float(gaps.max()),
                }
            )
    md = (
        "Share of VaRT's held-out rows and of its test rows inside the uncalibrated 90 % "
        "interval (coverage score <= 1), pooled over each set's ten splits, read off the "
        "committed runs (`python -m benchmarks.vart_held_out_bias`). `gap`: held-out minus "
        "test; without selection it is sampling noise around zero.\n\n"
        "## Summary\n\n" + markdown_table(summary) + "\n## Per set\n\n" + markdown_table(rows)
    )
    write_results("vart_held_out_bias", {"summary": summary, "rows": rows}, md)
    print(markdown_table(summary))


if __name__ == "__main__":
    main()
