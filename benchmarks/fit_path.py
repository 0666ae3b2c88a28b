"""X's path through ``VaRTRegressor.fit``: which pyro_trees functions receive the
training inputs, in the order they are first called, and how often that path returns to
a module it had already left (issue 37).

A function "receives X" when one of its arguments is the user's ``X`` or a NumPy array
or torch tensor of ``L`` columns whose rows are those of ``X`` or a subset of them (the
validated, standardised, held-out or training rows). Each function counts once, at its
first call (training steps repeat the same calls); the module sequence of those stops,
with consecutive stops in one module merged, gives the returns.

Run: ``python -m benchmarks.fit_path`` (a few seconds on one core).
"""

from __future__ import annotations

import sys

import numpy as np
import torch


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


def returns(path: list[tuple[str, str]]) -> tuple[list[str], int]:
    """The module sequence (consecutive repeats merged) and the number of times it
    returns to a module it had left."""
    seq = []
    for module, _ in path:
        if not seq or seq[-1] != module:
            seq.append(module)
    back = sum(1 for i, m in enumerate(seq) if m in seq[:i])
    return seq, back


def main() -> None:
    from pyro_trees.estimators import VaRTRegressor

    X = np.random.default_rng(0).normal(size=(40, 2))
    est = VaRTRegressor(depth=2, num_steps=3, num_samples=5, random_state=0)
    path = trace_fit(est, X, X[:, 0])
    seq, back = returns(path)
    for module, name in path:
        print(f"  {module}.{name}")
    print(
        f"{len(path)} stops across {len(set(m for m, _ in path))} modules; "
        f"module sequence of {len(seq)}, returning {back} times to a module it had left"
    )


if __name__ == "__main__":
    main()
