import numpy as np
import pytest
import torch

from pyro_trees.estimators._base import Standardizer
from pyro_trees.validation import resolve_device, resolve_dtype


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
