"""The plotting functions with missing values (NaN) in X: nothing breaks, and the trees
show where a missing value goes."""

import numpy as np
import pytest

from pyro_trees.estimators import RNNTreeRegressor, VaRTRegressor
from pyro_trees.plotting import plot_importances, plot_predictive, plot_tree


@pytest.fixture(scope="module")
def holes():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(80, 2))
    y = np.where(X[:, 0] > 0, 2.0, -1.0) + 0.3 * rng.normal(size=80)
    X[rng.random(X.shape) < 0.2] = np.nan
    return X, y


@pytest.mark.parametrize("cls", [VaRTRegressor, RNNTreeRegressor])
def test_plots_take_missing_values(holes, cls):
    X, y = holes
    kw = {"num_samples": 8} if cls is VaRTRegressor else {"hidden_size": 8}
    est = cls(depth=2, num_steps=30, random_state=0, **kw).fit(X, y)
    ax = plot_predictive(est, X, y, feature=0, grid_resolution=10)
    (line,) = ax.get_lines()
    grid, mean = line.get_data()
    assert np.isfinite(grid).all() and np.isfinite(mean).all()
    assert grid.min() >= np.nanmin(X[:, 0]) and grid.max() <= np.nanmax(X[:, 0])
    boxes = plot_tree(est)
    assert any("missing:" in b.get_text() for b in boxes)
    if cls is VaRTRegressor:
        assert len(plot_importances(est, X).patches) == 2
    with pytest.raises(ValueError, match="no observed value"):
        plot_predictive(est, np.column_stack([np.full(5, np.nan), np.zeros(5)]), feature=0)
