"""Quantiles of Gaussian mixtures, the central predictive intervals of mixture experts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["compact_mixture_rows", "gaussian_mixture_quantiles", "row_mixture_quantiles"]

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gaussian_mixture_quantiles(
    weight: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    probs: Sequence[float],
    dim: int | tuple[int, ...] = -1,
    max_steps: int = 60,
) -> torch.Tensor:
    r"""Quantiles :math:`q` of Gaussian mixtures: :math:`\sum w\, \Phi((q - \mu) / \sigma)
    = p`, the sum running over the component dims ``dim``.

    Newton steps on the mixture's CDF, kept inside a bracket that bisection shrinks
    (starting at the used components' :math:`\mu \pm 40 \sigma`, within the dtype's
    finite range), until every CDF is within 1e-13 of its target or ``max_steps`` steps have
    run. A mixture whose CDF has reached its target keeps its quantile while the others
    go on, so each mixture's quantile is the same whichever mixtures share its batch.
    The quantiles are finite for finite ``loc`` and ``scale`` of any magnitude.

    :param weight: component weights, broadcastable with ``loc``, summing to one over
        ``dim``; components of weight 0 are ignored.
    :param loc: component means.
    :param scale: their standard deviations (same shape).
    :param probs: probabilities in ``(0, 1)``.
    :param dim: the component dim or dims, summed over.
    :returns: ``(len(probs),) + shape``, where ``shape`` is ``loc``'s (broadcast) shape
        without ``dim``.
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    used = weight > 0
    inf = torch.full_like(loc, math.inf)
    big = torch.finfo(loc.dtype).max
    low = torch.where(used, loc - 40 * scale, inf).amin(dims, keepdim=True).clamp_min(-big)
    high = torch.where(used, loc + 40 * scale, -inf).amax(dims, keepdim=True).clamp_max(big)
    out = []
    for p in probs:
        a, b = low.clone(), high.clone()
        q = a / 2 + b / 2  # (a + b) / 2 without overflow (the same bits otherwise)
        for _ in range(max_steps):
            z = (q - loc) / scale
            cdf = (weight * torch.special.ndtr(z)).sum(dims, keepdim=True)
            pdf = (weight * torch.exp(-0.5 * z * z) / scale).sum(dims, keepdim=True)
            pdf = pdf / math.sqrt(2 * math.pi)
            below = cdf < p
            a, b = torch.where(below, q, a), torch.where(below, b, q)
            done = (cdf - p).abs() <= 1e-13
            if bool(done.all()):
                break
            step = q - (cdf - p) / pdf
            inside = (step > a) & (step < b)
            q = torch.where(done, q, torch.where(inside, step, a / 2 + b / 2))
        out.append(q.squeeze(dims))
    return torch.stack(out)


def compact_mixture_rows(weight: torch.Tensor, *others: torch.Tensor, tol: float = 1e-12):
    """Per-row Gaussian mixtures ``(S, n, K)`` (``S`` groups of ``K`` components for each
    of ``n`` rows, as a posterior's ``S`` draws of a ``K``-leaf mixture) laid out as one
    mixture of ``C`` components per row, ``(n, C)``: every component of weight at least
    ``tol / (S K)`` (so that the weight dropped from a row is at most ``tol``), packed to
    the left in their original order, ``C`` the most any row keeps. The layout that
    :func:`row_mixture_quantiles` takes.

    :param weight: ``(S, n, K)`` component weights (a row's mixture: all ``S K`` of them).
    :param others: further ``(S, n, K)`` tensors (means, scales), gathered alike; their
        padding is one (a finite, positive scale).
    :param float tol: the most weight dropped from a row.
    :returns: a tuple of ``(n, C)`` tensors, ``weight`` (zero where padded) first.
    """
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


def _ndtr(z: torch.Tensor) -> torch.Tensor:
    """The standard normal CDF as ``erfc(-z / sqrt 2) / 2`` (the same function as
    ``torch.special.ndtr``, several times faster on CPU)."""
    return 0.5 * torch.special.erfc(z * -_SQRT_HALF)


def _newton_quantiles(weight, w_pdf, loc, inv, q, a, b, p: float, tol: float, max_steps: int):
    """Safeguarded Newton steps for the ``p``-quantiles of the row mixtures of
    :func:`row_mixture_quantiles` (``inv`` the reciprocal scales, ``w_pdf`` the
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
    for _ in range(max_steps):
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


def row_mixture_quantiles(
    weight: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    probs,
    tol: float = 1e-12,
    max_steps: int = 100,
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

    :param weight: ``(n, C)`` weights summing to one per row (zero: padding), as
        :func:`compact_mixture_rows` lays them out.
    :param loc: ``(n, C)`` means.
    :param scale: ``(n, C)`` standard deviations (positive).
    :param probs: probabilities in ``(0, 1)``.
    :param float tol: the largest error of the CDF at the quantiles.
    :param int max_steps: the most Newton steps per precision.
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
            q32 = _newton_quantiles(*single, q.float(), a.float(), b.float(), p, 1e-5, max_steps)
            q = torch.minimum(torch.maximum(q32.to(q.dtype), a), b)
        out.append(_newton_quantiles(weight, w_pdf, loc, inv, q, a, b, p, tol, max_steps))
    return torch.stack(out)
