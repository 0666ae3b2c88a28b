"""The held-out noise calibration of :class:`~pyro_trees.estimators.VaRTRegressor`: the
rules that turn held-out log densities or coverage scores into one factor on the leaf
noise, and those scores under the Gaussian mixture of the posterior trees (eq. 32).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* R. F. Barber, E. J. Candes, A. Ramdas, R. J. Tibshirani, *Predictive inference with the
  jackknife+*, Annals of Statistics, 2021.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pyro_trees.distributions import compact_mixture_rows as _compact_rows
from pyro_trees.models import row_mixtures as _row_mixtures

__all__ = [
    "SCORE_GRID",
    "NoiseCalibration",
    "coverage_factor",
    "noise_factor_from_curve",
    "noise_factor_from_scores",
]

CALIBRATION_ROWS = 512  # held-out rows used for the noise factor (cost ~ rows x trees x nodes)


def noise_factor_from_curve(grid: torch.Tensor, log_density: torch.Tensor) -> float:
    """The noise factor rule of :class:`~pyro_trees.estimators.VaRTRegressor`
    (``calibrate="likelihood"``): the maximiser :math:`\\hat c` of the held-out log
    density when it is at least one, else :math:`\\min(1, c_+)`, with :math:`c_+` the
    largest grid value with :math:`2(\\ell(\\hat c) - \\ell(c)) \\le 2.71` (the one-sided
    95 % profile likelihood bound).

    :param grid: increasing candidate factors ``(K,)``.
    :param log_density: ``(K,)``.
    """
    best = int(log_density.argmax())
    if grid[best] >= 1.0:
        return float(grid[best])
    inside = (2.0 * (log_density[best] - log_density) <= 2.71) & (grid >= grid[best])
    return min(1.0, float(grid[inside].max()))


def noise_factor_from_scores(
    scores: torch.Tensor, level: float, confidence: float | None = 0.95
) -> float | None:
    """The ``calibrate="coverage"`` rule of
    :class:`~pyro_trees.estimators.VaRTRegressor` from the held-out coverage scores
    :math:`s_j` (the least noise factor from which row :math:`j` lies inside the central
    ``level`` interval; see :meth:`~pyro_trees.estimators.VaRTRegressor.coverage_scores`).

    With the sorted scores :math:`s_{(1)} \\le \\dots \\le s_{(n)}`, a new exchangeable
    row is covered by :math:`s_{(k)}` with probability :math:`k / (n + 1)`. The rule
    takes :math:`\\hat c` at position :math:`p = \\mathrm{level}\\,(n + 1)`, linear in
    :math:`\\log c` between :math:`s_{(\\lfloor p \\rfloor)}` and
    :math:`s_{(\\lceil p \\rceil)}` (the split conformal quantile, interpolated so that
    the expected coverage is the level rather than up to :math:`1/(n+1)` above it), and
    returns :math:`c = \\hat c` when :math:`\\hat c \\ge 1`. Below one, the fitted noise
    is shrunk only as far as the rows make certain, as in
    :func:`noise_factor_from_curve`: :math:`c = \\min(1, s_{(u)})` with
    :math:`s_{(u)}` the one-sided ``confidence`` upper bound of the ``level`` quantile of the scores
    (:math:`u` the least index with :math:`P(\\mathrm{Bin}(n, \\mathrm{level}) < u) \\ge`
    ``confidence``; :math:`c = 1` when :math:`u > n`). With ``confidence=None`` the
    factor is :math:`\\hat c` either way (shrinking on the point estimate; compared with
    the default in ``benchmarks/vart_calibration_rules.py``).

    :param scores: held-out scores ``(n,)`` (``inf`` for a row no factor covers).
    :param float level: the interval's probability, in ``(0, 1)``.
    :param confidence: of the upper bound used when shrinking, or ``None``.
    :returns: the factor, or ``None`` when :math:`p > n` (fewer than
        :math:`\\mathrm{level} / (1 - \\mathrm{level})` rows, e.g. 9 at 0.9).
    """
    s = scores.detach().double().flatten().sort().values.cpu()
    n = int(s.numel())
    pos = level * (n + 1)
    if n == 0 or pos > n + 1e-9:
        return None
    lo = max(int(math.floor(pos + 1e-9)), 1)
    hi = min(lo + 1, n)
    t = min(max(pos - lo, 0.0), 1.0)
    a, b = float(s[lo - 1]), float(s[hi - 1])
    if t == 0.0 or a == b:  # (also keeps 0 * log(inf) out of the interpolation)
        c = a
    elif math.isinf(b):
        c = math.inf
    else:
        c = math.exp((1 - t) * math.log(a) + t * math.log(b))
    if c >= 1.0 or confidence is None:
        return c
    # least u with P(Bin(n, level) <= u - 1) >= confidence
    k = torch.arange(n + 1, dtype=torch.float64)
    cdf = torch.distributions.Binomial(n, probs=torch.tensor(level, dtype=torch.float64))
    cdf = cdf.log_prob(k).exp().cumsum(0)
    u = int((cdf < confidence).sum()) + 1
    return 1.0 if u > n else min(1.0, float(s[u - 1]))


#: the log grid of the coverage scores: log2 of its smallest and largest factor, and its
#: number of points (:meth:`~pyro_trees.estimators.VaRTRegressor.coverage_scores`)
SCORE_GRID = (-6.0, 8.0, 29)


def coverage_factor(
    scores: torch.Tensor, level: float, confidence: float | None = 0.95
) -> float | None:
    """The noise factor of ``calibrate="coverage"``:
    :func:`noise_factor_from_scores` capped at the score grid's largest factor,
    ``2 ** SCORE_GRID[1]`` (a row no factor on the grid covers scores ``inf``).

    :param scores: held-out coverage scores ``(n,)``.
    :param float level: the interval's probability, in ``(0, 1)``.
    :param confidence: of the upper bound used when shrinking, or ``None``.
    :returns: the factor, or ``None`` with too few rows.
    """
    c = noise_factor_from_scores(scores, level, confidence)
    return None if c is None else min(c, 2.0 ** SCORE_GRID[1])


def _coverage_scores(weight: torch.Tensor, z: torch.Tensor, level: float) -> torch.Tensor:
    """Coverage scores of held-out rows under a Gaussian mixture predictive.

    Row :math:`j` with mixture weights :math:`w_{jm}` (summing to one) and standardised
    residuals :math:`z_{jm} = (y_j - \\mu_{jm}) / \\sigma_{jm}` lies inside the central
    ``level`` interval of the predictive with noise scales :math:`c\\,\\sigma_{jm}` iff
    :math:`F_j(c) = \\sum_m w_{jm} \\Phi(z_{jm} / c)` lies in
    :math:`[(1 - \\mathrm{level}) / 2, (1 + \\mathrm{level}) / 2]`. Its score is the least
    factor from which that holds on every factor of a log grid over
    :math:`[2^{-6}, 2^8]` (refined by bisection between grid points): ``2**-6`` when
    covered everywhere, ``inf`` when not covered at :math:`2^8`.

    :param weight: ``(S, n, M)`` weights, summing to one over the first and last dims.
    :param z: ``(S, n, M)`` standardised residuals.
    :returns: ``(n,)`` scores.
    """
    lo, hi = (1.0 - level) / 2.0, (1.0 + level) / 2.0

    def inside(w, zz, c):
        cdf = (w * torch.special.ndtr(zz / c)).sum((0, -1))
        return (cdf >= lo) & (cdf <= hi)

    factors = torch.exp2(torch.linspace(*SCORE_GRID, dtype=z.dtype, device=z.device))
    log_grid = factors.log()
    covered = torch.stack([inside(weight, z, float(c)) for c in factors])  # (K, n)
    k = log_grid.numel()
    outside = ~covered
    last = k - 1 - outside.flip(0).int().argmax(0)  # last grid point not covered
    last = torch.where(outside.any(0), last, torch.full_like(last, -1))
    scores = torch.where(last < 0, factors[0], torch.full_like(factors[0], math.inf))
    scores = scores.expand(last.shape).clone()
    mid = ((last >= 0) & (last < k - 1)).nonzero().flatten()
    if mid.numel():  # bisection between the last uncovered and the next (covered) point
        a, b = log_grid[last[mid]], log_grid[last[mid] + 1]
        w, zz = weight[:, mid], z[:, mid]
        for _ in range(24):
            m = (a + b) / 2
            ok = inside(w, zz, m.exp().unsqueeze(-1))
            a, b = torch.where(ok, a, m), torch.where(ok, m, b)
        scores[mid] = b.exp()
    return scores


def _compact_scores(weight: torch.Tensor, z: torch.Tensor, level: float) -> torch.Tensor:
    """:func:`_coverage_scores` of the rows of ``weight`` and ``z`` ``(S, n, K)``, on the
    components of :func:`_compact_rows`."""
    return _coverage_scores(*(t.unsqueeze(0) for t in _compact_rows(weight, z)), level)


def _fit_means(tree: dict, x: torch.Tensor) -> torch.Tensor:
    """The predictive mean ``(n,)`` of rows ``x`` under the posterior trees ``tree``."""
    logits, loc, _ = _row_mixtures(tree, x)
    return (logits.exp() * loc).sum(-1).mean(0)


def _pool_shaped_mixtures(own: dict, fits: list[dict], batches):
    """``(y, logits, loc, scale)`` of each batch of ``(x, y)`` held-out rows under the
    pool's shape centred at the fit ``own`` that never saw them.

    With the fits' posterior trees ``fits``, their means :math:`m_k(x)` and offsets
    :math:`d_k = m_k - \\bar m`, the mixture is :math:`\\frac1K \\sum_k F(y - d_k(x))`,
    ``own``'s predictive :math:`F` moved by each offset: ``(S, n, K M)`` components
    (:func:`~pyro_trees.models.row_mixtures`'s ``(S, n, M)`` with one fit,
    when it is ``own``'s). It spreads as the pooled predictive does (each fit's spread
    about its mean, and the fits' offsets), but around a mean that never saw the row.
    """
    k = len(fits)
    for xb, yb in batches:
        logits, loc, scale = _row_mixtures(own, xb)
        if k > 1:
            means = torch.stack([_fit_means(f, xb) for f in fits])  # (K, n)
            offsets = (means - means.mean(0)).unsqueeze(-1)  # (K, n, 1)
            logits = (logits - math.log(k)).repeat(1, 1, k)
            loc = torch.cat([loc + d for d in offsets], -1)
            scale = scale.repeat(1, 1, k)
        yield yb, logits, loc, scale


def _held_out_curves(mixtures, level: float, num_samples: int):
    """What both rules of ``calibrate`` read from held-out standardised rows
    under their predictive mixtures at factor-1 noise, ``mixtures`` of ``(y, logits,
    loc, scale)`` (rows ``(n,)``, the rest ``(S, n, M)``, the logits normalised within
    each of the ``S`` trees; :func:`_pool_shaped_mixtures`):

    * ``grid`` ``(109,)``: factors on a log grid over :math:`[1/8, 64]`;
    * ``log_density`` ``(109,)``: :math:`\\ell(c) = \\sum_j \\log \\frac1S
      \\sum_s p(y_j \\mid x_j, T_s, \\Theta_s, c)` at those factors;
    * ``scores`` ``(n,)``: each row's coverage score (:func:`_coverage_scores`) at ``level``.
    """
    grid = torch.logspace(math.log10(0.125), math.log10(64.0), 109, dtype=torch.float64)
    total = torch.zeros_like(grid)
    log_s = math.log(int(num_samples))
    scores = []
    for yb, logits, loc, scale in mixtures:
        z = (yb.double().unsqueeze(-1) - loc) / scale
        # log N(y; loc, (c scale)^2) = base - 0.5 z^2 / c^2 - log c
        base = logits - scale.log() - 0.5 * math.log(2 * math.pi)
        half_z2 = 0.5 * z * z
        for k, c in enumerate(grid.tolist()):
            per_tree = (base - half_z2 / (c * c)).logsumexp(-1) - math.log(c)  # (S, n)
            total[k] += float((per_tree.logsumexp(0) - log_s).sum())
        weight = logits.exp() / logits.shape[0]  # mixture weights over trees and leaves
        scores.append(_compact_scores(weight, z, level))
    return grid, total, torch.cat(scores)


def _mixture_scores(mixtures, level: float) -> torch.Tensor:
    """Coverage scores ``(N,)`` at ``level`` of held-out rows under their mixtures
    (``(y, logits, loc, scale)`` batches, as :func:`_held_out_curves` reads them)."""
    out = []
    for yb, logits, loc, scale in mixtures:
        weight = logits.exp() / logits.shape[0]
        z = (yb.double().unsqueeze(-1) - loc) / scale
        out.append(_compact_scores(weight, z, level))
    return torch.cat(out)


@dataclass(frozen=True)
class NoiseCalibration:
    """The held-out noise calibration rule of :class:`~pyro_trees.estimators.VaRTRegressor`
    (its ``calibrate``, ``calibration_level``, ``min_calibration_rows`` and
    ``refit``): how many folds score rows, and the factor on the leaf noise those
    scores and the held-out log densities give. It reads predictive mixtures and
    scores; the estimator supplies them (its posterior trees, its cross-fitted folds).

    :param rule: ``"coverage"``, ``"likelihood"`` or ``None`` (no calibration).
    :param float level: the interval probability the coverage rule calibrates.
    :param min_rows: score at least this many rows by cross-fitting, or ``None``.
    :param bool refit: whether the fits were refitted (the coverage rule then takes
        the conformal quantile as it is, below one too).
    """

    rule: str | None
    level: float
    min_rows: int | None = None
    refit: bool = False

    @classmethod
    def of(cls, est) -> NoiseCalibration:
        """The rule of an estimator's parameters (``calibrate=True`` is
        ``"likelihood"``, ``False`` is ``None``)."""
        rule = est.calibrate
        rule = "likelihood" if rule is True else None if rule is None or rule is False else rule
        return cls(rule, float(est.calibration_level), est.min_calibration_rows, bool(est.refit))

    def folds(self, n: int, n_val: int) -> int:
        """Folds whose held-out scores set the coverage factor: 1 (the held-out split
        alone) or, with ``min_rows``, enough disjoint splits of ``n_val`` rows for that
        many rows, at most ``n // n_val``."""
        if self.min_rows is None or not n_val or self.rule != "coverage":
            return 1
        return max(1, min(math.ceil(int(self.min_rows) / n_val), n // n_val))

    @torch.no_grad()
    def factor(self, held, extra=(), *, num_samples: int, num_fits: int, ranks):
        """The noise factor :math:`c` and what it was read from.

        Each fit's held-out rows come as their predictive mixtures at factor 1, in the
        pool's shape (``held``: one iterable of ``(y, logits, loc, scale)`` batches per
        fit, :func:`_pool_shaped_mixtures`); ``extra``: the coverage scores of
        cross-fitted folds. The log predictive density :math:`\\ell(c) = \\sum_j \\log
        \\frac1S \\sum_s p(y_j \\mid x_j, T_s, \\Theta_s, c)` on a log grid is summed
        over the fits and ranks, and each row's coverage score (:func:`_coverage_scores`)
        gathered.

        :returns: ``(c, record)``; ``record`` (the estimator's ``noise_calibration_``)
            holds ``grid``, ``log_density``, ``scores``, ``fold_scores``, ``level``,
            ``confidence`` (of the coverage rule's shrinking bound) and ``rule`` (the
            rule that chose the factor: ``"likelihood"`` where the coverage rule had too
            few rows).
        """
        total, scores = 0.0, []
        for mixtures in held:
            grid, curve, s = _held_out_curves(mixtures, self.level, int(num_samples))
            total, scores = total + curve, [*scores, s]
        total, scores = ranks.sum(total), ranks.gather(torch.cat(scores))  # every rank's rows
        pooled = torch.cat([scores.cpu(), *[e.cpu() for e in extra]])
        c_lik = noise_factor_from_curve(grid, total)
        # refit: the rows chose no parameters; a pool: see VaRTRegressor's num_fits
        confidence = None if self.refit or num_fits > 1 else 0.95
        c_cov = coverage_factor(pooled, self.level, confidence)
        rule = self.rule
        if rule == "coverage" and c_cov is None:
            rule = "likelihood"
        record = {
            "grid": grid.cpu().numpy(),
            "log_density": total.cpu().numpy(),
            "scores": scores.cpu().numpy(),
            "fold_scores": [e.cpu().numpy() for e in extra],
            "level": self.level,
            "rule": rule,
            "confidence": confidence,
        }
        return (c_cov if rule == "coverage" else c_lik), record
