"""Every regressor at its defaults on small tables: the defaults panel's regression sets
subsampled to 100 and 200 training rows, against CART(depth 3) and BART in the same run.

Run from the repository root with the public-data cache set, e.g.
``PYRO_TREES_DATA=/path/to/data python -m benchmarks.small_tables`` (every regression set
of :mod:`benchmarks.defaults`, 100 and 200 training rows, seeds 0-2), or a quick subset::

    python -m benchmarks.small_tables --datasets diabetes,yacht --seeds 1 --name small_tables_quick

The question (issue 37, item 5): a user types ``VaRTForestRegressor().fit(X, y)`` on a
table of 100-300 rows; is the answer as good as a depth-3 CART and as BART's? Per set,
size ``n`` and seed ``s``: ``n`` training rows drawn at random (seed ``s``), the test rows
the rest (at most ``--max-test`` of them, drawn with the same seed); a size runs on a set
only where at least ``MIN_TEST`` test rows remain. Inputs and targets as
:func:`benchmarks.defaults.load_dataset` loads them (categorical columns one-hot). Every
regressor of ``pyro_trees.estimators`` that :mod:`benchmarks.defaults` runs, built with
its defaults (``random_state`` aside), is scored as there
(:func:`benchmarks.defaults.run_one`: RMSE / std(y_test), coverage of the 90 % interval);
peers: scikit-learn's CART at depth 3 and stochtree's BART at its defaults
(:func:`benchmarks._common.fit_bart_default`). ``--variants`` adds rows of the VaRT
estimators under other held-out settings, through constructor parameters only
(:data:`VARIANTS`), so that a held-out rule for small tables can be chosen from one table;
for the VaRT families each fit's best step (the step early stopping kept), its steps run,
and the rows the noise calibration read are recorded.

Goals counted per size: every regressor no worse than CART(depth 3) + 0.05 (RMSE/std,
mean over seeds, per set), and ``VaRTForestRegressor`` within 5 % of BART's RMSE. Results
go to ``results/NAME.{json,md}`` (``--name``; another name than the script's is a
variant), rewritten after each set. One torch thread.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks._common import fit_bart_default, make_peer, markdown_table, write_results
from benchmarks.defaults import DATASETS, discover_estimators, load_dataset, run_one

MIN_TEST = 50  # test rows a size needs on a set
CART_DEPTH = 3
CART_MARGIN = 0.05  # every regressor: RMSE/std at most CART(depth 3)'s + this
BART_RATIO = 1.05  # the forest: RMSE at most this times BART's
REGRESSORS = (
    "VaRTRegressor",
    "VaRTForestRegressor",
    "RNNTreeRegressor",
    "HeteroscedasticGPRegressor",
    "BayesianHMERegressor",
)

# label -> (estimator, constructor arguments other than its defaults)
VARIANTS = {
    "Forest[num_fits=1]": ("VaRTForestRegressor", {"num_fits": 1}),
    "Forest[vf=0.2]": ("VaRTForestRegressor", {"validation_fraction": 0.2}),
    "Forest[vf=0.3]": ("VaRTForestRegressor", {"validation_fraction": 0.3}),
    "Forest[refit]": ("VaRTForestRegressor", {"refit": True}),
    "Forest[vf=0.2;refit]": ("VaRTForestRegressor", {"validation_fraction": 0.2, "refit": True}),
    "Forest[vf=0]": ("VaRTForestRegressor", {"validation_fraction": 0.0}),
    "Forest[patience=25]": ("VaRTForestRegressor", {"patience": 25}),
    "Forest[num_fits=5]": ("VaRTForestRegressor", {"num_fits": 5}),
    "Forest[num_steps=300]": ("VaRTForestRegressor", {"num_steps": 300}),
    "Forest[vf=0;num_steps=300]": (
        "VaRTForestRegressor",
        {"validation_fraction": 0.0, "num_steps": 300},
    ),
    "VaRT[vf=0.2]": ("VaRTRegressor", {"validation_fraction": 0.2}),
    "VaRT[vf=0]": ("VaRTRegressor", {"validation_fraction": 0.0}),
}
# the variants of the full run (the others cost more and did worse on a quick run)
DEFAULT_VARIANTS = ("Forest[num_fits=1]", "Forest[vf=0.2]", "Forest[vf=0.3]", "VaRT[vf=0.2]")


def split_rows(n_rows: int, n_train: int, max_test: int, seed: int):
    """Training and test row indices: ``n_train`` rows at random (``seed``), the test
    rows the rest, at most ``max_test`` of them."""
    perm = np.random.default_rng(seed).permutation(n_rows)
    return perm[:n_train], perm[n_train:][:max_test]


def fit_diagnostics(est) -> dict:
    """What the held-out rule did in a fitted VaRT estimator: each fit's kept step
    (``best_step``; with ``refit``, the stopped fit's), steps run, why it stopped, and
    the rows the noise calibration read (``noise_calibration_["scores"]``)."""
    stopped = getattr(est, "stopping_results_", None) or getattr(est, "fit_results_", [])
    out = {
        "best_step": [r.best_step for r in stopped],
        "steps_run": [r.num_steps for r in stopped],
        "stopped": [r.stopped for r in stopped],
    }
    cal = getattr(est, "noise_calibration_", None)
    if isinstance(cal, dict) and cal.get("scores") is not None:
        out["calibration_rows"] = int(len(cal["scores"]))
        out["calibration_rule"] = cal.get("rule")
    else:
        out["calibration_rows"] = 0
    out["noise_factor"] = float(getattr(est, "noise_factor_", float("nan")))
    return out


def _make(cls, params, seen):
    def make(seed):
        est = cls(random_state=seed, **params)
        seen.append(est)
        return est

    return make


def run_case(methods, Xtr, ytr, Xte, yte, seed) -> dict:
    """Every method on one split: ``{method: record}`` (:func:`run_one`'s, plus the
    VaRT diagnostics)."""
    out = {}
    for label, (cls, params) in methods.items():
        seen = []
        rec = run_one(_make(cls, params, seen), seed, "regression", Xtr, ytr, Xte, yte)
        if seen and "error" not in rec and hasattr(seen[-1], "fit_results_"):
            rec.update(fit_diagnostics(seen[-1]))
        out[label] = rec
    cart = run_one(
        lambda s: make_peer("CART", "regression", s, CART_DEPTH),
        seed,
        "regression",
        Xtr,
        ytr,
        Xte,
        yte,
    )
    out[f"CART(d={CART_DEPTH})"] = cart
    try:
        t = time.perf_counter()
        bart = fit_bart_default(Xtr, ytr, Xte, yte, seed)
        sd = float(np.std(yte))
        out["BART"] = {
            "rmse_std": bart["rmse"] / sd,
            "coverage90": bart["coverage90"],
            "fit_s": time.perf_counter() - t,
        }
    except ImportError as exc:
        out["BART"] = {"error": f"ImportError: {exc}"}
    return out


def _mean(records, d, n, m, key="rmse_std"):
    vals = [
        r["methods"][m][key]
        for r in records
        if r["dataset"] == d and r["n_train"] == n and key in r["methods"].get(m, {})
    ]
    return (float(np.mean(vals)), float(np.std(vals)), len(vals)) if vals else (None, None, 0)


def goals(records, sets, sizes, labels) -> list[dict]:
    """The goal rows: per size and method, the sets within CART(d=3) + 0.05 and within
    5 % of BART (a goal for the forest and its variants only, counted for all)."""
    cart, rows = f"CART(d={CART_DEPTH})", []
    for n in sizes:
        here = [d for d in sets if _mean(records, d, n, cart)[2]]
        for m in labels:
            within, far, bart_ok, bart_far = 0, [], 0, []
            for d in here:
                ours, c, b = (_mean(records, d, n, k)[0] for k in (m, cart, "BART"))
                if ours is None:
                    far.append(f"{d} (no score)")
                    continue
                if ours <= c + CART_MARGIN:
                    within += 1
                else:
                    far.append(f"{d} {ours:.3f} vs {c:.3f}")
                if b is not None and ours <= BART_RATIO * b:
                    bart_ok += 1
                elif b is not None:
                    bart_far.append(f"{d} {ours:.3f} vs {b:.3f}")
            forest = m.startswith("Forest") or m == "VaRTForestRegressor"
            rows.append(
                {
                    "rows": n,
                    "method": m,
                    "sets": len(here),
                    "<= CART+0.05": f"{within}/{len(here)}",
                    "misses (ours vs CART)": "; ".join(far),
                    "<= 1.05 BART": f"{bart_ok}/{len(here)}" + (" (goal)" if forest else ""),
                    "misses (ours vs BART)": "; ".join(bart_far),
                }
            )
    return rows


def score_table(records, sets, n, labels, key="rmse_std", digits=3) -> str:
    rows = []
    for d in sets:
        if not _mean(records, d, n, labels[-1])[2] and not _mean(records, d, n, "BART")[2]:
            continue
        row = {"data set": d}
        for m in labels:
            mean, std, k = _mean(records, d, n, m, key)
            row[m] = "" if mean is None else f"{mean:.{digits}f} ± {std:.{digits}f}"
        rows.append(row)
    mean_row = {"data set": "**mean over sets**"}
    for m in labels:
        vals = [_mean(records, d, n, m, key)[0] for d in sets]
        vals = [v for v in vals if v is not None]
        mean_row[m] = f"{np.mean(vals):.{digits}f}" if vals else ""
    return markdown_table([*rows, mean_row], ["data set", *labels])


def diagnostics_table(records, sets, sizes, labels) -> str:
    rows = []
    for n in sizes:
        for m in labels:
            recs = [
                r["methods"][m]
                for r in records
                if r["n_train"] == n and "best_step" in r["methods"].get(m, {})
            ]
            if not recs:
                continue
            best = [b for r in recs for b in r["best_step"] if b is not None]
            run = [s for r in recs for s in r["steps_run"]]
            cal = [r["calibration_rows"] for r in recs]
            rows.append(
                {
                    "rows": n,
                    "method": m,
                    "fits": sum(len(r["steps_run"]) for r in recs),
                    "best step median": float(np.median(best)) if best else None,
                    "best step <= 100": f"{np.mean(np.asarray(best) <= 100):.0%}" if best else "",
                    "steps run median": float(np.median(run)) if run else None,
                    "calibration rows": f"{min(cal)}-{max(cal)}",
                    "coverage90 mean": np.mean([r["coverage90"] for r in recs]),
                    "fit s mean": np.mean([r["fit_s"] for r in recs]),
                }
            )
    return markdown_table(rows)


def summarise(args, records, sets, sizes, labels, panel, wall_s) -> str:
    md = [
        f"Training rows {', '.join(map(str, sizes))}, drawn at random per seed (seeds "
        f"0..{args.seeds - 1}); test rows the rest, at most {args.max_test}; a size runs "
        f"where at least {MIN_TEST} test rows remain. Every regressor at its defaults "
        "(`random_state` = seed), VaRT variants through constructor parameters only, "
        "CART(depth 3) and stochtree's BART at its defaults, in the same run. Cells: "
        "RMSE / std(y_test), mean ± std over seeds. One torch thread, shared machine; "
        f"wall clock {wall_s / 60:.1f} min.\n\n",
        markdown_table(
            [
                {"data set": d, "rows": p["rows"], "features": p["features"], "prep": p["prep"]}
                for d, p in panel.items()
            ]
        ),
        "\n## Goals\n\nPer set, the mean over seeds: RMSE/std at most CART(d=3)'s + "
        f"{CART_MARGIN}; the forest's at most {BART_RATIO} x BART's.\n\n",
        markdown_table(goals(records, sets, sizes, labels)),
    ]
    peers = [f"CART(d={CART_DEPTH})", "BART"]
    for n in sizes:
        md.append(f"\n## RMSE / std(y_test), {n} training rows\n\n")
        md.append(score_table(records, sets, n, [*labels, *peers]))
    md.append("\n## 90 % interval coverage (goal 0.85-0.95)\n\n")
    for n in sizes:
        md.append(f"\n{n} training rows\n\n")
        md.append(score_table(records, sets, n, [*labels, "BART"], "coverage90", 2))
    md.append(
        "\n## What early stopping and calibration did (VaRT families)\n\n"
        "Over every set and seed: each fit's kept step (`best_step` of `fit_results_`, "
        "or with `refit` of `stopping_results_`: the stopped fit's), the steps it ran, "
        "and the rows the noise calibration read (`noise_calibration_['scores']`).\n\n"
    )
    md.append(diagnostics_table(records, sets, sizes, labels))
    errs = [
        f"* {m} on {r['dataset']} n={r['n_train']} seed {r['seed']}: {rec['error']}"
        for r in records
        for m, rec in r["methods"].items()
        if "error" in rec
    ]
    if errs:
        md.append("\n## Errors\n\n" + "\n".join(errs[:30]) + "\n")
    return "".join(md)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    regression = [d for d, (task, *_) in DATASETS.items() if task == "regression"]
    p.add_argument("--datasets", default=",".join(regression), help="comma-separated names")
    p.add_argument("--sizes", default="100,200", help="training rows, comma-separated")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument("--max-test", type=int, default=2000, help="test rows at most")
    p.add_argument("--methods", default=",".join(REGRESSORS), help="estimators at their defaults")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"labels of VARIANTS to add, comma-separated (empty: none); from {list(VARIANTS)}",
    )
    p.add_argument("--name", default="small_tables", help="result name")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    sets = [d for d in args.datasets.split(",") if d]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    found, _ = discover_estimators()
    methods = {m: (found[m]["cls"], {}) for m in args.methods.split(",") if m}
    for label in [v for v in args.variants.split(",") if v]:
        name, params = VARIANTS[label]
        methods[label] = (found[name]["cls"], params)
    labels = list(methods)
    records, panel = [], {}
    start = time.perf_counter()
    for d in sets:
        X, y, info = load_dataset(d, None)
        panel[d] = info
        for n in sizes:
            if len(y) - n < MIN_TEST:
                print(f"{d}: {len(y)} rows, no {n}-row training set", flush=True)
                continue
            for seed in range(args.seeds):
                tr, te = split_rows(len(y), n, args.max_test, seed)
                t = time.perf_counter()
                out = run_case(methods, X[tr], y[tr], X[te], y[te], seed)
                records.append(
                    {"dataset": d, "n_train": n, "seed": seed, "n_test": len(te), "methods": out}
                )
                shown = "  ".join(
                    f"{m} {r['rmse_std']:.3f}" if "rmse_std" in r else f"{m} ERR"
                    for m, r in out.items()
                )
                print(
                    f"{d} n={n} seed {seed} ({time.perf_counter() - t:.0f}s): {shown}", flush=True
                )
        md = summarise(args, records, sets, sizes, labels, panel, time.perf_counter() - start)
        payload = {
            "protocol": {
                "min_test": MIN_TEST,
                "cart_depth": CART_DEPTH,
                "cart_margin": CART_MARGIN,
                "bart_ratio": BART_RATIO,
                "variants": {k: VARIANTS[k] for k in labels if k in VARIANTS},
            },
            "panel": panel,
            "goals": goals(records, sets, sizes, labels),
            "records": records,
        }
        write_results(args.name, payload, md, args=vars(args))
    print(md[md.find("## Goals") :], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
