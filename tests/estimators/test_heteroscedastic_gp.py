import pickle

import numpy as np
import pytest

from pyro_trees.estimators import HeteroscedasticGPRegressor


def _data(n=80, seed=0):
    rng = np.random.default_rng(seed)
    X = np.linspace(-1, 1, n)[:, None] * 3 + 5  # not standardised
    sd = np.where(X[:, 0] < 5, 0.05, 1.0)
    y = 10 + np.sin(X[:, 0]) + sd * rng.standard_normal(n)
    return X, y


def test_fit_predict_rules_and_noise_levels():
    X, y = _data(60)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=15, init_steps=15, random_state=0)
    est.fit(X, y)
    mean, std = est.predict(X, return_std=True)
    assert mean.shape == (60,) and std.shape == (60,) and np.all(std > 0)
    noise = est.predict_noise(np.array([[3.0], [7.0]]))
    assert noise[1] - noise[0] > 1.5  # log(1.0 / 0.05) = 3.0
    post = est.predict_noise(X, routing="posterior")
    assert post.shape == (60,) and np.all(np.isfinite(post))
    lo, hi = est.predict_interval(X, 0.9)
    assert np.all(lo < mean) and np.all(mean < hi)
    assert np.isfinite(est.log_likelihood(X, y))
    text = est.export_text(["x"])
    assert "x <= " in text and text.count("log sigma") == 2
    threshold = float(text.split("x <= ")[1].split()[0])
    assert abs(threshold - 5.0) < 0.3  # in the units of X
    assert est.score(X, 10 + np.sin(X[:, 0])) > 0.8  # R^2 against the noise-free mean
    assert "depth=1" in repr(est)


def test_pickle_exact():
    X, y = _data(40)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=5, init_steps=5, random_state=0).fit(X, y)
    clone = pickle.loads(pickle.dumps(est))
    for routing in ("hard", "posterior"):
        np.testing.assert_array_equal(
            est.predict(X, routing=routing), clone.predict(X, routing=routing)
        )
        np.testing.assert_array_equal(
            est.predict_noise(X, routing=routing), clone.predict_noise(X, routing=routing)
        )
    assert est.export_text() == clone.export_text()


def test_sparse_with_minibatches():
    X, y = _data(120)
    est = HeteroscedasticGPRegressor(
        depth=1, num_inducing=10, batch_size=32, num_steps=10, init_steps=5, random_state=0
    ).fit(X, y)
    assert est.predict(X).shape == (120,)
    assert est.model_.num_inducing == 10


def test_bad_input():
    X, y = _data(20)
    with pytest.raises(ValueError, match="not fitted"):
        HeteroscedasticGPRegressor().predict(X)
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        HeteroscedasticGPRegressor(num_steps=1).fit(X, y[:5])
    bad = y.copy()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="y contains"):
        HeteroscedasticGPRegressor(num_steps=1).fit(X, bad)
    with pytest.raises(ValueError, match="routing"):
        HeteroscedasticGPRegressor(routing="nope").fit(X, y)
    with pytest.raises(ValueError, match="batch_size needs"):
        HeteroscedasticGPRegressor(num_inducing=0, batch_size=4).fit(X, y)
    with pytest.raises(ValueError, match="num_inducing"):
        HeteroscedasticGPRegressor(num_inducing=-1).fit(X, y)
    with pytest.raises(ValueError, match="dtype"):
        HeteroscedasticGPRegressor(dtype="float16").fit(X, y)
    with pytest.raises(ValueError, match="lr"):
        HeteroscedasticGPRegressor(lr=-1.0).fit(X, y)
    with pytest.raises(ValueError, match="depth"):
        HeteroscedasticGPRegressor(depth=0).fit(X, y)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=1, init_steps=1).fit(X, y)
    with pytest.raises(ValueError, match="features"):
        est.predict(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="level"):
        est.predict_interval(X, 1.5)
    with pytest.raises(ValueError, match="routing"):
        est.predict(X, routing="mode")


def test_early_stopping_keeps_the_best_held_out_state():
    X, y = _data(80)
    est = HeteroscedasticGPRegressor(
        depth=1,
        num_steps=40,
        init_steps=10,
        validation_fraction=0.25,
        eval_every=5,
        patience=2,
        random_state=0,
    ).fit(X, y)
    result = est.fit_result_
    assert result.val_losses and result.best_step is not None
    assert result.best_val == pytest.approx(min(v for _, v in result.val_losses))
    assert est._X_train.shape[0] == 60
    # the kept state scores best_val on the held-out points (same draw of 20)
    held_out = np.random.default_rng(0).permutation(80)[:20]
    ll = est.log_likelihood(X[held_out], y[held_out])
    assert ll == pytest.approx(
        -result.best_val - np.log(float(est.y_scaler_.scale)), rel=1e-9, abs=1e-9
    )
    with pytest.raises(ValueError, match="validation_fraction"):
        HeteroscedasticGPRegressor(validation_fraction=1.0).fit(X, y)
    with pytest.raises(ValueError, match="patience needs"):
        HeteroscedasticGPRegressor(patience=3).fit(X, y)
    with pytest.raises(ValueError, match="eval_every"):
        HeteroscedasticGPRegressor(eval_every=0).fit(X, y)


def test_num_inducing_auto_exact_then_sparse(monkeypatch):
    import pyro_trees.estimators.heteroscedastic_gp as hgp

    X, y = _data(60)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=5, init_steps=5, random_state=0)
    assert est.fit(X, y).num_inducing_ == 0 and not est.model_.sparse
    monkeypatch.setattr(hgp, "_EXACT_MAX_ROWS", 40)
    monkeypatch.setattr(hgp, "_AUTO_INDUCING", 16)
    est.fit(X, y)
    assert est.num_inducing_ == 16 and est.model_.num_inducing == 16
    mean, std = est.predict(X, return_std=True)
    assert np.all(np.isfinite(mean)) and np.all(std > 0)
    # the sparse collapsed fit predicts without the training data
    assert est._X_train is None
    assert (
        HeteroscedasticGPRegressor(num_inducing=0, num_steps=2, init_steps=2)
        .fit(X, y)
        .num_inducing_
        == 0
    )


def test_stops_on_a_plateau():
    X, y = _data(60)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=2000, init_steps=10, random_state=0)
    assert est.fit(X, y).fit_result_.num_steps < 2000


@pytest.mark.parametrize("far", [1e10, 1e30, 1e200])
def test_a_far_row_changes_no_other_row(far):
    # GPyTorch centred the cross-covariance at the mean of the new rows: one row at 1e10
    # moved the others by 10x sd(y), at 1e30 made them all equal, at 1e200 NaN
    X, y = _data(40)
    est = HeteroscedasticGPRegressor(depth=1, num_steps=5, init_steps=5, random_state=0)
    est.fit(X, y)
    Xt = np.array([[2.5], [4.0], [6.3], [7.9]])
    alone = [np.r_[est.predict(r[None]), np.ravel(est.predict_interval(r[None]))] for r in Xt]
    batch = np.vstack([Xt, [[far]]])
    mean = est.predict(batch)
    lo, hi = est.predict_interval(batch)
    np.testing.assert_allclose(np.c_[mean, lo, hi][:4], np.vstack(alone), rtol=1e-9, atol=1e-12)
    # the far row is finite: about the prior mean (the mean of y), wider than the others
    assert np.all(np.isfinite([mean[4], lo[4], hi[4]]))
    assert abs(mean[4] - y.mean()) < 0.5 * y.std()
    assert hi[4] - lo[4] > np.max(hi[:4] - lo[:4])


@pytest.mark.parametrize("options", [{"dtype": "float32"}, {"num_inducing": 8}])
def test_inputs_of_any_finite_magnitude_give_finite_predictions(options):
    X, y = _data(40)
    est = HeteroscedasticGPRegressor(
        depth=1, num_steps=3, init_steps=3, random_state=0, **options
    ).fit(X, y)
    batch = np.array([[5.0], [1e200], [-1e300], [1.7e308]])
    with np.errstate(over="ignore"):  # the standardisation of 1.7e308 overflows to inf
        mean = est.predict(batch)
        lo, hi = est.predict_interval(batch)
        noise = est.predict_noise(batch)
    assert np.all(np.isfinite(np.c_[mean, lo, hi, noise]))
    np.testing.assert_allclose(mean[0], est.predict(batch[:1])[0], rtol=1e-5)


@pytest.mark.parametrize("units", [1e6, 1e-3])
def test_predictions_follow_the_units_of_x(units):
    # standardised, X and units * X differ in the last bits (2e-15); the start's split
    # dimension was the argmax of spreads that are all 1 up to those bits, so the start,
    # and the fit, depended on the units (0.22 sd(y) in the mean, 0.99 in the intervals)
    rng = np.random.default_rng(2)
    X = rng.normal(size=(60, 4)) * [1.0, 30.0, 0.2, 5.0] + [3.0, -1.0, 100.0, 0.0]
    y = np.sin(X[:, 0]) + 0.3 * np.exp(0.1 * X[:, 3]) * rng.normal(size=60)
    kw = {"num_steps": 3, "init_steps": 5, "random_state": 0}
    a = HeteroscedasticGPRegressor(**kw).fit(X, y)
    b = HeteroscedasticGPRegressor(**kw).fit(X * units, y)
    tol = 1e-9 * y.std()  # rounding of the standardisation, carried through the fit
    np.testing.assert_allclose(b.predict(X * units), a.predict(X), rtol=0, atol=tol)
    np.testing.assert_allclose(
        np.ravel(b.predict_interval(X * units)), np.ravel(a.predict_interval(X)), rtol=0, atol=tol
    )


def test_default_kernel_learns_one_lengthscale_per_feature():
    """The default kernel is ARD: with one feature that matters among four that do not,
    the fitted lengthscale of the one is shorter than every other's (an isotropic kernel
    has one lengthscale for all), and the fit beats predicting the mean by far."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((120, 5))
    y = np.sin(2 * X[:, 0]) + 0.05 * rng.standard_normal(120)
    est = HeteroscedasticGPRegressor(depth=1, random_state=0).fit(X, y)
    scales = est.model_.kernel.base_kernel.lengthscale.detach().reshape(-1)
    assert scales.shape == (5,)
    assert bool((scales[0] < scales[1:]).all()), scales
    X_new = rng.standard_normal((200, 5))
    assert est.score(X_new, np.sin(2 * X_new[:, 0])) > 0.9
