"""Does training beat the RNN-Tree estimators' own start on the defaults panel?

For every set of :mod:`benchmarks.defaults` (its splits: seeded 75/25, stratified for
classification; its metrics: error rate, RMSE / std(y_test)), each RNN-Tree estimator is
fitted twice with its defaults (``random_state`` = the split seed): once as is (trained),
once with ``num_steps=0``, which keeps the start the defaults choose without training (the
greedy and the balanced tree, each with one M-step of the leaves, the held-out split
picking one; a greedy start is then grown again on all the rows, as in a default fit
whose early stopping kept step 0). Same seed, same held-out rows: the only difference is
the gradient steps.

Why training stops where it does, two diagnostics on the same splits (not defaults):
``no margin`` lets any lower held-out error replace the start (the defaults ask for 5 %
and one standard error of the held-out estimate) and waits 30 evaluations instead of 5;
``no early stop`` trains 300 steps on every training row and keeps the last
(``validation_fraction=0``, so the greedy start alone).

Per set: the mean over seeds of ``start - trained`` (positive: training helped), and two
standard errors: of that paired difference over the seeds, and of the trained error on the
test rows (binomial for the error rate, ``err / sqrt(2 n)`` for the RMSE, over
``sqrt(seeds)``). Training "beats its start by one standard error" where the mean
difference is at least the larger of the two. The issue's goal: on at least half of the
sets.

Run: ``python -m benchmarks.hme_rnn_tree_start [--datasets iris,wine] [--seeds 3]``.
Writes ``benchmarks/results/hme_rnn_tree_start.{json,md}``.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from benchmarks.defaults import DATASETS, SPLIT_TEST_SIZE, load_dataset
from benchmarks.hme_table1_protocol import no_start_margin
from pyro_trees.estimators import RNNTreeClassifier, RNNTreeRegressor

PANEL = (
    "iris,wine,breast_cancer,digits,diabetes,servo,yacht,autompg,housing,concrete,airfoil,kin8nm"
)


def score(task: str, pred, y) -> tuple[float, float]:
    """The panel's metric and its standard error on these test rows."""
    n = len(y)
    if task == "classification":
        err = float(np.mean(pred != y))
        p = min(max(err, 1.0 / n), 1.0 - 1.0 / n)
        return err, math.sqrt(p * (1 - p) / n)
    err = float(np.sqrt(np.mean((pred - y) ** 2)) / np.std(y))
    return err, err / math.sqrt(2 * n)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", default=PANEL, help="comma-separated names")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--entropy-weight",
        type=float,
        default=None,
        help="passed to every fit (default: the estimators' own); the results then go to "
        "hme_rnn_tree_start_entropy<w>",
    )
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the two diagnostics")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from sklearn.model_selection import train_test_split

    extra = {} if args.entropy_weight is None else {"entropy_weight": args.entropy_weight}
    name_out = "hme_rnn_tree_start" + (
        "" if args.entropy_weight is None else f"_entropy{args.entropy_weight:g}"
    )
    start = time.perf_counter()
    rows, runs = [], []
    for name in [n for n in args.datasets.split(",") if n]:
        X, y, info = load_dataset(name, None)
        task = DATASETS[name][0]
        cls = RNNTreeClassifier if task == "classification" else RNNTreeRegressor
        trained, begun, ses, kept, secs = [], [], [], [], []
        diag = {"no margin": [], "no early stop": []}
        for seed in range(args.seeds):
            Xtr, Xte, ytr, yte = train_test_split(
                X,
                y,
                test_size=SPLIT_TEST_SIZE,
                random_state=seed,
                stratify=y if task == "classification" else None,
            )
            t0 = time.perf_counter()
            est = cls(random_state=seed, **extra).fit(Xtr, ytr)
            secs.append(time.perf_counter() - t0)
            e_tr, se = score(task, np.asarray(est.predict(Xte)), yte)
            st = cls(random_state=seed, num_steps=0, **extra).fit(Xtr, ytr)
            e_st, _ = score(task, np.asarray(st.predict(Xte)), yte)
            nm_step = None
            if args.no_diagnostics:
                diag["no margin"].append(float("nan"))
                diag["no early stop"].append(float("nan"))
            else:
                with no_start_margin(True):
                    nm = cls(random_state=seed, patience=30, **extra).fit(Xtr, ytr)
                nm_step = nm.fit_result_.best_step
                diag["no margin"].append(score(task, np.asarray(nm.predict(Xte)), yte)[0])
                ne = cls(random_state=seed, validation_fraction=0.0, num_steps=300, **extra)
                ne.fit(Xtr, ytr)
                diag["no early stop"].append(score(task, np.asarray(ne.predict(Xte)), yte)[0])
            trained.append(e_tr)
            begun.append(e_st)
            ses.append(se)
            step = est.fit_result_.best_step
            kept.append(f"{est.start_[0]}:{'-' if step is None else step}")
            runs.append(
                {
                    "dataset": name,
                    "seed": seed,
                    "trained": e_tr,
                    "start": e_st,
                    "se_test": se,
                    "start_kept": est.start_,
                    "start_untrained": st.start_,
                    "best_step": step,
                    "no_margin": diag["no margin"][-1],
                    "no_margin_step": nm_step,
                    "no_early_stop": diag["no early stop"][-1],
                }
            )
        diff = np.asarray(begun) - np.asarray(trained)
        se_pair = float(np.std(diff, ddof=1) / math.sqrt(len(diff))) if len(diff) > 1 else 0.0
        se_test = float(np.mean(ses) / math.sqrt(len(ses)))
        se = max(se_pair, se_test)
        beats = bool(diff.mean() > 0 and diff.mean() >= se)
        rows.append(
            {
                "data set": name,
                "task": "C" if task == "classification" else "R",
                "rows": info["rows_used"],
                "start": f"{np.mean(begun):.3f}",
                "trained": f"{np.mean(trained):.3f}",
                "start - trained": f"{diff.mean():+.4f}",
                "s.e. (paired / test rows)": f"{se_pair:.4f} / {se_test:.4f}",
                "beats start by 1 s.e.": beats,
                "trained worse": bool(diff.mean() < 0),
                "start, step kept (per seed)": " ".join(kept),
                "no margin (diagnostic)": f"{np.mean(diag['no margin']):.3f}",
                "no early stop (diagnostic)": f"{np.mean(diag['no early stop']):.3f}",
                "fit s": round(float(np.mean(secs)), 2),
            }
        )
        print(rows[-1], flush=True)
    total = time.perf_counter() - start
    n_beats = sum(r["beats start by 1 s.e."] for r in rows)
    n_kept = sum(1 for r in runs if r["best_step"] == 0)

    def lower(key):  # sets where the diagnostic's mean test error is below the start's
        out = []
        for r in rows:
            mine = [x for x in runs if x["dataset"] == r["data set"]]
            if np.mean([x[key] for x in mine]) < np.mean([x["start"] for x in mine]) - 1e-9:
                out.append(r["data set"])
        return out

    diagnostics = (
        " Diagnostics skipped."
        if args.no_diagnostics
        else f" Diagnostics, mean test error below the start's: no margin on "
        f"{len(lower('no_margin'))} sets ({', '.join(lower('no_margin')) or 'none'}), "
        f"no early stop on {len(lower('no_early_stop'))} "
        f"({', '.join(lower('no_early_stop')) or 'none'})."
    )
    also = f", and {extra}" if extra else ""
    md = (
        f"Seeds {args.seeds}, {args.threads} torch thread, every estimator at its defaults "
        f"(random_state = seed{also}); start = the same fit with num_steps=0. Metrics: "
        "error rate (C), RMSE / std(y_test) (R). Per seed: the start kept (g greedy, b "
        "balanced) and the step early stopping kept (0: the start). "
        f"Whole run: {total:.0f} s.\n\n"
        f"**Training beats its start by one standard error on {n_beats} of {len(rows)} "
        f"sets** (goal: at least half); early stopping kept step 0 on {n_kept} of "
        f"{len(runs)} fits.{diagnostics}\n\n" + markdown_table(rows)
    )
    write_results(
        name_out,
        {
            "rows": rows,
            "runs": runs,
            "beats": n_beats,
            "sets": len(rows),
            "step0_fits": n_kept,
            "fits": len(runs),
            "total_seconds": total,
            "args": vars(args),
        },
        md,
    )
    print(md)
    return {"rows": rows, "beats": n_beats}


if __name__ == "__main__":
    main()
