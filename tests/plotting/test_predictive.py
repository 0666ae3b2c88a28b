"""plot_predictive: the partial dependence, its credible or predictive band, the data."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.collections import PathCollection, PolyCollection

from pyro_trees.estimators import RNNTreeRegressor, VaRTClassifier, VaRTRegressor
from pyro_trees.plotting import plot_predictive


@pytest.fixture(scope="module")
def step():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(60, 1))
    y = np.where(X[:, 0] > 0, 2.0, -1.0) + 0.3 * rng.normal(size=60)
    est = VaRTRegressor(depth=2, num_steps=40, num_samples=8, random_state=0).fit(X, y)
    return est, X, y


def _band(ax) -> PolyCollection:
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    return band


def test_one_input_draws_the_prediction_its_credible_band_and_the_data(step):
    est, X, y = step
    fig, ax = plt.subplots()
    assert plot_predictive(est, X, y, grid_resolution=25, ax=ax) is ax
    (line,) = ax.get_lines()
    grid, mean = line.get_data()
    assert len(grid) == 25 and grid.min() == X.min() and grid.max() == X.max()
    # with one input the partial dependence is the prediction itself
    assert np.allclose(mean, est.predict(grid.reshape(-1, 1)))
    (points,) = [c for c in ax.collections if isinstance(c, PathCollection)]
    assert len(points.get_offsets()) == 60
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["data", "90% credible band", "predictive mean"]
    # the band is the quantiles of the posterior function draws at the grid
    draws = est.sample_function(grid.reshape(-1, 1))
    lo, hi = np.quantile(draws, [0.05, 0.95], axis=0)
    ys = _band(ax).get_paths()[0].vertices[:, 1]
    assert np.isclose(ys.min(), lo.min()) and np.isclose(ys.max(), hi.max())


def test_the_predictive_band_holds_new_targets_and_is_wider(step):
    est, X, y = step
    credible = _band(plot_predictive(est, X, band="function"))
    predictive_ax = plot_predictive(est, X, band="predictive")
    predictive = _band(predictive_ax)
    assert predictive_ax.get_legend_handles_labels()[1][0] == "90% predictive interval"

    def spread(band):
        ys = band.get_paths()[0].vertices[:, 1]
        return ys.max() - ys.min()

    assert spread(predictive) > spread(credible)
    assert not [c for c in plot_predictive(est, X, band=None).collections]


def test_several_inputs_average_over_the_others_by_name():
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(1)
    X = pd.DataFrame(rng.normal(size=(50, 2)), columns=["dose", "age"])
    y = 2 * X["dose"] + 0.1 * rng.normal(size=50)
    est = VaRTRegressor(depth=1, num_steps=30, num_samples=4, random_state=0).fit(X, y)
    ax = plot_predictive(est, X, feature="age", grid_resolution=5)
    assert ax.get_xlabel() == "age" and "averaged over the other inputs" in ax.get_ylabel()
    grid, mean = ax.get_lines()[0].get_data()
    rows = np.repeat(X.to_numpy()[None], 5, axis=0)
    rows[:, :, 1] = grid[:, None]
    frame = pd.DataFrame(rows.reshape(-1, 2), columns=X.columns)
    assert np.allclose(mean, est.predict(frame).reshape(5, 50).mean(1))


def test_a_classifier_draws_the_probability_of_its_target():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = np.where(X[:, 0] > 0, "yes", "no")
    clf = VaRTClassifier(depth=1, num_steps=30, num_samples=4, num_fits=1, random_state=0)
    ax = plot_predictive(clf.fit(X, y), X, y, feature=0)
    assert ax.get_ylabel().startswith("P(y = yes)")
    mean = ax.get_lines()[0].get_ydata()
    assert ((0 <= mean) & (mean <= 1)).all() and mean[-1] > mean[0]
    points = [c for c in ax.collections if isinstance(c, PathCollection)][0].get_offsets()
    assert set(np.unique(points[:, 1])) == {0.0, 1.0}
    assert plot_predictive(clf, X, target="no").get_ylabel().startswith("P(y = no)")


def test_an_estimator_that_only_samples_new_targets_gets_the_predictive_band():
    X = np.linspace(-1, 1, 40).reshape(-1, 1)
    y = np.where(X[:, 0] > 0, 1.0, -1.0)
    est = RNNTreeRegressor(depth=1, hidden_size=4, num_steps=3, random_state=0).fit(X, y)
    assert not hasattr(est, "sample_function") and hasattr(est, "sample")
    ax = plot_predictive(est, X, y)
    assert [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert not [
        c for c in plot_predictive(est, X, band=None).collections if isinstance(c, PolyCollection)
    ]
    with pytest.raises(ValueError, match="no 'function' band"):
        plot_predictive(est, X, band="function")


def test_what_plot_predictive_refuses(step):
    est, X, _ = step
    with pytest.raises(ValueError, match="unknown feature"):
        plot_predictive(est, X, feature="nope")
    with pytest.raises(ValueError, match="out of range"):
        plot_predictive(est, X, feature=3)
    with pytest.raises(ValueError, match="band must be"):
        plot_predictive(est, X, band="wide")
    with pytest.raises(ValueError, match="level"):
        plot_predictive(est, X, level=0)
