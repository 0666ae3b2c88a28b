"""Split-usage importances of a VaRT tree or forest, with their posterior spread.

:func:`plot_importances` draws, per input, the share it takes in the splits of the
posterior trees (``sample_importances`` of
:class:`~pyro_trees.estimators.VaRTRegressor`,
:class:`~pyro_trees.estimators.VaRTForestRegressor` and
:class:`~pyro_trees.estimators.VaRTClassifier`): a bar at the posterior mean and a
whisker over the central credible interval of the posterior draws, so that an input
the trees use now and then is told apart from one they always use a little.
"""

from __future__ import annotations

import numpy as np

__all__ = ["plot_importances"]


def plot_importances(
    estimator,
    X,
    *,
    level: float = 0.9,
    feature_names=None,
    max_features: int | None = 20,
    ax=None,
):
    """Draw each input's share in the splits as a bar, with its ``level`` credible
    interval under the posterior trees as a whisker (largest shares on top).

    :param estimator: a fitted estimator with ``sample_importances(X)`` ``(S, L)``:
        :class:`~pyro_trees.estimators.VaRTRegressor`,
        :class:`~pyro_trees.estimators.VaRTForestRegressor` or
        :class:`~pyro_trees.estimators.VaRTClassifier`.
    :param X: ``(N, L)`` rows that weight each node by the share of them that reach it
        (the training rows, or any others).
    :param float level: probability of the whiskers' intervals, in ``(0, 1)``.
    :param feature_names: ``L`` names (default: the estimator's ``feature_names_in_``
        when it was fitted on a frame, else ``x_0``, ``x_1``, ...).
    :param max_features: draw only the inputs with the largest mean shares; ``None``:
        all of them.
    :param ax: the matplotlib axes; ``None``: a new figure.
    :returns: the matplotlib axes.
    :raises TypeError: for an estimator without ``sample_importances``.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTForestRegressor
    >>> from pyro_trees.plotting import plot_importances
    >>> X = np.random.default_rng(0).normal(size=(40, 3))
    >>> est = VaRTForestRegressor(num_trees=3, num_steps=3, num_samples=6, random_state=0)
    >>> ax = plot_importances(est.fit(X, X[:, 0]), X)
    >>> len(ax.patches)  # one bar per input
    3
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if not hasattr(estimator, "sample_importances"):
        raise TypeError(
            f"{type(estimator).__name__} has no sample_importances: plot_importances draws "
            "a VaRTRegressor, VaRTForestRegressor or VaRTClassifier"
        )
    draws = np.asarray(estimator.sample_importances(X), dtype=np.float64)  # (S, L)
    width = draws.shape[1]
    names = feature_names
    if names is None:
        names = getattr(estimator, "feature_names_in_", None)
    names = [f"x_{j}" for j in range(width)] if names is None else [str(v) for v in names]
    if len(names) != width:
        raise ValueError(f"{len(names)} feature names given for {width} inputs")
    mean = draws.mean(0)
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0)
    order = np.argsort(-mean, kind="stable")
    if max_features is not None:
        order = order[: int(max_features)]
    order = order[::-1]  # barh draws bottom up: the largest share on top
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(6.0, 0.8 + 0.3 * len(order)))
    pos = np.arange(len(order))
    err = np.stack([mean[order] - lo[order], hi[order] - mean[order]]).clip(min=0.0)
    ax.barh(pos, mean[order], xerr=err, color="C0", alpha=0.8, ecolor="0.2", capsize=3)
    ax.set_yticks(pos, [names[j] for j in order])
    ax.set_xlabel(f"share of the splits (posterior mean, {level:.0%} interval)")
    ax.set_xlim(left=0.0)
    ax.set_title(f"split usage over {draws.shape[0]} posterior draws", fontsize=10)
    return ax
