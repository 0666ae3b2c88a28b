"""Missing values (NaN) in ``X``: the VaRT and RNN-Tree estimators route them natively,
at fit, at prediction or both; a fit without any is the fit it always was; the others
refuse them with an error that names the imputer pipeline."""

import pickle

import numpy as np
import pytest
import torch

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)

NATIVE = {
    VaRTRegressor: {"depth": 2, "num_steps": 40, "num_samples": 8},
    VaRTForestRegressor: {"num_trees": 4, "depth": 2, "num_steps": 40, "num_samples": 8},
    VaRTClassifier: {"depth": 2, "num_steps": 40, "num_samples": 8},
    RNNTreeRegressor: {"depth": 2, "hidden_size": 8, "num_steps": 30},
    RNNTreeClassifier: {"depth": 2, "hidden_size": 8, "num_steps": 30},
}
CLASSIFIERS = (VaRTClassifier, RNNTreeClassifier)


def _data(n=120, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    y = X[:, 0] + np.sin(2 * X[:, 1]) + 0.1 * rng.normal(size=n)
    holes = X.copy()
    holes[rng.random(X.shape) < 0.2] = np.nan
    holes[5] = np.nan  # a row missing everything
    return X, holes, y


def _target(cls, y):
    return (y > 0).astype(int) if cls in CLASSIFIERS else y


def _outputs(est, X):
    if hasattr(est, "predict_proba"):
        return est.predict_proba(X)
    out = [est.predict(X)]
    if hasattr(est, "predict_interval"):
        out += list(est.predict_interval(X))
        out.append(est.predict(X, return_std=True)[1])
    return np.stack(out)


@pytest.mark.parametrize("cls", list(NATIVE))
def test_tags_say_nan_is_allowed(cls):
    assert cls().__sklearn_tags__().input_tags.allow_nan
    for other in (BayesianHMERegressor, HeteroscedasticGPRegressor):
        assert not other().__sklearn_tags__().input_tags.allow_nan


@pytest.mark.parametrize("cls", [BayesianHMERegressor, HeteroscedasticGPRegressor])
def test_the_others_refuse_nan_and_name_the_fix(cls):
    _, holes, y = _data(30)
    name = cls.__name__
    with pytest.raises(ValueError, match=rf"make_pipeline\(SimpleImputer\(\), {name}\(\)\)"):
        cls().fit(holes, y)


@pytest.mark.parametrize("cls", list(NATIVE))
def test_fit_and_predict_with_missing_values(cls):
    X, holes, y = _data()
    y = _target(cls, y)
    est = cls(random_state=0, **NATIVE[cls]).fit(holes, y)
    np.testing.assert_allclose(est.missing_fraction_, np.isnan(holes).mean(0))
    out = _outputs(est, holes)
    assert np.isfinite(out).all()
    if cls in CLASSIFIERS:
        np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)
        assert set(est.predict(holes)) <= set(est.classes_)
    else:
        assert est.predict(holes).shape == (len(y),)
        if hasattr(est, "predict_interval"):
            assert (out[1] <= out[2]).all()
            assert est.sample(holes, num_samples=3).shape == (3, len(y))
        if hasattr(est, "sample_function"):  # the VaRT regressors' posterior functions
            assert np.isfinite(est.sample_function(holes)).all()
            assert np.isfinite(est.coverage_scores(holes, y)).all()
    if hasattr(est, "sample_importances"):
        np.testing.assert_allclose(est.sample_importances(holes).sum(-1), 1.0, rtol=1e-6)
    # complete rows too, and the same answers after pickling
    assert np.isfinite(_outputs(est, X)).all()
    loaded = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(_outputs(loaded, holes), out)
    # infinities stay refused, NaN targets too
    bad = X.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        est.predict(bad)
    if cls not in CLASSIFIERS:
        with pytest.raises(ValueError, match="NaN"):
            cls(**NATIVE[cls]).fit(X, np.where(np.arange(len(y)) == 3, np.nan, y))


@pytest.mark.parametrize("cls", list(NATIVE))
def test_missing_at_prediction_only(cls):
    X, holes, y = _data()
    est = cls(random_state=0, **NATIVE[cls]).fit(X, _target(cls, y))
    assert not est.missing_fraction_.any()
    out = _outputs(est, holes)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(_outputs(est, holes), out)  # the same draws every call
    np.testing.assert_array_equal(_outputs(pickle.loads(pickle.dumps(est)), holes), out)
    complete = ~np.isnan(holes).any(1)  # complete rows are predicted as in a clean batch
    np.testing.assert_allclose(
        _outputs(est, holes[complete]), _outputs(est, X[complete]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("cls", list(NATIVE))
def test_a_fit_without_missing_values_never_takes_the_missing_path(cls, monkeypatch):
    """The model of a fit without NaN has no missing-value routes, and the code that
    routes missing values never runs: predictions are those of the code before missing
    values were accepted (checked bit for bit against it when they were added)."""
    from pyro_trees.guides import rnn_tree
    from pyro_trees.models import vart_mixture

    def boom(*args, **kwargs):
        raise AssertionError("the missing-value path ran on complete data")

    monkeypatch.setattr(vart_mixture, "missing_share", boom)
    monkeypatch.setattr(rnn_tree.RNNTree, "_missing_log_probs", boom)
    soft = rnn_tree._log_right_left

    def complete_only(x, log_dim, w0, w1, missing=None, missing_logits=None):
        assert missing is None, "the missing-value path ran on complete data"
        return soft(x, log_dim, w0, w1)

    monkeypatch.setattr(rnn_tree, "_log_right_left", complete_only)
    X, _, y = _data()
    for feedback in ("hard", "soft") if cls in (RNNTreeRegressor, RNNTreeClassifier) else (None,):
        kw = {} if feedback is None else {"feedback": feedback}
        est = cls(random_state=0, **NATIVE[cls], **kw).fit(X, _target(cls, y))
        assert np.isfinite(_outputs(est, X)).all()
        if hasattr(est, "export_text") and cls is not VaRTForestRegressor:
            assert "missing" not in est.export_text()
        if hasattr(est, "model_") and hasattr(est.model_, "missing"):
            assert est.model_.missing is False
        if hasattr(est, "guide_") and hasattr(est.guide_, "rho_logits"):
            raise AssertionError("a fit without missing values has rho parameters")


def _step(seed, missing_at_fit):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(300, 2))
    y = 3 * np.sign(X[:, 0]) + 0.1 * rng.normal(size=300)
    if missing_at_fit:
        X = X.copy()
        X[rng.random(300) < 0.2, 0] = np.nan
    Xt = rng.normal(size=(40, 2))
    Xm = Xt.copy()
    Xm[:, 0] = np.nan
    return X, y, Xt, Xm


@pytest.mark.parametrize("missing_at_fit", [False, True])
def test_intervals_widen_where_the_route_is_uncertain(missing_at_fit):
    """y = 3 sign(x_0): a row missing x_0 may lie on either side of the split, and its
    90 % interval spans both levels. Measured over seeds 0-4: the median width of those
    rows is 8.1-22 times that of complete rows (6.2-6.6 against 0.28-0.79); checked at
    4 times, with both levels inside every such row's interval."""
    X, y, Xt, Xm = _step(0, missing_at_fit)
    est = VaRTRegressor(depth=2, num_steps=200, num_samples=20, random_state=0).fit(X, y)
    lo, hi = est.predict_interval(Xt)
    lm, hm = est.predict_interval(Xm)
    assert np.median(hm - lm) > 4 * np.median(hi - lo)
    assert (lm < -2.5).all() and (hm > 2.5).all()


def test_export_text_marks_where_missing_values_go():
    X, holes, y = _data()
    vart = VaRTRegressor(random_state=0, **NATIVE[VaRTRegressor]).fit(holes, y)
    assert "or missing (p = " in vart.export_text()
    rnn = RNNTreeRegressor(random_state=0, **NATIVE[RNNTreeRegressor]).fit(holes, y)
    assert "or missing" in rnn.export_text()


def test_a_fit_without_missing_values_routes_them_by_the_prior():
    """At prediction a fit without missing values draws rho from its prior, Beta(1, 1),
    one per posterior tree and split, seeded: half the mass of a split on a missing
    input goes each way on average."""
    X, _, y = _data()
    est = VaRTRegressor(random_state=0, **NATIVE[VaRTRegressor]).fit(X, y)
    tree = est._posterior().leaves()
    assert tree["rho"].shape == (8, 3)
    assert torch.equal(tree["rho"], est._posterior().stack(est._posterior().samples)["rho"])
    assert 0.0 < float(tree["rho"].min()) and float(tree["rho"].max()) < 1.0
