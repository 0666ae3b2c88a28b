"""VaRT forests against BART (stochtree at its defaults) and XGBoost on the 18 UCI sets
of the VaRT benchmark, in one run.

Run from the repository root, e.g. ``python -m benchmarks.vart_forest`` (3 splits of
each set) or ``python -m benchmarks.vart_forest --splits 0,1,2,3,4,5,6,7,8,9`` (all ten),
``--datasets kin40k --splits 0`` for Table B's large set; ``--num-fits``, ``--num-trees``
and ``--depth`` run a non-default forest, named in the results (the variant
``results/variants/vart_forest_5fits``: ``--n-fits 5 --splits 0,...,9 --name
vart_forest_5fits``).

Protocol: that of ``benchmarks/vart_uci.py`` (the same cached ``uci/<name>`` sets, their
``test_mask`` 90/10 splits, targets min-max scaled to [0, 1] over the full set, inputs as
they are). Ours: :class:`~pyro_trees.estimators.VaRTForestRegressor` with its default
arguments (``random_state`` = the split). BART: ``stochtree.BARTModel().sample(X_train,
y_train)`` with its default arguments (a seed aside): 200 trees, 10 grow-from-root
sweeps, 100 kept MCMC draws; its 90 % interval from the draws of ``f`` plus Gaussian
noise with each draw's variance. XGBoost: ``vart_uci``'s peer (50 trees, one thread).
Coverage: share of test targets inside the 90 % interval. Timings: wall-clock fit
seconds on this machine, shared with other jobs, so only ratios within one run mean
anything (``time ratio``: ours / BART on the same split).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from benchmarks._common import (
    UCI_SETS,
    fit_bart_default,
    markdown_table,
    rmse,
    run_peers,
    uci_splits,
    write_results,
)
from benchmarks.vart_uci import PAPER_TABLE_2
from pyro_trees.estimators import VaRTForestRegressor


def fit_forest(split, Xtr, ytr, Xte, yte, **kwargs) -> dict:
    """One default forest: test RMSE, 90 % coverage, fit seconds, steps, noise factor."""
    t = time.perf_counter()
    est = VaRTForestRegressor(random_state=split, **kwargs).fit(Xtr, ytr)
    secs = time.perf_counter() - t
    lo, hi = est.predict_interval(Xte, level=0.9)
    return {
        "rmse": rmse(est.predict(Xte), yte),
        "coverage90": float(np.mean((yte >= lo) & (yte <= hi))),
        "seconds": secs,
        "steps": int(est.fit_result_.best_step or len(est.fit_result_.losses)),
        "noise_factor": float(est.noise_factor_),
    }


def summarise(args, records, kwargs) -> None:
    """Write the results of the sets finished so far (called after each one)."""
    names = list(dict.fromkeys(r["dataset"] for r in records))
    rows, counts = [], {"beat BART": 0, "beat XGBoost": 0, "cov in [0.85, 0.95]": 0}
    counts.update({"BART cov in [0.85, 0.95]": 0, "time <= BART": 0})
    for name in names:
        recs = [r for r in records if r["dataset"] == name]

        def mean(model, key, recs=recs):
            return float(np.mean([r[model][key] for r in recs]))

        ours, bart, xgb = mean("forest", "rmse"), mean("bart", "rmse"), mean("xgboost", "rmse")
        ratio = float(np.mean([r["forest"]["seconds"] / r["bart"]["seconds"] for r in recs]))
        cov, bcov = mean("forest", "coverage90"), mean("bart", "coverage90")
        counts["beat BART"] += int(ours < bart)
        counts["beat XGBoost"] += int(ours < xgb)
        counts["cov in [0.85, 0.95]"] += int(0.85 <= cov <= 0.95)
        counts["BART cov in [0.85, 0.95]"] += int(0.85 <= bcov <= 0.95)
        counts["time <= BART"] += int(ratio <= 1.0)
        rows.append(
            {
                "dataset": name,
                "n": recs[0]["n"],
                "splits": len(recs),
                "forest RMSE": ours,
                "BART RMSE": bart,
                "XGBoost RMSE": xgb,
                "forest cov90": cov,
                "BART cov90": bcov,
                "forest s": mean("forest", "seconds"),
                "BART s": mean("bart", "seconds"),
                "time ratio": ratio,
                "steps": mean("forest", "steps"),
                "paper VaRT/BART50": "/".join(f"{v:.3f}" for v in PAPER_TABLE_2.get(name, ())),
            }
        )
    n = len(names)
    nondefault = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none"
    md = (
        f"VaRTForestRegressor (default arguments; non-default: {nondefault}) against "
        "stochtree BART at its defaults (200 trees, 10 GFR sweeps, 100 MCMC draws) and "
        f"XGBoost (50 trees), in one run; splits {args.splits}; targets min-max scaled "
        "to [0, 1]. RMSE: mean test RMSE over the splits; cov90: share of test targets "
        "inside the 90 % interval; time ratio: forest / BART fit seconds (mean over "
        "splits; 2 shared CPU cores, one thread each). `paper`: Table 2 of Salazar (2023), "
        "single VaRT median and BART with 50 trees (another scaling may apply).\n\n"
        + markdown_table(rows)
        + "\n"
        + "\n".join(f"* {k}: {v}/{n}" for k, v in counts.items())
        + "\n"
    )
    write_results(
        args.name,
        {
            "splits": args.splits,
            "non_default_arguments": kwargs,
            "rows": rows,
            "counts": counts,
            "records": records,
        },
        md,
        args=vars(args),
    )
    print(md if len(names) == len(args.datasets.split(",")) else "", end="", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default=",".join(UCI_SETS))
    p.add_argument("--splits", default="0,1,2")
    p.add_argument("--name", default="vart_forest")
    p.add_argument(
        "--num-trees", type=int, default=None, help="non-default num_trees (named in the results)"
    )
    p.add_argument("--depth", type=int, default=None, help="non-default depth (named too)")
    p.add_argument("--num-fits", type=int, default=None, help="non-default num_fits (named too)")
    p.add_argument("--patience", type=int, default=None, help="non-default patience (named too)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    kwargs = {}
    if args.num_trees is not None:
        kwargs["num_trees"] = args.num_trees
    if args.depth is not None:
        kwargs["depth"] = args.depth
    if args.num_fits is not None:
        kwargs["num_fits"] = args.num_fits
    if args.patience is not None:
        kwargs["patience"] = args.patience
    splits = [int(s) for s in args.splits.split(",") if s]
    records = []
    for name, split, X, Xtr, ytr, Xte, yte in uci_splits(args.datasets, splits):
        rec = {"dataset": name, "split": split, "n": len(X), "d": X.shape[1]}
        rec["forest"] = fit_forest(split, Xtr, ytr, Xte, yte, **kwargs)
        rec["bart"] = fit_bart_default(Xtr, ytr, Xte, yte, split)
        rec.update(run_peers(["xgboost"], Xtr, ytr, Xte, yte, split))
        records.append(rec)
        print(name, split, {k: v for k, v in rec.items() if isinstance(v, dict)}, flush=True)
        if split == splits[-1]:
            summarise(args, records, kwargs)


if __name__ == "__main__":
    main()
