"""The estimators' side of data-parallel training under ``torchrun``.

Every estimator's ``fit`` runs on the processes of the default process group when one
is initialised (or when ``torchrun`` set ``WORLD_SIZE > 1``); the gradient steps go
through :func:`pyro_trees.infer.fit`, which splits each minibatch across the ranks and
averages the gradients. What is not a gradient step is decided here, the same way on
every rank:

* **default** (``fit(X, y)``, every rank passes the same rows): every rank computes the
  same statistics from the same rows, so nothing needs reducing; the results are those
  of one process. (The estimators' own losses split each minibatch across the ranks
  with :class:`RankRows`; the closed-form VB of the Bayesian HME gives each rank rows
  ``r::W`` and all-reduces its sums, :meth:`Ranks.all_sum`.)
* **sharded** (``fit(X, y, sharded=True)``, each rank passes only its own rows): sums,
  counts, minima and maxima are all-reduced (the standardisation's means and scales,
  the global row count, held-out errors, sufficient statistics of closed-form updates),
  rows that a rule needs together (the coverage scores of a calibration) are gathered,
  and what cannot be reduced exactly (a data-driven initialisation that picks rows, a
  greedy tree) is computed on rank 0's rows and broadcast.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings

import numpy as np
import torch
import torch.distributed as dist

from pyro_trees.infer import collective as _collective
from pyro_trees.infer import comm_device as _comm_device
from pyro_trees.infer import rank_subsample, world
from pyro_trees.infer.hme_elbo import HMEELBO
from pyro_trees.infer.vart_elbo import VaRTELBO
from pyro_trees.infer.vart_forest_elbo import VaRTForestELBO

__all__ = [
    "RankHMEELBO",
    "RankRows",
    "RankVaRTELBO",
    "RankVaRTForestELBO",
    "Ranks",
    "fit_args",
    "rank_fit",
]


def _checksum(y):
    """A value that differs, almost surely, between two different target vectors."""
    if y is None:
        return None
    try:
        return float(np.asarray(y, dtype=np.float64).sum())
    except (TypeError, ValueError):  # class labels of any hashable kind
        return hashlib.sha1("\x00".join(map(str, np.ravel(y))).encode()).hexdigest()


class Ranks:
    """The processes of one ``fit`` and how their rows relate.

    :param bool sharded: each rank holds its own rows (else every rank holds all rows).
    :param device: the device the fit trains on (picks the backend when
        :func:`~pyro_trees.infer.distributed.world` forms the process group).

    ``size`` is 1 outside ``torchrun``; then every reduction is the identity.
    """

    def __init__(self, sharded: bool = False, device=None):
        if not isinstance(sharded, bool):
            raise ValueError(f"sharded must be True or False, got {sharded!r}")
        self.rank, self.size = world(device)
        self.sharded = sharded
        #: rows differ across ranks: statistics must be reduced
        self.spread = sharded and self.size > 1

    # -- reductions ------------------------------------------------------------------
    def _reduce(self, value, op, always: bool = False) -> torch.Tensor:
        t = torch.as_tensor(value)
        if not (self.spread or (always and self.size > 1)):
            return t
        device = t.device
        out = t.detach().to(_comm_device(), torch.float64).clone()
        with _collective("reducing a statistic of the rows"):
            dist.all_reduce(out, op=op)
        return out.to(device, t.dtype if t.is_floating_point() else torch.float64)

    def sum(self, value) -> torch.Tensor:
        """The sum over ranks, in float64, returned in the value's floating dtype (the
        value itself when rows are not spread)."""
        return self._reduce(value, dist.ReduceOp.SUM)

    def all_sum(self, value) -> torch.Tensor:
        """The sum over ranks whenever there are several, also when every rank holds
        every row (for computations that split the rows themselves)."""
        return self._reduce(value, dist.ReduceOp.SUM, always=True)

    def min(self, value) -> torch.Tensor:
        """The elementwise minimum over ranks."""
        return self._reduce(value, dist.ReduceOp.MIN)

    def max(self, value) -> torch.Tensor:
        """The elementwise maximum over ranks."""
        return self._reduce(value, dist.ReduceOp.MAX)

    def count(self, n: int) -> int:
        """The global number of rows from this rank's ``n``."""
        return int(self.sum(float(n)).item())

    def mean_error(self, total, n: int) -> float:
        """``sum(total) / sum(n)`` over ranks: a held-out mean from per-rank sums."""
        both = self.sum(torch.tensor([float(total), float(n)], dtype=torch.float64))
        return float(both[0] / both[1].clamp_min(1.0))

    def first(self, value):
        """The first rank's non-``None`` ``value`` (in rank order), the same on every
        rank: a finding of one shard (a degenerate fit, say) counts for all."""
        if not self.spread:
            return value
        return next((v for v in self.gather_object(value) if v is not None), None)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's ``rows`` concatenated in rank order (the rows themselves when
        not spread)."""
        if not self.spread:
            return rows
        parts = self.gather_object(rows.detach().cpu())
        return torch.cat(parts).to(rows.device)

    def gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.spread:
            return [obj]
        out = [None] * self.size
        with _collective("gathering rows' results"):
            dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank (when spread)."""
        if not self.spread:
            return obj
        box = [obj]
        with _collective("broadcasting rank 0's result"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def shared(self, obj):
        """Rank 0's picklable ``obj`` on every rank whenever there are several (a seed
        drawn from a rank's own random stream, say)."""
        if self.size == 1:
            return obj
        box = [obj]
        with _collective("sharing rank 0's seed"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_modules(self, *modules: torch.nn.Module) -> None:
        """Give every module rank 0's parameters and buffers (when spread)."""
        if not self.spread:
            return
        states = self.broadcast_object(
            [{k: v.cpu() for k, v in m.state_dict().items()} for m in modules]
        )
        for m, s in zip(modules, states, strict=True):
            m.load_state_dict(s)

    def check_data(self, X: np.ndarray, y) -> None:
        """Check that the ranks' data fit together: the same number of features and,
        unless sharded, the same rows (counts and checksums of ``X`` and ``y``).

        :raises ValueError: naming the first rank that differs from rank 0 and how.
        """
        if self.size == 1:
            return
        mine = (X.shape[1],)
        if not self.sharded:
            mine = (
                X.shape[1],
                X.shape[0],
                float(np.nansum(X)),
                int(np.isnan(X).sum()),
                _checksum(y),
            )
        out = [None] * self.size
        with _collective("comparing the ranks' data"):
            dist.all_gather_object(out, mine)
        for r, theirs in enumerate(out):
            if theirs[0] != out[0][0]:
                raise ValueError(f"rank {r} passed {theirs[0]} features, rank 0 passed {out[0][0]}")
            if theirs != out[0]:
                raise ValueError(
                    f"rank {r} passed other rows than rank 0 ({theirs[1]} rows vs "
                    f"{out[0][1]}, or other values): without sharded=True every rank must "
                    "pass the same X and y; with sharded=True each passes its own shard"
                )

    # -- standardisation ---------------------------------------------------------------
    def moments(self, values: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """Global ``(count, mean, std)`` (``ddof=1``) of the rows of ``values`` over
        ranks, in two passes (the mean first, then the squared deviations from it, so
        that large offsets keep their precision)."""
        values = np.asarray(values, dtype=np.float64)
        n = self.count(values.shape[0])
        mean = self.sum(torch.as_tensor(np.asarray(values.sum(axis=0)))).cpu().numpy() / n
        ss = self.sum(torch.as_tensor(np.asarray(((values - mean) ** 2).sum(axis=0)))).cpu().numpy()
        std = np.sqrt(ss / (n - 1)) if n > 1 else np.zeros_like(mean)
        return n, np.asarray(mean), np.asarray(std)


class RankRows:
    """The rows each rank's loss reads at each call, for the estimators' own losses
    (which draw their minibatches themselves rather than through ``pyro.plate``).

    Called as ``rows(n, subsample_size)`` with this rank's row count ``n`` and the
    per-rank minibatch size (``None``: full batch); returns ``(idx, num_rows)``: the
    rows to read and the number of rows the likelihood stands for (it is scaled by
    ``num_rows / len(idx)``), so that the average of the ranks' losses is an
    unbiased estimate of the full-data loss. ``(None, None)`` in one process: the loss
    draws as it always did.

    * every rank holds all rows: a full batch is split ``r::W`` (each rank's part
      scaled by ``W``, so the averaged loss is the full-batch loss); a minibatch is
      rank ``r``'s block of the step's global batch
      (:func:`~pyro_trees.infer.distributed.rank_subsample`).
    * sharded: each rank reads its own rows (all of them, or a minibatch from a
      permutation of its shard), scaled by ``W n_r / b``.

    :param Ranks ranks: the processes of the fit.
    :param int seed: seed of the minibatch permutations.
    """

    def __init__(self, ranks: Ranks, seed: int = 0):
        self.ranks, self.seed, self.step = ranks, int(seed), 0

    def __call__(self, n: int, subsample_size: int | None):
        ranks = self.ranks
        if ranks.size == 1:
            return None, None
        w = ranks.size
        full = subsample_size is None or (not ranks.sharded and w * subsample_size >= n)
        if full:
            idx = torch.arange(n) if ranks.sharded else torch.arange(ranks.rank, n, w)
            return idx, w * idx.numel()
        step, self.step = self.step, self.step + 1
        if ranks.sharded:
            b = min(int(subsample_size), n)
            return rank_subsample(n, b, step, self.seed, rank=0, world_size=1), w * n
        return rank_subsample(n, int(subsample_size), step, self.seed), n


@contextlib.contextmanager
def rank_fit(ranks: Ranks):
    """Around :func:`~pyro_trees.infer.fit` with a loss that reads :class:`RankRows`:
    silences fit's warning that no ``pyro.plate`` subsamples the rows (the loss splits
    them itself)."""
    with warnings.catch_warnings():
        if ranks.size > 1:
            warnings.filterwarnings("ignore", message="no plate subsamples its rows")
        yield


def fit_args(ranks: Ranks, *tensors) -> tuple:
    """:func:`~pyro_trees.infer.fit`'s positional arguments: ``tensors``, or none when
    the ranks hold shards of different sizes (``fit`` checks that every rank passes
    tensors of the same shapes; the loss then holds this rank's rows itself)."""
    return () if ranks.spread else tensors


class _ReadsRankRows:
    """A loss of ours (VaRT tree or forest, HME) reading this rank's rows of :class:`RankRows`
    (``subsample_size`` per rank); called without ``x``, it reads ``data`` (this rank's
    shard, see :func:`fit_args`) and scores them with the loss's ``rows_loss``."""

    def __init__(self, rows: RankRows, data: tuple | None = None, **kwargs):
        super().__init__(**kwargs)
        self.rows, self.data = rows, data

    def differentiable_loss(self, model, guide, x=None, y=None, subsample_size=None):
        if x is None and self.data is not None:
            x, y = self.data
        idx, num_rows = self.rows(x.shape[0], subsample_size)
        if idx is None:
            return super().differentiable_loss(model, guide, x, y, subsample_size)
        return self.rows_loss(model, guide, x, y, idx.to(x.device), num_rows)


class RankVaRTELBO(_ReadsRankRows, VaRTELBO):
    """:class:`~pyro_trees.infer.VaRTELBO` reading this rank's rows of :class:`RankRows`."""


class RankVaRTForestELBO(_ReadsRankRows, VaRTForestELBO):
    """:class:`~pyro_trees.infer.VaRTForestELBO` reading this rank's rows of
    :class:`RankRows`."""


class RankHMEELBO(_ReadsRankRows, HMEELBO):
    """:class:`~pyro_trees.infer.HMEELBO` reading this rank's rows of :class:`RankRows`."""
