"""Temperature scaling of a classifier's posterior predictive on held-out rows (the
``calibrate`` rule of :class:`~pyro_trees.estimators.VaRTClassifier`), as a small
object the estimator holds.

References

* C. Guo, G. Pleiss, Y. Sun, K. Q. Weinberger, *On calibration of modern neural
  networks*, ICML 2017.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

__all__ = ["TemperatureScaling"]


@dataclass(frozen=True)
class TemperatureScaling:
    """:math:`p_k \\propto \\bar p_k^{1/T}`, with :math:`T` on a log grid over
    :math:`[2^{-\\mathrm{octaves}}, 2^{\\mathrm{octaves}}]` (``points`` values)
    minimising the held-out log loss, kept only when every class has a held-out row and
    the leave-one-out check (each row scored at the temperature fitted without it)
    beats :math:`T = 1`; else 1, with a warning where the least log loss was at the
    grid's edge or a class had no held-out row.

    :param float octaves: the grid's half-width in powers of two.
    :param int points: grid points.
    :param str owner: the estimator's name in the warnings.
    :param int stacklevel: of the warnings (the caller of the estimator's ``fit``).
    """

    octaves: float = 2.0
    points: int = 41
    owner: str = "VaRTClassifier"
    stacklevel: int = 7

    @torch.no_grad()
    def fit(self, probs: torch.Tensor, y: torch.Tensor, *, classes, ranks) -> float:
        """The temperature of held-out rows with class probabilities ``probs``
        ``(S, n, K)`` under each of ``S`` posterior draws and labels ``y`` ``(n,)``
        (indices into ``classes``). ``ranks``: sums over every rank's held-out rows
        (:class:`~pyro_trees.estimators._distributed.Ranks`)."""
        counts = ranks.sum(torch.bincount(y, minlength=len(classes)).double())
        if bool((counts == 0).any()):
            missing = [classes[k] for k in (counts == 0).nonzero().flatten().tolist()]
            warnings.warn(
                f"{self.owner}: no held-out row of class {', '.join(map(str, missing))} "
                f"(of {int(counts.sum())} held-out rows); a temperature would move that "
                "class's probabilities with no row to check them on, so calibration is "
                "skipped (temperature_ = 1). Hold out more rows (validation_fraction) to "
                "calibrate.",
                UserWarning,
                stacklevel=self.stacklevel,
            )
            return 1.0
        log_p = probs.double().mean(0).clamp_min(1e-300).log()
        grid = torch.logspace(
            -self.octaves, self.octaves, self.points, base=2.0, dtype=torch.float64
        )
        # per-row log loss at each temperature, (n, G), and at T = 1, (n,)
        scaled = (log_p.unsqueeze(-1) / grid).log_softmax(-2)  # (n, K, G)
        rows = -scaled.gather(-2, y.view(-1, 1, 1).expand(-1, 1, grid.numel())).squeeze(-2)
        raw = -log_p.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        nll = ranks.sum(rows.sum(0))  # (G,)
        best = int(torch.argmin(nll))
        # leave-one-out: each row scored at the temperature fitted without it; the
        # calibration must beat no calibration on rows that did not choose it
        loo = (nll - rows).argmin(-1, keepdim=True)  # (n, 1)
        crossed = ranks.sum(rows.gather(-1, loo).sum())
        if bool(crossed < ranks.sum(raw.sum())):
            return float(grid[best])
        if best in (0, grid.numel() - 1):  # the signature of too few rows of a class
            lo, hi = 2.0**-self.octaves, 2.0**self.octaves
            warnings.warn(
                f"{self.owner}: the held-out log loss is least at the edge of the "
                f"temperature grid [{lo:g}, {hi:g}] (T = {float(grid[best]):g}), but that "
                "temperature scores worse than none on held-out rows that did not choose "
                "it (leave-one-out; a class with few held-out rows); calibration is "
                "skipped (temperature_ = 1).",
                UserWarning,
                stacklevel=self.stacklevel,
            )
        return 1.0
