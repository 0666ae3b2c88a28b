"""Synthetic tasks of Antorán et al. (Appendix F): eight-level pulse, binary parity, noise;
and random step functions of the pulse's kind that the paper does not use
(:func:`make_steps`), a check that a fit does not lean on the pulse itself.

All generators return NumPy arrays; the random ones draw from
``numpy.random.default_rng(random_state)`` and are deterministic for a given seed.

**References**

[1] J. Antorán, J. Yao, W. Pan, J. M. Hernández-Lobato, F. Doshi-Velez,
*Amortised Variational Inference for Hierarchical Mixture Models*, Appendix F.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "NOISE_LOG_SIGMA_LEVELS",
    "PULSE_LEVELS",
    "make_noise_task",
    "make_parity",
    "make_pulse",
    "make_steps",
    "noise_log_sigma",
    "noise_task_mean",
    "parity_test_set",
    "pulse_function",
]

#: Pulse height on ``[-4, -3), [-3, -2), ..., [3, 4]`` (F.1).
PULSE_LEVELS = (1.0, 4.0, 2.5, 5.0, 1.5, 3.5, 0.5, 2.5)
_PULSE_EDGES = np.arange(-3.0, 4.0)  # -3, -2, ..., 3

#: ``log sigma`` on ``[-2, -5/4), [-5/4, -1/2), [-1/2, 1/4), [1/4, 1]`` (F.3).
NOISE_LOG_SIGMA_LEVELS = (0.0, 2.0 / 3.0, 2.0, 10.0 / 3.0)
_NOISE_EDGES = np.array([-5.0 / 4.0, -1.0 / 2.0, 1.0 / 4.0])


def _check_count(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


def _check_domain(x, low: float, high: float, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    bad = ~((x >= low) & (x <= high))  # also catches NaN
    if bad.any():
        raise ValueError(
            f"{name} is defined on [{low}, {high}]; got {int(bad.sum())} value(s) outside "
            f"it or NaN, first {x[bad].flat[0]!r}"
        )
    return x


def _step(x: np.ndarray, edges: np.ndarray, levels) -> np.ndarray:
    # side="right": a point on an edge belongs to the region to its right (closed left end).
    return np.asarray(levels, dtype=np.float64)[np.searchsorted(edges, x, side="right")]


def pulse_function(x) -> np.ndarray:
    """The eight-level pulse of F.1: unit-width steps on ``[-4, 4]``.

    :param x: array of any shape with values in ``[-4, 4]``.
    :returns: float64 array of the same shape with values from
        :data:`~pyro_trees.datasets.hme.PULSE_LEVELS`.
    """
    return _step(_check_domain(x, -4.0, 4.0, "pulse_function"), _PULSE_EDGES, PULSE_LEVELS)


def make_pulse(n: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """The eight-level pulse regression task (F.1): ``n`` uniformly spaced inputs.

    :param int n: number of points, spaced uniformly on ``[-4, 4]`` (ends included).
    :returns: ``X`` of shape ``(n, 1)`` and noise-free targets ``y`` of shape ``(n,)``.
    """
    n = _check_count(n, "n", 2)
    x = np.linspace(-4.0, 4.0, n)
    return x[:, None], pulse_function(x)


def make_steps(
    n: int = 400, levels: int = 8, noise: float = 0.1, random_state=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random step function of the pulse's kind, on inputs drawn at random (not in F.1).

    ``levels`` equal-width steps on ``[0, 1]`` whose heights are ``0, 0.5, ...,
    0.5 (levels - 1)`` in a random order that is neither increasing nor decreasing;
    ``x ~ U(0, 1)``, ``y = f(x) + noise * eps``, ``eps ~ N(0, 1)``. Unlike the pulse, the
    inputs are not evenly spaced, so the balanced start's median cuts miss the edges.

    :param int n: number of points.
    :param int levels: number of steps, ``>= 3``.
    :param float noise: noise standard deviation, ``>= 0``.
    :param random_state: seed or ``numpy.random.Generator``.
    :returns: ``X`` of shape ``(n, 1)``, ``y`` of shape ``(n,)`` and the noise-free
        ``f(x)`` of shape ``(n,)``.
    """
    n = _check_count(n, "n", 2)
    levels = _check_count(levels, "levels", 3)
    noise = float(noise)
    if not np.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0; got {noise}")
    rng = np.random.default_rng(random_state)
    heights = rng.permutation(0.5 * np.arange(levels))
    while np.all(np.diff(heights) > 0) or np.all(np.diff(heights) < 0):
        heights = rng.permutation(heights)
    x = rng.uniform(0.0, 1.0, n)
    f = heights[np.minimum((x * levels).astype(np.int64), levels - 1)]
    y = f + noise * rng.standard_normal(n)
    return x[:, None], y, f


def _parity_labels(b: np.ndarray) -> np.ndarray:
    return (b.sum(axis=-1) % 2 == 0).astype(np.int64)


def make_parity(
    n: int = 3000, bits: int = 8, sigma: float = 0.0, random_state=None
) -> tuple[np.ndarray, np.ndarray]:
    """The binary parity task (F.2): ``x = b + eps`` with ``b ~ Bern(0.5)^bits``.

    The label is 1 when ``b`` has an even number of active bits, else 0; it is computed
    from ``b`` before the noise ``eps ~ N(0, sigma^2)`` (``sigma`` is a standard deviation)
    is added. The bits are drawn before the noise, so a seed gives the same ``b`` and
    labels for every ``sigma``.

    :param int n: number of samples.
    :param int bits: input dimension.
    :param float sigma: noise standard deviation, ``>= 0`` (the paper varies it in [0, 0.9]).
    :param random_state: seed or ``numpy.random.Generator``.
    :returns: ``X`` of shape ``(n, bits)`` float64 and ``y`` of shape ``(n,)`` int64.
    """
    n = _check_count(n, "n")
    bits = _check_count(bits, "bits")
    sigma = float(sigma)
    if not np.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a finite number >= 0; got {sigma}")
    rng = np.random.default_rng(random_state)
    b = rng.integers(0, 2, size=(n, bits))
    X = b + sigma * rng.standard_normal((n, bits))
    return X, _parity_labels(b)


def parity_test_set(bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """All ``2**bits`` noise-free bit patterns with their parity labels (F.2's test set).

    Row ``i`` holds the binary digits of ``i``, most significant first.

    :returns: ``X`` of shape ``(2**bits, bits)`` float64 and ``y`` of shape ``(2**bits,)``
        int64 (1 for an even number of ones).
    """
    bits = _check_count(bits, "bits")
    if bits > 24:
        raise ValueError(f"bits must be <= 24 (2**bits rows); got {bits}")
    shifts = np.arange(bits - 1, -1, -1)
    b = (np.arange(2**bits)[:, None] >> shifts) & 1
    return b.astype(np.float64), _parity_labels(b)


def noise_log_sigma(x) -> np.ndarray:
    """The true noise level of F.3: ``log sigma``, a four-step function on ``[-2, 1]``.

    :param x: array of any shape with values in ``[-2, 1]``.
    :returns: float64 array of the same shape with values from
        :data:`~pyro_trees.datasets.hme.NOISE_LOG_SIGMA_LEVELS` (0, 2/3, 2, 10/3).
    """
    x = _check_domain(x, -2.0, 1.0, "noise_log_sigma")
    return _step(x, _NOISE_EDGES, NOISE_LOG_SIGMA_LEVELS)


def noise_task_mean(x) -> np.ndarray:
    """The mean function of F.3, ``f(x) = -x**3 + x**2``."""
    x = np.asarray(x, dtype=np.float64)
    return -(x**3) + x**2


def make_noise_task(n: int = 1200, random_state=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The heteroscedastic noise-estimation task (F.3).

    ``y = f(x) + eps``, ``f(x) = -x**3 + x**2``, ``eps ~ N(0, sigma(x)**2)`` with
    ``log sigma(x)`` from :func:`noise_log_sigma`, on ``n`` uniformly spaced ``x`` in
    ``[-2, 1]``.

    :param int n: number of points.
    :param random_state: seed or ``numpy.random.Generator``.
    :returns: ``X`` of shape ``(n, 1)``, ``y`` of shape ``(n,)`` and the true
        ``log sigma`` at each point, shape ``(n,)``.
    """
    n = _check_count(n, "n", 2)
    x = np.linspace(-2.0, 1.0, n)
    log_sigma = noise_log_sigma(x)
    rng = np.random.default_rng(random_state)
    y = noise_task_mean(x) + np.exp(log_sigma) * rng.standard_normal(n)
    return x[:, None], y, log_sigma
