"""Shared helpers for benchmark scripts: environment record and result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

import torch

from benchmarks._records import RESULTS, read_record, record_paths

__all__ = [
    "LR_SCHEDULE_TEXT",
    "RESULTS",
    "environment",
    "read_record",
    "record_paths",
    "lr_schedule_from_env",
    "make_lr_scheduler",
    "markdown_table",
    "write_results",
]

# learning-rate schedules a benchmark may be asked for, and how its results describe them
LR_SCHEDULE_TEXT = {"constant": "0.01", "cosine": "0.01 falling to 0.001 along a half cosine"}


def lr_schedule_from_env(var: str) -> str:
    """The schedule named by environment variable ``var`` (default ``"constant"``);
    a ``ValueError`` for a name not in :data:`LR_SCHEDULE_TEXT`."""
    name = os.environ.get(var, "constant")
    if name not in LR_SCHEDULE_TEXT:
        raise ValueError(f"{var} must be one of {sorted(LR_SCHEDULE_TEXT)}, got {name!r}")
    return name


def make_lr_scheduler(name: str, optimizer, steps: int):
    """The scheduler of schedule ``name`` for ``optimizer`` over ``steps`` steps (its
    rate starting at 0.01), or ``None`` for the constant rate."""
    if name == "constant":
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=1e-3)


def environment(device=None) -> dict:
    """Date, machine, library versions and device of this run."""
    import pyro

    try:
        import gpytorch

        gpytorch_version = gpytorch.__version__
    except ImportError:  # pragma: no cover
        gpytorch_version = None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "gpytorch": gpytorch_version,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub markdown table of ``rows`` (dicts), in ``columns`` order."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out) + "\n"


def write_results(name: str, payload: dict, markdown: str, device=None) -> Path:
    """Write ``results/NAME.json`` (payload + environment) and ``results/NAME.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    payload = {"benchmark": name, "environment": env, **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    header = (
        f"# {name}\n\n"
        f"{env['date']} · {env['machine']} · {env['cpu_count']} CPUs "
        f"({env['torch_threads']} torch threads) · torch {env['torch']} · pyro {env['pyro']} "
        f"· device {env['device']}\n\n"
    )
    path = RESULTS / f"{name}.md"
    path.write_text(header + markdown)
    return path


def fit_bart(X, y, seed: int):
    """The BART peer of the VaRT benchmarks: stochtree, 50 trees, 200 burn-in and 200
    kept MCMC draws, no grow-from-root warm start. Returns the sampled ``BARTModel``."""
    from stochtree import BARTModel

    m = BARTModel()
    m.sample(
        X_train=X,
        y_train=y,
        num_gfr=0,
        num_burnin=200,
        num_mcmc=200,
        general_params={"random_seed": seed},
        mean_forest_params={"num_trees": 50},
    )
    return m
