import numpy as np
import pytest
import torch

from pyro_trees.estimators import (
    BayesianHMERegressor,
    VaRTCausal,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)
from pyro_trees.estimators._base import RENAMED_IN_0_2, Standardizer
from pyro_trees.validation import resolve_device, resolve_dtype

RETIRED = {new: old for old, new in RENAMED_IN_0_2.items()}


def test_standardizer_round_trip_and_unit_spread():
    rng = np.random.default_rng(0)
    values = rng.normal(5.0, 3.0, size=(50, 3)) + 1e12 * np.array([0, 1, 0])
    sc = Standardizer(values)
    z = sc.transform(values)
    # (values near 1e12 carry rounding of about 1e-4 in float64 themselves)
    np.testing.assert_allclose(z.mean(0), 0.0, atol=1e-4)
    np.testing.assert_allclose(z.std(0, ddof=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(sc.inverse(z), values, rtol=1e-12)
    back = sc.inverse(torch.as_tensor(z))
    np.testing.assert_allclose(back.numpy(), values, rtol=1e-12)
    np.testing.assert_allclose(sc.inverse_scale(np.ones(3)), sc.scale)


def test_standardizer_constant_column_keeps_scale_one():
    values = np.column_stack([np.full(10, 7.0), np.arange(10.0)])
    sc = Standardizer(values)
    assert sc.scale[0] == 1.0
    assert np.all(sc.transform(values)[:, 0] == 0.0)
    single = Standardizer(np.array([[2.0, 3.0]]))
    assert np.array_equal(single.scale, [1.0, 1.0])


@pytest.mark.parametrize(
    ("value", "want"),
    [("float32", torch.float32), ("float64", torch.float64), (torch.float64, torch.float64)],
)
def test_resolve_dtype(value, want):
    assert resolve_dtype(value) == want


@pytest.mark.parametrize("value", ["float16", torch.int64, 32, None])
def test_resolve_dtype_rejects_by_name(value):
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype(value)


def test_resolve_device():
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize(
    "make",
    [
        lambda: VaRTRegressor(num_fits=3, kl_weight=0.5, calibrate="likelihood"),
        lambda: VaRTForestRegressor(num_trees=4, num_fits=2),
        lambda: VaRTClassifier(num_fits=2, calibrate=False),
        lambda: BayesianHMERegressor(num_restarts=3, num_cycles=7),
        lambda: VaRTCausal(num_trees=5),
    ],
)
def test_a_pickle_of_version_0_1_loads_under_the_new_names(make):
    """Version 0.1.0 stored n_fits, n_trees, n_restarts, n_iter, calibrate_noise and lam;
    such a state loads with today's names and values (not the defaults)."""
    est = make()
    old = {RETIRED.get(k, k): v for k, v in est.__dict__.items()}
    assert old != est.__dict__
    loaded = type(est).__new__(type(est))
    loaded.__setstate__(old)
    assert loaded.get_params(deep=False) == est.get_params(deep=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda: VaRTRegressor(depth=1, num_steps=20, num_samples=4, random_state=0),
        lambda: VaRTClassifier(depth=1, num_steps=20, num_samples=4, num_fits=1, random_state=0),
        lambda: __import__("pyro_trees.estimators").estimators.RNNTreeRegressor(
            1, num_steps=5, random_state=0
        ),
        lambda: __import__("pyro_trees.estimators").estimators.HeteroscedasticGPRegressor(
            depth=1, num_steps=2, init_steps=2, random_state=0
        ),
    ],
    ids=["VaRTRegressor", "VaRTClassifier", "RNNTreeRegressor", "HeteroscedasticGPRegressor"],
)
def test_export_text_names_the_columns_of_a_fitted_frame(make):
    """``export_text()`` prints the frame's column names by default (``x_0``... after a
    fit on an array); given names win, and a wrong count is an error."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 2))
    signal = np.where(X[:, 0] > 0, 1.0, 0.0)
    est = make()
    y = np.where(signal > 0, "yes", "no") if isinstance(est, VaRTClassifier) else signal
    y = y if isinstance(est, VaRTClassifier) else y + np.where(X[:, 1] > 0, 0.5, 0.0)
    text = est.fit(pd.DataFrame(X, columns=["dose", "age"]), y).export_text()
    assert ("dose" in text or "age" in text) and "x_0" not in text and "x_1" not in text
    given = est.export_text(feature_names=["a", "b"])
    assert "dose" not in given and "age" not in given and ("a " in given or "b " in given)
    with pytest.raises(ValueError, match="names"):
        est.export_text(feature_names=["a"])
    plain = make().fit(X, y).export_text()
    assert "x_0" in plain or "x_1" in plain
