"""plot_importances: split usage per input with its posterior spread, as a bar chart."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from pyro_trees.estimators import RNNTreeRegressor, VaRTForestRegressor
from pyro_trees.plotting import plot_importances


@pytest.fixture(scope="module")
def forest():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(100, 4))
    y = 3 * np.sin(X[:, 0]) + 0.1 * rng.normal(size=100)
    est = VaRTForestRegressor(num_trees=4, depth=2, num_steps=60, num_samples=12, random_state=0)
    return est.fit(X, y), X


def test_one_bar_per_input_largest_on_top_with_its_interval(forest):
    est, X = forest
    fig, ax = plt.subplots()
    assert plot_importances(est, X, feature_names=list("abcd"), ax=ax) is ax
    bars = ax.patches
    assert len(bars) == 4
    draws = est.sample_importances(X)
    order = np.argsort(-draws.mean(0), kind="stable")[::-1]
    assert [t.get_text() for t in ax.get_yticklabels()] == [list("abcd")[j] for j in order]
    assert np.allclose([b.get_width() for b in bars], draws.mean(0)[order])
    # whiskers: one error bar per input, spanning the 90 % interval of the draws
    (errors,) = [c for c in ax.collections if c.get_segments()]
    lo, hi = np.quantile(draws, [0.05, 0.95], axis=0)
    spans = [(s[0][0], s[1][0]) for s in errors.get_segments()]
    assert np.allclose(spans, np.stack([lo[order], hi[order]], 1))
    assert "12 posterior draws" in ax.get_title()


def test_max_features_keeps_the_largest(forest):
    est, X = forest
    ax = plot_importances(est, X, max_features=2)
    top = np.argsort(-est.sample_importances(X).mean(0), kind="stable")[:2]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"x_{j}" for j in top[::-1]]


def test_what_plot_importances_refuses(forest):
    est, X = forest
    with pytest.raises(ValueError, match="3 feature names"):
        plot_importances(est, X, feature_names=["a", "b", "c"])
    with pytest.raises(TypeError, match="sample_importances"):
        plot_importances(RNNTreeRegressor(), X)
