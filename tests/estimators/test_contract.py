"""The contract every estimator keeps: scikit-learn's own checks with default arguments,
pandas frames, pipelines and searches, pickling, and clear errors for bad input."""

import inspect
import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import clone, is_classifier
from sklearn.exceptions import DataConversionWarning, NotFittedError
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)

pd = pytest.importorskip("pandas")

ESTIMATORS = [
    RNNTreeClassifier,
    RNNTreeRegressor,
    BayesianHMERegressor,
    VaRTRegressor,
    VaRTClassifier,
    VaRTForestRegressor,
    HeteroscedasticGPRegressor,
]
REGRESSORS = [e for e in ESTIMATORS if not is_classifier(e())]

# Checks that fail by design, each with the reason. (None at present.)
EXPECTED_FAILED_CHECKS: dict[str, dict[str, str]] = {}


# scikit-learn's checks fit about forty small data sets each. The default schedules of
# VaRTClassifier (three fits of up to 1,000 steps, patience 20) and VaRTForestRegressor
# (20 trees, a stopped fit and three refits) make that minutes each, a third of the
# suite, so their checks run one fit of 100 steps; their default fits, the pooling of
# num_fits (pickling included) and its draws are checked on their own
# (tests/estimators/test_vart.py, test_vart_classifier.py, test_vart_forest.py) and
# measured by benchmarks/vart_classification and vart_forest.
_QUICK = {"num_steps": 100, "num_fits": 1}
CHECK_ARGS = {VaRTClassifier: _QUICK, VaRTForestRegressor: _QUICK}


@parametrize_with_checks(
    [est(random_state=0, **CHECK_ARGS.get(est, {})) for est in ESTIMATORS],
    expected_failed_checks=lambda est: EXPECTED_FAILED_CHECKS.get(type(est).__name__, {}),
)
def test_sklearn_contract(estimator, check):
    """scikit-learn's estimator checks, with default arguments (a seed aside; see
    ``CHECK_ARGS``)."""
    with warnings.catch_warnings():
        # the checks fit on data our estimators warn about (e.g. tiny sets); a warning
        # is not a failure of the contract
        warnings.simplefilter("ignore", UserWarning)
        check(estimator)


def _table(n=60, seed=0, classification=False):
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "size": rng.normal(size=n),
            "weight": rng.uniform(0, 10, size=n),
            "colour": rng.choice(["red", "green", "blue"], size=n),
        }
    )
    frame = pd.get_dummies(frame, columns=["colour"])  # bool columns, as users get them
    signal = frame["size"] + 0.3 * frame["weight"] + 2 * frame["colour_red"]
    if classification:
        y = np.where(signal > signal.median(), "high", "low")
    else:
        y = signal.to_numpy() + 0.1 * rng.normal(size=n)
    return frame, y


def _small(est_cls, **kwargs):
    """A quick configuration for the checks below (the defaults are checked above)."""
    small = {
        RNNTreeClassifier: {"depth": 2, "num_steps": 30},
        RNNTreeRegressor: {"depth": 2, "num_steps": 30},
        BayesianHMERegressor: {"max_experts": 2, "num_restarts": 2, "num_cycles": 20, "grow": 0},
        VaRTRegressor: {"depth": 2, "num_steps": 30, "num_samples": 20},
        VaRTClassifier: {"depth": 2, "num_steps": 30, "num_samples": 20},
        VaRTForestRegressor: {"num_trees": 5, "depth": 2, "num_steps": 30, "num_samples": 20},
        HeteroscedasticGPRegressor: {"depth": 1, "num_steps": 10, "init_steps": 5},
    }[est_cls]
    return est_cls(random_state=0, **{**small, **kwargs})


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_pandas_frames_with_bool_columns_and_feature_names(est_cls):
    X, y = _table(classification=is_classifier(est_cls()))
    est = _small(est_cls).fit(X, y)
    assert list(est.feature_names_in_) == list(X.columns)
    assert est.n_features_in_ == X.shape[1]
    pred = est.predict(X)
    assert pred.shape == (len(X),)
    if is_classifier(est_cls()):
        assert set(np.unique(pred)) <= {"high", "low"}
        assert list(est.classes_) == ["high", "low"]
    # columns in another order: scikit-learn's error, never a silently wrong answer
    with pytest.raises(ValueError, match="feature names"):
        est.predict(X[X.columns[::-1]])
    # names at predict that fit never saw: scikit-learn's warning
    est_np = _small(est_cls).fit(X.to_numpy(dtype=float), y)
    with pytest.warns(UserWarning, match="feature names"):
        est_np.predict(X)


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_pipeline_grid_search_and_cross_validation(est_cls):
    X, y = _table(classification=is_classifier(est_cls()))
    X = X.to_numpy(dtype=float)
    pipe = make_pipeline(StandardScaler(), _small(est_cls))
    pipe.fit(X, y)
    assert np.isfinite(pipe.score(X, y))
    name = type(pipe[-1]).__name__.lower()
    param = f"{name}__random_state"
    search = GridSearchCV(pipe, {param: [0, 1]}, cv=2).fit(X, y)
    assert search.best_params_[param] in (0, 1)
    scores = cross_val_score(_small(est_cls), X, y, cv=2)
    assert scores.shape == (2,) and np.isfinite(scores).all()


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_pickle_round_trip_predicts_identically(est_cls):
    X, y = _table(classification=is_classifier(est_cls()))
    est = _small(est_cls).fit(X, y)
    back = pickle.loads(pickle.dumps(est))
    assert np.array_equal(back.predict(X), est.predict(X))
    if hasattr(est, "predict_interval"):
        for a, b in zip(back.predict_interval(X), est.predict_interval(X), strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_not_fitted_error(est_cls):
    X, _ = _table()
    for method in ("predict", "predict_proba", "predict_interval", "sample"):
        if hasattr(est_cls, method):
            with pytest.raises(NotFittedError):
                getattr(est_cls(), method)(X)


@pytest.mark.parametrize("est_cls", REGRESSORS)
def test_uncertainty_vocabulary(est_cls):
    """Every probabilistic regressor: predict(return_std), predict_interval(level=0.9),
    sample(X, n); the interval holds the mean and widens with the level."""
    X, y = _table()
    est = _small(est_cls).fit(X, y)
    if not hasattr(est, "predict_interval"):
        pytest.skip(f"{est_cls.__name__} is not probabilistic")
    mean, std = est.predict(X, return_std=True)
    assert mean.shape == std.shape == (len(X),)
    assert (std > 0).all()
    lo, hi = est.predict_interval(X)
    lo50, hi50 = est.predict_interval(X, level=0.5)
    assert (lo <= hi).all() and (lo <= lo50 + 1e-9).all() and (hi50 <= hi + 1e-9).all()
    draws = est.sample(X, 7)
    assert draws.shape == (7, len(X)) and np.isfinite(draws).all()


@pytest.mark.parametrize("est_cls", REGRESSORS)
def test_targets_are_scaled_inside(est_cls):
    """Multiplying y by 1e3 multiplies the predictions by 1e3 (y is standardised)."""
    X, y = _table()
    X = X.to_numpy(dtype=float)
    pred = _small(est_cls).fit(X, y).predict(X)
    pred_big = _small(est_cls).fit(X, y * 1e3).predict(X)
    np.testing.assert_allclose(pred_big, pred * 1e3, rtol=1e-3, atol=1e-3 * np.abs(pred).max())


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_large_offsets_and_integer_inputs(est_cls):
    """Inputs around 1e12 and integer inputs fit and give finite predictions."""
    X, y = _table(classification=is_classifier(est_cls()))
    X = X.to_numpy(dtype=float)
    big = _small(est_cls).fit(X + 1e12, y)
    pred = big.predict(X + 1e12)
    if is_classifier(big):
        assert set(pred) <= set(big.classes_)
    else:
        assert np.isfinite(pred).all()
    ints = _small(est_cls).fit(np.round(X * 10).astype(np.int64), y)
    assert len(ints.predict(np.round(X * 10).astype(np.int64))) == len(X)


def _bad_inputs(classification, allow_nan=False):
    X, y = _table(n=20, classification=classification)
    X = X.to_numpy(dtype=float)
    nan_X = X.copy()
    nan_X[3, 1] = np.nan
    inf_X = X.copy()
    inf_X[2, 0] = np.inf
    text = X.astype(object)
    text[0, 0] = "abc"
    cases = [
        ("inf in X", inf_X, y, ValueError, "infinity"),
        ("empty X", X[:0], y[:0], ValueError, "0 sample"),
        ("one row", X[:1], y[:1], ValueError, "1 sample"),
        ("strings in X", text, y, ValueError, "could not convert string"),
        ("mismatched lengths", X, y[:-1], ValueError, "inconsistent numbers of samples"),
        ("1-D X", X[:, 0], y, ValueError, "Expected 2D array"),
        ("y is None", X, None, ValueError, "requires y"),
    ]
    if not allow_nan:  # the others route missing inputs (tests/estimators/test_missing.py)
        cases.append(("NaN in X", nan_X, y, ValueError, "make_pipeline.SimpleImputer"))
    if classification:
        cases += [
            ("a single class", X, np.full(len(X), "a"), ValueError, "single class"),
            ("continuous y", X, np.linspace(0, 1, len(X)), ValueError, "Unknown label type"),
        ]
    else:
        nan_y = np.asarray(y, dtype=float).copy()
        nan_y[4] = np.nan
        cases += [
            ("NaN in y", X, nan_y, ValueError, "NaN"),
            ("constant y", X, np.full(len(X), 3.0), ValueError, "constant"),
        ]
    return cases


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_bad_input_table(est_cls):
    """Each bad input gets a ValueError naming the cause, never a torch traceback."""
    classification = is_classifier(est_cls())
    allow_nan = est_cls()._allow_nan
    for label, X, y, exc, match in _bad_inputs(classification, allow_nan):
        with pytest.raises(exc, match=match):
            _small(est_cls).fit(X, y)
        assert label  # the table's row, in the failure's traceback
    X, y = _table(classification=classification)
    X = X.to_numpy(dtype=float)
    est = _small(est_cls).fit(X, y)
    with pytest.raises(ValueError, match="features"):
        est.predict(X[:, :2])
    bad = X.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        est.predict(bad)
    bad[0, 0] = np.nan
    if allow_nan:
        assert len(est.predict(bad)) == len(bad)
    else:  # the error names the fix
        with pytest.raises(ValueError, match="make_pipeline.SimpleImputer"):
            est.predict(bad)


@pytest.mark.parametrize("est_cls", ESTIMATORS)
def test_y_column_vector_warns(est_cls):
    X, y = _table(classification=is_classifier(est_cls()))
    if est_cls._multi_output:
        pytest.skip("multi-output regressors take (n, 1) as one output")
    with pytest.warns(DataConversionWarning):
        _small(est_cls).fit(X, np.asarray(y).reshape(-1, 1))


@pytest.mark.parametrize("est_cls", ESTIMATORS)
@pytest.mark.parametrize("dtype", ["float64", torch.float64])
def test_dtype_accepts_string_and_torch_dtype(est_cls, dtype):
    if "dtype" not in est_cls().get_params():
        pytest.skip(f"{est_cls.__name__} computes in one precision")
    X, y = _table(classification=is_classifier(est_cls()))
    est = _small(est_cls, dtype=dtype).fit(X, y)
    assert est.dtype_ == torch.float64
    with pytest.raises(ValueError, match="dtype must be"):
        _small(est_cls, dtype="float16").fit(X, y)


def test_one_vocabulary_across_estimators():
    """The same ideas have the same names on every estimator."""
    for est_cls in [*ESTIMATORS, VaRTCausal]:
        params = est_cls().get_params()
        for name in ("random_state", "device", "progress"):
            assert name in params, (est_cls.__name__, name)
        if "routing" in params:
            assert params["routing"] in ("hard", "posterior")
    for est_cls in REGRESSORS:
        if hasattr(est_cls, "predict_interval"):
            level = inspect.signature(est_cls.predict_interval).parameters["level"].default
            assert level == 0.9, est_cls.__name__


def test_vart_causal_clones_its_regressor():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 2))
    A = rng.integers(0, 2, size=80)
    y = X[:, 0] + 2.0 * A + 0.1 * rng.normal(size=80)
    reg = VaRTRegressor(depth=2, num_steps=30, num_samples=20, random_state=0)
    causal = VaRTCausal(reg).fit(X, A, y)
    assert not hasattr(reg, "guide_")  # the given regressor is left unfitted
    assert causal.regressor_ is not reg
    assert clone(causal).get_params()["regressor"] is not reg
    with pytest.raises(NotFittedError):
        VaRTCausal().ate()


def test_rnn_tree_signatures_share_their_defaults():
    """RNNTreeRegressor spells out the shared constructor (scikit-learn reads explicit
    signatures); its defaults must stay those of RNNTreeClassifier."""
    reg, clf = RNNTreeRegressor().get_params(), RNNTreeClassifier().get_params()
    assert set(reg) - set(clf) == {"noise_scale"}
    assert {k: reg[k] for k in clf} == clf
