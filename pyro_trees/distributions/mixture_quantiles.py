"""Quantiles of Gaussian mixtures, the central predictive intervals of mixture experts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["gaussian_mixture_quantiles"]


def gaussian_mixture_quantiles(
    weight: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    probs: Sequence[float],
    dim: int | tuple[int, ...] = -1,
    iters: int = 60,
) -> torch.Tensor:
    r"""Quantiles :math:`q` of Gaussian mixtures: :math:`\sum w\, \Phi((q - \mu) / \sigma)
    = p`, the sum running over the component dims ``dim``.

    Newton steps on the mixture's CDF, kept inside a bracket that bisection shrinks
    (starting at the used components' :math:`\mu \pm 40 \sigma`), until every CDF is
    within 1e-13 of its target or ``iters`` steps have run.

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
    low = torch.where(used, loc - 40 * scale, inf).amin(dims, keepdim=True)
    high = torch.where(used, loc + 40 * scale, -inf).amax(dims, keepdim=True)
    out = []
    for p in probs:
        a, b = low.clone(), high.clone()
        q = (a + b) / 2
        for _ in range(iters):
            z = (q - loc) / scale
            cdf = (weight * torch.special.ndtr(z)).sum(dims, keepdim=True)
            pdf = (weight * torch.exp(-0.5 * z * z) / scale).sum(dims, keepdim=True)
            pdf = pdf / math.sqrt(2 * math.pi)
            below = cdf < p
            a, b = torch.where(below, q, a), torch.where(below, b, q)
            if bool(((cdf - p).abs() <= 1e-13).all()):
                break
            step = q - (cdf - p) / pdf
            inside = (step > a) & (step < b)
            q = torch.where(inside, step, (a + b) / 2)
        out.append(q.squeeze(dims))
    return torch.stack(out)
