"""What the benchmark scripts share: result files, the data they load, and the peers they
are measured against.

* **Result files.** Each benchmark writes its current result to ``results/NAME.json`` (the
  record, with the environment of the run and the arguments that made it) and
  ``results/NAME.md`` (its table), ``NAME`` the script's name; a run under another name (a
  variant: other arguments) goes to ``results/variants/``. :func:`read_record` and
  :func:`record_paths` read them back. The module imports only the standard library at
  load (numpy, torch and the peers' libraries where a function needs them), so that
  :mod:`benchmarks.results_readme` can use it.
* **Data.** The 18 UCI regression sets of the VaRT paper (:data:`UCI_SETS`,
  :func:`uci_splits`) and the synthetic rows of the distributed benchmarks
  (:class:`SyntheticRows`), generated batch by batch.
* **Peers.** BART (stochtree: :func:`fit_bart`, :func:`fit_bart_default`,
  :func:`fit_bart_probit`), XGBoost, RandomForest, CatBoost (:func:`run_peers`) and the
  scikit-learn / XGBoost factories of the CART, defaults and missing-value comparisons
  (:func:`make_peer`, :func:`imputed`).
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

__all__ = [
    "IN_FEATURES",
    "LR_SCHEDULE_TEXT",
    "RESULTS",
    "UCI_SETS",
    "VARIANTS",
    "SyntheticRows",
    "bart_scores",
    "environment",
    "environment_settings",
    "fit_bart",
    "fit_bart_default",
    "fit_bart_probit",
    "imputed",
    "lr_schedule_from_env",
    "make_lr_scheduler",
    "make_peer",
    "markdown_table",
    "read_record",
    "record_paths",
    "result_path",
    "rmse",
    "run_peers",
    "synthetic_rows",
    "uci_splits",
    "write_results",
]

# ----------------------------------------------------------------------------- result files

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = RESULTS / "variants"
_SCRIPTS = Path(__file__).resolve().parent


def result_path(name: str) -> Path:
    """Where result ``name`` lives, without its extension: ``results/NAME`` for a
    benchmark's current result (``NAME`` is a script or package in ``benchmarks/``),
    ``results/variants/NAME`` for any other name."""
    own = (_SCRIPTS / f"{name}.py").is_file() or (_SCRIPTS / name / "__main__.py").is_file()
    return (RESULTS if own else VARIANTS) / name


def read_record(path) -> dict:
    """A result record, ``NAME.json`` or gzipped ``NAME.json.gz`` (the large per-row
    records are kept compressed)."""
    path = Path(path)
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def record_paths(pattern: str) -> list[Path]:
    """The result records matching ``pattern`` (a glob ending in ``.json``), plain or
    gzipped, current results and variants alike, sorted by name."""
    found = [p for d in (RESULTS, VARIANTS) for p in (*d.glob(pattern), *d.glob(pattern + ".gz"))]
    return sorted(found, key=lambda p: p.name)


def environment(device=None) -> dict:
    """Date, machine, library versions and device of this run."""
    import pyro
    import torch

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


def _script() -> str | None:
    """The benchmark module this process runs (``python -m benchmarks.NAME``), if any."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    return name.removeprefix("benchmarks.").removesuffix(".__main__") or None


def environment_settings(prefix: str) -> dict:
    """The environment variables starting with ``prefix`` (the settings of a benchmark
    configured that way), by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefix)}


def write_results(name: str, payload: dict, markdown: str, device=None, *, args=None) -> Path:
    """Write ``NAME.json`` (payload + environment + the script and its arguments) and
    ``NAME.md`` where :func:`result_path` puts them; returns the ``.md``.

    :param dict args: the settings of the run (``vars(args)`` of the script's parser, or
        its environment variables); recorded as ``"args"`` unless the payload has them.
    """
    base = result_path(name)
    base.parent.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    head = {"benchmark": name, "script": _script(), "environment": env}
    if args is not None and "args" not in payload:
        head["args"] = dict(args)
    payload = {**head, **payload}
    base.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    header = (
        f"# {name}\n\n"
        f"{env['date']} · {env['machine']} · {env['cpu_count']} CPUs "
        f"({env['torch_threads']} torch threads) · torch {env['torch']} · pyro {env['pyro']} "
        f"· device {env['device']}\n\n"
    )
    path = base.with_suffix(".md")
    path.write_text(header + markdown)
    return path


# ----------------------------------------------------------------------------- schedules

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
    import torch

    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=1e-3)


# ----------------------------------------------------------------------------- data

# the 18 UCI regression sets of the VaRT paper's Table 2 (Salazar)
UCI_SETS = [
    "autompg",
    "concreteslump",
    "forest",
    "solar",
    "stock",
    "yacht",
    "airfoil",
    "autos",
    "breastcancer",
    "concrete",
    "fertility",
    "housing",
    "machine",
    "pendulum",
    "servo",
    "skillcraft",
    "sml",
    "wine",
]


def uci_splits(datasets: str, splits: list[int]):
    """``(name, split, X, Xtr, ytr, Xte, yte)`` for every set named in ``datasets``
    (comma-separated) and every split of :func:`pyro_trees.datasets.load_uci`, targets
    min-max scaled over the full set."""
    from pyro_trees.datasets import load_uci

    for name in [n for n in datasets.split(",") if n]:
        X, y, mask = load_uci(name)
        y = (y - y.min()) / (y.max() - y.min())
        for split in splits:
            te = mask[:, split]
            yield name, split, X, X[~te], y[~te], X[te], y[te]


IN_FEATURES = 8  # inputs of the synthetic rows


def _synthetic_target(x):
    """A tree-shaped function of the first three inputs plus a linear trend."""
    import torch

    step = torch.where(x[:, 0] > 0, 1.0, -1.0) + torch.where(x[:, 1] > 0.5, 0.5, 0.0)
    return step + 0.5 * x[:, 2]


def synthetic_rows(start: int, stop: int, seed: int = 0):
    """Rows ``start..stop-1`` of the synthetic data set ``seed``: ``(x (n, 8), y (n,))``;
    row ``i`` is the same whatever batch it comes in (generated in blocks of 1024 rows)."""
    import torch

    xs, ys = [], []
    block = 1024
    for b in range(start // block, (stop - 1) // block + 1):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
        x = torch.randn(block, IN_FEATURES, generator=gen)
        y = _synthetic_target(x) + 0.1 * torch.randn(block, generator=gen)
        lo, hi = max(start - b * block, 0), min(stop - b * block, block)
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    return torch.cat(xs), torch.cat(ys)


class SyntheticRows:
    """A re-iterable of ``(x, y)`` batches of ``batch_size`` rows out of ``num_rows``,
    generated on the fly (:func:`synthetic_rows`); ``rank``/``world_size`` take every
    ``world_size``-th batch.

    :param int num_rows: rows of the whole data set.
    :param int batch_size: rows per batch.
    :param int seed: the data set.
    """

    def __init__(self, num_rows, batch_size, seed=0, rank=0, world_size=1):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        glob = self.batch_size * self.world_size
        for k in range(self.num_rows // glob):  # the same number of batches on every rank
            start = k * glob + self.rank * self.batch_size
            yield synthetic_rows(start, start + self.batch_size, self.seed)


# ----------------------------------------------------------------------------- peers


def rmse(a, b) -> float:
    """Root mean squared error of ``a`` against ``b``."""
    import numpy as np

    return float(np.sqrt(np.mean((np.asarray(a) - np.asarray(b)) ** 2)))


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


def bart_scores(m, Xte, yte, seed: int) -> dict:
    """Test RMSE of a sampled BART's mean and the coverage of its 90 % predictive
    interval (each draw's mean plus Gaussian noise with that draw's variance)."""
    f = m.predict(X=Xte)["y_hat"]  # (N, draws)
    import numpy as np

    sigma = np.sqrt(np.asarray(m.global_var_samples)).reshape(1, -1)
    draws = f + sigma * np.random.default_rng(seed).normal(size=f.shape)
    lo, hi = np.quantile(draws, [0.05, 0.95], axis=1)
    return {"rmse": rmse(f.mean(1), yte), "coverage90": float(np.mean((yte >= lo) & (yte <= hi)))}


def fit_bart_default(Xtr, ytr, Xte, yte, seed) -> dict:
    """stochtree's BART at its default arguments (a seed aside): :func:`bart_scores` and
    the fit's seconds."""
    from stochtree import BARTModel

    t = time.perf_counter()
    m = BARTModel()
    m.sample(X_train=Xtr, y_train=ytr, general_params={"random_seed": seed})
    return {**bart_scores(m, Xte, yte, seed), "seconds": time.perf_counter() - t}


def fit_bart_probit(Xtr, ytr, Xte, seed):
    """The binary classifiers' BART peer: stochtree at its defaults with a probit link
    (``OutcomeModel(outcome="binary", link="probit")``). Returns the test class
    probabilities ``(N, 2)`` (the posterior mean of the probit) and the fit's seconds."""
    import warnings

    import numpy as np
    from scipy.stats import norm
    from stochtree import BARTModel, OutcomeModel

    t = time.perf_counter()
    m = BARTModel()
    with warnings.catch_warnings():  # "error variance is fixed at 1 under probit"
        warnings.simplefilter("ignore", UserWarning)
        m.sample(
            X_train=Xtr,
            y_train=ytr.astype(float),
            general_params={
                "random_seed": seed,
                "outcome_model": OutcomeModel(outcome="binary", link="probit"),
            },
        )
    secs = time.perf_counter() - t
    f = m.predict(X=Xte, type="posterior", scale="linear")
    f = f["y_hat"] if isinstance(f, dict) else f
    p1 = norm.cdf(f).mean(1)
    return np.column_stack([1 - p1, p1]), secs


def run_peers(peers, Xtr, ytr, Xte, yte, seed) -> dict:
    """The VaRT paper's peers, fifty trees each, one thread: ``{"xgboost", "rf",
    "catboost", "bart"}`` (those named in ``peers``) -> test RMSE and fit seconds (BART:
    :func:`fit_bart`, with its 90 % coverage)."""
    out = {}
    if "xgboost" in peers:
        import xgboost

        t = time.perf_counter()
        m = xgboost.XGBRegressor(n_estimators=50, random_state=seed, n_jobs=1)
        m.fit(Xtr, ytr)
        out["xgboost"] = {"rmse": rmse(m.predict(Xte), yte), "seconds": time.perf_counter() - t}
    if "rf" in peers:
        from sklearn.ensemble import RandomForestRegressor

        t = time.perf_counter()
        m = RandomForestRegressor(n_estimators=50, random_state=seed, n_jobs=1).fit(Xtr, ytr)
        out["rf"] = {"rmse": rmse(m.predict(Xte), yte), "seconds": time.perf_counter() - t}
    if "catboost" in peers:
        import catboost

        t = time.perf_counter()
        m = catboost.CatBoostRegressor(
            iterations=50,
            random_seed=seed,
            verbose=False,
            thread_count=1,
            allow_writing_files=False,
        )
        m.fit(Xtr, ytr)
        out["catboost"] = {"rmse": rmse(m.predict(Xte), yte), "seconds": time.perf_counter() - t}
    if "bart" in peers:
        t = time.perf_counter()
        m = fit_bart(Xtr, ytr, seed)
        secs = time.perf_counter() - t
        out["bart"] = {**bart_scores(m, Xte, yte, seed), "seconds": secs}
    return out


def make_peer(name: str, task: str, seed: int, depth: int | None = None):
    """A peer at its library's defaults (``random_state=seed``) for a ``task``
    (``"classification"`` or ``"regression"``) set: ``"CART"`` (``max_depth=depth``),
    ``"Linear"`` (standardised ``LogisticRegression`` / ``RidgeCV``), ``"RF"``,
    ``"XGBoost"`` or ``"HGB"`` (HistGradientBoosting)."""
    clf = task == "classification"
    if name == "CART":
        from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

        cls = DecisionTreeClassifier if clf else DecisionTreeRegressor
        return cls(max_depth=depth, random_state=seed)
    if name == "Linear":
        from sklearn.linear_model import LogisticRegression, RidgeCV
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        return make_pipeline(StandardScaler(), LogisticRegression() if clf else RidgeCV())
    if name == "RF":
        from sklearn.ensemble import RandomForestClassifier, RandomForestRegressor

        return (RandomForestClassifier if clf else RandomForestRegressor)(random_state=seed)
    if name == "XGBoost":
        import xgboost

        return (xgboost.XGBClassifier if clf else xgboost.XGBRegressor)(random_state=seed)
    if name == "HGB":
        from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor

        cls = HistGradientBoostingClassifier if clf else HistGradientBoostingRegressor
        return cls(random_state=seed)
    raise ValueError(f"unknown peer {name!r}")


def imputed(estimator, imputer: str, seed: int):
    """``estimator`` behind an imputer: ``"simple"`` (column means) or ``"iterative"``
    (``IterativeImputer(random_state=seed)``, scikit-learn's defaults otherwise)."""
    from sklearn.experimental import enable_iterative_imputer  # noqa: F401
    from sklearn.impute import IterativeImputer, SimpleImputer
    from sklearn.pipeline import make_pipeline

    if imputer not in ("simple", "iterative"):
        raise ValueError(f"imputer must be 'simple' or 'iterative', got {imputer!r}")
    step = SimpleImputer() if imputer == "simple" else IterativeImputer(random_state=seed)
    return make_pipeline(step, estimator)
