"""Balanced and greedy starting trees for routing networks and hierarchical mixtures.

:func:`balanced_start` walks a heap-indexed tree from the root and cuts each node's points
at their median (or, with ``cuts="greedy"``, where CART would); it serves
:meth:`pyro_trees.guides.RNNTree.init_balanced` and :class:`pyro_trees.models.HME`'s
expert start. :func:`input_scaling` gives the standardisation both apply first.

Missing inputs (NaN) are allowed: cuts are placed among each dimension's observed values,
and a node sends the points missing its dimension to the side the greedy search finds
best (XGBoost's learnt default direction) or, failing that, to the side most of its
observed points take (the rule of scikit-learn's trees for a feature never missing in
training).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pyro_trees import trees


def _balanced_cuts(pts: torch.Tensor, like: torch.Tensor):
    """Per dimension: the cut between distinct values nearest the median, and the spread.

    :param pts: ``(n, L)`` points; ``like``: an ``(L,)`` tensor for dtype and device.
    :returns: ``(cut, std)``, each ``(L,)``; a constant dimension has cut = its value
        and std 0; with no points, cuts are 0 and spreads 0.
    """
    n = pts.shape[0]
    if n == 0:
        return torch.zeros_like(like), torch.zeros_like(like)
    missing = torch.isnan(pts)
    if n == 1:  # a missing value cuts at 0, the standardised mean
        return torch.where(missing[0], torch.zeros_like(like), pts[0]), torch.zeros_like(like)
    if bool(missing.any()):
        return _balanced_cuts_missing(pts, missing)
    srt = pts.sort(dim=0).values  # (n, L)
    changes = srt[1:] > srt[:-1]  # (n - 1, L): a cut can sit between rows i and i + 1
    pos = torch.arange(1, n, device=pts.device, dtype=pts.dtype).unsqueeze(-1)
    cost = (pos - n / 2).abs().expand_as(changes).masked_fill(~changes, float("inf"))
    i = cost.argmin(0)  # (L,)
    lo = srt.gather(0, i.unsqueeze(0)).squeeze(0)
    hi = srt.gather(0, (i + 1).unsqueeze(0)).squeeze(0)
    cut = torch.where(changes.any(0), 0.5 * (lo + hi), srt[0])
    return cut, pts.std(0)


def _balanced_cuts_missing(pts: torch.Tensor, missing: torch.Tensor):
    """:func:`_balanced_cuts` among each dimension's observed values (the median of
    those); a dimension with none gets cut 0 and spread 0."""
    n = pts.shape[0]
    count = (~missing).sum(0)  # (L,)
    srt = torch.where(missing, math.inf, pts).sort(dim=0).values  # observed values first
    pos = torch.arange(1, n, device=pts.device, dtype=pts.dtype).unsqueeze(-1)
    changes = (srt[1:] > srt[:-1]) & torch.isfinite(srt[1:])  # between observed values
    cost = (pos - count.to(pts.dtype) / 2).abs().masked_fill(~changes, float("inf"))
    i = cost.argmin(0)
    lo = srt.gather(0, i.unsqueeze(0)).squeeze(0)
    hi = srt.gather(0, (i + 1).unsqueeze(0)).squeeze(0)
    first = torch.where(count > 0, srt[0], torch.zeros_like(srt[0]))
    cut = torch.where(changes.any(0), 0.5 * (lo + hi), first)
    _, spread = _nan_moments(pts, missing)
    return cut, spread


def _nan_moments(x: torch.Tensor, missing: torch.Tensor):
    """Mean and standard deviation (``n - 1``) of each column's observed values, ``(L,)``
    each; 0 where a column has no observed value, spread 0 with a single one."""
    count = (~missing).sum(0).to(x.dtype)
    filled = torch.where(missing, torch.zeros_like(x), x)
    mean = filled.sum(0) / count.clamp_min(1)
    dev = torch.where(missing, torch.zeros_like(x), x - mean)
    var = (dev * dev).sum(0) / (count - 1).clamp_min(1)
    return mean, torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


def _impurity(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Impurity times size of the points selected by each column of ``weights`` ``(n, L)``:
    Gini for long labels, squared error for real targets. Returns ``(L,)``."""
    if y.dtype in (torch.long, torch.int32, torch.int64, torch.bool):
        onehot = torch.nn.functional.one_hot(y.long()).to(weights.dtype)  # (n, C)
        counts = weights.T @ onehot  # (L, C)
        size = counts.sum(-1)
        return size - (counts**2).sum(-1) / size.clamp_min(1)
    y2 = y.reshape(y.shape[0], -1).to(weights.dtype)
    size = weights.sum(0).unsqueeze(-1)  # (L, 1)
    total = weights.T @ y2
    return ((weights.T @ y2**2) - total**2 / size.clamp_min(1)).sum(-1)


def _greedy_cuts(pts: torch.Tensor, y: torch.Tensor, min_leaf: int = 1):
    """Per dimension: the cut that most reduces the impurity of ``y``, as CART grows a node.

    Cuts sit midway between consecutive distinct values and leave at least ``min_leaf``
    points on each side. Vectorised over dimensions with prefix sums of the sorted
    targets, ``O(n L (log n + C))``.

    :param pts: ``(n, L)`` points, ``n >= 2``; ``y``: long labels ``(n,)`` or real
        targets ``(n,)``/``(n, K)``.
    :returns: ``(cut, gain)``, each ``(L,)``; ``gain`` is ``-inf`` where no admissible
        cut exists (e.g. a constant dimension).
    """
    n, L = pts.shape
    srt, order = pts.sort(dim=0)  # (n, L)
    if y.dtype in (torch.long, torch.int32, torch.int64, torch.bool):
        t = F.one_hot(y.long()).to(pts.dtype)  # (n, C)
        counts = t[order].cumsum(0)  # (n, L, C): counts left of a cut after row i
        total = counts[-1]
        size = torch.arange(1, n + 1, dtype=pts.dtype, device=pts.device)[:, None]
        left = size - (counts**2).sum(-1) / size
        right = (n - size) - ((total - counts) ** 2).sum(-1) / (n - size).clamp_min(1)
        whole = n - (total**2).sum(-1) / n  # (L,)
    else:
        t = y.reshape(n, -1).to(pts.dtype)  # (n, K)
        s1 = t[order].cumsum(0)  # (n, L, K)
        s2 = (t**2)[order].cumsum(0)
        size = torch.arange(1, n + 1, dtype=pts.dtype, device=pts.device)[:, None, None]
        left = (s2 - s1**2 / size).sum(-1)
        rsize = (n - size).clamp_min(1)
        right = ((s2[-1] - s2) - (s1[-1] - s1) ** 2 / rsize).sum(-1)
        whole = (s2[-1] - s1[-1] ** 2 / n).sum(-1)
    gain = (whole - left - right)[:-1]  # (n - 1, L): cut between rows i and i + 1
    pos = torch.arange(1, n, device=pts.device)[:, None]
    ok = (srt[1:] > srt[:-1]) & (pos >= min_leaf) & (n - pos >= min_leaf)
    ok &= torch.isfinite(srt[:-1]) & torch.isfinite(srt[1:])  # cuts between finite values
    gain = gain.masked_fill(~ok, -float("inf"))
    best, i = gain.max(0)  # (L,)
    lo = srt.gather(0, i.unsqueeze(0)).squeeze(0)
    hi = srt.gather(0, (i + 1).unsqueeze(0)).squeeze(0)
    return 0.5 * (lo + hi), best


def _greedy_cuts_missing(pts: torch.Tensor, y: torch.Tensor, min_leaf: int = 1):
    """:func:`_greedy_cuts` with missing values (NaN): each dimension's cuts among its
    observed values, the points missing it sent left or right, whichever reduces the
    impurity more (XGBoost's learnt default direction).

    :returns: ``(cut, gain, missing_right)``, each ``(L,)`` (``missing_right`` bool).
    """
    missing = torch.isnan(pts)
    cut_l, gain_l = _greedy_cuts(torch.where(missing, -math.inf, pts), y, min_leaf)
    cut_r, gain_r = _greedy_cuts(torch.where(missing, math.inf, pts), y, min_leaf)
    right = gain_r > gain_l
    return torch.where(right, cut_r, cut_l), torch.maximum(gain_l, gain_r), right


def _first_max(values: torch.Tensor, rtol: float = 1e-9) -> int:
    """The first index whose value is within ``rtol`` (relative) of the largest.

    Standardised inputs all have spread 1 up to the last bits of the standardisation,
    which change with the units of the data (``X`` and ``1e6 * X`` standardise to inputs
    2e-15 apart); a plain ``argmax`` would pick the split dimension by that rounding and
    a fit would depend on the units. Ties at rounding level go to the first dimension.
    """
    top = float(values.max())
    close = values >= top - rtol * abs(top)
    return int(close.nonzero()[0, 0])


def _choose_dimension(pts, y, cut, spread) -> int:
    """The widest dimension, or, with targets, the most informative wide dimension
    (ties at rounding level go to the first dimension, see :func:`_first_max`)."""
    if y is None or pts.shape[0] < 2 or float(spread.max()) <= 0:
        return _first_max(spread)
    right = (pts > cut).to(pts.dtype)  # (n, L)
    ones = torch.ones_like(right)
    gain = _impurity(y, ones) - _impurity(y, right) - _impurity(y, ones - right)
    eligible = spread >= 0.75 * spread.max()
    gain = gain.masked_fill(~eligible, -float("inf"))
    # A gain below 5 % of the node's impurity is noise (e.g. parity, where no single
    # split informs): then the widest dimension is taken.
    if float(gain.max()) <= 0.05 * float(_impurity(y, ones[:, :1])[0]):
        return _first_max(spread)
    return _first_max(gain)


def check_init(init) -> None:
    """Refuse a start other than ``"balanced"``, ``"greedy"`` or ``None`` (the HME model's
    and the RNN-Tree guide's ``init``, which must agree)."""
    if init not in ("balanced", "greedy", None):
        raise ValueError(f"init must be 'balanced', 'greedy' or None, got {init!r}")


def input_scaling(x: torch.Tensor):
    """Mean and standard deviation of every input dimension, ``(L,)`` each; a constant
    (or single-row) dimension gets scale 1. Missing values (NaN) are left out (a
    dimension with no observed value gets mean 0)."""
    missing = torch.isnan(x)
    if bool(missing.any()):
        loc, scale = _nan_moments(x, missing)
    else:
        loc = x.mean(0)
        scale = x.std(0) if x.shape[0] > 1 else torch.ones_like(loc)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return loc, scale


@torch.no_grad()
def balanced_start(
    x: torch.Tensor,
    y: torch.Tensor | None,
    depth: int,
    *,
    sharpness: float = 40.0,
    dim_margin: float = 3.0,
    cuts: str = "balanced",
    min_leaf: int = 1,
    with_missing: bool = False,
):
    """The balanced (or greedy) tree of :meth:`~pyro_trees.guides.RNNTree.init_balanced` on ``x``.

    :param x: ``(N, L)`` inputs, already standardised (NaN where missing).
    :param y: optional targets (see :meth:`~pyro_trees.guides.RNNTree.init_balanced`).
    :param bool with_missing: also return where missing values go.
    :returns: ``(targets, leaf)``: per internal node the dimension logits, ``w0`` and
        ``w1`` ``(2**D - 1, 3L)``, and the leaf each point reaches ``(N,)``; with
        ``with_missing``, ``(targets, leaf, missing)``, with ``missing`` ``(2**D - 1, L)``
        the log-odds that a point missing a dimension goes right at each node when it
        splits on that dimension: ``+-dim_margin`` where a greedy cut chose the side of
        its missing points, else the log-odds of the node's observed points going right
        (each count plus a half).
    """
    if cuts not in ("balanced", "greedy"):
        raise ValueError(f"cuts must be 'balanced' or 'greedy', got {cuts!r}")
    if cuts == "greedy" and y is None:
        raise ValueError("cuts='greedy' needs the targets y")
    L = x.shape[-1]
    n_internal = trees.num_internal(depth)
    targets = torch.zeros(n_internal, 3 * L, dtype=x.dtype, device=x.device)
    missing = torch.zeros(n_internal, L, dtype=x.dtype, device=x.device)
    node_of_point = torch.ones(x.shape[0], dtype=torch.long, device=x.device)
    any_missing = bool(torch.isnan(x).any())
    for j in range(n_internal):
        node = j + 1
        mask = node_of_point == node
        cut, spread = _balanced_cuts(x[mask], like=x[0])
        l = None
        chosen = None  # the greedy side of the missing points, where it was searched
        if cuts == "greedy" and int(mask.sum()) >= 2 * max(1, min_leaf):
            if any_missing:
                g_cut, gain, chosen = _greedy_cuts_missing(
                    x[mask], y[mask], min_leaf=max(1, min_leaf)
                )
            else:
                g_cut, gain = _greedy_cuts(x[mask], y[mask], min_leaf=max(1, min_leaf))
            if float(gain.max()) > 0:
                l = _first_max(gain)
                cut = torch.where(torch.isfinite(gain), g_cut, cut)
        if l is None:
            l = _choose_dimension(x[mask], None if y is None else y[mask], cut, spread)
        slope = sharpness / spread.clamp_min(1e-2)
        targets[j, l] = dim_margin + math.log(max(1, L - 1))
        targets[j, L : 2 * L] = -slope * cut
        targets[j, 2 * L :] = slope
        missing[j] = _missing_log_odds(x[mask], cut, chosen, dim_margin)
        right = x[:, l] > cut[l]
        if any_missing:
            right = torch.where(torch.isnan(x[:, l]), missing[j, l] > 0, right)
        node_of_point = torch.where(mask, 2 * node + right.long(), node_of_point)
    leaf = node_of_point - trees.num_leaves(depth)
    return (targets, leaf, missing) if with_missing else (targets, leaf)


def _missing_log_odds(pts: torch.Tensor, cut: torch.Tensor, chosen, margin: float):
    """Per dimension ``(L,)``, the log-odds that a point of ``pts`` missing it goes right
    at cut ``cut``: ``+-margin`` where a greedy search chose the side of the missing
    points (``chosen``, bool ``(L,)``, and the dimension has some), else the log-odds of
    the observed points going right, each count plus a half (0 with no point)."""
    observed = ~torch.isnan(pts)
    right = (pts > cut) & observed
    n_right = right.sum(0).to(pts.dtype)
    n_left = (observed & ~right).sum(0).to(pts.dtype)
    out = torch.log((n_right + 0.5) / (n_left + 0.5))
    if chosen is not None:
        searched = (~observed).any(0)
        out = torch.where(searched, torch.where(chosen, margin, -margin), out).to(pts.dtype)
    return out
