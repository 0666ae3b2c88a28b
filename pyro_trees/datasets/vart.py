"""Causal toy data and IHDP response surfaces of VaRT (Salazar, 2023, Sec. 4.2).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023, eqs. 35-45.
* J. Hill, *Bayesian nonparametric modeling for causal inference*, JCGS 2011.
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_vart_causal_toy", "make_vart_step", "simulate_ihdp_surface"]

_TOY_MEANS = {"partial": (40.0, 20.0), "overlap": (30.0, 40.0)}


def _mu1(x):
    return 90.0 + np.exp(0.06 * x)


def _mu0(x):
    return 72.0 + 3.0 * np.sqrt(np.clip(x, 0.0, None))


_STEP_EDGES = (-1.0, 0.0, 1.0)
_STEP_LEVELS = (-1.0, 1.0, 0.0, 2.0)


def step_function(x):
    """The step function of :func:`make_vart_step`: ``-1, 1, 0, 2`` on the intervals
    ``(-inf, -1), [-1, 0), [0, 1), [1, inf)``."""
    return np.asarray(_STEP_LEVELS)[np.searchsorted(_STEP_EDGES, np.asarray(x), side="right")]


def make_vart_step(n: int = 100, noise: float = 0.1, spread: float = 0.15, random_state=None):
    r"""The piecewise-constant toy of the paper's Figure A.

    Inputs come from a uniform mixture of Gaussians centred on the midpoints
    ``-1.5, -0.5, 0.5, 1.5`` of the four intervals of :func:`step_function` (standard
    deviation ``spread``); :math:`y = f(x) + \varepsilon`, :math:`\varepsilon \sim
    \mathcal N(0, \text{noise}^2)`. The paper shows the posterior on 100 and 1,000
    points concentrating on the steps.

    :returns: dict with ``X`` ``(n, 1)``, ``y`` ``(n,)``, ``f`` ``(n,)`` (the step
        function at ``X``) and the callable ``step``.
    """
    if int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(random_state)
    mids = np.array([-1.5, -0.5, 0.5, 1.5])
    x = mids[rng.integers(4, size=int(n))] + spread * rng.normal(size=int(n))
    f = step_function(x)
    y = f + noise * rng.normal(size=int(n))
    return {"X": x[:, None], "y": y, "f": f, "step": step_function}


def make_vart_causal_toy(n: int = 120, setting: str = "partial", random_state=None) -> dict:
    """The one-covariate toy data of eqs. 35-37.

    .. math::
        A \\sim \\mathrm{Bernoulli}(0.5),\\quad X \\mid A=a \\sim \\mathcal N(\\mu_a, 10^2),
        \\quad Y \\mid A=1, X \\sim \\mathcal N(90 + e^{0.06X}, 1),\\quad
        Y \\mid A=0, X \\sim \\mathcal N(72 + 3\\sqrt{X}, 1).

    ``setting="partial"`` (partially overlapping, as in Hill, 2011) uses
    :math:`(\\mu_1, \\mu_0) = (40, 20)`; ``"overlap"`` uses :math:`(30, 40)`. The square
    root of the control surface follows Hill (2011) (the paper's text lost the radical);
    :math:`\\sqrt{X}` is taken of :math:`\\max(X, 0)`.

    :returns: dict with ``X`` ``(n, 1)``, ``A`` ``(n,)`` in {0, 1}, ``y`` ``(n,)``,
        ``mu0``/``mu1`` (the true conditional means at ``X``), and the callables
        ``f0``/``f1`` of the true response surfaces.
    """
    if setting not in _TOY_MEANS:
        raise ValueError(f"setting must be one of {sorted(_TOY_MEANS)}, got {setting!r}")
    if int(n) < 2:
        raise ValueError(f"n must be >= 2, got {n}")
    rng = np.random.default_rng(random_state)
    m1, m0 = _TOY_MEANS[setting]
    a = rng.binomial(1, 0.5, size=int(n))
    x = np.where(a == 1, rng.normal(m1, 10.0, size=n), rng.normal(m0, 10.0, size=n))
    mu1, mu0 = _mu1(x), _mu0(x)
    y = np.where(a == 1, mu1, mu0) + rng.normal(size=n)
    return {"X": x[:, None], "A": a, "y": y, "mu0": mu0, "mu1": mu1, "f0": _mu0, "f1": _mu1}


def simulate_ihdp_surface(X, A, surface: str = "linear", random_state=None) -> dict:
    """Hill's (2011) response surfaces on the IHDP covariates, as in eqs. 38-45.

    * ``"linear"``: :math:`\\beta_j \\in \\{0,1,2,3,4\\}` with probabilities
      :math:`(.5,.2,.15,.1,.05)`; :math:`Y(0) \\sim \\mathcal N(X\\beta, 1)`,
      :math:`Y(1) \\sim \\mathcal N(X\\beta + 4, 1)`.
    * ``"nonlinear"``: :math:`\\beta_j \\in \\{0,.1,.2,.3,.4\\}` with probabilities
      :math:`(.6,.1,.1,.1,.1)`; :math:`Y(0) \\sim \\mathcal N(\\exp(X\\beta + 1/2), 1)`,
      :math:`Y(1) \\sim \\mathcal N(X\\beta - \\omega, 1)` with the constant :math:`\\omega`
      chosen so that the sample average treatment effect of the noiseless surfaces is
      exactly 4 (the paper states "the CATE equals 4", which no constant :math:`\\omega`
      achieves for this pair of surfaces; Hill fixes the effect on the treated instead).

    :param X: covariates ``(N, 25)`` (binary columns coded 0/1).
    :param A: treatment indicators ``(N,)``.
    :returns: dict with ``y`` (observed), ``y0``/``y1`` (noisy potential outcomes),
        ``mu0``/``mu1`` (noiseless surfaces), ``ate`` (true sample ATE) and ``beta``.
    """
    X = np.asarray(X, dtype=float)
    A = np.asarray(A).astype(int).ravel()
    if X.ndim != 2 or X.shape[0] != A.shape[0]:
        raise ValueError(f"X must be (N, L) with N matching A; got X {X.shape} and A {A.shape}")
    if not np.isfinite(X).all():
        raise ValueError("X contains NaN or infinite values")
    rng = np.random.default_rng(random_state)
    L = X.shape[1]
    if surface == "linear":
        beta = rng.choice([0.0, 1.0, 2.0, 3.0, 4.0], size=L, p=[0.5, 0.2, 0.15, 0.1, 0.05])
        mu0 = X @ beta
        mu1 = mu0 + 4.0
    elif surface == "nonlinear":
        beta = rng.choice([0.0, 0.1, 0.2, 0.3, 0.4], size=L, p=[0.6, 0.1, 0.1, 0.1, 0.1])
        lin = X @ beta
        mu0 = np.exp(lin + 0.5)
        omega = np.mean(lin - mu0) - 4.0
        mu1 = lin - omega
    else:
        raise ValueError(f"surface must be 'linear' or 'nonlinear', got {surface!r}")
    y0 = mu0 + rng.normal(size=X.shape[0])
    y1 = mu1 + rng.normal(size=X.shape[0])
    return {
        "y": np.where(A == 1, y1, y0),
        "y0": y0,
        "y1": y1,
        "mu0": mu0,
        "mu1": mu1,
        "ate": float(np.mean(mu1 - mu0)),
        "beta": beta,
    }
