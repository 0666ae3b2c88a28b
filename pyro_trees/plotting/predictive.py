"""The predictive along one input: a partial dependence with its credible band.

:func:`plot_predictive` sets one input of every row of ``X`` to each value of a grid
over that input's range, predicts, and averages over the rows (the partial dependence
of scikit-learn's ``PartialDependenceDisplay``; with one input it is the prediction
itself). The band is what a Bayesian tree adds: the central interval of the same
average under each posterior draw of the regression function (a credible band of the
partial dependence), or, for estimators that only sample new targets, the interval of
those draws pooled over the rows (where a new target falls for a row of ``X`` whose
input is set to the grid value).
"""

from __future__ import annotations

import numpy as np

__all__ = ["plot_predictive"]

_BANDS = ("auto", "function", "predictive", None)


def plot_predictive(
    estimator,
    X,
    y=None,
    *,
    feature=0,
    level: float = 0.9,
    band: str | None = "auto",
    target=None,
    grid_resolution: int = 50,
    max_rows: int | None = 200,
    feature_names=None,
    ax=None,
):
    """Draw the predictive mean and its ``level`` band along one input, with the data.

    :param estimator: a fitted regressor or classifier (any with ``predict``, or
        ``predict_proba`` for classifiers).
    :param X: ``(N, L)`` rows (NumPy array or pandas frame) whose other inputs are
        averaged over, and whose range of ``feature`` sets the grid (missing values,
        NaN, stay missing in the other inputs; estimators that route them natively
        average over them as they are).
    :param y: optional ``(N,)`` targets drawn as points against ``X[:, feature]``
        (a classifier's as 1 for ``target`` and 0 for the other classes).
    :param feature: the input, by position or by name (``feature_names`` or the
        estimator's ``feature_names_in_``).
    :param float level: probability of the band, in ``(0, 1)``.
    :param band: ``"function"``: the credible band of the partial dependence, from the
        posterior draws of the regression function (``sample_function``; a
        classifier's class probability, ``sample_proba``); ``"predictive"``: the
        interval of new targets (``sample``) pooled over the rows; ``None``: no band;
        ``"auto"`` (default): the first of these the estimator offers.
    :param target: a classifier's class whose probability is drawn (default: the last of
        ``classes_``, the positive class of a binary problem).
    :param int grid_resolution: grid points over the range of ``feature`` (fewer when
        it takes fewer distinct values).
    :param max_rows: the rows averaged over: at most this many of ``X``, drawn at
        random (seeded) when it has more; ``None``: all of them.
    :param feature_names: ``L`` names of the inputs, for the axis label.
    :param ax: the matplotlib axes; ``None``: a new figure.
    :returns: the matplotlib axes.
    :raises ValueError: for an unknown ``feature``, ``band`` or ``target``, or a band
        the estimator cannot give.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTRegressor
    >>> from pyro_trees.plotting import plot_predictive
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> est = VaRTRegressor(depth=2, num_steps=3, num_samples=5, random_state=0)
    >>> ax = plot_predictive(est.fit(X, X[:, 0]), X, X[:, 0], feature=0)
    >>> [line.get_label() for line in ax.get_lines()]
    ['predictive mean']
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if band not in _BANDS:
        raise ValueError(f"band must be one of {_BANDS}, got {band!r}")
    values = np.asarray(X, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"X must be 2-D (N, L), got shape {values.shape}")
    n, width = values.shape
    names = feature_names if feature_names is not None else getattr(X, "columns", None)
    if names is None:
        names = getattr(estimator, "feature_names_in_", None)
    names = [f"x_{j}" for j in range(width)] if names is None else [str(v) for v in names]
    if len(names) != width:
        raise ValueError(f"{len(names)} feature names given for {width} inputs")
    j = _feature_index(feature, names, width)

    rows = values
    if max_rows is not None and n > max_rows:
        rows = values[np.sort(np.random.default_rng(0).choice(n, int(max_rows), replace=False))]
    column = values[:, j]
    seen = column[~np.isnan(column)]  # the grid spans the observed values
    if seen.size == 0:
        raise ValueError(f"X has no observed value of {names[j]} to place a grid on")
    grid = np.unique(seen)
    if grid.shape[0] > grid_resolution:
        grid = np.linspace(seen.min(), seen.max(), int(grid_resolution))
    stacked = np.repeat(rows[None], grid.shape[0], axis=0)  # (G, n, L)
    stacked[:, :, j] = grid[:, None]
    stacked = stacked.reshape(-1, width)
    if hasattr(X, "columns"):  # a frame in, a frame to the estimator (its feature names)
        stacked = type(X)(stacked, columns=X.columns)
    shape = (grid.shape[0], rows.shape[0])

    classifier = hasattr(estimator, "classes_") and hasattr(estimator, "predict_proba")
    if classifier:
        classes = list(estimator.classes_)
        target = classes[-1] if target is None else target
        if target not in classes:
            raise ValueError(f"target {target!r} is not one of the classes {classes}")
        k = classes.index(target)
        mean = estimator.predict_proba(stacked)[:, k].reshape(shape).mean(1)
        sources = {"function": "sample_proba"}
        ylabel = f"P(y = {target})"
    else:
        mean = np.asarray(estimator.predict(stacked), dtype=np.float64).reshape(shape).mean(1)
        sources = {"function": "sample_function", "predictive": "sample"}
        ylabel = "y"
    if band == "auto":
        band = next((b for b, m in sources.items() if hasattr(estimator, m)), None)
    elif band is not None and not hasattr(estimator, sources.get(band, " ")):
        raise ValueError(f"{type(estimator).__name__} gives no {band!r} band")

    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6.0, 3.6))
    if y is not None:
        y = np.asarray(y)
        points = (y == target).astype(float) if classifier else y.astype(float)
        ax.scatter(column, points, s=8, color="0.55", alpha=0.6, label="data", zorder=1)
    if band is not None:
        probs = [(1 - level) / 2, (1 + level) / 2]
        if band == "function" and classifier:
            draws = estimator.sample_proba(stacked)[..., k]  # (S, G n)
            lo, hi = np.quantile(draws.reshape(-1, *shape).mean(-1), probs, axis=0)
            what = "credible band"
        elif band == "function":
            draws = estimator.sample_function(stacked)  # (S, G n)
            lo, hi = np.quantile(draws.reshape(-1, *shape).mean(-1), probs, axis=0)
            what = "credible band"
        else:  # new targets, pooled over the rows
            draws = estimator.sample(stacked).reshape(-1, *shape)  # (S, G, n)
            lo, hi = np.quantile(draws.transpose(1, 0, 2).reshape(shape[0], -1), probs, axis=1)
            what = "predictive interval"
        ax.fill_between(grid, lo, hi, alpha=0.3, color="C0", label=f"{level:.0%} {what}")
    ax.plot(grid, mean, color="C0", lw=2, label="predictive mean", zorder=3)
    ax.set_xlabel(names[j])
    ax.set_ylabel(ylabel if width == 1 else f"{ylabel}, averaged over the other inputs")
    ax.legend(fontsize=8)
    return ax


def _feature_index(feature, names: list[str], width: int) -> int:
    """``feature`` as a column position: an int in ``[0, width)`` or one of ``names``."""
    if isinstance(feature, int | np.integer) and not isinstance(feature, bool):
        if not 0 <= int(feature) < width:
            raise ValueError(f"feature {feature} is out of range for {width} inputs")
        return int(feature)
    if str(feature) in names:
        return names.index(str(feature))
    raise ValueError(f"unknown feature {feature!r}; the inputs are {names}")
