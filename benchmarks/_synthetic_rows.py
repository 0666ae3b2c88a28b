"""Synthetic regression rows generated batch by batch (never all in memory), for the
distributed and streaming benchmarks."""

from __future__ import annotations

import torch

IN_FEATURES = 8


def target(x: torch.Tensor) -> torch.Tensor:
    """A tree-shaped function of the first three inputs plus a linear trend."""
    step = torch.where(x[:, 0] > 0, 1.0, -1.0) + torch.where(x[:, 1] > 0.5, 0.5, 0.0)
    return step + 0.5 * x[:, 2]


def rows(start: int, stop: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start..stop-1`` of the data set ``seed``: ``(x (n, 8), y (n,))``; row ``i``
    is the same whatever batch it comes in (generated in blocks of 1024 rows)."""
    xs, ys = [], []
    block = 1024
    for b in range(start // block, (stop - 1) // block + 1):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + b)
        x = torch.randn(block, IN_FEATURES, generator=gen)
        y = target(x) + 0.1 * torch.randn(block, generator=gen)
        lo, hi = max(start - b * block, 0), min(stop - b * block, block)
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    return torch.cat(xs), torch.cat(ys)


class SyntheticRows:
    """A re-iterable of ``(x, y)`` batches of ``batch_size`` rows out of ``num_rows``,
    generated on the fly; ``rank``/``world_size`` take every ``world_size``-th batch.

    :param int num_rows: rows of the whole data set.
    :param int batch_size: rows per batch.
    :param int seed: the data set.
    """

    def __init__(self, num_rows, batch_size, seed=0, rank=0, world_size=1):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        glob = self.batch_size * self.world_size
        for k in range(self.num_rows // glob):  # the same number of batches on every rank
            start = k * glob + self.rank * self.batch_size
            yield rows(start, start + self.batch_size, self.seed)
