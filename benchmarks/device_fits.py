"""Fit seconds of every estimator at its defaults on the CPU and on a CUDA GPU, in one run
(issue 38's "every estimator, 400 rows, GPU vs CPU" and "kin40k forest on the GPU").

Run from the repository root: ``python -m benchmarks.device_fits`` (the CPU alone where no
GPU is present: the GPU columns then say so); ``--kin40k`` adds
:class:`~pyro_trees.estimators.VaRTForestRegressor` on split 0 of the cached ``uci/kin40k``
(needs ``PYRO_TREES_DATA``); ``--rows`` sets the synthetic rows (default 400).

Protocol: every estimator of ``pyro_trees.estimators.__all__`` whose ``fit`` takes
``(X, y)``, built with its defaults except ``random_state=0`` and ``device``, fits the
first ``--rows`` rows of :func:`benchmarks._common.synthetic_rows` (8 features; a
classifier gets ``y > median``) twice on each device: ``first s`` pays every one-time cost
of the process (CUDA's start is paid before the first fit; a compiled loss compiles here),
``again s`` is the same fit repeated (a compiled loss reuses its program), the figure a
user who fits more than once sees. ``ratio``: the GPU's ``again s`` over the CPU's (below 1:
the GPU is faster). Predictions of the two devices are compared on the training rows
(``max |diff|``, on a probability scale for classifiers). Wall-clock seconds on a shared
machine: compare within one run only.
"""

from __future__ import annotations

import argparse
import inspect
import time

import numpy as np
import torch

from benchmarks._common import markdown_table, rmse, synthetic_rows, uci_splits, write_results


def estimators() -> dict:
    """``{name: class}`` of the estimators whose ``fit`` takes ``(X, y)``."""
    from pyro_trees import estimators as E

    out = {}
    for name in E.__all__:
        cls = getattr(E, name)
        if not isinstance(cls, type) or not hasattr(cls, "fit"):
            continue
        params = list(inspect.signature(cls.fit).parameters)[1:3]
        if params == ["X", "y"]:
            out[name] = cls
    return out


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_fits(cls, X, y, device: str) -> dict:
    """Two fits of ``cls`` on ``device``: seconds of each, the second fit and its
    predictions on ``X``."""
    record = {}
    for key in ("first s", "again s"):
        est = cls(random_state=0, device=device)
        _sync(device)
        t = time.perf_counter()
        est.fit(X, y)
        _sync(device)
        record[key] = time.perf_counter() - t
    pred = est.predict_proba(X)[:, 1] if hasattr(est, "predict_proba") else est.predict(X)
    record["pred"] = np.asarray(pred, dtype=float)
    record["estimator"] = est
    return record


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or ``{"failed": "<error>"}`` where it raises: one estimator that
    fails on a device is a row saying so, and the run still writes its table."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - any failure of a fit is a result here
        return {"failed": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}


def _record(row: dict, device: str, fit: dict) -> None:
    """The fit's seconds (or its failure) in ``row``'s columns for ``device``."""
    if "failed" in fit:
        row[f"{device} first s"] = row[f"{device} again s"] = None
        row["failed"] = f"{device}: {fit['failed']}"
    else:
        row[f"{device} first s"] = fit["first s"]
        row[f"{device} again s"] = fit["again s"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--kin40k", action="store_true", help="add the forest on kin40k split 0")
    p.add_argument("--estimators", default=None, help="comma-separated class names")
    p.add_argument("--name", default="device_fits")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    devices = ["cpu"] + (["cuda"] if cuda else [])
    if cuda:
        torch.zeros(1, device="cuda")  # CUDA's start, before any fit is timed
    x, yt = synthetic_rows(0, args.rows, seed=0)
    X, y = x.numpy().astype(np.float64), yt.numpy().astype(np.float64)
    labels = (y > np.median(y)).astype(int)
    chosen = estimators()
    if args.estimators:
        chosen = {k: v for k, v in chosen.items() if k in args.estimators.split(",")}
    rows = []
    for name, cls in chosen.items():
        target = labels if "Classifier" in name else y
        row = {"estimator": name, "rows": args.rows}
        fits = {}
        for device in devices:
            fits[device] = _guarded(timed_fits, cls, X, target, device)
            _record(row, device, fits[device])
        if cuda and "failed" not in row:
            row["ratio"] = fits["cuda"]["again s"] / fits["cpu"]["again s"]
            row["max |diff|"] = float(np.abs(fits["cuda"]["pred"] - fits["cpu"]["pred"]).max())
        elif not cuda:
            row["cuda"] = "no GPU in this run"
        print(row, flush=True)
        rows.append(row)
    if args.kin40k:
        from pyro_trees.estimators import VaRTForestRegressor

        _, split, _, Xtr, ytr, Xte, yte = next(uci_splits("kin40k", [0]))
        row = {"estimator": "VaRTForestRegressor (kin40k split 0)", "rows": len(ytr)}
        fits = {}
        for device in devices:
            fit = _guarded(timed_fits, VaRTForestRegressor, Xtr, ytr, device)
            if "failed" not in fit:
                fit["rmse"] = rmse(fit["estimator"].predict(Xte), yte)
                row[f"{device} RMSE"] = fit["rmse"]
            fits[device] = fit
            _record(row, device, fit)
        if cuda and "failed" not in row:
            row["ratio"] = fits["cuda"]["again s"] / fits["cpu"]["again s"]
        elif not cuda:
            row["cuda"] = "no GPU in this run"
        print(row, flush=True)
        rows.append(row)
    gpu = torch.cuda.get_device_name(0) if cuda else "none (GPU figures pending a GPU run)"
    threads = torch.get_num_threads()
    md = (
        f"Fit seconds at default arguments (`random_state=0`, `device`), CPU ({threads} "
        f"torch threads) and GPU ({gpu}) in one run; {args.rows} synthetic rows (8 "
        "features; classifiers: y above its median); `first s` pays the process's one-time "
        "costs (compilation included), `again s` repeats the fit; `ratio`: GPU over CPU, "
        "`again s`; `max |diff|`: largest difference of the two devices' predictions on the "
        "training rows. See `benchmarks/device_fits.py`.\n\n"
        + markdown_table(rows, list(dict.fromkeys(k for r in rows for k in r)))  # every column
        + "\n"
    )
    device = "cuda" if cuda else "cpu"
    write_results(args.name, {"rows": rows, "gpu": gpu}, md, device=device, args=vars(args))
    print(md)


if __name__ == "__main__":
    main()
