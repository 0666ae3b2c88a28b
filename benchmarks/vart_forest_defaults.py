"""How ``VaRTForestRegressor``'s training defaults were chosen: candidate settings on the
18 UCI sets of ``vart_forest``, with stochtree BART and XGBoost in the same run.

Run from the repository root: ``python -m benchmarks.vart_forest_defaults`` (splits 0-2,
every candidate; ``--configs`` picks some by name). Each candidate names only the
arguments it sets; the others are the estimator's defaults at the time of the run, so
``default`` is whatever the estimator ships. Protocol and peers: those of
``benchmarks/vart_forest.py`` (same splits, targets min-max scaled, one thread).

Committed runs: ``vart_forest_defaults`` (the learning-rate schedule, patience and the
number of trees; its ``default`` had one fit, before ``num_fits`` existed),
and, under ``results/variants/``, ``vart_forest_defaults_fits`` (``--configs "default,one
fit,5 fits" --name vart_forest_defaults_fits``: the number of pooled fits; its ``default``
has three refits sharing one held-out split) and ``vart_forest_defaults_folds``
(``--configs "default,refit,one fit"``: three fits, each on its own held-out fold, with
and without a refit), with ``vart_forest_defaults_folds_5fits`` (``--configs "5 fits"``)
and ``vart_forest_defaults_folds_steps`` (``--configs "2000 steps,lr 0.05"``) at those
defaults. From ``vart_forest_defaults_folds`` on, each file names the shipped defaults of
its run in its header.

Per candidate: the sets (of 18, RMSE and coverage averaged over the splits) where it beats
BART and XGBoost, where its 90 % intervals cover 0.85-0.95, the mean over sets of
log(RMSE / BART's RMSE) (negative: better than BART on the geometric average), and its
total fit seconds against BART's total in the same run.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from benchmarks._common import (
    UCI_SETS,
    fit_bart_default,
    markdown_table,
    run_peers,
    uci_splits,
    write_results,
)
from benchmarks.vart_forest import fit_forest
from pyro_trees.estimators import VaRTForestRegressor

# the training arguments the candidates vary, at the estimator's shipped values
VARIED = (
    "num_trees",
    "depth",
    "kl_weight",
    "num_steps",
    "lr",
    "lr_decay",
    "num_fits",
    "refit",
    "patience",
)
SHIPPED = {k: v for k, v in VaRTForestRegressor().get_params().items() if k in VARIED}

CONFIGS = {
    "default": {},
    "previous: constant lr 0.03; patience 5": {"lr_decay": 1.0, "patience": 5},
    "lr_decay 0.05; patience 5": {"lr_decay": 0.05, "patience": 5},
    "constant lr 0.01; patience 5": {"lr": 0.01, "lr_decay": 1.0, "patience": 5},
    "50 trees": {"num_trees": 50},
    "one fit": {"num_fits": 1},
    "5 fits": {"num_fits": 5},
    "refit": {"refit": True},
    "2000 steps": {"num_steps": 2000},
    "lr 0.05": {"lr": 0.05},
}


def summarise(records: list[dict], configs: list[str]) -> tuple[list[dict], list[dict]]:
    """Per-candidate counts and per-set means of the records so far."""
    names = list(dict.fromkeys(r["dataset"] for r in records))
    summary, per_set = [], []
    for cfg in configs:
        counts = {"beat BART": 0, "beat XGBoost": 0, "cov in [0.85, 0.95]": 0}
        logs, secs, bart_secs, done = [], 0.0, 0.0, 0
        for name in names:
            recs = [r for r in records if r["dataset"] == name and cfg in r["forest"]]
            if not recs:
                continue
            done += 1
            ours = float(np.mean([r["forest"][cfg]["rmse"] for r in recs]))
            bart = float(np.mean([r["bart"]["rmse"] for r in recs]))
            xgb = float(np.mean([r["xgboost"]["rmse"] for r in recs]))
            cov = float(np.mean([r["forest"][cfg]["coverage90"] for r in recs]))
            counts["beat BART"] += int(ours < bart)
            counts["beat XGBoost"] += int(ours < xgb)
            counts["cov in [0.85, 0.95]"] += int(0.85 <= cov <= 0.95)
            logs.append(math.log(ours / bart))
            secs += sum(r["forest"][cfg]["seconds"] for r in recs)
            bart_secs += sum(r["bart"]["seconds"] for r in recs)
            per_set.append(
                {
                    "candidate": cfg,
                    "dataset": name,
                    "RMSE": ours,
                    "BART RMSE": bart,
                    "XGBoost RMSE": xgb,
                    "cov90": cov,
                    "steps": float(np.mean([r["forest"][cfg]["steps"] for r in recs])),
                }
            )
        if done:
            summary.append(
                {
                    "candidate": cfg,
                    "sets": done,
                    **{k: f"{v}/{done}" for k, v in counts.items()},
                    "mean log(RMSE/BART)": float(np.mean(logs)),
                    "fit s": secs,
                    "BART fit s": bart_secs,
                    "time ratio": secs / bart_secs,
                }
            )
    return summary, per_set


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default=",".join(UCI_SETS))
    p.add_argument("--splits", default="0,1,2")
    p.add_argument("--configs", default=",".join(CONFIGS), help="names from CONFIGS")
    p.add_argument("--name", default="vart_forest_defaults")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    splits = [int(s) for s in args.splits.split(",") if s]
    records = []
    for name, split, X, Xtr, ytr, Xte, yte in uci_splits(args.datasets, splits):
        rec = {"dataset": name, "split": split, "n": len(X), "forest": {}}
        for cfg in configs:
            rec["forest"][cfg] = fit_forest(split, Xtr, ytr, Xte, yte, **CONFIGS[cfg])
        rec["bart"] = fit_bart_default(Xtr, ytr, Xte, yte, split)
        rec.update(run_peers(["xgboost"], Xtr, ytr, Xte, yte, split))
        records.append(rec)
        print(name, split, flush=True)
        if split != splits[-1]:
            continue
        summary, per_set = summarise(records, configs)
        md = (
            "Candidate training settings of VaRTForestRegressor (each names only what it "
            "sets; `default` is the shipped estimator) against stochtree BART (defaults) and "
            f"XGBoost (50 trees) in one run; splits {args.splits}; targets min-max scaled. "
            "Counts over sets, RMSE and coverage averaged over the splits; `mean "
            "log(RMSE/BART)` below 0: better than BART on the geometric average; times: "
            "total fit seconds, one thread, 2 shared cores. Shipped defaults at this run: "
            + ", ".join(f"`{k}={SHIPPED[k]!r}`" for k in sorted(SHIPPED))
            + ".\n\n"
            + "\n".join(f"* `{c}`: `{CONFIGS[c]}`" for c in configs)
            + "\n\n"
            + markdown_table(summary)
            + "\n\n## Per set\n\n"
            + markdown_table(per_set)
            + "\n"
        )
        write_results(
            args.name,
            {
                "splits": args.splits,
                "configs": {c: CONFIGS[c] for c in configs},
                "summary": summary,
                "per_set": per_set,
                "records": records,
            },
            md,
            args=vars(args),
        )
    print(markdown_table(summary))


if __name__ == "__main__":
    main()
