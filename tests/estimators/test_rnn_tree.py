import pickle

import numpy as np
import pytest
import torch

from pyro_trees.datasets import make_parity, make_pulse, parity_test_set
from pyro_trees.estimators import RNNTreeClassifier, RNNTreeRegressor


@pytest.fixture(scope="module")
def pulse_fit():
    X, y = make_pulse(200)
    return RNNTreeRegressor(3, random_state=0, num_steps=150, entropy_weight=-1.0).fit(X, y), X, y


@pytest.fixture(scope="module")
def parity_fit():
    X, y = make_parity(600, bits=4, sigma=0.0, random_state=0)
    est = RNNTreeClassifier(4, random_state=0, num_steps=60, entropy_weight=-1.0).fit(X, y)
    return est, X, y


def test_regressor_fits_the_pulse(pulse_fit):
    est, X, y = pulse_fit
    assert len(set(est.apply(X).tolist())) == 8
    assert np.mean((est.predict(X) - y) ** 2) < 0.1
    assert est.score(X, y) > 0.9
    assert est.predict(X, routing="posterior").shape == (200,)
    assert est.predict_leaf_proba(X).shape == (200, 8)
    np.testing.assert_allclose(est.predict_leaf_proba(X).sum(-1), 1.0, rtol=1e-5)


def test_classifier_solves_noise_free_parity(parity_fit):
    est, _, _ = parity_fit
    X_test, y_test = parity_test_set(4)
    assert est.score(X_test, y_test) == 1.0
    proba = est.predict_proba(X_test)
    assert proba.shape == (16, 2)
    np.testing.assert_allclose(proba.sum(-1), 1.0, rtol=1e-5)
    assert est.classes_.tolist() == [0, 1]


def test_export_text_uses_input_units(pulse_fit):
    est, X, _ = pulse_fit
    text = est.export_text(feature_names=["x"])
    assert text.count("value:") == 8 and "x <=" in text
    thresholds = sorted(float(t) for t in est.rules_.threshold)
    # standardised thresholds map back near the pulse's integer boundaries
    raw = np.array(thresholds) * est.x_scaler_.scale[0] + est.x_scaler_.mean[0]
    assert np.all(np.abs(raw - np.round(raw)) < 0.15)
    # the leaf values are in the units of y too: those of the hard predictions
    lines = [line for line in text.splitlines() if "value:" in line]
    printed = {round(float(line.split("value:")[1]), 3) for line in lines}
    np.testing.assert_allclose(sorted(printed), sorted(set(est.predict(X).round(3))), atol=2e-3)


@pytest.mark.parametrize("routing", ["hard", "posterior"])
def test_pickle_and_torch_save_reproduce_predictions_exactly(pulse_fit, tmp_path, routing):
    est, X, _ = pulse_fit
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(
        again.predict(X, routing=routing), est.predict(X, routing=routing)
    )
    torch.save(est, tmp_path / "est.pt")
    loaded = torch.load(tmp_path / "est.pt", weights_only=False)
    np.testing.assert_array_equal(
        loaded.predict(X, routing=routing), est.predict(X, routing=routing)
    )


@pytest.mark.parametrize("routing", ["hard", "posterior"])
def test_classifier_pickle_and_torch_save_reproduce_predictions_exactly(
    parity_fit, tmp_path, routing
):
    est, X, _ = parity_fit
    X_test, _ = parity_test_set(4)
    X_all = np.concatenate([X, X_test])
    want_proba = est.predict_proba(X_all, routing=routing)
    want = est.predict(X_all, routing=routing)
    torch.save(est, tmp_path / "est.pt")
    for again in (
        pickle.loads(pickle.dumps(est)),
        torch.load(tmp_path / "est.pt", weights_only=False),
    ):
        np.testing.assert_array_equal(again.predict_proba(X_all, routing=routing), want_proba)
        np.testing.assert_array_equal(again.predict(X_all, routing=routing), want)
        assert again.classes_.tolist() == est.classes_.tolist()
        assert again.export_text() == est.export_text()


def test_score_rejects_bad_targets(pulse_fit, parity_fit):
    """score is scikit-learn's (R^2, accuracy): its checks name the cause."""
    est, X, y = pulse_fit
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        est.score(X, y[:-1])
    with pytest.raises(ValueError, match="NaN"):
        est.score(X, np.where(np.arange(200) == 5, np.nan, y))
    clf, Xc, yc = parity_fit
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        clf.score(Xc, yc[:-1])


def test_same_seed_same_fit():
    X, y = make_pulse(60)
    a = RNNTreeRegressor(2, random_state=3, num_steps=20).fit(X, y).predict(X)
    b = RNNTreeRegressor(2, random_state=3, num_steps=20).fit(X, y).predict(X)
    np.testing.assert_array_equal(a, b)


def test_float64_and_string_labels_and_multi_output():
    X, y = make_pulse(60)
    est = RNNTreeRegressor(2, num_steps=10, dtype="float64").fit(X, np.stack([y, -y], 1))
    assert est.predict(X).shape == (60, 2)
    labels = np.where(y > 2.5, "high", "low")
    clf = RNNTreeClassifier(2, num_steps=10).fit(X, labels)
    assert set(clf.predict(X)) <= {"high", "low"}


def test_get_set_params_and_repr():
    est = RNNTreeRegressor(4, lr=0.1)
    params = est.get_params()
    assert params["depth"] == 4 and params["lr"] == 0.1 and "noise_scale" in params
    assert est.set_params(depth=2).depth == 2
    assert repr(est) == "RNNTreeRegressor(depth=2, lr=0.1)"
    with pytest.raises(ValueError, match="Invalid parameter"):
        est.set_params(nope=1)


def test_early_stopping_on_validation():
    X, y = make_pulse(120)
    est = RNNTreeRegressor(
        3, num_steps=400, validation_fraction=0.2, patience=2, eval_every=10, random_state=0
    ).fit(X, y)
    assert est.fit_result_.stopped in ("early_stopping", "num_steps")
    assert est.fit_result_.best_step is not None


@pytest.mark.parametrize(
    "X,y,match",
    [
        (np.array([[0.0], [1.0]]), np.array([1.0, np.nan]), "NaN"),
        (np.array([[np.inf], [1.0]]), np.array([1.0, 2.0]), "infinity"),
        (np.array([[0.0], [1.0]]), np.array([1.0, np.inf]), "infinity"),
        (np.zeros((3, 1)), np.zeros(2), "inconsistent numbers of samples"),
        (np.zeros(3), np.zeros(3), "Expected 2D array"),
    ],
)
def test_bad_training_input(X, y, match):
    with pytest.raises(ValueError, match=match):
        RNNTreeRegressor(2, num_steps=1).fit(X, y)


def test_bad_depths():
    X, y = make_pulse(20)
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        RNNTreeRegressor(0).fit(X, y)
    with pytest.raises(ValueError, match="would need about"):
        RNNTreeRegressor(48).fit(X, y)


def test_bad_prediction_input(pulse_fit):
    est, _, _ = pulse_fit
    with pytest.raises(ValueError, match="expecting 1 features"):
        est.predict(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="infinity"):
        est.predict(np.array([[np.inf]]))
    with pytest.raises(ValueError, match="routing"):
        est.predict(np.zeros((3, 1)), routing="nope")
    with pytest.raises(ValueError, match="not fitted"):
        RNNTreeRegressor().predict(np.zeros((3, 1)))


def test_classifier_rejects_a_single_class(parity_fit):
    est, X, y = parity_fit
    with pytest.raises(ValueError, match="single class"):
        RNNTreeClassifier(2, num_steps=1).fit(X, np.zeros(len(X)))


@pytest.mark.cuda
def test_cuda_fit_and_predict():
    X, y = make_pulse(50)
    est = RNNTreeRegressor(2, num_steps=5, device="cuda").fit(X, y)
    assert est.predict(X).shape == (50,)


def test_refit_leaves_gives_the_hard_tree_its_own_partition_means():
    X, y = make_pulse(80)
    kw = dict(random_state=0, num_steps=30, entropy_weight=-1.0)
    a = RNNTreeRegressor(2, refit_leaves=True, **kw).fit(X, y)
    b = RNNTreeRegressor(2, refit_leaves=False, **kw).fit(X, y)
    assert b.hard_leaf_loc_ is None
    # "auto" refits only where that lowers the error on the validation split
    c = RNNTreeRegressor(2, **kw).fit(X, y)
    assert c.hard_leaf_loc_ is None
    with pytest.raises(ValueError, match="refit_leaves must be"):
        RNNTreeRegressor(2, refit_leaves="yes", **kw).fit(X, y)
    leaf, pred = a.apply(X), a.predict(X)
    for k in np.unique(leaf):
        np.testing.assert_allclose(pred[leaf == k], y[leaf == k].mean(), rtol=1e-5)
    # the same training run: the tree and the posterior-routing predictions agree
    np.testing.assert_array_equal(leaf, b.apply(X))
    np.testing.assert_array_equal(
        a.predict(X, routing="posterior"), b.predict(X, routing="posterior")
    )
    assert np.mean((pred - y) ** 2) <= np.mean((b.predict(X) - y) ** 2) + 1e-9
    assert "value:" in a.export_text()


def test_refit_leaves_predicts_each_leafs_majority_class(parity_fit):
    est, X, y = parity_fit
    est = pickle.loads(pickle.dumps(est))
    est.refit_leaves = True
    est._refit_hard_leaves(
        est._validate_predict(X), torch.as_tensor(np.searchsorted(est.classes_, y))
    )
    leaf, pred = est.apply(X), est.predict(X)
    for k in np.unique(leaf):
        counts = np.bincount(y[leaf == k], minlength=2)
        if counts[0] != counts[1]:
            assert (pred[leaf == k] == counts.argmax()).all()


def test_defaults_fit_real_data_and_cure_a_collapse():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    est = RNNTreeClassifier(random_state=0).fit(X, y)
    assert est.start_ in ("greedy", "balanced") and est.collapse_ is None
    assert set(est.predict(X)) == {0, 1} and est.score(X, y) > 0.93
    # the ELBO from a balanced start, unchecked by held-out rows: a degenerate tree
    # that the greedy start replaces (at lr 0.1 it collapses within 50 steps; from the
    # start's slope 40 at lr 0.03 it takes 200)
    bad = RNNTreeClassifier(
        init="balanced",
        entropy_weight=1.0,
        validation_fraction=0,
        num_steps=50,
        lr=0.1,
        random_state=0,
    ).fit(X, y)
    assert bad.collapse_ is not None and bad.start_ == "greedy"
    assert bad.score(X, y) > 0.93


@pytest.mark.parametrize("cls", [RNNTreeClassifier, RNNTreeRegressor])
def test_degenerate_inputs_warn(cls):
    rng = np.random.default_rng(0)
    X = np.ones((40, 3))  # no split separates anything
    y = rng.integers(0, 2, 40) if cls is RNNTreeClassifier else rng.normal(size=40)
    with pytest.warns(UserWarning, match="degenerate: every training row falls in the same"):
        est = cls(random_state=0).fit(X, y)
    assert est.collapse_ is not None
    assert len(est.predict(X)) == 40


@pytest.mark.parametrize("routing", ["hard", "posterior"])
def test_predict_proba_rows_sum_to_one_in_float64(parity_fit, routing):
    """scikit-learn's metrics (``log_loss``) check the sums at float64 precision; a
    float32 fit's probabilities are renormalised after the cast."""
    est, X, _ = parity_fit
    proba = est.predict_proba(X, routing=routing)
    assert proba.dtype == np.float64
    np.testing.assert_allclose(proba.sum(1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(est.classes_[proba.argmax(1)], est.predict(X, routing=routing))


def _steps(n, seed, noise=0.3):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, size=(n, 2))
    y = np.where(X[:, 0] > 0, 2.0, -1.0) + np.where(X[:, 1] > 1, 1.5, 0.0)
    return X, y + noise * rng.standard_normal(n)


def test_regressor_intervals_are_the_leaves_gaussians_calibrated_on_held_out_rows():
    """Hard routing: each row's interval is its leaf's value plus or minus the normal
    quantile times the experts' noise and ``noise_factor_``; the factor, from the
    held-out rows, gives about the level's coverage on new rows."""
    X, y = _steps(400, 0)
    est = RNNTreeRegressor(2, random_state=0).fit(X, y)
    X_new, y_new = _steps(4000, 1)
    mean, std = est.predict(X_new, return_std=True)
    np.testing.assert_array_equal(mean, est.predict(X_new))
    lo, hi = est.predict_interval(X_new, 0.9)
    np.testing.assert_allclose((lo + hi) / 2, mean, atol=1e-9)
    np.testing.assert_allclose(hi - lo, 2 * 1.6448536 * std, rtol=1e-6)
    # homoscedastic leaves: one scale for every row, the noise times the factor
    scale = float(est.model_.scale().detach()) * float(np.ravel(est.y_scaler_.scale)[0])
    np.testing.assert_allclose(std, est.noise_factor_ * scale, rtol=1e-5)
    assert 0.5 < est.noise_factor_ < 2.0
    assert 0.85 <= np.mean((y_new >= lo) & (y_new <= hi)) <= 0.95
    lo5, hi5 = est.predict_interval(X_new, 0.5)
    assert (hi5 - lo5 < hi - lo).all()
    # the posterior's mixture over the leaves adds the spread between them
    _, std_post = est.predict(X_new, return_std=True, routing="posterior")
    assert (std_post >= std * (1 - 1e-6)).all()
    # without held-out rows there is nothing to calibrate on
    plain = RNNTreeRegressor(2, validation_fraction=0, num_steps=5, random_state=0).fit(X, y)
    assert plain.noise_factor_ == 1.0


def test_regressor_intervals_of_several_outputs_and_after_pickling():
    X, y = _steps(200, 2)
    Y = np.stack([y, -2 * y], 1)
    est = RNNTreeRegressor(2, num_steps=20, random_state=0).fit(X, Y)
    lo, hi = est.predict_interval(X[:7])
    mean, std = est.predict(X[:7], return_std=True)
    assert lo.shape == hi.shape == mean.shape == std.shape == (7, 2)
    assert (lo < mean).all() and (mean < hi).all()
    again = pickle.loads(pickle.dumps(est))
    for a, b in zip(again.predict_interval(X[:7]), (lo, hi), strict=True):
        np.testing.assert_array_equal(a, b)


def test_regressor_samples_follow_its_predictive():
    X, y = _steps(200, 3)
    est = RNNTreeRegressor(2, num_steps=20, random_state=0).fit(X, y)
    draws = est.sample(X[:5], 4000)
    assert draws.shape == (4000, 5)
    mean, std = est.predict(X[:5], return_std=True)
    np.testing.assert_allclose(draws.mean(0), mean, atol=4 * std.max() / np.sqrt(4000) + 1e-9)
    np.testing.assert_allclose(draws.std(0), std, rtol=0.06)
    np.testing.assert_array_equal(est.sample(X[:5], 3), est.sample(X[:5], 3))  # seeded
    assert est.sample(X[:5]).shape == (100, 5)
    with pytest.raises(ValueError, match="num_samples"):
        est.sample(X[:5], 0)


def test_leaf_loc_is_a_copy_of_the_hard_trees_leaves(pulse_fit):
    """Unfitted: NotFittedError. Fitted: ``(2**depth, width)``, the leaves the hard
    routing predicts with, and a copy (changing it changes no prediction)."""
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        _ = RNNTreeRegressor(2).leaf_loc_
    est, X, _ = pulse_fit
    loc = est.leaf_loc_
    assert loc.shape == (2**3, 1) and loc.device.type == "cpu"
    before = est.predict(X)
    loc.add_(10.0)
    np.testing.assert_array_equal(est.predict(X), before)
    torch.testing.assert_close(est.leaf_loc_, loc - 10.0)
