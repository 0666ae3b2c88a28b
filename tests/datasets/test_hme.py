import itertools

import numpy as np
import pytest

from pyro_trees.datasets import (
    NOISE_LOG_SIGMA_LEVELS,
    PULSE_LEVELS,
    make_noise_task,
    make_parity,
    make_pulse,
    make_steps,
    noise_log_sigma,
    noise_task_mean,
    parity_test_set,
    pulse_function,
)


def test_pulse_values_at_region_midpoints():
    mids = np.arange(-3.5, 4.0, 1.0)
    np.testing.assert_array_equal(pulse_function(mids), [1, 4, 2.5, 5, 1.5, 3.5, 0.5, 2.5])
    # Left ends are closed, the right end of the last region too.
    edges = np.arange(-4.0, 5.0)
    np.testing.assert_array_equal(pulse_function(edges), list(PULSE_LEVELS) + [2.5])


def test_make_pulse():
    X, y = make_pulse()
    assert X.shape == (400, 1) and y.shape == (400,)
    assert X.dtype == y.dtype == np.float64
    assert X[0, 0] == -4.0 and X[-1, 0] == 4.0
    np.testing.assert_allclose(np.diff(X[:, 0]), 8 / 399)
    # Eight regions, each with its level; levels 1 and 7 share the value 2.5.
    region = np.minimum(np.floor(X[:, 0] + 4), 7).astype(int)
    assert np.array_equal(np.unique(region), np.arange(8))
    for r in range(8):
        assert np.all(y[region == r] == PULSE_LEVELS[r])
    assert len(set(PULSE_LEVELS)) == 7 and len(set(y.tolist())) == 7
    assert make_pulse(17)[0].shape == (17, 1)


def test_pulse_bad_input():
    with pytest.raises(ValueError, match=r"\[-4.0, 4.0\]"):
        pulse_function([0.0, 4.5])
    with pytest.raises(ValueError, match="NaN"):
        pulse_function(np.nan)
    with pytest.raises(ValueError, match="n must be"):
        make_pulse(1)


@pytest.mark.parametrize("sigma", [0.0, 0.3])
def test_parity_labels_brute_force(sigma):
    X, y = make_parity(500, bits=6, sigma=sigma, random_state=1)
    assert X.shape == (500, 6) and y.shape == (500,) and y.dtype == np.int64
    b = make_parity(500, bits=6, sigma=0.0, random_state=1)[0].astype(int)
    assert np.isin(b, (0, 1)).all()
    for bits_row, label in zip(b, y, strict=True):
        ones = sum(int(v) for v in bits_row)
        assert label == (1 if ones % 2 == 0 else 0)
    if sigma == 0.0:
        assert np.array_equal(X, b)
    else:
        noise = X - b
        assert abs(noise.std() - sigma) < 0.03 and abs(noise.mean()) < 0.03


def test_parity_deterministic():
    a = make_parity(100, random_state=7)
    b = make_parity(100, random_state=7)
    c = make_parity(100, random_state=8)
    assert all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    X, y = make_parity(random_state=0)
    assert X.shape == (3000, 8) and 0.4 < y.mean() < 0.6


def test_parity_test_set():
    X, y = parity_test_set(8)
    assert X.shape == (256, 8) and y.shape == (256,)
    patterns = list(itertools.product((0, 1), repeat=8))
    assert np.array_equal(X, np.array(patterns, dtype=float))
    assert np.array_equal(y, [int(sum(p) % 2 == 0) for p in patterns])
    assert parity_test_set(3)[1].tolist() == [1, 0, 0, 1, 0, 1, 1, 0]


def test_parity_bad_input():
    with pytest.raises(ValueError, match="sigma"):
        make_parity(sigma=-0.1)
    with pytest.raises(ValueError, match="bits"):
        make_parity(bits=0)
    with pytest.raises(ValueError, match="bits must be <= 24"):
        parity_test_set(30)


def test_noise_log_sigma_steps():
    x = np.array([-2.0, -1.5, -1.25, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0])
    expected = [0, 0, 2 / 3, 2 / 3, 2, 2, 10 / 3, 10 / 3, 10 / 3]
    np.testing.assert_allclose(noise_log_sigma(x), expected)
    assert NOISE_LOG_SIGMA_LEVELS == (0.0, 2 / 3, 2.0, 10 / 3)
    with pytest.raises(ValueError, match="noise_log_sigma"):
        noise_log_sigma(1.5)


def test_make_noise_task():
    X, y, log_sigma = make_noise_task(random_state=0)
    assert X.shape == (1200, 1) and y.shape == log_sigma.shape == (1200,)
    assert X[0, 0] == -2.0 and X[-1, 0] == 1.0
    np.testing.assert_array_equal(log_sigma, noise_log_sigma(X[:, 0]))
    z = (y - noise_task_mean(X[:, 0])) / np.exp(log_sigma)
    # Standardised residuals are N(0, 1) in every step.
    for level in NOISE_LOG_SIGMA_LEVELS:
        zs = z[log_sigma == level]
        assert len(zs) > 200
        assert abs(zs.mean()) < 0.25 and 0.8 < zs.std() < 1.2
    assert np.array_equal(make_noise_task(random_state=0)[1], y)
    assert not np.array_equal(make_noise_task(random_state=1)[1], y)
    np.testing.assert_allclose(noise_task_mean([0.0, 1.0, -1.0, 2.0]), [0, 0, 2, -4])


def test_make_steps():
    X, y, f = make_steps(400, random_state=0)
    assert X.shape == (400, 1) and y.shape == f.shape == (400,)
    assert X.min() >= 0 and X.max() <= 1
    region = np.minimum((X[:, 0] * 8).astype(int), 7)
    heights = np.array([f[region == r][0] for r in range(8)])
    for r in range(8):  # one height per equal-width step
        assert np.all(f[region == r] == heights[r])
    np.testing.assert_array_equal(np.sort(heights), 0.5 * np.arange(8))
    for seed in range(20):  # never monotone
        h = make_steps(200, levels=4, random_state=seed)
        steps = np.diff(
            [h[2][np.minimum((h[0][:, 0] * 4).astype(int), 3) == r][0] for r in range(4)]
        )
        assert (steps > 0).any() and (steps < 0).any()
    assert 0.08 < np.std(y - f) < 0.12  # noise sd 0.1
    assert np.array_equal(make_steps(400, random_state=0)[1], y)
    np.testing.assert_array_equal(
        make_steps(50, noise=0.0, random_state=3)[1], make_steps(50, noise=0.0, random_state=3)[2]
    )
    with pytest.raises(ValueError, match="levels"):
        make_steps(levels=2)
    with pytest.raises(ValueError, match="noise"):
        make_steps(noise=-1.0)
