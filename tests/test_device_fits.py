"""``benchmarks/device_fits.py`` finds every estimator that fits ``(X, y)`` and times two
fits of one, returning the second fit's predictions."""

from __future__ import annotations

import numpy as np

from benchmarks import device_fits


def test_it_finds_the_estimators_that_fit_x_and_y():
    found = device_fits.estimators()
    assert {"VaRTRegressor", "VaRTForestRegressor", "RNNTreeClassifier"} <= set(found)
    assert "VaRTCausal" not in found  # fits (X, treatment, y)
    assert all(isinstance(cls, type) for cls in found.values())


def test_two_timed_fits_give_times_and_the_second_fits_predictions():
    from pyro_trees.estimators import RNNTreeRegressor

    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 2))
    y = X[:, 0] + 0.1 * rng.normal(size=30)
    record = device_fits.timed_fits(RNNTreeRegressor, X, y, "cpu")
    assert record["first s"] > 0 and record["again s"] > 0
    assert record["pred"].shape == (30,) and np.isfinite(record["pred"]).all()
    np.testing.assert_array_equal(record["pred"], record["estimator"].predict(X))


def test_a_fit_that_fails_is_a_row_saying_so(monkeypatch):
    """One estimator failing on a device names its error in the table; the others and
    the table itself are still written."""
    from pyro_trees.estimators import RNNTreeRegressor

    class Broken(RNNTreeRegressor):
        def fit(self, X, y):
            raise RuntimeError("no kernel image is available for execution on the device")

    written = {}
    monkeypatch.setattr(
        device_fits, "estimators", lambda: {"Broken": Broken, "RNNTreeRegressor": RNNTreeRegressor}
    )
    monkeypatch.setattr(
        device_fits, "write_results", lambda name, payload, md, *a, **k: written.update(md=md)
    )
    device_fits.main(["--rows", "30", "--name", "unused"])
    md = written["md"]
    assert "cpu: RuntimeError: no kernel image is available" in md
    header = next(line for line in md.splitlines() if line.startswith("| estimator"))
    assert "| failed |" in header
    assert "| RNNTreeRegressor | 30 |" in md  # the next estimator still ran
