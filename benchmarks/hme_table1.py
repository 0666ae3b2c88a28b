"""Table 1 of Antorán et al.: RNN-Tree vs CART on six small data sets.

Protocol: three random 80/10/10 train/validation/test splits; the validation split
drives early stopping for the RNN-Tree and cost-complexity pruning for CART. Errors:
classification error (Iris, Wine, Digits, Breast cancer) and, for Diabetes and Boston
(``uci/housing`` in the data cache), the MSE of targets standardised on the training
split: the paper's caption says RMSE, but of RMSE, MSE and RMSE over the range only the
MSE puts our CART within the paper's CART figures on both regression sets
(``hme_table1_protocol.md``); the RMSE is shown beside it. Both methods run side by side
in the same process.

Starts: ``--init auto`` (default: the estimators' own choice, which trains the greedy and
the balanced start and lets the held-out error pick), ``balanced`` (median cuts), ``greedy``
(CART's impurity cuts) or ``both`` (one fit per start; the held-out error picks one per seed).
Every other option is the estimators' default, but the validation fraction, which the
protocol fixes at the size of its validation split. Depths: the paper
does not state the depth it used; ``--depth`` takes one or several, and with several the
held-out error picks one per seed too (as CART's pruning picks its size), among the
depths whose 2**D leaves leave at least ``--min-leaf-points`` (default 4) training
points per leaf on average (always the shallowest). On the small sets, choosing depth 8
on 15-57 held-out points overfitted the choice and cost test error on four of them.

Run: ``python -m benchmarks.hme_table1 [--datasets iris wine] [--depth 4 8] [--init auto]``.
Writes ``benchmarks/results/hme_table1.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.datasets import load_sklearn
from pyro_trees.estimators import RNNTreeClassifier, RNNTreeRegressor

# name: (task, paper CART mean, sd, paper RNN-Tree mean, sd)
PAPER = {
    "iris": ("C", 0.0, 0.0, 0.0, 0.0),
    "boston": ("R", 0.311, 0.105, 0.218, 0.043),
    "wine": ("C", 0.092, 0.026, 0.055, 0.045),
    "diabetes": ("R", 0.855, 0.241, 0.583, 0.079),
    "digits": ("C", 0.161, 0.022, 0.168, 0.018),
    "breast_cancer": ("C", 0.058, 0.036, 0.023, 0.008),
}


def split(n: int, seed: int):
    perm = np.random.default_rng(seed).permutation(n)
    n_test = n_val = int(round(0.1 * n))
    return perm[n_test + n_val :], perm[n_test : n_test + n_val], perm[:n_test]


def cart(task: str, X_tr, y_tr, X_va, y_va, seed: int):
    """CART grown fully, pruned by cost complexity with alpha chosen on validation."""
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    cls = DecisionTreeClassifier if task == "C" else DecisionTreeRegressor
    path = cls(random_state=seed).cost_complexity_pruning_path(X_tr, y_tr)
    best, best_err = None, np.inf
    for alpha in np.unique(path.ccp_alphas):
        model = cls(random_state=seed, ccp_alpha=max(float(alpha), 0.0)).fit(X_tr, y_tr)
        err = error(task, model.predict(X_va), y_va)
        if err < best_err - 1e-12:
            best, best_err = model, err
    return best


def error(task: str, pred, y) -> float:
    """Error rate (``"C"``) or RMSE (``"R"``)."""
    if task == "C":
        return float(np.mean(pred != y))
    return float(np.sqrt(np.mean((pred - y) ** 2)))


def paper_metric(task: str, errs) -> np.ndarray:
    """Table 1's figure: the error rate, or the MSE of standardised targets."""
    errs = np.asarray(errs, dtype=np.float64)
    return np.square(errs) if task == "R" else errs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", nargs="*", default=list(PAPER))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--depth", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--min-leaf-points", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=None, help="default: the estimator's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init", default="auto", choices=["auto", "balanced", "greedy", "both"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows, runs = [], []
    for name in args.datasets:
        task = PAPER[name][0]
        X, y = load_sklearn(name)
        X = np.asarray(X, dtype=np.float64)
        errs = {"cart": [], "rnn": []}
        secs = {"cart": [], "rnn": []}
        for seed in range(args.seeds):
            tr, va, te = split(len(y), seed)
            y_tr, y_va, y_te = y[tr], y[va], y[te]
            if task == "R":  # standardise targets on the training split
                mu, sd = y_tr.mean(), y_tr.std()
                y_tr, y_va, y_te = (y_tr - mu) / sd, (y_va - mu) / sd, (y_te - mu) / sd
            t0 = time.perf_counter()
            c = cart(task, X[tr], y_tr, X[va], y_va, seed)
            secs["cart"].append(time.perf_counter() - t0)
            errs["cart"].append(error(task, c.predict(X[te]), y_te))
            est_cls = RNNTreeClassifier if task == "C" else RNNTreeRegressor
            # Early stopping (and, with --init both, the choice of start) uses a held-out
            # split of the protocol's validation size, drawn by the estimator from the
            # training and validation points together.
            X_fit = np.concatenate([X[tr], X[va]])
            y_fit = np.concatenate([y_tr, y_va])
            t0 = time.perf_counter()
            fits = []
            inits = ("balanced", "greedy") if args.init == "both" else (args.init,)
            steps = {} if args.steps is None else {"num_steps": args.steps}
            depths = sorted(args.depth)
            depths = [d for d in depths if 2**d * args.min_leaf_points <= len(X_fit)] or depths[:1]
            for depth, init in itertools.product(depths, inits):
                est = est_cls(
                    depth,
                    random_state=seed,
                    init=init,
                    # the protocol's validation size (the estimator's default is 0.2)
                    validation_fraction=len(va) / len(X_fit),
                    **steps,
                )
                est.fit(X_fit, y_fit)
                fit_err = error(task, est.predict(X_fit), y_fit)
                held_out = est.validation_error_
                fits.append((held_out, depth, fit_err, f"{est.start_[0]}{depth}", est))
            # Same seed, same held-out points: the lower validation error wins. A tie
            # (15 held-out points on Iris make ties common) goes to the shallower tree,
            # then to the lower error on the points fitted (with equal held-out errors,
            # the lower training error); a tie on all keeps the balanced start (the
            # prior's mode).
            _, _, _, chosen, est = min(fits, key=lambda f: f[:3])
            secs["rnn"].append(time.perf_counter() - t0)
            errs["rnn"].append(error(task, est.predict(X[te]), y_te))
            runs.append(
                {
                    "dataset": name,
                    "seed": seed,
                    "cart": errs["cart"][-1],
                    "rnn_tree": errs["rnn"][-1],
                    "init": chosen,
                    # 0: early stopping kept the starting tree (training did not lower
                    # the held-out error)
                    "best_step": est.fit_result_.best_step,
                }
            )
        _, pc, pcs, pr, prs = PAPER[name]
        c_fig, r_fig = paper_metric(task, errs["cart"]), paper_metric(task, errs["rnn"])
        rows.append(
            {
                "dataset": f"{name} ({task})",
                "CART (ours)": f"{np.mean(c_fig):.3f} ± {np.std(c_fig):.3f}",
                "RNN-Tree (ours)": f"{np.mean(r_fig):.3f} ± {np.std(r_fig):.3f}",
                "CART (paper)": f"{pc:.3f} ± {pcs:.3f}",
                "RNN-Tree (paper)": f"{pr:.3f} ± {prs:.3f}",
                # The caption says RMSE, yet only the MSE of standardised targets puts our
                # CART within the paper's CART on both regression sets
                # (hme_table1_protocol): Table 1's figure is the MSE; the RMSE is shown.
                "RMSE CART / RNN-Tree (ours)": (
                    f"{np.mean(errs['cart']):.3f} / {np.mean(errs['rnn']):.3f}"
                    if task == "R"
                    else ""
                ),
                "ours <= paper RNN-Tree": bool(np.mean(r_fig) <= pr + 1e-9),
                "ours <= our CART": bool(np.mean(r_fig) <= np.mean(c_fig) + 1e-9),
                "start, depth (per seed)": " ".join(
                    r["init"] for r in runs if r["dataset"] == name
                ),
                "step kept (per seed)": " ".join(
                    str(r["best_step"]) for r in runs if r["dataset"] == name
                ),
                "RNN-Tree s/fit": float(np.mean(secs["rnn"])),
                "CART s/fit": float(np.mean(secs["cart"])),
            }
        )
        print(rows[-1], flush=True)
    total = time.perf_counter() - start
    md = (
        "Figures: error rate (C) and MSE of targets standardised on the training split (R; "
        "the metric that reproduces the paper's CART, hme_table1_protocol.md; RMSE in its "
        "own column); mean ± sd over the splits. "
        f"Depths {args.depth} (those with >= {args.min_leaf_points:g} training points per "
        f"leaf on average), steps {args.steps or 'default'}, otherwise the estimators' "
        f"defaults, init={args.init!r} "
        "(auto, the default: the estimator trains the greedy and the balanced start and "
        "its held-out error picks one; both: two fits, one per start, the lower held-out "
        "error picks; 'start, depth' lists b/g and the depth "
        "chosen), early stopping on a held-out split "
        "of the validation size (the starting tree included; 'step kept' 0 means training "
        "never beat the start on the held-out points). 'RNN-Tree s/fit' counts "
        f"every start and depth trained. Whole run: "
        f"{total:.0f} s (goal: <= 600 s on CPU).\n\n" + markdown_table(rows)
    )
    write_results(
        "hme_table1", {"rows": rows, "runs": runs, "total_seconds": total, "args": vars(args)}, md
    )
    print(md)
    return {"rows": rows, "total_seconds": total}


if __name__ == "__main__":
    main()
