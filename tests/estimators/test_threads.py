"""Threads: prediction and sampling from several threads equal sequential calls, and
fits started from several threads give the fits of sequential calls.

Pyro's handler stack, its param store and the global random streams are process-wide;
the estimators serialise what touches them (``pyro_trees.infer.exclusive``)."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

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

THREADS = 4


def _data(n=80, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    return X, np.sin(2 * X[:, 0]) + 0.1 * rng.normal(size=n)


def _small(name):
    """A quick fit of each estimator (a few steps; these tests are about threads)."""
    return {
        "vart": lambda: VaRTRegressor(depth=2, num_steps=20, num_samples=8, random_state=0),
        "forest": lambda: VaRTForestRegressor(
            num_trees=3, num_steps=20, num_samples=6, random_state=0
        ),
        "vart_clf": lambda: VaRTClassifier(
            depth=2, num_steps=20, num_samples=6, num_fits=2, random_state=0
        ),
        "rnn_reg": lambda: RNNTreeRegressor(depth=2, num_steps=20, random_state=0),
        "rnn_clf": lambda: RNNTreeClassifier(depth=2, num_steps=20, random_state=0),
        "bhme": lambda: BayesianHMERegressor(
            max_experts=2, num_restarts=2, num_cycles=10, random_state=0
        ),
        "hgp": lambda: HeteroscedasticGPRegressor(num_steps=5, init_steps=5, random_state=0),
        "causal": lambda: VaRTCausal(
            VaRTRegressor(depth=2, num_steps=20, num_samples=6, validation_fraction=0.0),
            random_state=0,
        ),
    }[name]()


def _fit(name):
    X, y = _data()
    est = _small(name)
    if name == "causal":
        return est.fit(X, (X[:, 1] > 0).astype(int), y)
    if name in ("vart_clf", "rnn_clf"):
        return est.fit(X, (y > 0).astype(int))
    return est.fit(X, y)


#: the methods that draw (through Pyro's Predictive or the seeded global streams) and
#: those that only evaluate fitted tensors, per estimator
CALLS = {
    "vart": ("sample", "sample_function", "predict", "predict_interval"),
    "forest": ("sample", "sample_function", "predict", "predict_interval"),
    "vart_clf": ("sample_proba", "predict_proba"),
    "rnn_reg": ("predict",),
    "rnn_clf": ("predict_proba",),
    "bhme": ("sample", "predict", "predict_interval"),
    "hgp": ("sample", "predict", "predict_interval"),
    "causal": ("sample_cate", "cate"),
}


@pytest.fixture(scope="module")
def fitted():
    return {name: _fit(name) for name in CALLS}


def _same(a, b):
    if isinstance(a, tuple | list):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            _same(u, v)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "name,method", [(n, m) for n, methods in CALLS.items() for m in methods], ids=str
)
def test_calls_from_threads_equal_sequential_calls(fitted, name, method):
    est = fitted[name]
    X = _data(12, seed=1)[0]
    call = getattr(est, method)
    sequential = [call(X) for _ in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
        threaded = list(pool.map(lambda _: call(X), range(3 * THREADS)))
    for result in threaded:
        _same(result, sequential[0])


@pytest.mark.parametrize("name", ["vart", "hgp", "rnn_reg", "bhme"])
def test_fits_from_two_threads_equal_sequential_fits(name):
    X = _data(20, seed=2)[0]
    sequential = [_fit(name).predict(X) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda _: _fit(name).predict(X), range(2)))
    for a, b in zip(sequential, threaded, strict=True):
        np.testing.assert_array_equal(a, b)
