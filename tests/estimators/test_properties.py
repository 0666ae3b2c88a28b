"""Properties every estimator's predictions keep, whatever the rows asked about.

Each estimator is fitted once for the module (tiny fits: the properties below hold for
any fitted state, not only a well-trained one), and hypothesis varies the rows passed to
its prediction methods:

(a) a row's prediction does not depend on the other rows of its batch;
(b) outputs are finite for finite inputs of any magnitude (up to 1e200 in any cell);
(c) a rare class is predicted, on average over new rows from the training
    distribution, within a factor of 3 of its training frequency (default fits on a set
    with 2 % positives).
"""

import warnings

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pyro_trees.estimators import (  # noqa: E402
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)

N_FEATURES = 3
# derandomize: the same examples on every run; the module-scoped fits are shared by the
# examples, and the autouse fixture of tests/conftest.py (a clean param store per test)
# does not touch what a fitted estimator predicts from
PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _regression(n=60, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, N_FEATURES)) * [1.0, 10.0, 0.1] + [0.0, 5.0, -2.0]
    y = np.sin(2 * X[:, 0]) + 0.03 * X[:, 1] + 0.1 * rng.normal(size=n)
    return X, y


def _tiny():
    """``name -> (estimator, kind)``: tiny fits of every estimator."""
    small = {"random_state": 0}
    vart = {"depth": 2, "num_steps": 30, "num_samples": 20, **small}
    return {
        "rnn_tree_regressor": (RNNTreeRegressor(depth=2, num_steps=30, **small), "reg"),
        "rnn_tree_classifier": (RNNTreeClassifier(depth=2, num_steps=30, **small), "clf"),
        "vart_regressor": (VaRTRegressor(**vart), "reg"),
        "vart_forest_regressor": (VaRTForestRegressor(num_trees=3, **vart), "reg"),
        "vart_classifier": (VaRTClassifier(num_fits=1, **vart), "clf"),
        "bayesian_hme": (
            BayesianHMERegressor(max_experts=2, num_restarts=2, num_cycles=20, grow=0, **small),
            "reg",
        ),
        "hgp_exact": (HeteroscedasticGPRegressor(depth=1, num_steps=10, init_steps=5), "reg"),
        "hgp_sparse": (
            HeteroscedasticGPRegressor(depth=1, num_steps=10, init_steps=5, num_inducing=8),
            "reg",
        ),
        "vart_causal": (
            VaRTCausal(VaRTRegressor(validation_fraction=0.0, **vart)),
            "causal",
        ),
    }


@pytest.fixture(scope="module")
def fitted():
    X, y = _regression()
    labels = (X[:, 0] + 0.5 * np.random.default_rng(1).normal(size=len(X)) > 0).astype(int)
    treated = (np.random.default_rng(2).random(len(X)) < 0.5).astype(int)
    out = {}
    for name, (est, kind) in _tiny().items():
        if kind == "causal":
            est.fit(X, treated, y)
        else:
            est.fit(X, labels if kind == "clf" else y)
        out[name] = (est, kind, float(np.std(y)) if kind != "clf" else 1.0)
    return out


def _outputs(est, kind, X) -> list[np.ndarray]:
    """Every per-row output of the estimator's prediction methods, each ``(N, ...)``."""
    if kind == "causal":
        return [np.asarray(v) for v in est.cate(X)]
    if kind == "clf":
        return [est.predict_proba(X)]
    out = [est.predict(X)]
    if hasattr(est, "predict_interval"):
        out += list(est.predict_interval(X))
    return out


NAMES = list(_tiny())
# typical cells (around the training rows) and cells of any magnitude up to 1e200
CELL = st.one_of(
    st.floats(-6, 12, allow_nan=False),
    st.floats(-1e200, 1e200, allow_nan=False, allow_infinity=False),
    st.sampled_from([1e200, -1e200, 1e10, -1e30]),
)
BATCH = st.lists(st.lists(CELL, min_size=N_FEATURES, max_size=N_FEATURES), min_size=2, max_size=6)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(rows=BATCH)
def test_a_row_does_not_depend_on_the_rest_of_its_batch(fitted, name, rows):
    est, kind, scale = fitted[name]
    X = np.array(rows, dtype=np.float64)
    with np.errstate(over="ignore"):  # standardising 1e200 may overflow to inf (clipped)
        batch = _outputs(est, kind, X)
        alone = [_outputs(est, kind, X[i : i + 1]) for i in range(len(X))]
    for j, out in enumerate(batch):
        single = np.concatenate([a[j] for a in alone])
        # float32 estimators: matrix products of another batch size may differ in the
        # last bits (BLAS blocking), so rounding-level differences are allowed (rtol 1e-5
        # for float32; the float64 GP and HME stay at 1e-12 here)
        np.testing.assert_allclose(out, single, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("name", NAMES)
@PROPERTY
@given(rows=BATCH)
def test_outputs_are_finite_for_finite_inputs_of_any_magnitude(fitted, name, rows):
    est, kind, _ = fitted[name]
    X = np.array(rows, dtype=np.float64)
    with np.errstate(over="ignore"):
        outputs = _outputs(est, kind, X)
    for out in outputs:
        assert np.all(np.isfinite(out)), (name, X, out)
    if kind == "clf":
        np.testing.assert_allclose(outputs[0].sum(-1), 1.0, rtol=1e-6)
        assert np.all(outputs[0] >= 0)
    elif kind == "reg" and len(outputs) == 3:
        _, lower, upper = outputs
        assert np.all(lower <= upper)


# -- (c) a rare class ---------------------------------------------------------------------
RARE_ROWS, RARE_POSITIVES = 400, 8  # 2 % positives, on noise features
# a training set none of whose positives is among VaRTClassifier's 40 held-out rows
# (so with 4 sets in 10 at this frequency)
RARE_SEED = 5


def _rare(seed=RARE_SEED):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(RARE_ROWS, 2))
    y = np.zeros(RARE_ROWS, dtype=int)
    y[rng.choice(RARE_ROWS, RARE_POSITIVES, replace=False)] = 1
    return X, y


@pytest.fixture(scope="module")
def rare_fits():
    X, y = _rare()
    fits = {}
    for est in (VaRTClassifier(random_state=0), RNNTreeClassifier(random_state=0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(X, y)
        # the calibration may say that a class has too few held-out rows; nothing else
        for w in caught:
            assert "held-out" in str(w.message), w.message
        fits[type(est).__name__] = est
    return fits, float(y.mean())


@pytest.mark.parametrize("name", ["VaRTClassifier", "RNNTreeClassifier"])
@settings(PROPERTY, max_examples=8)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1000, 3000))
def test_a_rare_class_is_predicted_near_its_frequency(rare_fits, name, seed, n):
    """Mean P(1) over ``n`` new rows of the training distribution, against the training
    frequency (0.02). Measured ratios over 2000 new rows, default fits (calibration
    included) on ten training sets (seeds 0-9): 0.83-1.35 for VaRTClassifier and
    1.06-1.69 for RNNTreeClassifier (0.84 and 1.26 on this one, seed 5); the new rows of
    one set move them by less than 0.1. Before ``calibrate`` checked its temperature,
    VaRTClassifier on the three sets without a held-out positive (seeds 5, 6, 8) was at
    T = 1/4 and below 0.005 of the frequency. A single row's P(1) is no such property: a
    leaf holding two positives of 30 rows rightly says 0.07."""
    fits, freq = rare_fits
    X = np.random.default_rng(seed).normal(size=(n, 2))
    p1 = fits[name].predict_proba(X)[:, 1].mean()
    assert freq / 3 < p1 < 3 * freq, (name, p1 / freq)
