"""``StackedEarlyStopping``: early stopping of each fit of a stack of guides trained as one.

When ``F`` fits train as one program (a :class:`~pyro_trees.guides.StackedGuides`), each
still has its own held-out rows, its own best state and its own patience: it is scored,
kept and stopped as :class:`~pyro_trees.infer.EarlyStopping` would stop it alone. A fit
that stops leaves the program, which runs on with the others until every fit has
stopped; each fit's best state is then restored into its guide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pyro_trees.infer.fit import EarlyStopping, FitResult, _snapshot

__all__ = ["StackedEarlyStopping"]


class StackedEarlyStopping(EarlyStopping):
    """Early stopping of each of the ``F`` fits of a stack of guides, for :func:`fit`.

    Every ``eval_every`` steps the stack's values are written into its guides
    (:meth:`StackedGuides.unstack <pyro_trees.guides.StackedGuides.unstack>`) and each
    fit still running is scored by ``metric(j)`` (lower is better); its best state (the
    guide's ``state_dict``), best step and patience are its own, under
    :class:`~pyro_trees.infer.EarlyStopping`'s rules (the starting state is a candidate,
    ``min_delta``, ``patience=None`` never stops). A fit that stops leaves the program
    (:meth:`StackedGuides.keep <pyro_trees.guides.StackedGuides.keep>`), so that the
    later steps compute the running fits only; :func:`fit` stops when every fit has
    stopped, and :meth:`restore` loads each fit's best state into its guide.

    Each fit's own history is in ``results`` (one :class:`~pyro_trees.infer.FitResult`
    per fit): its validation scores, best step and value, why it stopped and, where
    ``fit_losses`` is given, its own loss at every step it ran. :func:`fit`'s result is the
    stack's (the summed loss).

    :param metric: ``metric(j) -> float``, fit ``j``'s criterion on its held-out rows,
        read from guide ``j`` (written from the stack before each evaluation).
    :param stack: the :class:`~pyro_trees.guides.StackedGuides` being trained.
    :param fit_losses: optional callable returning the fits' losses of the last step, a
        tensor ``(F,)`` (such as :attr:`VaRTForestELBO.fit_losses
        <pyro_trees.infer.VaRTForestELBO.fit_losses>`); read back at the evaluations.
    :param int eval_every: steps between evaluations.
    :param patience: evaluations without an improvement of ``min_delta`` before a fit
        stops (``None``: none stops early; each keeps its best state).
    :param float min_delta: the smallest decrease that counts as an improvement.

    .. rubric:: Examples

    >>> import pyro
    >>> from pyro_trees.guides import StackedGuides, VaRTForestGuide
    >>> from pyro_trees.infer import FitResult, StackedEarlyStopping
    >>> from pyro_trees.models import VaRTForest
    >>> model = VaRTForest(1, num_trees=2, depth=1)
    >>> with pyro.settings.context(module_local_params=True):
    ...     stack = StackedGuides([VaRTForestGuide(model, init="random") for _ in range(2)])
    >>> scores = {0: iter([3.0, 2.0, 2.5]), 1: iter([3.0, 2.9, 2.8])}
    >>> stopping = StackedEarlyStopping(lambda j: next(scores[j]), stack, eval_every=1,
    ...                                 patience=1)
    >>> stopping.bind([stack], FitResult())
    >>> stopping.score_start()
    >>> [stopping.after_step(step, last=False) for step in (1, 2)]
    [False, False]
    >>> [(r.best_step, r.stopped) for r in stopping.results]
    [(1, 'early_stopping'), (2, 'num_steps')]
    """

    def __init__(
        self,
        metric: Callable[[int], float],
        stack,
        *,
        fit_losses: Callable[[], torch.Tensor | None] | None = None,
        eval_every: int = 20,
        patience: int | None = None,
        min_delta: float = 0.0,
    ):
        super().__init__(metric, eval_every=eval_every, patience=patience, min_delta=min_delta)
        self.stack = stack
        self.fit_losses = fit_losses
        self._reset()

    def _reset(self) -> None:
        num = len(self.stack)
        self.results = [FitResult() for _ in range(num)]
        self.best_states: list = [None] * num
        self.bad = [0] * num
        self.running = list(range(num))
        self._pending: list = []

    def bind(self, modules, result, loss=None, kwargs=None, device=None) -> None:
        """Attach to a run (``modules`` are not snapshot: each fit's guide is); the
        bookkeeping of an earlier run is cleared."""
        self.modules, self.result = list(modules), result
        self.best_state, self.bad_evals = None, 0
        self._reset()

    def _score(self, done: int) -> None:
        """Score every running fit after ``done`` steps; stop those out of patience."""
        guides = self.stack.unstack()
        running = len(self.running)
        for j in list(self.running):
            result = self.results[j]
            val = float(self.metric(j))
            result.val_losses.append((done, val))
            if self._improves(result, val):
                result.best_val, result.best_step = val, done
                self.best_states[j] = _snapshot(guides[j])[0]
                self.bad[j] = 0
                continue
            self.bad[j] += 1
            if self._out_of_patience(self.bad[j]):
                result.stopped = "early_stopping"
                self.running.remove(j)
        if self.running and len(self.running) < running:
            self.stack.keep(self.running)  # the stopped fits leave the program

    def _read_losses(self) -> None:
        """Move the pending step losses into the running fits' results."""
        if not self._pending:
            return
        rows = torch.stack(self._pending).tolist()  # one wait for the device
        self._pending.clear()
        for j in self.running:
            self.results[j].losses.extend(row[j] for row in rows)

    def score_start(self) -> None:
        """Score every fit's starting state as step 0."""
        self._score(0)

    def after_step(self, done: int, last: bool) -> bool:
        """Called after ``done`` steps (``last``: the final one); ``True`` when every fit
        has stopped."""
        if self.fit_losses is not None:
            value = self.fit_losses()
            if value is not None:
                self._pending.append(value)
        if done % self.eval_every != 0 and not last:
            return False
        self._read_losses()
        self._score(done)
        return not self.running

    def restore(self) -> None:
        """Load each fit's best state into its guide; the fits still running when the
        loop ended take its reason (``"num_steps"``, ``"non_finite"``) and its time."""
        self._read_losses()
        guides = self.stack.guides
        for j, result in enumerate(self.results):
            if j in self.running:
                result.stopped = self.result.stopped
            result.seconds = self.result.seconds
            if self.best_states[j] is not None:
                guides[j].load_state_dict(self.best_states[j])
