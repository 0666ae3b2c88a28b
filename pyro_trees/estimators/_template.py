"""The one ``fit`` of every SVI estimator, written once: :class:`SVIEstimator`.

``fit`` runs, in this order and for every family,

1. the declared parameter checks (:func:`~pyro_trees.estimators._constraints.validate_params`
   over the class's ``_parameter_constraints``, then the family's
   ``_check_params_together`` for the few checks that tie parameters together);
2. the input checks and scaling (:meth:`TabularEstimator._validate_fit`, which also
   records where the values of estimators that route them are missing);
3. one seed rule (:func:`fit_seed`): ``seed_`` is ``random_state``, or with ``None`` a
   seed drawn from torch's global stream (rank 0's, shared under ``torchrun``);
4. one held-out split (:func:`held_out_rows`, its sizes a :class:`HeldOutRule` per
   family);
5. the several-fits loop: ``_num_fits`` times ``_fit_one`` (a VaRT pool's members, the
   RNN-Tree's starts, the one fit of the GP), each of which starts a model and guide
   and trains them with :func:`run_svi` (:func:`~pyro_trees.infer.fit` with early
   stopping on the family's held-out score);
6. the after-fit hook ``_after_fit`` (pooling, calibration, the choice among starts).

A family writes only its hooks. Families whose every random draw comes from the global
streams (``_seed_whole_fit = True``) run steps 4 to 6 inside
:func:`~pyro_trees.estimators._rng.local_seed` of ``seed_``; the VaRT families seed each
fit themselves (a generator for the start, ``local_seed`` around training).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyro_trees.estimators._base import TabularEstimator
from pyro_trees.estimators._constraints import validate_params
from pyro_trees.estimators._distributed import fit_args, rank_fit
from pyro_trees.estimators._rng import local_seed
from pyro_trees.infer.fit import fit

__all__ = ["HeldOut", "HeldOutRule", "SVIEstimator", "fit_seed", "held_out_rows", "run_svi"]


def fit_seed(random_state, ranks) -> int:
    """The seed of a fit (``seed_``): ``random_state``, or with ``None`` one drawn from
    torch's global stream (under ``torchrun``, rank 0's draw, shared by every rank)."""
    if random_state is None:
        return int(ranks.shared(int(torch.randint(2**31, ()).item())))
    return int(random_state)


@dataclass(frozen=True)
class HeldOutRule:
    """How many of ``n`` rows a family holds out, and how it draws them.

    With ``f = validation_fraction``: none when ``f == 0`` or ``f * n < min_expected``;
    else ``max(round(f n), min(floor, n // floor_share))`` rows, or none when that is
    below ``min_rows``. ``generator="torch"`` draws the permutation with
    ``torch.randperm`` from the fit's generator (which goes on to start the first
    fit); ``"numpy"`` with ``numpy.random.default_rng(seed_)``.
    """

    floor: int = 1
    floor_share: int = 1
    min_rows: int = 1
    min_expected: float = 0.0
    generator: str = "numpy"

    def size(self, n: int, fraction: float) -> int:
        """Held-out rows of ``n`` at ``fraction``."""
        if fraction <= 0 or fraction * n < self.min_expected:
            return 0
        n_val = max(int(round(fraction * n)), min(self.floor, n // self.floor_share))
        return n_val if n_val >= self.min_rows else 0


#: the VaRT families: at least min(10, N // 5) rows where N allows, none below 4
VART_HELD_OUT = HeldOutRule(floor=10, floor_share=5, min_rows=4, generator="torch")


@dataclass
class HeldOut:
    """A held-out split: the row permutation ``perm`` ``(N,)`` and the fold size
    ``n_val`` (0: nothing held out, ``perm`` is ``arange(N)``). Fold ``k`` is
    ``perm[k n_val : (k + 1) n_val]``; fold 0 is the held-out split."""

    perm: torch.Tensor
    n_val: int

    @property
    def num_folds(self) -> int:
        """Disjoint folds of ``n_val`` rows (1 without held-out rows)."""
        return max(self.perm.shape[0] // self.n_val, 1) if self.n_val else 1

    def fold(self, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold ``k``'s rows and the other rows, in ``perm``'s order."""
        start, stop = k * self.n_val, (k + 1) * self.n_val
        return self.perm[start:stop], torch.cat([self.perm[:start], self.perm[stop:]])


def held_out_rows(
    n: int, fraction: float, rule: HeldOutRule, *, ranks, seed: int, generator=None, device=None
) -> HeldOut:
    """The held-out split of ``n`` rows under ``rule`` (every shard holds out rows, or
    none). ``generator``: the fit's ``torch.Generator`` (``rule.generator="torch"``);
    ``seed``: ``seed_`` (``"numpy"``)."""
    n_val = rule.size(n, fraction)
    if ranks.spread and not ranks.min(n_val):
        n_val = 0
    if not n_val:
        return HeldOut(torch.arange(n, device=device), 0)
    if rule.generator == "torch":
        perm = torch.randperm(n, generator=generator)
    else:
        perm = torch.as_tensor(np.random.default_rng(seed).permutation(n))
    return HeldOut(perm.to(device), n_val)


def run_svi(
    ranks,
    model,
    guide,
    X: torch.Tensor,
    y: torch.Tensor,
    *,
    seed: int | None = None,
    batch: int | None = None,
    n_rows: int | None = None,
    **fit_kwargs,
):
    """Train ``model`` and ``guide`` on ``(X, y)`` with :func:`~pyro_trees.infer.fit`
    (early stopping, schedules, loss... in ``fit_kwargs``), as every SVI estimator does:
    under ``torchrun`` each rank passes its rows (:func:`fit_args`) and reads its share
    of each minibatch of ``batch`` rows (``None``, or at least ``n_rows``: full
    batches); with ``seed``, inside :func:`local_seed` of it (the global streams left
    alone). Returns the :class:`~pyro_trees.infer.FitResult`."""
    if batch is not None and (n_rows is None or batch < n_rows):
        fit_kwargs["subsample_size"] = max(int(batch) // ranks.size, 1)
    with local_seed(seed, X.device), rank_fit(ranks):
        return fit(model, guide, *fit_args(ranks, X, y), **fit_kwargs)


class SVIEstimator(TabularEstimator):
    """Base of the SVI estimators: the ``fit`` template above and its hooks.

    Subclasses declare ``_parameter_constraints`` (every constructor parameter) and
    ``_held_out_rule``, and write the hooks ``_fit_one`` (one fit: model and guide,
    loss, held-out score, :func:`run_svi`), and where they need them
    ``_check_params_together``, ``_num_fits`` and ``_after_fit``.
    """

    _parameter_constraints: dict = {}
    _held_out_rule: HeldOutRule = HeldOutRule()
    #: whether the whole fit runs inside ``local_seed(seed_)`` (families that draw from
    #: the global streams); else each fit seeds itself
    _seed_whole_fit = True

    def fit(self, X, y, *, sharded: bool = False):
        """Fit on ``X`` and ``y`` (see the class's docstring for what its fit learns).

        ``X`` (and a regressor's ``y``) are standardised inside; predictions are in the
        units of ``y``. With an integer ``random_state`` the fit is reproducible and
        leaves the global random streams (Python, NumPy, torch) as it found them; with
        ``None`` it draws its seed from torch's global stream and keeps it as ``seed_``
        (``random_state=seed_`` repeats the fit). Under ``torchrun`` the fit is
        data-parallel (the guide's "Estimators on several processes"): each rank trains
        on its part of every minibatch and the fitted estimator is the same on every
        rank.

        :param X: ``(N, L)`` array-like or pandas DataFrame of numeric or bool columns.
        :param y: ``(N,)`` targets or class labels (``(N, K)`` for a multi-output
            regressor).
        :param bool sharded: under ``torchrun``, each rank passes only its own rows
            (default: every rank passes all of them). Scalers, classes, clipping ranges
            and held-out scores then use every rank's rows (all-reduced); each rank
            holds out its own rows, and data-driven starts are grown on rank 0's rows
            and broadcast. Estimators that cannot train on shards say so.
        :returns: ``self``.
        :raises ValueError: naming the cause, for invalid options or data.
        """
        validate_params(self)
        self._check_params_together(sharded)
        X, y = self._validate_fit(X, y, sharded=sharded)
        self.seed_ = fit_seed(self.random_state, self.ranks_)
        with local_seed(self.seed_ if self._seed_whole_fit else None, self.device_):
            generator = torch.Generator().manual_seed(self.seed_)
            split = held_out_rows(
                X.shape[0],
                self.validation_fraction,
                self._held_out_rule,
                ranks=self.ranks_,
                seed=self.seed_,
                generator=generator,
                device=X.device,
            )
            self._before_fits(X, y, split)
            self._after_fit(X, y, split, self._fit_all(X, y, split, generator))
        return self

    # -- hooks ---------------------------------------------------------------------------
    def _check_params_together(self, sharded: bool) -> None:
        """Checks that tie parameters together (after the declared ones)."""

    def _num_fits(self, split: HeldOut) -> int:
        return 1

    def _before_fits(self, X, y, split: HeldOut) -> None:
        """What every fit shares (built once, before the loop)."""

    def _fit_all(self, X, y, split: HeldOut, generator) -> list:
        """The several-fits loop: ``_fit_one`` for ``j`` in ``range(_num_fits)``."""
        return [self._fit_one(j, X, y, split, generator) for j in range(self._num_fits(split))]

    def _fit_one(self, j: int, X, y, split: HeldOut, generator):
        """Fit ``j`` of the loop; its return value goes to :meth:`_after_fit`."""
        raise NotImplementedError

    def _after_fit(self, X, y, split: HeldOut, fits: list) -> None:
        """After every fit: pooling, calibration, choices among the fits."""
