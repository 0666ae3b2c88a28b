"""How the noise factor of a pool of VaRT fits is set: the test coverage of the shipped
rule beside the rules it replaced, on the same fitted forests.

Run from the repository root: ``python -m benchmarks.vart_pool_calibration`` (splits
0-2 of the 18 UCI sets of ``benchmarks/vart_forest.py``, same protocol), ``--num-fits 5``
for a pool of five, ``--friedman 5`` for five draws of the VaRT notebook's section 6
data instead (Friedman's function, noise 1: 500 training rows drawn with
``random_state=2 d``, 1,000 test rows with ``2 d + 1``, the forest seeded ``d``; draw 0
is the notebook's).

Each :class:`~pyro_trees.estimators.VaRTForestRegressor` (default arguments, or
``num_fits`` as named) is fitted once; fit :math:`j` held out fold :math:`j`. Its held-out
rows are scored two ways at factor-1 noise:

* ``own``: under fit :math:`j`'s own posterior forests alone (the rule until 2026-11-27);
* ``pool``: in the pool's shape, fit :math:`j`'s predictive moved by every fit's offset
  from the fits' mean at that row (the shipped rule).

Each set of scores gives a factor with the 0.95 confidence bound below one
(``bound``) or without it (``quantile``); the shipped rule is ``pool`` + ``quantile``
and must equal the fitted ``noise_factor_`` (checked). A test row is inside the 90 %
interval of the pooled predictive at factor :math:`c` iff its coverage score
(:meth:`~pyro_trees.estimators.VaRTRegressor.coverage_scores`) is at most :math:`c`, so
the four rules' test coverages come from one set of test scores.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import make_friedman1

from benchmarks._common import UCI_SETS, markdown_table, rmse, uci_splits, write_results
from pyro_trees.estimators import VaRTForestRegressor, coverage_factor
from pyro_trees.estimators._vart_calibration import _mixture_scores, _pool_shaped_mixtures

RULES = {
    "own + bound (previous)": ("own", 0.95),
    "own + quantile": ("own", None),
    "pool + bound": ("pool", 0.95),
    "pool + quantile (shipped)": ("pool", None),
}
LEVEL = 0.9


class _Recording(VaRTForestRegressor):
    """Keeps the held-out rows each fit was calibrated on (``held_``)."""

    def _calibrate_noise(self, held, extra=(), fits=None):
        self.held_ = held
        return super()._calibrate_noise(held, extra, fits)


def fit_rules(split, Xtr, ytr, Xte, yte, num_fits: int) -> dict:
    """One forest: its test RMSE and the test coverage of each rule's factor."""
    est = _Recording(random_state=split, num_fits=num_fits).fit(Xtr, ytr)
    fits = est._all_fit_leaves()
    scores = {"own": [], "pool": []}
    with torch.no_grad():
        for j, (Xva, yva) in enumerate(est.held_):
            for kind, pool in (("own", [fits[j]]), ("pool", fits)):
                batches = est._posterior().batches(Xva, yva, parts=len(pool))
                mixtures = _pool_shaped_mixtures(fits[j], pool, batches)
                scores[kind].append(_mixture_scores(mixtures, LEVEL))
    test = est.coverage_scores(Xte, yte, level=LEVEL)  # at factor-1 noise
    out = {"rmse": rmse(est.predict(Xte), yte), "noise_factor": float(est.noise_factor_)}
    for rule, (kind, confidence) in RULES.items():
        c = coverage_factor(torch.cat(scores[kind]), LEVEL, confidence)
        out[rule] = {"factor": c, "coverage90": float(np.mean(test <= c * (1 + 1e-9)))}
    shipped = out["pool + quantile (shipped)"]["factor"]
    assert abs(shipped - est.noise_factor_) <= 1e-9 * shipped, (shipped, est.noise_factor_)
    return out


def summarise(args, records) -> None:
    names = list(dict.fromkeys(r["dataset"] for r in records))
    rows, counts = [], {rule: {"in band": 0, "above": 0, "below": 0} for rule in RULES}
    means = {rule: [] for rule in RULES}
    for name in names:
        recs = [r for r in records if r["dataset"] == name]
        row = {"dataset": name, "n": recs[0]["n"], "splits": len(recs)}
        row["RMSE"] = float(np.mean([r["rmse"] for r in recs]))
        for rule in RULES:
            cov = float(np.mean([r[rule]["coverage90"] for r in recs]))
            row[rule] = cov
            means[rule].append(cov)
            key = "in band" if 0.85 <= cov <= 0.95 else "above" if cov > 0.95 else "below"
            counts[rule][key] += 1
        rows.append(row)
    n = len(names)
    summary = [
        {
            "rule": rule,
            "mean cov90": float(np.mean(means[rule])),
            "in [0.85, 0.95]": f"{c['in band']}/{n}",
            "above 0.95": c["above"],
            "below 0.85": c["below"],
            "mean abs(cov90 - 0.9)": float(np.mean(np.abs(np.array(means[rule]) - 0.9))),
        }
        for rule, c in counts.items()
    ]
    md = (
        f"VaRTForestRegressor (default arguments, num_fits={args.num_fits}), each fitted once "
        f"per split; splits {args.splits}. Test coverage of the 90 % interval of the pooled "
        "predictive under each rule's noise factor (see the script's docstring): scores "
        "of each fit's held-out fold under its own forests (`own`) or in the pool's "
        "shape (`pool`), factor with the 0.95 confidence bound below one (`bound`) or "
        "the quantile as it is (`quantile`). Coverage averaged over the splits.\n\n"
        + markdown_table(summary)
        + "\n\n## Per set\n\n"
        + markdown_table(rows)
        + "\n"
    )
    write_results(
        args.name,
        {
            "splits": args.splits,
            "num_fits": args.num_fits,
            "summary": summary,
            "rows": rows,
            "records": records,
        },
        md,
        args=vars(args),
    )
    print(md if len(names) == len(args.datasets.split(",")) else "", end="", flush=True)


def friedman_draws(draws: int):
    """``(name, draw, X, Xtr, ytr, Xte, yte)`` of the notebook's Friedman data."""
    for d in range(draws):
        Xtr, ytr = make_friedman1(n_samples=500, noise=1.0, random_state=2 * d)
        Xte, yte = make_friedman1(n_samples=1000, noise=1.0, random_state=2 * d + 1)
        yield "friedman1", d, Xtr, Xtr, ytr, Xte, yte


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default=",".join(UCI_SETS))
    p.add_argument("--splits", default="0,1,2")
    p.add_argument("--num-fits", type=int, default=3)
    p.add_argument("--friedman", type=int, default=0, help="draws of the notebook's toy")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if args.name is None:
        suffix = "" if args.num_fits == 3 else f"_{args.num_fits}fits"
        suffix += "_friedman" if args.friedman else ""
        args.name = "vart_pool_calibration" + suffix
    torch.set_num_threads(1)
    splits = [int(s) for s in args.splits.split(",") if s]
    data = uci_splits(args.datasets, splits)
    if args.friedman:
        args.datasets, args.splits = "friedman1", ",".join(map(str, range(args.friedman)))
        splits = list(range(args.friedman))
        data = friedman_draws(args.friedman)
    records = []
    for name, split, X, Xtr, ytr, Xte, yte in data:
        rec = {"dataset": name, "split": split, "n": len(X)}
        rec.update(fit_rules(split, Xtr, ytr, Xte, yte, args.num_fits))
        records.append(rec)
        print(name, split, {k: v for k, v in rec.items() if isinstance(v, dict)}, flush=True)
        if split == splits[-1]:
            summarise(args, records)


if __name__ == "__main__":
    main()
