"""``VaRTRegressor``: scikit-learn style variational regression tree with Bayesian intervals.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
"""

from __future__ import annotations

import math

import numpy as np
import pyro
import torch
import torch.nn.functional as F
from pyro.infer import Predictive, Trace_ELBO
from sklearn.base import RegressorMixin
from sklearn.utils.validation import check_is_fitted

from pyro_trees import trees
from pyro_trees.estimators._base import TabularEstimator
from pyro_trees.estimators._rng import local_seed
from pyro_trees.guides.vart import (
    TemperatureSchedule,
    VaRTGuide,
    _guide_param_count,
    _require_memory,
)
from pyro_trees.infer.fit import fit
from pyro_trees.infer.vart_elbo import VaRTELBO
from pyro_trees.models.vart import VaRT, mixture_params, with_bias
from pyro_trees.validation import check_level

__all__ = ["VaRTRegressor", "noise_factor_from_curve", "noise_factor_from_scores"]

_PREDICT_BYTES = 256 * 2**20  # memory for one prediction batch
_CALIBRATION_ROWS = 512  # held-out rows used for the noise factor (cost ~ rows x trees x nodes)
_REFIT_SEED = 104729  # refit=True: offset of the fresh fit's seed from ``seed_``
_ROW_BYTES_PER_NODE = 6 * 8  # per tree and row: the double mixture tensors of one row
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _check_training_memory(depth, batch: int, in_features: int, device) -> int:
    """Training: ``(batch, 2**(D+1))`` routing and means with their gradients (about 12
    float copies of ``(batch, 2**D, 2)``: :func:`~pyro_trees.trees.check_depth`, which
    also validates ``depth``), and the guide's parameters with their gradients,
    ClippedAdam's two moments and one draw (five copies).

    :returns: ``depth`` as an ``int``.
    """
    depth = trees.check_depth(depth, batch, width=2, device=device, copies=12)
    need = 4.0 * (12 * batch * 2 ** (depth + 1) + 5 * _guide_param_count(depth, in_features))
    _require_memory(
        depth,
        need,
        f"training on {batch:,} rows at a time with {in_features:,} inputs",
        "a smaller depth or batch_size",
        device,
    )
    return depth


def _check_prediction_memory(depth: int, num_samples: int, in_features: int, device) -> None:
    """Prediction: the ``num_samples`` posterior trees (split indicators, split and leaf
    weights and noise scales of every node, about ``2**D (3 (L + 1) + 4)`` floats
    each) held in about four copies while they are drawn and stacked, and the mixture
    tensors of one row (``num_samples * 2**(D+1) * 48`` bytes; larger inputs are
    processed in batches within a fixed budget)."""
    per_tree = 2**depth * (3 * (in_features + 1) + 4)
    need = num_samples * (4.0 * 4 * per_tree + _ROW_BYTES_PER_NODE * 2 ** (depth + 1))
    _require_memory(
        depth,
        need,
        f"prediction with num_samples={num_samples:,} posterior trees of {in_features:,} inputs",
        "a smaller depth or num_samples",
        device,
    )


def noise_factor_from_curve(grid: torch.Tensor, log_density: torch.Tensor) -> float:
    """The noise factor rule of :class:`VaRTRegressor` (``calibrate_noise``): the
    maximiser :math:`\\hat c` of the held-out log density when it is at least one, else
    :math:`\\min(1, c_+)`, with :math:`c_+` the largest grid value with
    :math:`2(\\ell(\\hat c) - \\ell(c)) \\le 2.71` (the one-sided 95 % profile likelihood
    bound).

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
    """The ``calibrate_noise="coverage"`` rule of :class:`VaRTRegressor` from the
    held-out coverage scores :math:`s_j` (the least noise factor from which row
    :math:`j` lies inside the central ``level`` interval; see
    :meth:`~pyro_trees.estimators.VaRTRegressor.coverage_scores`).

    With the sorted scores :math:`s_{(1)} \\le \\dots \\le s_{(n)}`, a new exchangeable
    row is covered by :math:`s_{(k)}` with probability :math:`k / (n + 1)`. The rule
    takes :math:`\\hat c` at position :math:`p = \\mathrm{level}\\,(n + 1)`, linear in
    :math:`\\log c` between :math:`s_{(\\lfloor p \\rfloor)}` and
    :math:`s_{(\\lceil p \\rceil)}` (the split conformal quantile, interpolated so that
    the expected coverage is the level rather than up to :math:`1/(n+1)` above it), and
    returns :math:`c = \\hat c` when :math:`\\hat c \\ge 1`. Below one, the fitted noise
    is shrunk only as far as the rows make certain, as in
    :func:`~pyro_trees.estimators.vart.noise_factor_from_curve`: :math:`c = \\min(1, s_{(u)})` with
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


_SCORE_GRID = (-6.0, 8.0, 29)  # log2 of the smallest and largest factor, grid points


def _coverage_factor(scores: torch.Tensor, level: float, confidence: float | None = 0.95):
    """:func:`noise_factor_from_scores` capped at the score grid's largest factor (a
    row no factor on the grid covers scores ``inf``); ``None`` with too few rows."""
    c = noise_factor_from_scores(scores, level, confidence)
    return None if c is None else min(c, 2.0 ** _SCORE_GRID[1])


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

    factors = torch.exp2(torch.linspace(*_SCORE_GRID, dtype=z.dtype, device=z.device))
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


def _row_mixtures(leaf: dict, x: torch.Tensor):
    """The predictive mixtures of rows ``x`` ``(n, L)`` under the trees of
    :func:`_leaf_tree`, in double precision: log leaf weights normalised within each
    tree, means and scales, each ``(S, n, K)``. Over trees and leaves together the
    weights are ``exp(log_w) / S``."""
    logits, loc, log_scale = _leaf_mixtures(leaf, x)
    logits, loc = logits.double(), loc.double()
    scale = log_scale.double().exp().expand_as(loc)
    return logits - logits.logsumexp(-1, keepdim=True), loc, scale


def _stack_trees(samples: dict, depth: int) -> dict:
    """The guide's posterior draws (sites ``split_d``, ``beta_d``, ``theta_d``,
    ``log_sigma_d``, leading dimension ``S``) in the format of
    :meth:`~pyro_trees.models.VaRT.sample_tree` with batch shape ``(S,)``."""
    num = samples["split_0"].shape[0]
    width = samples["theta_0"].shape[-1]
    split = [samples[f"split_{d}"].reshape(num, -1) for d in range(depth + 1)]
    log_exist = [split[0].new_zeros(num, 1)]
    for d in range(depth):
        log_exist.append((log_exist[-1] + split[d].log()).repeat_interleave(2, dim=-1))
    return {
        "split": torch.cat(split, -1),
        "log_exist": torch.cat(log_exist, -1),
        "beta": torch.cat([samples[f"beta_{d}"].reshape(num, -1, width) for d in range(depth)], -2),
        "theta": torch.cat(
            [samples[f"theta_{d}"].reshape(num, -1, width) for d in range(depth + 1)], -2
        ),
        "log_sigma": torch.cat(
            [samples[f"log_sigma_{d}"].reshape(num, -1) for d in range(depth + 1)], -1
        ),
    }


def _leaf_tree(tree: dict) -> dict:
    """The stacked trees of :func:`_stack_trees` cut to the nodes that are a leaf of at
    least one of them: ``keep`` ``(K,)`` their heap positions, ``log_kappa`` ``(S, K)``
    (``-inf`` where a node is no leaf of that tree), ``theta`` ``(S, K, L + 1)`` and
    ``log_sigma`` ``(S, K)``; ``beta`` ``(S, 2**D - 1, L + 1)`` as before. The other nodes
    have mixture weight zero in every tree."""
    log_kappa = tree["log_exist"] + torch.log1p(-tree["split"])
    keep = (log_kappa > -math.inf).any(0).nonzero().flatten()
    return {
        "keep": keep,
        "log_kappa": log_kappa[:, keep],
        "beta": tree["beta"],
        "theta": tree["theta"][:, keep],
        "log_sigma": tree["log_sigma"][:, keep],
    }


def _leaf_mixtures(leaf: dict, x: torch.Tensor):
    """The mixtures of eq. 27 for rows ``x`` ``(n, L)`` under the trees of
    :func:`_leaf_tree`, over their ``K`` leaf nodes: unnormalised logits, means and
    log scales ``(S, n, K)`` (the values :func:`~pyro_trees.models.vart.mixture_params`
    gives at those nodes; its other nodes have weight zero).

    The routing is computed top-down, level by level: a node's log reach is its
    parent's plus ``logsigmoid(beta^T x)`` (left child) or ``logsigmoid(-beta^T x)``."""
    x1 = with_bias(x)
    beta = leaf["beta"]
    num, n = leaf["log_kappa"].shape[0], x1.shape[0]
    levels = [x1.new_zeros(num, n, 1)]
    if beta is not None and beta.shape[-2] > 0:
        u = torch.matmul(x1, beta.transpose(-1, -2))  # (S, n, 2**D - 1): beta^T x
        depth = (beta.shape[-2] + 1).bit_length() - 1
        for d in range(depth):
            ud = u[..., (1 << d) - 1 : (1 << (d + 1)) - 1]
            pair = torch.stack([F.logsigmoid(ud), F.logsigmoid(-ud)], -1) + levels[-1].unsqueeze(-1)
            levels.append(pair.flatten(-2))
    log_reach = torch.cat(levels, -1)[..., leaf["keep"]]
    logits = leaf["log_kappa"].unsqueeze(-2) + log_reach
    means = torch.matmul(x1, leaf["theta"].transpose(-1, -2))
    return logits, means, leaf["log_sigma"].unsqueeze(-2)


def _compact_rows(weight: torch.Tensor, *others: torch.Tensor, tol: float = 1e-12):
    """Per-row Gaussian mixtures ``(S, n, K)`` laid out as ``(n, C)``: every component of
    weight at least ``tol / (S K)`` (so that the weight dropped from a row is at most
    ``tol``), packed to the left in their original order, ``C`` the most any row keeps.
    The padding has weight zero and ``others`` one there (finite, positive scales).
    ``others`` ``(S, n, K)`` are gathered alike."""
    num, n, k = weight.shape
    flat = [t.permute(1, 0, 2).reshape(n, num * k) for t in (weight, *others)]
    kept = flat[0] >= tol / (num * k)
    pos = kept.cumsum(-1)
    width = max(int(pos[:, -1].max()), 1)
    index = torch.where(kept, pos - 1, width)  # dropped components go to a spare column
    out = []
    for j, t in enumerate(flat):
        packed = t.new_full((n, width + 1), 0.0 if j == 0 else 1.0)
        out.append(packed.scatter_(-1, index, t)[:, :width])
    return tuple(out)


def _compact_scores(weight: torch.Tensor, z: torch.Tensor, level: float) -> torch.Tensor:
    """:func:`_coverage_scores` of the rows of ``weight`` and ``z`` ``(S, n, K)``, on the
    components of :func:`_compact_rows`."""
    return _coverage_scores(*(t.unsqueeze(0) for t in _compact_rows(weight, z)), level)


def _ndtr(z: torch.Tensor) -> torch.Tensor:
    """The standard normal CDF as ``erfc(-z / sqrt 2) / 2`` (the same function as
    ``torch.special.ndtr``, several times faster on CPU)."""
    return 0.5 * torch.special.erfc(z * -_SQRT_HALF)


def _newton_quantiles(weight, w_pdf, loc, inv, q, a, b, p: float, tol: float, iters: int):
    """Safeguarded Newton steps for the ``p``-quantiles of the row mixtures of
    :func:`_row_mixture_quantiles` (``inv`` the reciprocal scales, ``w_pdf`` the
    weights over ``sqrt(2 pi)`` times ``inv``), from ``q`` ``(n,)`` inside brackets
    ``[a, b]`` with CDF below and above ``p``; each row stops once its CDF is within
    ``tol`` of ``p`` or its bracket is a few ulps wide, and only the other rows are
    evaluated further."""
    result = q.clone()
    rows = torch.arange(q.shape[0], device=q.device)
    eps = 4 * torch.finfo(q.dtype).eps
    # |z| beyond 8 (single) or 30 (double) changes a CDF by under 1e-15 or 1e-197 of
    # its weight; clamping keeps subnormal numbers (slow on CPUs) out of the sums
    bound = 8.0 if q.dtype == torch.float32 else 30.0
    for _ in range(iters):
        z = (q.unsqueeze(-1) - loc).mul_(inv).clamp_(-bound, bound)
        cdf = torch.linalg.vecdot(weight, _ndtr(z))
        pdf = torch.linalg.vecdot(w_pdf, z.square_().mul_(-0.5).exp_())
        err = cdf - p
        below = err < 0
        a, b = torch.where(below, q, a), torch.where(below, b, q)
        step = q - err / pdf
        new = torch.where((step > a) & (step < b), step, (a + b) / 2)
        done = (err.abs() <= tol) | (b - a <= eps * q.abs())
        result[rows] = torch.where(done, q, new)
        if bool(done.all()):
            break
        live = (~done).nonzero().flatten()
        rows, a, b, q = rows[live], a[live], b[live], new[live]
        weight, w_pdf, loc, inv = weight[live], w_pdf[live], loc[live], inv[live]
    return result


def _row_mixture_quantiles(
    weight: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    probs,
    tol: float = 1e-12,
    iters: int = 100,
) -> torch.Tensor:
    """Quantiles of one Gaussian mixture per row: the ``q`` with
    :math:`\\sum_k w_{jk} \\Phi((q - \\mu_{jk}) / \\sigma_{jk}) = p`.

    Safeguarded Newton steps on the CDF, kept inside the bracket of the components' own
    ``p``-quantiles (the mixture's lies between their least and greatest), which
    bisection shrinks whenever a Newton step would leave it; only the rows not yet
    converged are evaluated. The steps start at the quantile of the Gaussian with the
    mixture's mean and variance and run in single precision until the CDF is within
    ``1e-5`` of ``p`` (for double inputs), then in the inputs' precision from there
    (one or two steps) until it is within ``tol``.

    :param weight: ``(n, C)`` weights summing to one per row (zero: padding).
    :param loc: ``(n, C)`` means.
    :param scale: ``(n, C)`` standard deviations (positive).
    :param probs: probabilities in ``(0, 1)``.
    :returns: ``(len(probs), n)``.
    """
    used = weight > 0
    mean = (weight * loc).sum(-1)
    var = (weight * (scale * scale + (loc - mean.unsqueeze(-1)) ** 2)).sum(-1)
    sd = var.clamp_min(0).sqrt()
    inv = scale.reciprocal()
    w_pdf = weight * inv * _INV_SQRT_2PI
    coarse = loc.dtype == torch.float64
    if coarse:  # the first steps in single precision: half the memory traffic
        single = [t.float() for t in (weight, w_pdf, loc, inv)]
    out = []
    for p in probs:
        zp = float(torch.special.ndtri(torch.tensor(float(p), dtype=torch.float64)))
        comp = loc + scale * zp
        a = torch.where(used, comp, math.inf).amin(-1)
        b = torch.where(used, comp, -math.inf).amax(-1)
        q = torch.minimum(torch.maximum(mean + sd * zp, a), b)
        if coarse:
            q32 = _newton_quantiles(*single, q.float(), a.float(), b.float(), p, 1e-5, iters)
            q = torch.minimum(torch.maximum(q32.to(q.dtype), a), b)
        out.append(_newton_quantiles(weight, w_pdf, loc, inv, q, a, b, p, tol, iters))
    return torch.stack(out)


class VaRTRegressor(RegressorMixin, TabularEstimator):
    """A variational regression tree (VaRT) with posterior predictive intervals.

    Fits :class:`~pyro_trees.models.VaRT` with the truncated guide
    :class:`~pyro_trees.guides.VaRTGuide` by maximising the :math:`\\lambda`-weighted ELBO
    (eq. 4) with ClippedAdam through :func:`~pyro_trees.infer.fit`, annealing the Gumbel-softmax
    temperature geometrically from ``temperature_start`` to ``temperature_end``. Inputs
    and targets are standardised internally; predictions are in the original units.

    Predictions use ``num_samples`` trees drawn once from the guide with hard split
    indicators (temperature 0, the limit of eq. 22) and a fixed seed, so ``predict`` is
    deterministic and identical after pickling; inputs of any length are processed in
    batches against the same trees.

    :param int depth: truncation depth :math:`D` of the guide.
    :param float lam: :math:`\\lambda` of eq. 4 (the paper uses ``1e-3``).
    :param int num_steps: gradient steps.
    :param float lr: ClippedAdam learning rate.
    :param batch_size: minibatch size (``subsample_size`` of the ``data`` plate);
        ``None`` uses full batches up to 2048 rows.
    :param float temperature_start: initial Gumbel-softmax temperature.
    :param float temperature_end: final temperature.
    :param int num_samples: posterior trees used by ``predict`` and ``predict_interval``
        (and by the noise calibration). Prediction costs grow linearly with it; the
        predictive mixture has about ``num_samples`` times as many components per row
        as one tree.
    :param float split_alpha: prior split probability at the root (see VaRT).
    :param float split_beta: depth decay of the prior split probability.
    :param float split_scale: prior standard deviation of the split weights.
    :param float leaf_scale: prior standard deviation of the leaf weights.
    :param float validation_fraction: share of the training rows held out (at random,
        seeded by ``seed_``) for early stopping and noise calibration; ``0``
        trains on every row for ``num_steps`` steps without either (the paper's runs).
        At least ``min(10, N // 5)`` rows are held out; none when that is below 4.
    :param int patience: early stopping: evaluations (every ``eval_every`` steps) of the
        held-out RMSE of :meth:`~pyro_trees.guides.VaRTGuide.mean_tree` without improvement before
        training stops; the best parameters are kept. ``None`` trains all ``num_steps`` and keeps
        the best.
    :param int eval_every: steps between held-out evaluations.
    :param calibrate_noise: how the held-out rows set one factor :math:`c` that
        multiplies every leaf's noise scale (stored as ``noise_factor_``; ``None`` or
        ``False``: none, :math:`c = 1`). At small :math:`\\lambda` the KL term hardly
        constrains the leaf noise, which then shrinks to the training residuals of a
        tree that can nearly interpolate a small data set; the held-out rows measure the
        residuals on data the tree has not seen. At most 512 held-out rows enter; what
        both rules read is kept in ``noise_calibration_``.

        * ``"coverage"`` (default): split conformal calibration of the interval
          (:func:`~pyro_trees.estimators.vart.noise_factor_from_scores`). Each held-out row's score
          (:meth:`coverage_scores`) is the least factor from which it lies inside the
          central ``calibration_level`` interval of the posterior predictive (eq. 32
          over the ``num_samples`` trees, computed exactly from the Gaussian mixture);
          :math:`\\hat c` is the score at position :math:`\\mathrm{level}\\,(n+1)` of
          the :math:`n` sorted scores (interpolated), so that a new row is covered
          with probability close to the level whatever the shape of the residuals
          (heavy tails, say, where a likelihood-matched scale over-covers). With
          ``refit`` (the default) :math:`c = \\hat c`. With ``refit=False``, as with
          the likelihood rule, :math:`c = \\hat c` when :math:`\\hat c \\ge 1`, and below
          one the noise is shrunk only to the one-sided 95 % upper confidence bound of
          the score quantile (not at all with fewer than 29 rows at 0.9). With
          fewer than :math:`\\mathrm{level}/(1-\\mathrm{level})` held-out rows (9 at
          0.9) the likelihood rule is used (``noise_calibration_["rule"]`` says
          which). Intervals of other levels keep the predictive's shape. With
          ``refit=False`` the held-out rows also picked the early-stopping checkpoint
          of the model they score, so their scores run small and new rows are covered
          less often than the level (see ``refit``). The factor scales only the leaf
          noise: where the spread of the posterior trees' predictions alone already
          covers a row (small data sets with many features and linear leaves), no
          factor narrows its interval, and intervals can over-cover (on ``autos`` at
          depth 5 with ``refit=False``, 90 % of
          the test rows lie inside the interval at the smallest factor, :math:`2^{-6}`:
          no noise factor takes the coverage below about 0.90).
        * ``"likelihood"`` (``True``): :math:`c` read off the held-out log posterior
          predictive density :math:`\\ell(c)` (log grid over :math:`[1/8, 64]`,
          :func:`~pyro_trees.estimators.vart.noise_factor_from_curve`): :math:`c = \\hat c` when the
          maximiser :math:`\\hat c \\ge 1`; otherwise the noise is shrunk only as far as the
          held-out rows make certain, :math:`c = \\min(1, c_+)` with :math:`c_+` the
          upper end of the profile likelihood interval
          :math:`2(\\ell(\\hat c) - \\ell(c)) \\le 2.71` (one-sided 95 %).
    :param float calibration_level: the central interval probability whose held-out
        coverage ``calibrate_noise="coverage"`` sets, in ``(0, 1)``.
    :param min_calibration_rows: ``calibrate_noise="coverage"`` only: score at least this
        many held-out rows by cross-fitting (``None``, the default: the held-out split
        alone). The training rows are cut into disjoint folds of the held-out split's size
        (fold 0 is that split); fold :math:`k = 1, \\dots, K-1` is scored by an extra fit
        that holds it out (for early stopping too, like the main fit) and is seeded
        ``seed_ + k``, with :math:`K` the least number of folds with that many rows (at most
        ``N // n_val``, every row once). The pooled scores set the factor of the main
        fit, which alone predicts; training costs :math:`K` fits. With ten held-out rows
        (:math:`N \\approx 100`) the quantile of the split's scores is that of one or two
        rows, and the one-sided bound forbids any shrinking below 29 rows, so the
        factor is mostly noise; cross-fitting pools every row's score (the CV+ idea of
        Barber et al., 2021), at the price of scores from fits on slightly different
        rows. ``noise_calibration_["fold_scores"]`` keeps them. Measured on the 18 UCI
        sets at depth 5 (``benchmarks/results/vart_uci_d5_crossfit100_*.md``, 100
        rows): it does not help there. The smallest sets then under-cover
        (concreteslump 0.824, fertility 0.840, against 0.845 and 0.890 from the held-out
        split alone) and autos still over-covers (0.962): with enough rows the factor
        may go below one, and the folds' scores, like the split's, come from rows that
        also picked their fit's early-stopping step. Hence off by default.
    :param bool refit: separate choosing the number of steps from calibrating the noise.
        Early stopping picks, among some fifty checkpoints, the one whose mean tree fits
        the held-out rows best, so those rows end up fitted better than new rows: on the
        18 UCI sets at depth 5 they lie inside the fitted 90 % interval more often than
        the test rows on 14 (concreteslump 0.94 against 0.81), and with about ten of them
        the factor they set under-covers. With ``refit=True`` the stopped fit
        (kept as ``stopping_result_``) only gives its number of steps
        :math:`T` (its best step, at least 1); a fresh guide, seeded
        ``seed_ + 104729``, trains :math:`T` steps of the same temperature schedule on the
        same training rows without early stopping and is the fitted model
        (``fit_result_``). The held-out rows chose nothing of it but :math:`T`, so their
        scores are close to exchangeable with new rows', and ``"coverage"`` takes the
        conformal quantile as it is, below one as well (no confidence bound;
        ``noise_calibration_["confidence"]`` is ``None``). Training costs up to twice as
        much. Cross-fitted folds (``min_calibration_rows``) are refitted the same way.
        Without held-out rows it changes nothing. Measured on the 18 UCI sets at depth 5,
        ten splits (``benchmarks/results/vart_uci_d5_refit_*.md``): every set's mean test
        coverage of the 90 % interval lies in 0.86-0.93 (15 of 18 inside 0.85-0.95 with
        ``refit=False``), and VaRT beats XGBoost on the same 9 sets.
    :param float init_split_prob: initial split probability :math:`\\tilde\\gamma_i` of
        every internal node of the guide. The split logits move slowly, so at 0.9 a
        hard posterior tree prunes about one node in ten at random, and those
        subtrees' (hardly trained) stand-in leaves spread the posterior trees'
        predictions; 0.99 (default) starts from the full tree of depth ``depth``.
    :param str init: ``"data"`` (default) starts the split rules through random
        training points (:meth:`~pyro_trees.guides.VaRTGuide.init_splits_from_data`); ``"random"``
        uses random hyperplanes through the origin of the standardised inputs.
    :param str elbo: ``"vectorised"`` (default) trains with
        :class:`~pyro_trees.infer.VaRTELBO`, the same estimator of the
        :math:`\\lambda`-weighted ELBO as ``Trace_ELBO`` computed without Pyro's per-site
        tracing (several times faster per step on small data); ``"trace"`` uses
        :class:`pyro.infer.Trace_ELBO` on the model and guide.
    :param clip_margin: clip every input of a new row to the range it had in the
        training rows (per feature; the rows the model learns from, not the held-out
        ones), widened by ``clip_margin`` times its width on each side; ``None`` never
        clips. Linear leaves extrapolate without bound, so one far outlying input (a
        data-entry error, say) would otherwise give an arbitrarily large prediction,
        while a mild extrapolation of a linear trend is often right. Training is
        unaffected; the held-out rows are clipped like new rows for early stopping and
        calibration (on the ``machine`` data set, one held-out row 1,000 range widths
        out made the untrained start look best to early stopping).
    :param random_state: an int seeds initialisation, training and the draws of the
        posterior trees used for prediction; fitting and predicting leave the global
        random streams (Python, NumPy, torch) as they were. ``None``: ``fit`` draws a
        seed from torch's global stream, so unseeded fits differ from one another. The
        seed in use is kept as ``seed_``: a fitted estimator's predictions are
        reproducible across calls and after pickling either way, and
        ``random_state=seed_`` repeats the fit.
    :param device: torch device for training and prediction (default CPU).
    :param bool progress: show a progress bar.
    """

    def __init__(
        self,
        depth: int = 5,
        lam: float = 1e-3,
        *,
        num_steps: int = 1000,
        lr: float = 0.03,
        batch_size: int | None = None,
        temperature_start: float = 1.0,
        temperature_end: float = 0.1,
        num_samples: int = 50,
        validation_fraction: float = 0.1,
        patience: int | None = 5,
        eval_every: int = 20,
        calibrate_noise: str | bool | None = "coverage",
        calibration_level: float = 0.9,
        min_calibration_rows: int | None = None,
        refit: bool = True,
        init: str = "data",
        init_split_prob: float = 0.99,
        elbo: str = "vectorised",
        clip_margin: float | None = 0.5,
        split_alpha: float = 0.95,
        split_beta: float = 2.0,
        split_scale: float = 1.0,
        leaf_scale: float = 1.0,
        random_state: int | None = None,
        device=None,
        progress: bool = False,
    ):
        self.depth = depth
        self.lam = lam
        self.num_steps = num_steps
        self.lr = lr
        self.batch_size = batch_size
        self.temperature_start = temperature_start
        self.temperature_end = temperature_end
        self.num_samples = num_samples
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.calibrate_noise = calibrate_noise
        self.calibration_level = calibration_level
        self.min_calibration_rows = min_calibration_rows
        self.refit = refit
        self.init = init
        self.init_split_prob = init_split_prob
        self.elbo = elbo
        self.clip_margin = clip_margin
        self.split_alpha = split_alpha
        self.split_beta = split_beta
        self.split_scale = split_scale
        self.leaf_scale = leaf_scale
        self.random_state = random_state
        self.device = device
        self.progress = progress

    # ------------------------------------------------------------------ fitting
    def _seed(self) -> int:
        """The seed of the fit and of prediction sampling: ``seed_`` (set by ``fit``);
        estimators pickled before ``seed_`` existed used ``random_state``, 0 for
        ``None``."""
        seed = getattr(self, "seed_", None)
        if seed is None:
            return 0 if self.random_state is None else int(self.random_state)
        return int(seed)

    def fit(self, X, y):
        """Fit the variational posterior on ``X`` ``(N, L)`` and ``y`` ``(N,)``.

        ``X`` and ``y`` are standardised inside; predictions and intervals are in the
        units of ``y``.

        :param X: ``(N, L)`` array-like or pandas DataFrame of numeric or bool columns.
        :param y: ``(N,)`` real targets.
        :returns: ``self``.
        :raises ValueError: naming the cause, for invalid options or data.
        """
        if int(self.num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie in [0, 1), got {self.validation_fraction}"
            )
        if self.clip_margin is not None and not float(self.clip_margin) >= 0:
            raise ValueError(f"clip_margin must be >= 0 or None, got {self.clip_margin}")
        if self.init not in ("data", "random"):
            raise ValueError(f"init must be 'data' or 'random', got {self.init!r}")
        if self.elbo not in ("vectorised", "trace"):
            raise ValueError(f"elbo must be 'vectorised' or 'trace', got {self.elbo!r}")
        if int(self.eval_every) < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if not isinstance(self.refit, bool):
            raise ValueError(f"refit must be True or False, got {self.refit!r}")
        rule = self._calibration_rule()
        check_level(self.calibration_level, "calibration_level")
        X, y = self._validate_fit(X, y)
        n = X.shape[0]
        if self.random_state is None:  # unseeded: a seed from the global torch stream
            self.seed_ = int(torch.randint(2**31, ()).item())
        else:
            self.seed_ = int(self.random_state)
        gen = torch.Generator().manual_seed(self._seed())
        n_val = 0
        if self.validation_fraction > 0:  # at least 10 held-out rows where n allows it
            n_val = max(int(round(self.validation_fraction * n)), min(10, n // 5))
            if n_val < 4:
                n_val = 0
        if n_val:
            perm = torch.randperm(n, generator=gen).to(X.device)
        else:
            perm = torch.arange(n, device=X.device)
        num_folds = self._calibration_folds(n, n_val, rule)
        self.stopping_result_ = None
        Xva, yva = self._fit_split(X, y, perm[:n_val], perm[n_val:], gen)
        if n_val and self.refit:
            self.stopping_result_ = self.fit_result_
            self._refit(X, y, perm[:n_val], perm[n_val:], self._seed())
        self.noise_factor_ = 1.0
        self._tree_samples = None
        if n_val and rule is not None:  # the held-out rows are in random order
            extra = [self._fold_scores(X, y, perm, n_val, k) for k in range(1, num_folds)]
            self.noise_factor_ = self._calibrate_noise(
                Xva[:_CALIBRATION_ROWS], yva[:_CALIBRATION_ROWS], extra
            )
            self._tree_samples = None
        self._leaf_trees()  # drawn here once: predicting changes no attribute
        return self

    def _calibration_folds(self, n: int, n_val: int, rule) -> int:
        """Folds whose held-out scores set the coverage factor: 1 (the held-out split
        alone) or, with ``min_calibration_rows``, enough disjoint splits of ``n_val`` rows
        for that many rows, at most ``n // n_val``."""
        m = self.min_calibration_rows
        if m is None:
            return 1
        if isinstance(m, bool) or int(m) != m or m < 1:
            raise ValueError(f"min_calibration_rows must be a positive integer or None, got {m!r}")
        if not n_val or rule != "coverage":
            return 1
        return max(1, min(math.ceil(int(m) / n_val), n // n_val))

    def _refit(self, X, y, val_idx, train_idx, seed: int) -> None:
        """``refit=True``: a fresh guide, seeded ``seed + _REFIT_SEED``, trained on
        ``train_idx`` for the number of steps early stopping chose
        (``fit_result_.best_step``, at least 1), replaces the stopped one."""
        steps = max(int(self.fit_result_.best_step or 0), 1)
        seed = int(seed) + _REFIT_SEED
        gen = torch.Generator().manual_seed(seed)
        self._fit_split(X, y, val_idx, train_idx, gen, seed=seed, num_steps=steps)

    def _fold_scores(self, X, y, perm, n_val: int, k: int) -> torch.Tensor:
        """Coverage scores of fold ``k``'s rows ``perm[k n_val : (k + 1) n_val]`` under a
        fit that holds them out (for early stopping, as the main fit does with fold 0),
        seeded ``seed_ + k``."""
        rows = perm[k * n_val : (k + 1) * n_val]
        rest = torch.cat([perm[: k * n_val], perm[(k + 1) * n_val :]])
        params = dict(self.get_params(), calibrate_noise=None, min_calibration_rows=None)
        params.update(progress=False, random_state=self._seed() + k)
        other = type(self)(**params)
        other.seed_ = self._seed() + k
        self._share_inputs(other)
        other._fit_split(X, y, rows, rest, torch.Generator().manual_seed(other.seed_))
        if self.refit:
            other._refit(X, y, rows, rest, other.seed_)
        other.noise_factor_, other._tree_samples = 1.0, None
        level = float(self.calibration_level)
        scores = other._standardised_scores(
            other._clip(X[rows][:_CALIBRATION_ROWS]), y[rows][:_CALIBRATION_ROWS], level
        )
        return torch.as_tensor(scores, dtype=torch.float64)

    def _fit_split(self, X, y, val_idx, train_idx, gen, *, seed=None, num_steps=None):
        """Fit on rows ``train_idx`` with ``val_idx`` held out (early stopping);
        ``gen`` seeds the guide's initialisation and ``seed`` (default ``seed_``) the
        training draws. With ``num_steps`` (the refit of ``refit=True``) it trains
        exactly that many steps of the ``self.num_steps`` temperature schedule, without
        early stopping. Returns the held-out rows, standardised."""
        n, num_features = X.shape
        n_val = len(val_idx)
        n_train = n - n_val
        batch = min(n_train, 2048) if self.batch_size is None else int(self.batch_size)
        if batch < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        batch = min(batch, n_train)
        depth = _check_training_memory(self.depth, batch, num_features, X.device)
        _check_prediction_memory(depth, int(self.num_samples), num_features, X.device)
        Xs, ys = X, y  # standardised by _validate_fit
        Xtr, ytr, yva = Xs[train_idx], ys[train_idx], ys[val_idx]
        self.x_min_, self.x_max_ = Xtr.min(0).values, Xtr.max(0).values  # the rows it learns
        Xva = self._clip(Xs[val_idx])  # held-out rows are scored as new rows would be
        # inputs are checked above; Pyro's per-site validation only costs time here
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            self.model_ = VaRT(
                num_features,
                lam=self.lam,
                split_alpha=self.split_alpha,
                split_beta=self.split_beta,
                split_scale=self.split_scale,
                leaf_scale=self.leaf_scale,
            )
            self.guide_ = VaRTGuide(
                self.model_,
                depth,
                temperature=self.temperature_start,
                init="random",  # the data-driven start follows, from ``gen``
                init_split_prob=self.init_split_prob,
                generator=gen,
            )
            if self.init == "data":
                self.guide_.init_splits_from_data(Xtr, generator=gen)
            self.guide_.to(X.device)
            schedule = TemperatureSchedule(
                max(int(self.num_steps), 1), self.temperature_start, self.temperature_end
            )
            kwargs = {} if batch >= n_train else {"subsample_size": batch}
            val = {}
            steps = int(self.num_steps) if num_steps is None else int(num_steps)
            if n_val and num_steps is None:
                guide, xv1 = self.guide_, with_bias(Xva)

                def val_rmse() -> float:
                    with torch.no_grad():
                        logits, means, _ = mixture_params(guide.mean_tree(), xv1)
                        pred = (logits.softmax(-1) * means).sum(-1)
                        return float((pred - yva).pow(2).mean().sqrt())

                val = {
                    "val_metric": val_rmse,
                    "eval_every": int(self.eval_every),
                    "patience": self.patience,
                }
            seed = self._seed() if seed is None else int(seed)
            with local_seed(seed, X.device):  # the global streams are left alone
                self.fit_result_ = fit(
                    self.model_,
                    self.guide_,
                    Xtr,
                    ytr,
                    num_steps=steps,
                    loss=VaRTELBO() if self.elbo == "vectorised" else Trace_ELBO(),
                    optim="clipped_adam",
                    lr=self.lr,
                    progress=self.progress,
                    desc="VaRT" if num_steps is None else "VaRT refit",
                    callback=schedule.callback(self.guide_),
                    **val,
                    **kwargs,
                )
        self.feature_importances_ = self._importances(Xtr[:4096])
        return Xva, yva

    @torch.no_grad()
    def _calibrate_noise(self, Xva: torch.Tensor, yva: torch.Tensor, extra=()) -> float:
        """The noise factor :math:`c` of ``calibrate_noise`` from held-out standardised
        rows ``Xva`` ``(n, L)``, ``yva`` ``(n,)``.

        Computes both rules' inputs on the ``num_samples`` posterior trees (factor 1):
        the log posterior predictive density :math:`\\ell(c) = \\sum_j \\log \\frac1S
        \\sum_s p(y_j \\mid x_j, T_s, \\Theta_s, c)` on a log-spaced grid, and each row's
        coverage score (:meth:`_coverage_scores`); all are stored in
        ``noise_calibration_`` (``grid``, ``log_density``, ``scores``, ``level``,
        ``rule``: the rule that chose the factor, ``"likelihood"`` where the coverage
        rule had too few rows)."""
        tree = self._raw_leaves()
        grid = torch.logspace(math.log10(0.125), math.log10(64.0), 109, dtype=torch.float64)
        total = torch.zeros_like(grid)
        level = float(self.calibration_level)
        log_s = math.log(int(self.num_samples))
        scores = []
        for xb, yb in self._calibration_batches(Xva, yva):
            logits, loc, scale = _row_mixtures(tree, xb)  # (S, n, K)
            z = (yb.double().unsqueeze(-1) - loc) / scale
            # log N(y; loc, (c scale)^2) = base - 0.5 z^2 / c^2 - log c
            base = logits - scale.log() - 0.5 * math.log(2 * math.pi)
            half_z2 = 0.5 * z * z
            for k, c in enumerate(grid.tolist()):
                per_tree = (base - half_z2 / (c * c)).logsumexp(-1) - math.log(c)  # (S, n)
                total[k] += float((per_tree.logsumexp(0) - log_s).sum())
            weight = logits.exp() / logits.shape[0]  # mixture weights over trees and leaves
            scores.append(_compact_scores(weight, z, level))
        scores = torch.cat(scores)
        pooled = torch.cat([scores.cpu(), *[e.cpu() for e in extra]])
        c_lik = noise_factor_from_curve(grid, total)
        confidence = None if self.refit else 0.95  # refit: the rows chose no parameters
        c_cov = _coverage_factor(pooled, level, confidence)
        rule = self._calibration_rule()
        if rule == "coverage" and c_cov is None:
            rule = "likelihood"
        self.noise_calibration_ = {
            "grid": grid.numpy(),
            "log_density": total.numpy(),
            "scores": scores.cpu().numpy(),
            "fold_scores": [e.cpu().numpy() for e in extra],
            "level": level,
            "rule": rule,
            "confidence": confidence,
        }
        return c_cov if rule == "coverage" else c_lik

    def _raw_leaves(self) -> dict:
        """The trees of :meth:`_leaf_trees` with factor-1 noise."""
        tree = self._leaf_trees()
        shift = math.log(getattr(self, "noise_factor_", 1.0))
        return dict(tree, log_sigma=tree["log_sigma"] - shift) if shift else tree

    def _leaf_trees(self) -> dict:
        """The posterior trees of ``_posterior_trees`` stacked and cut to their leaves
        (:func:`_leaf_tree`), cached alongside the draws they come from."""
        samples = self._posterior_trees()
        cache = getattr(self, "_leaf_cache", None)
        if cache is None or cache[0] is not samples:
            cache = (samples, _leaf_tree(_stack_trees(samples, self.guide_.depth)))
            self._leaf_cache = cache
        return cache[1]

    @torch.no_grad()
    def coverage_scores(self, X, y, level: float | None = None) -> np.ndarray:
        """Each row's coverage score: the least noise factor (relative to the fitted
        leaf noise, before ``noise_factor_``) from which ``y`` lies inside the central
        ``level`` interval of the exact posterior predictive (the Gaussian mixture over
        the ``num_samples`` trees and their leaves) for every larger factor (log grid
        over :math:`[2^{-6}, 2^8]`, refined by bisection; ``inf`` beyond it).

        A row is inside the ``level`` interval of the calibrated predictive iff its
        score is at most ``noise_factor_``; ``calibrate_noise="coverage"`` chooses the
        factor from these scores on the held-out rows
        (:func:`~pyro_trees.estimators.vart.noise_factor_from_scores`). ``predict_interval``
        estimates the same interval from ``num_samples`` draws.

        :param X: ``(N, L)``.
        :param y: ``(N,)``.
        :param level: default ``calibration_level``.
        :returns: ``(N,)`` scores.
        """
        level = check_level(self.calibration_level if level is None else level)
        Xs = self._prepare(X)
        return self._standardised_scores(Xs, self._scaled_targets(y, Xs.shape[0]), level)

    def _standardised_scores(self, Xs: torch.Tensor, ys: torch.Tensor, level: float):
        """:meth:`coverage_scores` of standardised (and clipped) rows."""
        tree = self._raw_leaves()
        out = []
        for xb, yb in self._calibration_batches(Xs, ys):
            logits, loc, scale = _row_mixtures(tree, xb)
            weight = logits.exp() / logits.shape[0]
            z = (yb.double().unsqueeze(-1) - loc) / scale
            out.append(_compact_scores(weight, z, level))
        return torch.cat(out).cpu().numpy()

    def _calibration_batches(self, *tensors: torch.Tensor):
        """Matching row slices of ``tensors`` (each ``(N, ...)``), small enough that
        their ``(S, rows, M)`` double mixture tensors fit the prediction budget."""
        nodes = 2 ** (self.guide_.depth + 1)
        rows = max(1, _PREDICT_BYTES // (_ROW_BYTES_PER_NODE * int(self.num_samples) * nodes))
        for start in range(0, tensors[0].shape[0], rows):
            yield tuple(t[start : start + rows] for t in tensors)

    def _calibration_rule(self) -> str | None:
        """``calibrate_noise`` checked: ``"likelihood"``, ``"coverage"`` or ``None``."""
        rule = self.calibrate_noise
        if rule is True:
            return "likelihood"
        if rule is None or rule is False:
            return None
        if rule not in ("likelihood", "coverage"):
            raise ValueError(
                "calibrate_noise must be 'coverage', 'likelihood', None, True or False, "
                f"got {rule!r}"
            )
        return rule

    # --------------------------------------------------------------- prediction
    def _prepare(self, X) -> torch.Tensor:
        return self._clip(self._validate_predict(X))

    def _clip(self, Xs: torch.Tensor) -> torch.Tensor:
        """Standardised inputs clipped to the training rows' range widened by
        ``clip_margin`` times its width on each side (``clip_margin=None``: unchanged)."""
        if self.clip_margin is not None and getattr(self, "x_min_", None) is not None:
            pad = float(self.clip_margin) * (self.x_max_ - self.x_min_)
            Xs = torch.minimum(torch.maximum(Xs, self.x_min_ - pad), self.x_max_ + pad)
        return Xs

    def _posterior_trees(self) -> dict:
        """``num_samples`` hard trees from the guide, drawn once with a fixed seed."""
        if getattr(self, "_tree_samples", None) is None:
            dummy = torch.zeros(1, self.n_features_in_, dtype=self.dtype_, device=self.device_)
            _check_prediction_memory(
                self.guide_.depth, int(self.num_samples), self.n_features_in_, dummy.device
            )
            with (
                local_seed(self._seed() + 1, dummy.device),
                pyro.settings.context(module_local_params=True),
                pyro.validation_enabled(False),
                self.guide_.temperature_set_to(0.0),
                torch.no_grad(),
            ):
                samples = Predictive(self.guide_, num_samples=int(self.num_samples), parallel=True)(
                    dummy
                )
            shift = math.log(getattr(self, "noise_factor_", 1.0))
            if shift != 0.0:  # calibrated noise: every leaf's scale times noise_factor_
                for key in samples:
                    if key.startswith("log_sigma_"):
                        samples[key] = samples[key] + shift
            self._tree_samples = samples
        return self._tree_samples

    def _predictive(self, Xs: torch.Tensor, sites: tuple[str, ...], seed_offset: int):
        samples = self._posterior_trees()
        nodes = 2 ** (self.guide_.depth + 1)
        rows = max(1, _PREDICT_BYTES // (8 * 4 * int(self.num_samples) * nodes))
        out = {s: [] for s in sites}
        with (
            local_seed(self._seed() + seed_offset, Xs.device),
            pyro.settings.context(module_local_params=True),
            pyro.validation_enabled(False),
            torch.no_grad(),
        ):
            pred = Predictive(
                self.model_, posterior_samples=samples, return_sites=list(sites), parallel=True
            )
            for start in range(0, Xs.shape[0], rows):
                res = pred(Xs[start : start + rows])
                for s in sites:
                    out[s].append(res[s])
        return {s: self._outputs(torch.cat(v, dim=-1)) for s, v in out.items()}

    def predict(self, X, return_std: bool = False):
        """Posterior predictive mean (eq. 32): the average over posterior trees of
        :math:`\\sum_i \\kappa_i P(x \\to i)\\, \\theta_i^\\top x`; shape ``(N,)``.

        :param bool return_std: also return the standard deviation of the posterior
            predictive (the Gaussian mixture over the ``num_samples`` trees and their
            leaves, calibrated noise included), ``(N,)``.
        """
        Xs = self._prepare(X)
        mean = self._function_draws(Xs).mean(0)
        if not return_std:
            return mean
        tree = self._leaf_trees()
        var = []
        with torch.no_grad():
            for (xb,) in self._calibration_batches(Xs):
                logits, loc, scale = _row_mixtures(tree, xb)  # (S, n, M)
                weight = logits.exp() / logits.shape[0]
                m = (weight * loc).sum((0, -1))
                second = (weight * (loc * loc + scale * scale)).sum((0, -1))
                var.append((second - m * m).clamp_min(0.0))
        return mean, self._output_scale(torch.cat(var).sqrt())

    def sample_function(self, X, num_samples: int | None = None) -> np.ndarray:
        """Posterior draws of the regression function :math:`E[y \\mid x, T, \\Theta]`,
        one per posterior tree: shape ``(num_samples, N)`` (credible bands for means)."""
        return self._take(self._function_draws(self._prepare(X)), num_samples)

    def _function_draws(self, Xs: torch.Tensor) -> np.ndarray:
        """:meth:`sample_function` of standardised rows, every posterior tree."""
        tree = self._leaf_trees()
        nodes = max(int(tree["keep"].numel()), trees.num_internal(self.guide_.depth))
        rows = max(1, _PREDICT_BYTES // (8 * 4 * int(self.num_samples) * nodes))
        out = []
        with torch.no_grad():
            for start in range(0, Xs.shape[0], rows):
                logits, means, _ = _leaf_mixtures(tree, Xs[start : start + rows])
                out.append((logits.softmax(-1) * means).sum(-1))
        return self._outputs(torch.cat(out, -1))

    def sample(self, X, num_samples: int | None = None) -> np.ndarray:
        """Draws of the posterior predictive :math:`y^*` (eq. 32), ``(num_samples, N)``.

        Draw ``j`` comes from posterior tree ``j mod S``, with ``S`` the estimator's
        ``num_samples``: the first ``S`` draws are one per tree, and any further ones
        are more draws of :math:`y^*` from the same trees in rounds of ``S``, each
        round with its own fixed seed. Every draw thus follows the Gaussian mixture
        over the ``S`` trees whose quantiles ``predict_interval`` returns, ``n < S``
        draws are the first ``n`` of the ``S``, and repeated calls (also after
        pickling) return the same draws.

        :param num_samples: any number ``>= 1`` (default: the estimator's
            ``num_samples``).
        """
        Xs = self._prepare(X)
        per_round = int(self.num_samples)
        want = per_round if num_samples is None else int(num_samples)
        if want < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        # round r draws with seed seed_ + 3 + r, so the first round is the default call's
        rounds = [
            self._predictive(Xs, ("obs",), 3 + r)["obs"] for r in range(-(-want // per_round))
        ]
        return np.concatenate(rounds)[:want]

    def _take(self, draws: np.ndarray, num_samples) -> np.ndarray:
        if num_samples is not None:
            num_samples = int(num_samples)
            if not 1 <= num_samples <= int(self.num_samples):
                raise ValueError(
                    f"num_samples must lie in [1, {self.num_samples}] (the estimator's "
                    f"num_samples: one function draw per posterior tree), got {num_samples}"
                )
            draws = draws[:num_samples]
        return draws

    def predict_interval(self, X, level: float = 0.9, *, method: str = "exact"):
        """Equal-tailed Bayesian predictive interval of probability ``level``.

        :param str method: ``"exact"`` (default): the quantiles
            :math:`(1 \\mp \\mathrm{level})/2` of the posterior predictive itself, the
            Gaussian mixture over the ``num_samples`` posterior trees and their leaves
            (eq. 32), solved per row by safeguarded Newton steps on its CDF (so a
            row is inside iff its :meth:`coverage_scores` at ``level`` is at most
            ``noise_factor_``, wherever the CDF at ``y`` moves monotonically toward
            1/2 as the noise grows). ``"draws"``: empirical quantiles of the
            ``num_samples`` draws of :meth:`sample` (one per tree; a Monte
            Carlo estimate of the same interval, slightly narrow on average).
        :returns: ``(lower, upper)``, each ``(N,)``.
        """
        level = check_level(level)
        if method == "draws":
            draws = self.sample(X)
            lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0)
            return lo, hi
        if method != "exact":
            raise ValueError(f"method must be 'exact' or 'draws', got {method!r}")
        Xs = self._prepare(X)
        tree = self._leaf_trees()
        probs = ((1 - level) / 2, (1 + level) / 2)
        out = []
        with torch.no_grad():
            for (xb,) in self._calibration_batches(Xs):
                logits, loc, scale = _row_mixtures(tree, xb)
                weight = logits.exp() / logits.shape[0]
                out.append(_row_mixture_quantiles(*_compact_rows(weight, loc, scale), probs))
        q = self._outputs(torch.cat(out, -1))
        return q[0], q[1]

    # ------------------------------------------------------------ interpretation
    @torch.no_grad()
    def _importances(self, Xs: torch.Tensor) -> np.ndarray:
        """Expected share of each feature in the splits, weighted by how many training
        points reach each node: :math:`\\sum_i E[\\psi_i]\\,\\overline{P(x \\to i)}\\,
        |\\tilde\\mu_{ij}| / \\sum_k |\\tilde\\mu_{ik}|` over standardised inputs."""
        g = self.guide_
        psi, _ = g.node_probs()
        n_int = trees.num_internal(g.depth)
        loc = g.beta_loc.detach()
        reach = trees.node_log_reach(trees.leaf_log_probs(-(with_bias(Xs) @ loc.T))).exp()[
            :, :n_int
        ]
        w = loc[:, :-1].abs()
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
        imp = ((psi[:n_int] * reach.mean(0)).unsqueeze(-1) * w).sum(0)
        total = imp.sum()
        imp = imp / total if total > 0 else torch.full_like(imp, 1 / imp.numel())
        return imp.cpu().numpy()

    @torch.no_grad()
    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The most probable tree under the guide
        (:meth:`~pyro_trees.guides.VaRTGuide.most_probable_structure`) as indented text in the style
        of ``sklearn.tree.export_text``.

        Splits are oblique (:math:`x` goes left iff :math:`\\tilde\\mu_i^\\top x > 0`); each
        is printed as its dominant feature (largest standardised weight, its share in
        brackets) with the threshold where the rule flips when the other inputs sit at
        their training means. Leaves (linear models) print their prediction at the
        training mean of the inputs, their noise scale and their three largest slopes.
        """
        check_is_fitted(self, "guide_")
        if feature_names is not None and len(feature_names) != self.n_features_in_:
            raise ValueError(
                f"feature_names has {len(feature_names)} names for {self.n_features_in_} features"
            )
        g = self.guide_
        split = g.most_probable_structure().tolist()
        n_int = len(split)
        mu = g.beta_loc.detach().double().cpu()
        theta = g.theta_loc.detach().double().cpu()
        sig = g.log_sigma_loc.detach().double().exp().cpu()
        xm = torch.as_tensor(self.x_scaler_.mean, dtype=torch.float64)
        xs = torch.as_tensor(self.x_scaler_.scale, dtype=torch.float64)
        ym, ysc = float(self.y_scaler_.mean), float(self.y_scaler_.scale)

        def name(j: int) -> str:
            return str(feature_names[j]) if feature_names is not None else f"x_{j}"

        def leaf(i: int) -> str:
            th = theta[i - 1]
            value = ym + ysc * float(th[-1])
            slopes = ysc * th[:-1] / xs
            order = torch.argsort(th[:-1].abs(), descending=True)[:3].tolist()
            terms = ", ".join(f"{name(j)}: {float(slopes[j]):+.{decimals}g}" for j in order)
            return (
                f"value: {value:.{decimals}f} (sd {ysc * float(sig[i - 1]):.{decimals}f}; "
                f"slopes {terms})"
            )

        lines: list[str] = []

        def visit(i: int, level: int) -> None:
            indent = "|   " * level + "|--- "
            if i - 1 >= n_int or not split[i - 1]:
                lines.append(indent + leaf(i))
                return
            b = mu[i - 1]
            j = int(b[:-1].abs().argmax())
            share = float(b[j].abs() / b[:-1].abs().sum().clamp_min(1e-300))
            t_std = -float(b[-1]) / float(b[j]) if float(b[j]) != 0 else math.inf
            t = float(xm[j] + xs[j] * t_std)
            left_op, right_op = (">", "<=") if float(b[j]) > 0 else ("<=", "> ")
            lines.append(f"{indent}{name(j)} {left_op} {t:.{decimals}f}  [{share:.0%}]")
            visit(2 * i, level + 1)
            lines.append(f"{indent}{name(j)} {right_op} {t:.{decimals}f}  [{share:.0%}]")
            visit(2 * i + 1, level + 1)

        visit(1, 0)
        return "\n".join(lines) + "\n"

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tree_samples"] = None  # redrawn with the same seed after loading
        state["_leaf_cache"] = None
        return state

    def __setstate__(self, state):
        # parameters added after an estimator was pickled: the behaviour it was fitted with
        state = {"min_calibration_rows": None, "refit": False, "init_split_prob": 0.9, **state}
        self.__dict__.update(state)
