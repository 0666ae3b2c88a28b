"""X's path through ``VaRTRegressor.fit``: which pyro_trees functions receive the
training inputs, in the order they are first called, and how often that path returns to
a module it had already left (issue 37).

A function "receives X" when one of its arguments is the user's ``X`` or a NumPy array
or torch tensor of ``L`` columns whose rows are those of ``X`` or a subset of them (the
validated, standardised, held-out or training rows). Each function counts once, at its
first call (training steps repeat the same calls); the module sequence of those stops,
with consecutive stops in one module merged, gives the returns. ``X`` has 11 columns: a
width that no other two-dimensional tensor of the fit has (node counts 1, 2, 4, 7 of a
depth-2 tree, ``L + 1`` columns with the bias, 5 posterior draws), so that only ``X``'s
rows are counted (with 2 columns, a level of two nodes was counted as ``X``).

It also counts, for a tiny fit of every estimator, the distinct lines of
``pyro_trees/estimators/`` that ``fit`` executes (its fit path in the estimator layer).

Run: ``python -m benchmarks.fit_path`` (under a minute on one core).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import markdown_table, write_results


def trace_fit(estimator, X, y) -> list[tuple[str, str]]:
    """``(module, function)`` of every pyro_trees function that receives ``X`` during
    ``estimator.fit(X, y)``, in the order of their first call."""
    n, width = X.shape
    seen, path = set(), []

    def holds_rows(value) -> bool:
        if value is X:
            return True
        if isinstance(value, np.ndarray | torch.Tensor) and value.ndim == 2:
            return value.shape[1] == width and 1 <= value.shape[0] <= n
        return False

    def tracer(frame, event, arg):
        if event != "call":
            return None
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("pyro_trees"):
            return None
        code = frame.f_code
        if code in seen:
            return None
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        values = [frame.f_locals.get(a) for a in names]
        values += list(frame.f_locals.get("args", ()) or ())
        if any(holds_rows(v) for v in values):
            seen.add(code)
            path.append((module, code.co_qualname))
        return None

    sys.settrace(tracer)
    try:
        estimator.fit(X, y)
    finally:
        sys.settrace(None)
    return path


def fit_lines(estimator, *args) -> dict[str, int]:
    """Distinct lines of ``pyro_trees/estimators/`` executed by ``estimator.fit(*args)``,
    by module file."""
    lines = set()

    def tracer(frame, event, arg):
        if "pyro_trees/estimators/" not in frame.f_code.co_filename:
            return None
        if event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return tracer

    sys.settrace(tracer)
    try:
        estimator.fit(*args)
    finally:
        sys.settrace(None)
    files = sorted({f for f, _ in lines})
    return {f.rsplit("/", 1)[-1]: sum(1 for g, _ in lines if g == f) for f in files}


def returns(path: list[tuple[str, str]], prefix: str = "") -> tuple[list[str], int]:
    """The module sequence of the stops in modules starting with ``prefix``
    (consecutive repeats merged) and the number of times it returns to a module it had
    left."""
    seq = []
    for module, _ in path:
        if not module.startswith(prefix):
            continue
        if not seq or seq[-1] != module:
            seq.append(module)
    back = sum(1 for i, m in enumerate(seq) if m in seq[:i])
    return seq, back


def main() -> None:
    from pyro_trees import estimators as E

    X = np.random.default_rng(0).normal(size=(40, 11))
    y = X[:, 0]
    est = E.VaRTRegressor(depth=2, num_steps=3, num_samples=5, random_state=0)
    path = trace_fit(est, X, y)
    seq, back = returns(path)
    own, own_back = returns(path, "pyro_trees.estimators")
    for module, name in path:
        print(f"  {module}.{name}")
    print(" -> ".join(m.removeprefix("pyro_trees.") for m in seq))
    print(
        f"{len(path)} stops across {len(set(m for m, _ in path))} modules; "
        f"module sequence of {len(seq)}, returning {back} times to a module it had left "
        f"({own_back} times within pyro_trees.estimators, a sequence of {len(own)})"
    )
    small = {"random_state": 0}
    cases = {
        "VaRTRegressor": E.VaRTRegressor(depth=2, num_steps=3, num_samples=5, **small),
        "VaRTForestRegressor": E.VaRTForestRegressor(
            num_trees=2, depth=2, num_steps=3, num_samples=5, **small
        ),
        "VaRTClassifier": E.VaRTClassifier(depth=2, num_steps=3, num_samples=5, **small),
        "RNNTreeRegressor": E.RNNTreeRegressor(depth=2, num_steps=3, **small),
        "RNNTreeClassifier": E.RNNTreeClassifier(depth=2, num_steps=3, **small),
        "HeteroscedasticGPRegressor": E.HeteroscedasticGPRegressor(
            depth=1, num_steps=3, init_steps=2, **small
        ),
        "BayesianHMERegressor": E.BayesianHMERegressor(
            max_experts=2, num_restarts=2, num_cycles=3, grow=0, **small
        ),
    }
    print("lines of pyro_trees/estimators/ executed by a tiny fit (total; by module):")
    lines = {}
    for name, est in cases.items():
        target = (y > 0).astype(int) if "Classifier" in name else y
        by_file = fit_lines(est, X, target)
        lines[name] = by_file
        parts = ", ".join(f"{f} {n}" for f, n in by_file.items())
        print(f"  {name}: {sum(by_file.values())}; {parts}")
    root = Path(__file__).resolve().parents[1] / "pyro_trees" / "estimators"
    raises = sum(p.read_text().count("raise ValueError") for p in root.glob("*.py"))
    md = (
        "X's path through `VaRTRegressor.fit` (functions that receive X's rows, each at its "
        f"first call): {len(path)} stops across {len(set(m for m, _ in path))} modules; "
        f"module sequence of {len(seq)}, **returning {back} times** to a module it had left "
        f"({own_back} within `pyro_trees.estimators`).\n\n"
        + " -> ".join(m.removeprefix("pyro_trees.") for m in seq)
        + f"\n\n`raise ValueError` in `pyro_trees/estimators/`: {raises}.\n\n"
        + "Lines of `pyro_trees/estimators/` executed by a tiny fit:\n\n"
        + markdown_table(
            [
                {
                    "estimator": k,
                    "total": sum(v.values()),
                    "by module": ", ".join(f"{f} {n}" for f, n in v.items()),
                }
                for k, v in lines.items()
            ]
        )
    )
    write_results(
        "fit_path",
        {
            "path": path,
            "sequence": seq,
            "returns": back,
            "returns_within_estimators": own_back,
            "raise_value_error": raises,
            "lines": lines,
        },
        md,
        args={},
    )


if __name__ == "__main__":
    main()
