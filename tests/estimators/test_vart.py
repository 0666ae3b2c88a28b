"""VaRTRegressor: fit/predict contract, intervals, pickling, batching and bad input."""

import math
import pickle

import numpy as np
import pytest
import torch

from pyro_trees.estimators import VaRTRegressor
from pyro_trees.estimators import vart as vart_module
from pyro_trees.estimators.vart import noise_factor_from_curve


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(120, 3))
    y = np.where(X[:, 0] > 0, 2.0 + X[:, 1], -1.0) + 0.1 * rng.normal(size=120)
    return X, y


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    return VaRTRegressor(depth=2, num_steps=150, lr=0.05, num_samples=50, random_state=0).fit(X, y)


def test_fit_predict_interval_and_score(fitted, data):
    X, y = data
    pred = fitted.predict(X)
    assert pred.shape == (120,) and np.isfinite(pred).all()
    lo, hi = fitted.predict_interval(X, level=0.9)
    assert lo.shape == hi.shape == (120,)
    assert (lo <= hi).all()
    lo50, hi50 = fitted.predict_interval(X, level=0.5)
    assert ((hi50 - lo50) <= (hi - lo) + 1e-9).all()
    # the step function is learnt far better than the constant predictor
    assert fitted.score(X, y) > 0.8
    draws = fitted.sample_predictive(X[:7], num_samples=20)
    assert draws.shape == (20, 7)
    assert fitted.sample_function(X[:7]).shape == (50, 7)
    imp = fitted.feature_importances_
    assert imp.shape == (3,) and np.isclose(imp.sum(), 1.0) and imp.argmax() == 0


def test_predict_is_deterministic_batched_and_pickles_exactly(fitted, data, monkeypatch):
    X, _ = data
    pred = fitted.predict(X)
    assert np.array_equal(pred, fitted.predict(X))
    clone = pickle.loads(pickle.dumps(fitted))
    assert np.array_equal(clone.predict(X), pred)
    assert np.array_equal(clone.predict_interval(X)[0], fitted.predict_interval(X)[0])
    # tiny prediction batches: same trees, same numbers
    monkeypatch.setattr(vart_module, "_PREDICT_BYTES", 1)
    fitted._tree_samples = None
    assert np.allclose(fitted.predict(X[:12]), pred[:12], atol=1e-5)
    # one row at a time agrees with all rows at once
    assert np.allclose(fitted.predict(X[5:6]), pred[5:6], atol=1e-5)


def test_export_text_and_params(fitted):
    text = fitted.export_text(feature_names=["a", "b", "c"])
    assert "value:" in text and text.endswith("\n")
    assert text.splitlines()[0].startswith("|--- ")
    assert "a" in text.splitlines()[0]  # the root splits on the informative feature
    with pytest.raises(ValueError, match="feature_names"):
        fitted.export_text(feature_names=["a"])
    assert fitted.get_params()["depth"] == 2
    assert "depth=2" in repr(fitted)


def test_minibatch_training_runs(data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=20, batch_size=16, num_samples=5, random_state=1)
    est.fit(X, y)
    assert est.fit_result_.num_steps == 20
    assert np.isfinite(est.predict(X)).all()


def test_bad_input(fitted, data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=1)
    with pytest.raises(ValueError, match="not fitted"):
        est.predict(X)
    Xn = X.copy()
    Xn[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        est.fit(Xn, y)
    Xi = X.copy()
    Xi[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinite"):
        fitted.predict(Xi)
    with pytest.raises(ValueError, match="mismatched lengths"):
        est.fit(X, y[:-1])
    with pytest.raises(ValueError, match="features"):
        fitted.predict(X[:, :2])
    with pytest.raises(ValueError, match="level"):
        fitted.predict_interval(X, level=1.0)
    with pytest.raises(ValueError, match="level"):
        fitted.predict_interval(X, level=0.0)
    with pytest.raises(ValueError, match=r"depth 60 .* would need about"):
        VaRTRegressor(depth=60).fit(X, y)
    with pytest.raises(ValueError, match="num_samples"):
        fitted.sample_predictive(X, num_samples=10_000)


def test_early_stopping_and_noise_calibration(fitted, data):
    X, y = data
    # the fixture held out 12 of 120 rows: best step kept, noise factor from the grid
    res = fitted.fit_result_
    assert res.best_step is not None and res.best_step <= res.num_steps
    assert res.val_losses and res.best_val == min(v for _, v in res.val_losses)
    cal = fitted.noise_calibration_
    assert fitted.noise_factor_ == noise_factor_from_curve(
        torch.as_tensor(cal["grid"]), torch.as_tensor(cal["log_density"])
    )
    trees_ = fitted._posterior_trees()
    with torch.random.fork_rng():
        fitted.noise_factor_, c = 1.0, fitted.noise_factor_
        fitted._tree_samples = None
        raw = fitted._posterior_trees()
        fitted.noise_factor_ = c
        fitted._tree_samples = None
    for key in raw:  # calibration shifts every leaf's log noise scale by log c, nothing else
        shift = math.log(c) if key.startswith("log_sigma_") else 0.0
        assert torch.allclose(trees_[key], raw[key] + shift, atol=1e-6)
    # held-out targets far noisier than the training residuals need a large factor ...
    Xs = fitted._prepare(X[:60])
    mean = torch.as_tensor(
        (fitted.predict(X[:60]) - float(fitted.y_mean_)) / float(fitted.y_scale_)
    )
    noisy = mean + 3.0 * torch.randn(60, generator=torch.Generator().manual_seed(0))
    assert fitted._calibrate_noise(Xs, noisy.float()) > 5.0
    # ... and targets drawn from the calibrated predictive itself about none (c ~ 1)
    draws = fitted.sample_predictive(X[:60])  # (50, 60)
    own = torch.as_tensor((draws[7] - float(fitted.y_mean_)) / float(fitted.y_scale_))
    assert fitted._calibrate_noise(Xs, own.float()) < 1.5


def test_without_validation_every_row_trains(data):
    X, y = data
    est = VaRTRegressor(
        depth=2, num_steps=15, num_samples=4, validation_fraction=0.0, init="random"
    ).fit(X, y)
    assert est.fit_result_.num_steps == 15 and est.fit_result_.best_step is None
    assert est.noise_factor_ == 1.0
    with pytest.raises(ValueError, match="validation_fraction"):
        VaRTRegressor(validation_fraction=1.0).fit(X, y)
    with pytest.raises(ValueError, match="init"):
        VaRTRegressor(init="kmeans").fit(X, y)
    with pytest.raises(ValueError, match="eval_every"):
        VaRTRegressor(eval_every=0).fit(X, y)


@pytest.mark.cuda
def test_cuda_estimator(data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=5, num_samples=4, device="cuda", random_state=0)
    est.fit(X, y)
    assert est.predict(X).shape == (120,)
    assert est.predict_interval(X)[0].shape == (120,)


def test_noise_factor_rule_widens_freely_and_shrinks_only_when_certain():
    grid = torch.logspace(-1, 1, 41, dtype=torch.float64)
    c = grid.log()

    # a Gaussian-scale log likelihood of n rows peaked at c0: n * (-log c - c0^2 / (2 c^2))
    def curve(n, c0):
        return n * (-c - c0**2 / (2 * grid**2))

    assert noise_factor_from_curve(grid, curve(10, 2.0)) == pytest.approx(2.0, rel=0.06)
    # few rows preferring a smaller noise: the upper bound exceeds one, keep the fitted noise
    assert noise_factor_from_curve(grid, curve(5, 0.7)) == 1.0
    # many rows: shrink, but only to the upper end of the profile interval (above c0)
    many = noise_factor_from_curve(grid, curve(500, 0.5))
    assert 0.5 < many < 0.6


def test_inputs_far_beyond_the_training_range_are_clipped(fitted, data):
    X, _ = data
    lo, hi = X[:, 1].min(), X[:, 1].max()
    far = X[:5].copy()
    far[:, 1] = 1e6  # a data-entry outlier, far beyond the training range of feature 1
    edge = far.copy()
    edge[:, 1] = hi + 0.5 * (hi - lo)  # the default margin: half the range
    np.testing.assert_allclose(fitted.predict(far), fitted.predict(edge), rtol=1e-5)
    mild = far.copy()
    mild[:, 1] = hi + 0.1 * (hi - lo)  # inside the margin: extrapolated, not clipped
    assert not np.allclose(fitted.predict(mild), fitted.predict(far))
    fitted.clip_margin = 0.0
    try:
        edge[:, 1] = hi
        np.testing.assert_allclose(fitted.predict(far), fitted.predict(edge), rtol=1e-5)
        fitted.clip_margin = None
        assert np.abs(fitted.predict(far)).max() > 1e3  # linear leaves extrapolate
    finally:
        fitted.clip_margin = 0.5
    with pytest.raises(ValueError, match="clip_margin"):
        VaRTRegressor(depth=2, num_steps=1, clip_margin=-1.0).fit(X, data[1])
