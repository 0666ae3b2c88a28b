"""Ctrl-C during ``fit``: the whole fit stops, ``KeyboardInterrupt`` propagates and the
estimator is left unfitted; the process fits normally afterwards.

Each fit here is configured to run for minutes (many steps, no early stopping), and a
timer thread delivers SIGINT to the main thread as Ctrl-C would."""

import _thread
import threading
import time

import numpy as np
import pytest
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

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

LONG = 10**6  # steps or cycles: far more than any of these fits can do in the test

#: a long-running configuration and a quick one of every estimator
ESTIMATORS = {
    "vart": (
        lambda: VaRTRegressor(num_steps=LONG, patience=None, random_state=0),
        lambda: VaRTRegressor(depth=2, num_steps=10, num_samples=5, random_state=0),
    ),
    "forest": (
        lambda: VaRTForestRegressor(num_trees=5, num_steps=LONG, patience=None, random_state=0),
        lambda: VaRTForestRegressor(num_trees=2, num_steps=10, num_samples=6, random_state=0),
    ),
    "vart_clf": (
        lambda: VaRTClassifier(num_steps=LONG, patience=None, random_state=0),
        lambda: VaRTClassifier(depth=2, num_steps=10, num_samples=6, num_fits=1, random_state=0),
    ),
    "rnn_reg": (
        lambda: RNNTreeRegressor(num_steps=LONG, validation_fraction=0.0, random_state=0),
        lambda: RNNTreeRegressor(depth=2, num_steps=10, random_state=0),
    ),
    "rnn_clf": (
        lambda: RNNTreeClassifier(num_steps=LONG, validation_fraction=0.0, random_state=0),
        lambda: RNNTreeClassifier(depth=2, num_steps=10, random_state=0),
    ),
    "bhme": (
        lambda: BayesianHMERegressor(num_cycles=LONG, tol=0.0, random_state=0),
        lambda: BayesianHMERegressor(max_experts=2, num_restarts=2, num_cycles=5, random_state=0),
    ),
    "hgp": (
        lambda: HeteroscedasticGPRegressor(num_steps=LONG, random_state=0),
        lambda: HeteroscedasticGPRegressor(num_steps=3, init_steps=3, random_state=0),
    ),
    "causal": (
        lambda: VaRTCausal(VaRTRegressor(num_steps=LONG, validation_fraction=0.0)),
        lambda: VaRTCausal(VaRTRegressor(depth=2, num_steps=10, num_samples=5)),
    ),
}


def _fit(name, est):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = X[:, 0] - np.abs(X[:, 1]) + 0.1 * rng.normal(size=200)
    if name == "causal":
        return est.fit(X, (X[:, 2] > 0).astype(int), y)
    if name in ("vart_clf", "rnn_clf"):
        return est.fit(X, (y > 0).astype(int))
    return est.fit(X, y)


def _predict(name, est):
    X = np.zeros((3, 3))
    if name == "causal":
        return est.cate(X)
    return est.predict(X)


@pytest.mark.parametrize("fitted_before", [False, True], ids=["new", "refit"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_ctrl_c_stops_the_whole_fit_and_leaves_it_unfitted(name, fitted_before):
    long, quick = ESTIMATORS[name]
    est = long()
    if fitted_before:  # an earlier fit's attributes go too: no half-old, half-new state
        est = _fit(name, quick())
        est.set_params(**long().get_params(deep=False))
    timer = threading.Timer(0.5, _thread.interrupt_main)
    start = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _fit(name, est)
    finally:
        timer.cancel()
    # the fit ended at the next safe point, not minutes later (a generous bound that
    # holds on a slow machine: one training step or VB cycle takes milliseconds)
    assert time.perf_counter() - start < 30.0
    with pytest.raises(NotFittedError):
        check_is_fitted(est)
    with pytest.raises(NotFittedError):
        _predict(name, est)
    # the process is unharmed: the same estimator fits and predicts afterwards
    est.set_params(**quick().get_params(deep=False))
    assert np.isfinite(_predict(name, _fit(name, est))).all()


def test_a_failing_fit_leaves_the_estimator_unfitted():
    params = dict(depth=2, num_steps=5, num_samples=4, random_state=0)
    est = VaRTRegressor(**params)
    X = np.random.default_rng(0).normal(size=(30, 2))
    est.fit(X, X[:, 0])
    with pytest.raises(ValueError):
        est.fit(X, np.full(30, np.nan))
    with pytest.raises(NotFittedError):
        est.predict(X)
    assert (
        est.get_params()
        == VaRTRegressor(depth=2, num_steps=5, num_samples=4, random_state=0).get_params()
    )
