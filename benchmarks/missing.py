"""Missing values: every tree estimator of ``pyro_trees.estimators`` at its defaults with
NaN in ``X``, against XGBoost and HistGradientBoosting (both route NaN natively) and
against itself after ``SimpleImputer`` and ``IterativeImputer``.

Run from the repository root with the public-data cache set, e.g.
``PYRO_TREES_DATA=/path/to/data python -m benchmarks.missing`` (six sets of the defaults
panel, three split seeds), or a quick subset::

    python -m benchmarks.missing --datasets concrete --scenarios mcar30 --seeds 1

The question: a table has holes; does ``Est().fit(X, y)`` with the NaN left in do as well
as the usual remedy (impute, then fit), and as well as the boosted trees that practitioners
reach for because they take NaN? Every estimator is built with its constructor defaults
(``random_state`` aside). Per set and seed: one seeded 75/25 split (stratified for
classification), then per scenario one mask over the whole table (training and test rows
alike, the same mask for every method):

* ``mcar10`` / ``mcar30``: each cell removed completely at random with probability 0.1 /
  0.3 (the target never);
* ``mnar``: not at random, the largest 30 % of one informative feature hidden (above the
  70th percentile of its training values), the feature with the largest absolute
  Spearman correlation with the target on the training rows (for classification, with
  any class's indicator).

Methods per tree estimator: ``native`` (NaN passed as they are), ``simple``
(``make_pipeline(SimpleImputer(), Est())``, column means) and ``iterative``
(``make_pipeline(IterativeImputer(random_state=seed), Est())``, scikit-learn's defaults
otherwise); peers ``XGBoost`` (``XGBRegressor``/``XGBClassifier``) and ``HGB``
(``HistGradientBoostingRegressor``/``Classifier``), both at their defaults with NaN native.
Metrics: RMSE / std(y_test) (regression) or the share misclassified (classification); for
estimators with ``predict_interval`` the share of test targets inside the 90 % interval
and its mean width / std(y_test) (an imputer pipeline's interval is the estimator's on the
imputed test rows); fit seconds. A cell is (estimator, set, scenario), its value the mean
over seeds. The goals of issue 42: native no worse than the better imputer pipeline on at
least 2/3 of the cells; native within 5 % of XGBoost's error; native 90 % coverage in
0.85-0.95. Results go to ``benchmarks/results/missing.{json,md}`` (``--name``), rewritten
after each set.
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings

import numpy as np

from benchmarks._common import (
    RESULTS,
    imputed,
    make_peer,
    markdown_table,
    result_path,
    write_results,
)
from benchmarks.defaults import DATASETS, load_dataset

# cheapest first: seed 0 runs over every set before seed 1 starts
DEFAULT_SETS = ("wine", "autompg", "breast_cancer", "housing", "concrete", "airfoil")
SCENARIOS = ("mcar10", "mcar30", "mnar")
MCAR_RATE = {"mcar10": 0.1, "mcar30": 0.3}
MNAR_QUANTILE = 0.7  # values above this quantile of the informative feature are hidden
SPLIT_TEST_SIZE = 0.25
INTERVAL_LEVEL = 0.9
COVERAGE_GOAL = (0.85, 0.95)
XGB_MARGIN = 0.05
IMPUTE_SHARE = 2 / 3
OURS = {
    "regression": ("VaRTRegressor", "VaRTForestRegressor", "RNNTreeRegressor"),
    "classification": ("VaRTClassifier", "RNNTreeClassifier"),
}
VARIANTS = ("native", "simple", "iterative")
PEERS = ("XGBoost", "HGB")


# ----------------------------------------------------------------------------- masks


def informative_feature(X, y, task: str) -> int:
    """The column of ``X`` with the largest absolute Spearman correlation with ``y`` (for
    classification, with any class's indicator); constant columns never."""
    from scipy.stats import rankdata

    rx = np.apply_along_axis(rankdata, 0, X)
    targets = [y] if task == "regression" else [(y == c).astype(float) for c in np.unique(y)]
    best, col = -1.0, 0
    for t in targets:
        rt = rankdata(t)
        for j in range(X.shape[1]):
            if np.ptp(rx[:, j]) == 0:
                continue
            r = abs(np.corrcoef(rx[:, j], rt)[0, 1])
            if np.isfinite(r) and r > best:
                best, col = r, j
    return col


def missing_mask(scenario: str, X, train_idx, y, task: str, seed: int):
    """Bool ``(N, L)``: where ``scenario`` hides the cells of the whole table ``X``
    (``train_idx`` its training rows, which alone choose the MNAR feature and cut)."""
    rng = np.random.default_rng([seed, SCENARIOS.index(scenario)])
    if scenario in MCAR_RATE:
        return rng.random(X.shape) < MCAR_RATE[scenario]
    j = informative_feature(X[train_idx], y[train_idx], task)
    cut = np.quantile(X[train_idx, j], MNAR_QUANTILE)
    mask = np.zeros(X.shape, dtype=bool)
    mask[:, j] = X[:, j] > cut
    return mask


# ----------------------------------------------------------------------------- methods


def _ours(name: str, variant: str):
    def make(seed):
        import pyro_trees.estimators as E

        est = getattr(E, name)(random_state=seed)
        return est if variant == "native" else imputed(est, variant, seed)

    return make


def _peer(name: str, task: str):
    return lambda seed: make_peer(name, task, seed)


def methods_for(task: str, selected: set) -> dict:
    """Ordered ``{column: make(seed)}``: each of our estimators in its three variants,
    then the peers."""
    out = {}
    for name in OURS[task]:
        if name.lower() in selected:
            for variant in VARIANTS:
                out[f"{name}/{variant}"] = _ours(name, variant)
    for peer in PEERS:
        if peer.lower() in selected:
            out[peer] = _peer(peer, task)
    return out


def run_one(make, seed, task, Xtr, ytr, Xte, yte) -> dict:
    """Fit, predict and score one method on one split; an exception becomes ``error``."""
    rec: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            est = make(seed)
            t = time.perf_counter()
            est.fit(Xtr, ytr)
            rec["fit_s"] = time.perf_counter() - t
            pred = est.predict(Xte)
            if task == "classification":
                rec["error"] = float(np.mean(pred != yte))
            else:
                sd = float(np.std(yte))
                rec["error"] = float(np.sqrt(np.mean((pred - yte) ** 2))) / sd
                final = est[-1] if hasattr(est, "steps") else est
                if hasattr(final, "predict_interval"):
                    Xi = est[:-1].transform(Xte) if hasattr(est, "steps") else Xte
                    lo, hi = final.predict_interval(Xi, level=INTERVAL_LEVEL)
                    rec["coverage"] = float(np.mean((yte >= lo) & (yte <= hi)))
                    rec["width"] = float(np.mean(hi - lo)) / sd
        except Exception as exc:  # recorded; the run goes on
            rec["failed"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc(limit=4)
    return rec


# ----------------------------------------------------------------------------- tables


def _mean(records, key):
    vals = [r[key] for r in records if key in r]
    return float(np.mean(vals)) if vals and len(vals) == len(records) else None


def cells(records: list[dict]) -> dict:
    """``{(set, scenario, method): {"error", "coverage", "width", "fit_s", "seeds"}}``:
    means over seeds (``None`` where a seed failed)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["dataset"], r["scenario"], r["method"]), []).append(r)
    out = {}
    for key, recs in groups.items():
        out[key] = {k: _mean(recs, k) for k in ("error", "coverage", "width", "fit_s")}
        out[key]["seeds"] = len(recs)
        out[key]["failed"] = [r["failed"] for r in recs if "failed" in r]
    return out


def goals(table: dict) -> dict:
    """The three goals over the cells (estimator, set, scenario) of ``table``."""
    impute, xgb, cover = [], [], []
    keys = sorted({(d, s, m.split("/")[0]) for d, s, m in table if "/" in m})
    for d, s, est in keys:
        native = table.get((d, s, f"{est}/native"), {}).get("error")
        if native is None:
            continue
        imputed = [table.get((d, s, f"{est}/{v}"), {}).get("error") for v in VARIANTS[1:]]
        imputed = [e for e in imputed if e is not None]
        if imputed:
            impute.append(
                {
                    "estimator": est,
                    "set": d,
                    "scenario": s,
                    "native": native,
                    "best imputer": min(imputed),
                    "ok": native <= min(imputed),
                }
            )
        ref = table.get((d, s, "XGBoost"), {}).get("error")
        if ref is not None:
            xgb.append(
                {
                    "estimator": est,
                    "set": d,
                    "scenario": s,
                    "native": native,
                    "XGBoost": ref,
                    "ratio": native / ref if ref > 0 else None,
                    "ok": native <= (1 + XGB_MARGIN) * ref,
                }
            )
        c = table[(d, s, f"{est}/native")].get("coverage")
        if c is not None:
            cover.append(
                {
                    "estimator": est,
                    "set": d,
                    "scenario": s,
                    "coverage": c,
                    "ok": COVERAGE_GOAL[0] <= c <= COVERAGE_GOAL[1],
                }
            )
    return {"impute": impute, "xgboost": xgb, "coverage": cover}


def complete_reference(sets, seeds: int) -> dict:
    """``{(set, column): error}`` without missing values, from the committed
    ``benchmarks/results/defaults.json`` (the same 75/25 splits, seeds ``0..seeds-1``;
    not rerun here): our estimators under ``<name>/native``, and XGBoost. Empty when
    that file or a set is absent."""
    import json

    path = RESULTS / "defaults.json"
    if not path.is_file():
        return {}
    records = json.loads(path.read_text()).get("records", [])
    out: dict = {}
    for d in sets:
        recs = [r for r in records if r["dataset"] == d and r["seed"] < seeds]
        if len(recs) < seeds:
            continue
        for method in {m for r in recs for m in r["methods"]}:
            got = [r["methods"].get(method, {}) for r in recs]
            vals = [g.get("rmse_std", g.get("error_rate")) for g in got]
            if any(v is None for v in vals):
                continue
            column = method if method == "XGBoost" else f"{method}/native"
            out[(d, column)] = float(np.mean(vals))
    return out


def _fmt(v, digits=3):
    return "" if v is None else f"{v:.{digits}f}"


def markdown(payload: dict) -> str:
    args, table = payload["args"], payload["table"]
    g, ran = payload["goals"], payload["ran"]["methods"]
    lines = [
        __doc__.split("\n\n")[0].replace("\n", " "),
        "",
        f"Sets: {', '.join(payload['ran']['datasets'])}; scenarios: "
        f"{', '.join(args['scenarios'].split(','))}; split seeds 0..{args['seeds'] - 1} "
        f"(cells: means over the seeds); methods: {', '.join(dict.fromkeys(ran))}. "
        f"Every estimator at its defaults (random_state = the seed). Wall clock "
        f"{payload['wall_s'] / 60:.1f} min, 1 torch thread, a shared 2-core machine.",
        "",
    ]
    if payload.get("not_run"):
        lines += ["**Not run**: " + payload["not_run"], ""]
    n_imp = sum(r["ok"] for r in g["impute"])
    n_xgb = sum(r["ok"] for r in g["xgboost"])
    n_cov = sum(r["ok"] for r in g["coverage"])
    lines += [
        "## Goals",
        "",
        f"* native no worse than the better imputer pipeline: **{n_imp} / {len(g['impute'])}"
        f"** cells (goal: at least {IMPUTE_SHARE:.0%})",
        f"* native within {XGB_MARGIN:.0%} of XGBoost's error: **{n_xgb} / "
        f"{len(g['xgboost'])}** cells",
        f"* native {INTERVAL_LEVEL:.0%} coverage in {COVERAGE_GOAL[0]}-{COVERAGE_GOAL[1]}: "
        f"**{n_cov} / {len(g['coverage'])}** cells",
        "",
    ]
    reference = complete_reference(payload["ran"]["datasets"], args["seeds"])
    if reference:
        lines += [
            "Rows `complete`: the same estimators and XGBoost on the same splits without "
            "missing values, from `defaults.json` (not rerun here; HGB and the pipelines "
            "not run there).",
            "",
        ]
    for task, metric in (("regression", "RMSE / std(y_test)"), ("classification", "error")):
        sets = [d for d in payload["ran"]["datasets"] if payload["panel"][d]["task"] == task]
        if not sets:
            continue
        methods = [m for m in payload["ran"]["methods_by_task"][task]]
        rows = []
        for d in sets:
            if any((d, m) in reference for m in methods):
                row = {"set": d, "scenario": "complete"}
                row.update({m: _fmt(reference.get((d, m))) for m in methods})
                rows.append(row)
            for s in args["scenarios"].split(","):
                row = {"set": d, "scenario": s}
                for m in methods:
                    row[m] = _fmt(table.get(_key(d, s, m), {}).get("error"))
                rows.append(row)
        lines += [f"## {task.capitalize()}: {metric}", "", markdown_table(rows), ""]
        if task == "regression":
            ests = [m for m in methods if table_has(table, m, "coverage")]
            rows = []
            for d in sets:
                for s in args["scenarios"].split(","):
                    row = {"set": d, "scenario": s}
                    for m in ests:
                        c = table.get(_key(d, s, m), {})
                        row[m] = (
                            ""
                            if c.get("coverage") is None
                            else f"{c['coverage']:.2f} / {c['width']:.2f}"
                        )
                    rows.append(row)
            lines += [
                f"### {INTERVAL_LEVEL:.0%} intervals: coverage / width (units of std(y_test))",
                "",
                markdown_table(rows),
                "",
            ]
    lines += ["## Native against the better imputer pipeline", ""]
    lines += [
        markdown_table(
            [
                {**r, "native": _fmt(r["native"]), "best imputer": _fmt(r["best imputer"])}
                for r in g["impute"]
            ]
        ),
        "",
        "## Native against XGBoost",
        "",
        markdown_table(
            [
                {
                    **r,
                    "native": _fmt(r["native"]),
                    "XGBoost": _fmt(r["XGBoost"]),
                    "ratio": _fmt(r["ratio"], 2),
                }
                for r in g["xgboost"]
            ]
        ),
        "",
        "## Fit seconds (mean over the cells of each method)",
        "",
    ]
    fit_rows = []
    for m in payload["ran"]["methods"]:
        vals = [c["fit_s"] for (_, _, mm), c in _items(table) if mm == m and c["fit_s"]]
        if vals:
            fit_rows.append({"method": m, "fit s": f"{np.mean(vals):.3g}", "cells": len(vals)})
    lines += [markdown_table(fit_rows), ""]
    failures = [(k, c["failed"]) for k, c in _items(table) if c["failed"]]
    if failures:
        lines += ["## Failures", ""]
        lines += [f"* {'/'.join(k)}: {f[0][:200]}" for k, f in failures]
        lines.append("")
    return "\n".join(lines)


def _key(d, s, m):
    return f"{d}|{s}|{m}"


def _items(table):
    return [(tuple(k.split("|")), v) for k, v in table.items()]


def table_has(table, method, metric) -> bool:
    return any(k.endswith(f"|{method}") and v.get(metric) is not None for k, v in table.items())


def render(name: str):
    """Rewrite ``results/NAME.md`` from ``results/NAME.json`` as :func:`write_results`
    writes it, with the environment of the run the JSON records."""
    import json

    base = result_path(name)
    payload = json.loads(base.with_name(f"{name}.json").read_text())
    env = payload["environment"]
    header = (
        f"# {name}\n\n"
        f"{env['date']} · {env['machine']} · {env['cpu_count']} CPUs "
        f"({env['torch_threads']} torch threads) · torch {env['torch']} · pyro {env['pyro']} "
        f"· device {env['device']}\n\n"
    )
    base.with_name(f"{name}.md").write_text(header + markdown(payload))


# ----------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default=",".join(DEFAULT_SETS), help="comma-separated names")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated estimator class names and XGBoost, HGB (default: all)",
    )
    p.add_argument("--seeds", type=int, default=3, help="number of split seeds (0..N-1)")
    p.add_argument("--name", default="missing", help="result name (benchmarks/results/NAME)")
    p.add_argument(
        "--render",
        action="store_true",
        help="only rewrite NAME.md from the committed NAME.json (its run and environment)",
    )
    args = p.parse_args(argv)
    if args.render:
        return render(args.name)

    import torch

    torch.set_num_threads(1)
    names = [n for n in args.datasets.split(",") if n]
    unknown = sorted(set(names) - set(DATASETS))
    if unknown:
        raise SystemExit(f"unknown data sets {unknown}; choose from {list(DATASETS)}")
    scenarios = [s for s in args.scenarios.split(",") if s]
    if set(scenarios) - set(SCENARIOS):
        raise SystemExit(f"unknown scenarios; choose from {SCENARIOS}")
    valid = {n.lower() for t in OURS.values() for n in t} | {q.lower() for q in PEERS}
    selected = {m.lower() for m in args.methods.split(",") if m} if args.methods else valid
    if selected - valid:
        raise SystemExit(f"unknown methods {sorted(selected - valid)}")

    from sklearn.model_selection import train_test_split

    records, panel, ran_sets, data = [], {}, [], {}
    for name in names:
        X, y, info = load_dataset(name, None)
        data[name] = (np.asarray(X, dtype=np.float64), y)
        panel[name] = info
    tasks = [t for t in OURS if any(panel[n]["task"] == t for n in names)]
    methods_by_task = {t: list(methods_for(t, selected)) for t in tasks}
    start = time.perf_counter()

    def save():
        table = cells(records)
        payload = {
            "args": vars(args),
            "panel": panel,
            "ran": {
                "datasets": ran_sets,
                "methods": [m for t in tasks for m in methods_by_task[t]],
                "methods_by_task": methods_by_task,
            },
            "wall_s": time.perf_counter() - start,
            "records": records,
            "table": {_key(*k): v for k, v in table.items()},
            "goals": goals(table),
        }
        done = {(r["dataset"], r["seed"]) for r in records}
        missing = [f"{d} seed {s}" for d in names for s in range(args.seeds) if (d, s) not in done]
        payload["not_run"] = (", ".join(missing) + " (not reached)") if missing else ""
        write_results(args.name, payload, markdown(payload))

    for seed in range(args.seeds):  # every set's seed 0 first: a cut run covers every set
        for name in names:
            X, y = data[name]
            task = panel[name]["task"]
            methods = methods_for(task, selected)
            idx = np.arange(len(y))
            tr, te = train_test_split(
                idx,
                test_size=SPLIT_TEST_SIZE,
                random_state=seed,
                stratify=y if task == "classification" else None,
            )
            for scenario in scenarios:
                mask = missing_mask(scenario, X, tr, y, task, seed)
                Xm = np.where(mask, np.nan, X)
                for method, make in methods.items():
                    t0 = time.perf_counter()
                    rec = run_one(make, seed, task, Xm[tr], y[tr], Xm[te], y[te])
                    rec.update(
                        dataset=name,
                        seed=seed,
                        scenario=scenario,
                        method=method,
                        missing_share=float(mask.mean()),
                    )
                    records.append(rec)
                    status = rec.get("failed", "")[:80] or (
                        f"err {rec['error']:.3f}"
                        + (f" cov {rec['coverage']:.2f}" if "coverage" in rec else "")
                    )
                    print(
                        f"{name} s{seed} {scenario} {method}: {status} "
                        f"({time.perf_counter() - t0:.1f} s)",
                        flush=True,
                    )
            if name not in ran_sets:
                ran_sets.append(name)
            save()
    save()


if __name__ == "__main__":
    main()
