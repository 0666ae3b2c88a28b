"""Estimators seed their own randomness and leave the global random streams alone."""

import random

import numpy as np
import pyro
import pytest
import torch

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTRegressor,
)
from pyro_trees.estimators._rng import local_seed


def _next_draws(device="cpu"):
    """One draw from each global stream (advances them)."""
    return (
        random.random(),
        float(np.random.rand()),
        float(torch.rand(())),
        float(torch.rand((), device=device)),
    )


def _draws_after(action, device="cpu"):
    """The global streams' next draws after ``action()`` from a fixed global seed."""
    pyro.set_rng_seed(123)
    action()
    return _next_draws(device)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    X = rng.uniform(-2, 2, size=(60, 2))
    y = np.where(X[:, 0] > 0, 1.5, -1.0) + 0.1 * rng.normal(size=60)
    return X, y


def test_local_seed_matches_set_rng_seed_and_restores_the_streams():
    untouched = _draws_after(lambda: None)
    pyro.set_rng_seed(7)
    expected = _next_draws()
    inside = []

    def action():
        with local_seed(7):
            inside.extend(_next_draws())

    assert _draws_after(action) == untouched
    assert tuple(inside) == expected  # the same draws as after pyro.set_rng_seed(7)

    def raising():
        with pytest.raises(RuntimeError), local_seed(7):
            _next_draws()
            raise RuntimeError

    assert _draws_after(raising) == untouched


def test_local_seed_none_draws_from_the_global_streams():
    untouched = _draws_after(lambda: None)
    pyro.set_rng_seed(123)
    with local_seed(None):
        first = _next_draws()
    assert first == untouched  # the block itself drew from the global streams


def test_vart_fit_and_prediction_leave_the_global_streams_alone(data):
    X, y = data
    untouched = _draws_after(lambda: None)
    est = VaRTRegressor(depth=2, num_steps=30, num_samples=10, random_state=3)
    assert _draws_after(lambda: est.fit(X, y)) == untouched
    pred = est.predict(X)
    for call in (
        lambda: est.predict(X),
        lambda: est.predict_interval(X, method="draws"),
        lambda: est.sample_function(X),
    ):
        est._tree_samples = None  # redraw the posterior trees inside the call
        assert _draws_after(call) == untouched
    # reproducible whatever the global state: a second fit after other global draws
    pyro.set_rng_seed(99)
    again = VaRTRegressor(depth=2, num_steps=30, num_samples=10, random_state=3).fit(X, y)
    assert np.array_equal(again.predict(X), pred)


def test_vart_causal_fit_leaves_the_global_streams_alone(data):
    X, y = data
    A = (X[:, 1] > 0).astype(float)
    untouched = _draws_after(lambda: None)
    reg = VaRTRegressor(depth=2, num_steps=20, num_samples=10, random_state=0)
    est = VaRTCausal(reg)
    assert _draws_after(lambda: est.fit(X[:, :1], A, y)) == untouched
    assert _draws_after(lambda: est.ate()) == untouched


@pytest.mark.parametrize(
    "make",
    [
        lambda: RNNTreeRegressor(depth=2, num_steps=10, random_state=3),
        lambda: RNNTreeClassifier(depth=2, num_steps=10, random_state=3),
        lambda: HeteroscedasticGPRegressor(depth=2, num_steps=5, init_steps=5, random_state=3),
        lambda: BayesianHMERegressor(max_experts=2, num_restarts=2, num_cycles=10, random_state=3),
    ],
    ids=["rnn_regressor", "rnn_classifier", "heteroscedastic_gp", "bayesian_hme"],
)
def test_other_estimators_fit_reproducibly_without_touching_the_global_streams(make, data):
    X, y = data
    if "Classifier" in type(make()).__name__:
        y = (y > 0).astype(int)
    untouched = _draws_after(lambda: None)
    first = make()
    assert _draws_after(lambda: first.fit(X, y)) == untouched
    pyro.set_rng_seed(99)
    second = make().fit(X, y)
    assert np.array_equal(first.predict(X), second.predict(X))


def test_unseeded_rnn_tree_fits_draw_from_the_global_streams(data):
    X, y = data
    untouched = _draws_after(lambda: None)
    est = RNNTreeRegressor(depth=2, num_steps=5)
    assert _draws_after(lambda: est.fit(X, y)) != untouched


@pytest.mark.cuda
def test_vart_on_cuda_leaves_the_cuda_stream_alone(data):
    X, y = data
    untouched = _draws_after(lambda: None, device="cuda")
    est = VaRTRegressor(depth=2, num_steps=20, num_samples=10, random_state=3, device="cuda")
    assert _draws_after(lambda: est.fit(X, y), device="cuda") == untouched
    pred = est.predict(X)
    est._tree_samples = None
    assert _draws_after(lambda: est.predict(X), device="cuda") == untouched
    assert np.array_equal(est.predict(X), pred)
    rnn = RNNTreeRegressor(depth=2, num_steps=5, random_state=3, device="cuda")
    assert _draws_after(lambda: rnn.fit(X, y), device="cuda") == untouched
