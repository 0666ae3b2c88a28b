"""``fit``: a training loop around a Pyro ELBO, with the conveniences of a mature library.

``fit`` is a convenience on top of Pyro, never the only way in: every model and guide
in pyro_trees also trains with a plain ``pyro.infer.SVI`` loop.

Parameters belong to the model and the guide (``PyroModule`` attributes). ``fit`` runs
inside a fresh scope of Pyro's param store (:func:`isolated_params`), so nothing is read
from or left in the global store, two models trained in one process never share
parameters, and ``torch.save`` / pickle of the model and guide is a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyro
import torch
from pyro.infer import Trace_ELBO
from pyro.util import get_rng_state

from pyro_trees._exclusive import exclusive
from pyro_trees._interrupts import deferred_interrupts, raise_if_interrupted
from pyro_trees.infer._fit_data import TrainingData, _to_device, local_device
from pyro_trees.infer.allocator import keep_freed_memory
from pyro_trees.infer.checkpoint import Checkpoint, _cuda_rng_state, resume_from
from pyro_trees.infer.distributed import is_main
from pyro_trees.infer.fused_adam import FusedClippedAdam

__all__ = [
    "EarlyStopping",
    "FitResult",
    "fit",
    "isolated_params",
    "make_optimizer",
    "train_steps",
]

#: steps between reads of the loss in a fit without early stopping, a callback that
#: reads the loss, checkpoints or several processes (see :func:`fit`)
_READ_EVERY = 50

_OPTIMIZERS = {
    "clipped_adam": FusedClippedAdam,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "radam": torch.optim.RAdam,
    "sgd": torch.optim.SGD,
}


@dataclass
class FitResult:
    """What :func:`fit` learnt about the run.

    :ivar losses: training loss (negative ELBO) after every step.
    :ivar val_losses: ``(step, value)`` pairs of the validation criterion.
    :ivar best_step: step whose parameters were kept (``None`` without validation;
        0 when the starting state scored best).
    :ivar best_val: the validation criterion at ``best_step``.
    :ivar stopped: why the loop ended: ``"num_steps"`` (every step ran),
        ``"early_stopping"``, ``"callback"`` (the callback returned ``True``) or
        ``"non_finite"`` (a Ctrl-C raises ``KeyboardInterrupt`` out of :func:`fit`;
        the last checkpoint's result then says ``"interrupted"``).
    :ivar seconds: wall-clock seconds spent in the loop.

    .. rubric:: Examples

    >>> import pyro
    >>> import pyro.distributions as dist
    >>> import torch
    >>> from pyro.infer.autoguide import AutoNormal
    >>> from pyro_trees.infer import fit
    >>> def model(y):
    ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    ...     with pyro.plate("data", len(y)):
    ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
    >>> result = fit(model, AutoNormal(model), torch.zeros(5), num_steps=3, progress=False)
    >>> result.num_steps, result.stopped, result.best_step  # no validation: no best step
    (3, 'num_steps', None)
    """

    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    best_step: int | None = None
    best_val: float | None = None
    stopped: str = "num_steps"
    seconds: float = 0.0

    @property
    def num_steps(self) -> int:
        """Number of steps taken: ``len(losses)``."""
        return len(self.losses)


@contextlib.contextmanager
def isolated_params():
    """A fresh, empty scope of Pyro's param store for the duration of the block.

    ``PyroModule`` parameters accessed inside are registered in the scope only, so a
    model never picks up a same-named parameter of another model from the global
    store; the global store is restored on exit. The store is process-wide: the block
    holds :func:`~pyro_trees.infer.exclusive`.
    """
    with exclusive(), pyro.get_param_store().scope():
        yield


def make_optimizer(params, optim="clipped_adam", lr: float = 1e-2, **optim_args):
    """Build a torch optimiser by name (``"clipped_adam"``, ``"adam"``, ``"adamw"``,
    ``"radam"``, ``"sgd"``), from an optimiser class, or from a callable ``params -> opt``."""
    if isinstance(optim, str):
        try:
            cls = _OPTIMIZERS[optim.lower()]
        except KeyError:
            raise ValueError(
                f"unknown optimiser {optim!r}; choose one of {sorted(_OPTIMIZERS)}, "
                "a torch.optim.Optimizer class, or a callable params -> optimiser"
            ) from None
        return cls(params, lr=lr, **optim_args)
    if isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer):
        return optim(params, lr=lr, **optim_args)
    if callable(optim):
        return optim(params)
    raise ValueError(f"optim must be a name, an optimiser class or a callable, got {optim!r}")


def _snapshot(*modules: torch.nn.Module) -> list[dict]:
    return [copy.deepcopy(m.state_dict()) for m in modules]


class EarlyStopping:
    """Early stopping for :func:`fit`: score the run on a validation criterion every
    ``eval_every`` steps, keep the best state, stop when it no longer improves.

    :param metric: callable returning the criterion (a float, lower is better), e.g. an
        error on held-out rows; or ``None`` with ``val_args``.
    :param val_args: the model's arguments on a validation split: the criterion is then
        the fit's loss on them (with ``val_kwargs``, by default the training keyword
        arguments without ``subsample_size``).
    :param int eval_every: steps between evaluations.
    :param patience: stop after this many evaluations without an improvement of
        ``min_delta`` (``None``: never stop, only keep the best state).
    :param float min_delta: the smallest decrease that counts as an improvement.

    The starting state is a candidate too (:meth:`score_start`): a good initialisation
    (a greedy tree, a warm start) is kept when training never matches it. The best state
    is restored at the end of the fit. :func:`fit` binds it to the run
    (:meth:`bind`); one object may serve several fits in turn.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import EarlyStopping, FitResult
    >>> net = torch.nn.Linear(1, 1)
    >>> scores = iter([3.0, 2.0, 2.5, 2.6])  # the criterion at steps 0, 1, 2 and 3
    >>> stopping = EarlyStopping(lambda: next(scores), eval_every=1, patience=2)
    >>> result = FitResult()
    >>> stopping.bind([net], result)
    >>> stopping.score_start()
    >>> [stopping.after_step(step, last=False) for step in (1, 2, 3)]
    [False, False, True]
    >>> result.best_step, result.best_val
    (1, 2.0)
    >>> stopping.restore()  # net's weights as they were after step 1
    """

    def __init__(
        self,
        metric: Callable[[], float] | None = None,
        *,
        val_args: Sequence | None = None,
        val_kwargs: dict | None = None,
        eval_every: int = 20,
        patience: int | None = None,
        min_delta: float = 0.0,
    ):
        if (metric is None) == (val_args is None):
            raise ValueError("EarlyStopping needs a criterion: a metric or val_args (one)")
        if eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {eval_every}")
        self.metric = metric
        self.val_args = val_args
        self.val_kwargs = val_kwargs
        self.eval_every = eval_every
        self.patience = patience
        self.min_delta = min_delta
        self.evaluate = metric
        self.modules: list = []
        self.result = FitResult()
        self.best_state: list[dict] | None = None
        self.bad_evals = 0

    def bind(self, modules, result, loss=None, kwargs=None, device=None) -> None:
        """Attach to a run: the ``modules`` to snapshot, the ``result`` to write the scores
        in (``val_losses``, ``best_step``, ``best_val``) and, for ``val_args``, the run's
        differentiable ``loss`` (``loss(*args, **kwargs) -> tensor``) and training
        ``kwargs``; the bookkeeping of an earlier run is cleared."""
        self.modules, self.result = list(modules), result
        self.best_state, self.bad_evals = None, 0
        if self.val_args is None:
            self.evaluate = self.metric
            return
        val_args = _to_device(self.val_args, device)
        val_kwargs = dict((kwargs or {}) if self.val_kwargs is None else self.val_kwargs)
        val_kwargs = _to_device(val_kwargs, device)
        val_kwargs.pop("subsample_size", None)

        def evaluate() -> float:
            with torch.no_grad():
                return float(loss(*val_args, **val_kwargs))

        self.evaluate = evaluate

    def score_start(self) -> None:
        """Score the starting state as step 0."""
        val = self.evaluate()
        self.result.val_losses.append((0, val))
        self.result.best_val, self.result.best_step = val, 0
        self.best_state = _snapshot(*self.modules)

    def after_step(self, done: int, last: bool) -> bool:
        """Called after ``done`` steps (``last``: the final one); ``True`` means stop."""
        if done % self.eval_every != 0 and not last:
            return False
        result = self.result
        val = self.evaluate()
        result.val_losses.append((done, val))
        if self._improves(result, val):
            result.best_val, result.best_step = val, done
            self.best_state = _snapshot(*self.modules)
            self.bad_evals = 0
            return False
        self.bad_evals += 1
        return self._out_of_patience(self.bad_evals)

    def _improves(self, result: FitResult, val: float) -> bool:
        """Whether ``val`` becomes the best of ``result``: lower by ``min_delta`` than
        the best so far (or the first score); the starting state keeps its place only
        while strictly better."""
        if result.best_val is None or val < result.best_val - self.min_delta:
            return True
        return result.best_step == 0 and val <= result.best_val

    def _out_of_patience(self, bad_evals: int) -> bool:
        """Whether ``bad_evals`` evaluations without improvement end the run."""
        return self.patience is not None and bad_evals >= self.patience

    def restore(self) -> None:
        """Load the best state into the modules (nothing when none was scored)."""
        if self.best_state is not None:
            for m, s in zip(self.modules, self.best_state, strict=True):
                m.load_state_dict(s)


def train_steps(
    step_fn, start: int, stop: int, result: FitResult, *, after_step=None, bar=None, read_every=1
):
    """The loop: ``step_fn()`` (one gradient step, returning the loss: a float or a 0-dim
    tensor) for steps ``start..stop-1``, recording losses in ``result``.

    Ends early on a non-finite loss (``result.stopped = "non_finite"``) and when
    ``after_step(step, loss)`` returns ``True`` (its reason is already in ``result``).
    Every finished step (``after_step`` included) is a safe point of
    :func:`~pyro_trees.infer.deferred_interrupts`: a Ctrl-C held there raises
    ``KeyboardInterrupt``, with ``result`` holding the finished steps.

    :param bar: a tqdm bar to advance, or ``None``.
    :param int read_every: read the losses back every ``read_every`` steps (after steps
        whose count is a multiple of it, and after the last): on a GPU reading a loss
        waits for the step to finish, so a loop that reads every step never runs ahead
        of the device. Between reads ``after_step`` receives ``None`` for the loss, and
        a non-finite loss stops the loop at the next read (``result.losses`` ends at it).
    """
    pending: list = []

    def read() -> bool:
        """Move the pending losses into ``result``; ``False`` at a non-finite one."""
        if not pending:
            return True
        if all(isinstance(v, torch.Tensor) for v in pending):
            values = torch.stack(pending).tolist()  # one wait for the device
        else:
            values = [float(v) for v in pending]
        pending.clear()
        for value in values:
            result.losses.append(value)
            if not math.isfinite(value):
                result.stopped = "non_finite"
                return False
        return True

    try:
        for step in range(start, stop):
            pending.append(step_fn())
            loss_value = None
            if read_every <= 1 or (step + 1) % read_every == 0 or step + 1 == stop:
                if not read():
                    break
                loss_value = result.losses[-1]
            if bar is not None:
                bar.update(1)
                if loss_value is not None and (read_every > 1 or step % 10 == 0):
                    bar.set_postfix(loss=f"{loss_value:.4g}")
            if after_step is not None and after_step(step, loss_value):
                break
            raise_if_interrupted()
    finally:
        read()


def fit(
    model: Callable,
    guide: Callable,
    *args,
    loss=None,
    num_steps: int = 1000,
    optim="clipped_adam",
    lr: float = 1e-2,
    lr_scheduler: Callable | None = None,
    early_stopping: EarlyStopping | None = None,
    checkpoint: Checkpoint | str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    callback: Callable[[int, float], object] | None = None,
    seed: int | None = None,
    device=None,
    progress: bool | str = True,
    **kwargs,
) -> FitResult:
    """Train ``model`` and ``guide`` by stochastic variational inference.

    ``model(*args, **kwargs)`` and ``guide(*args, **kwargs)`` are called at every step;
    minibatches come from the model's and guide's own ``pyro.plate(...,
    subsample_size=...)`` (pass ``subsample_size=`` through ``kwargs`` when the model
    takes it). In place of tensors, ``args`` may be one :class:`Stream` of minibatches
    (a ``DataLoader``, with the global row count): no process then holds all rows.

    **Several processes.** Launched by ``torchrun`` (or with a process group already
    initialised), ``fit`` trains data-parallel (see :mod:`pyro_trees.infer.distributed`):
    every rank passes the same tensors (or its own shard through a :class:`Stream`);
    each plate with ``subsample_size`` gives every rank its own disjoint rows
    (:class:`RankSubsample`; ``subsample_size`` is per rank, the global batch is
    ``world_size`` times larger); the loss keeps the scale of the global data; the
    gradients (and the reported loss) are averaged across ranks before each step.
    Every rank starts from rank 0's parameters and random state, so parameters stay
    identical on every rank; only rank 0 shows progress and writes checkpoints; early
    stopping and ``callback`` decide for all ranks at once; a checkpoint resumes with any
    number of ranks (the path must be readable by every rank). Without ``seed`` the
    minibatch order comes from a seed drawn on rank 0.

    :param model: a Pyro model, usually a :class:`~pyro.nn.PyroModule`.
    :param guide: its guide, with the same signature.
    :param loss: a :class:`pyro.infer.ELBO`; default :class:`~pyro.infer.Trace_ELBO`.
    :param int num_steps: gradient steps.
    :param optim: ``"clipped_adam"`` (Pyro's ClippedAdam, the default, as one
        multi-tensor update: :class:`~pyro_trees.infer.FusedClippedAdam`), ``"adam"``,
        ``"adamw"``, ``"radam"`` (the optimiser of Antorán et al.), ``"sgd"``, an
        optimiser class or a callable ``params -> optimiser``.
    :param float lr: learning rate.
    :param lr_scheduler: callable ``optimiser -> torch.optim.lr_scheduler.LRScheduler``,
        stepped after every gradient step.
    :param EarlyStopping early_stopping: a validation criterion, how often to score it
        and how patient to be; the best parameters are restored at the end.
    :param checkpoint: a :class:`Checkpoint`, or a path (written every 500 steps), that
        receives the training state and, at the end, the final one (before early
        stopping's best state is restored, so that resuming a finished run with a larger
        ``num_steps`` continues it as one longer run would have):
        ``{"model", "guide", "optimizer", "scheduler", "step", "result", "best_state",
        "bad_evals", "rng", "cuda_rng"}`` (a plain ``torch.save``; ``"scheduler"`` is
        ``None`` without ``lr_scheduler``, ``"best_state"`` without early stopping;
        ``"rng"`` holds :func:`pyro.util.get_rng_state`, the CPU generators, and
        ``"cuda_rng"`` the states of every CUDA device's generator when CUDA is in use,
        else ``None``).
    :param resume: a checkpoint to continue from: loads the model's, the guide's, the
        optimiser's and the scheduler's states, the history, early stopping's best
        state and count, and the random generators (these override ``seed``), then
        runs the remaining steps; a run resumed with the same arguments continues as
        the uninterrupted run would have. Pass the same ``lr_scheduler``; a checkpoint
        without a scheduler state (written by an older version) restarts the schedule
        from the saved learning rate.
    :param callback: called as ``callback(step, loss)`` after every step; returning
        ``True`` stops. A callback whose attribute ``reads_loss`` is ``False`` (such as
        :meth:`TemperatureSchedule.callback <pyro_trees.guides.TemperatureSchedule.callback>`)
        receives ``None`` for the loss between reads (see below).
    :param seed: seed for :func:`pyro.set_rng_seed`.
    :param device: move the model, the guide and tensor arguments there first.
    :param progress: show a tqdm progress bar with the loss (a string: its label).
    :returns: a :class:`FitResult`; the model and guide hold the learnt parameters.

    **Ctrl-C** (or a ``KeyboardInterrupt`` raised by ``callback``) ends the run after
    the step in progress: the checkpoint, if any, is written at that step (its
    ``result.stopped`` says ``"interrupted"``), and ``KeyboardInterrupt`` propagates,
    with the model and guide holding the parameters of the last finished step.
    Resuming from that checkpoint continues exactly as the uninterrupted run would
    have. A second Ctrl-C stops at once, without writing a checkpoint.

    **Reading the loss.** A step's loss is read back from the device only where
    something looks at it: every step with a ``callback`` that reads it, a
    ``checkpoint`` or several processes; otherwise at early stopping's evaluations
    (every ``eval_every`` steps), or every 50 steps without early stopping (on a GPU
    each read waits for the step to finish; the progress bar shows the loss of the
    last read). ``result.losses`` holds every step's loss either way; a non-finite loss
    ends the run at the next read.

    **Threads.** Pyro's handler stack, param store and random streams are
    process-wide: ``fit`` holds :func:`~pyro_trees.infer.exclusive` while it runs, so
    fits started from several threads run one after another.
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    keep_freed_memory()  # a CPU step that page-faults on every block it allocates is slow
    with exclusive(), deferred_interrupts():
        return _train(
            model,
            guide,
            args,
            kwargs,
            loss=loss,
            num_steps=num_steps,
            optim=optim,
            lr=lr,
            lr_scheduler=lr_scheduler,
            early_stopping=early_stopping,
            checkpoint=checkpoint,
            resume=resume,
            callback=callback,
            seed=seed,
            device=device,
            progress=progress,
        )


def _train(
    model,
    guide,
    args,
    kwargs,
    *,
    loss,
    num_steps,
    optim,
    lr,
    lr_scheduler,
    early_stopping,
    checkpoint,
    resume,
    callback,
    seed,
    device,
    progress,
) -> FitResult:
    """:func:`fit`'s work, run under its lock and with Ctrl-C held to safe points."""
    if seed is not None:
        pyro.set_rng_seed(seed)
    loss = Trace_ELBO() if loss is None else loss
    modules = [m for m in (model, guide) if isinstance(m, torch.nn.Module)]
    device = local_device(device)
    if device is not None:
        for m in modules:
            m.to(device)
        args, kwargs = _to_device((args, kwargs), device)
    data = TrainingData(args, kwargs, seed, device)

    result = FitResult()
    with isolated_params():
        elbo = loss(model, guide)
        # A first evaluation creates lazily initialised parameters.
        data.loss(elbo, 0, warm_up=True)
        params = [p for p in elbo.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model and guide have no trainable parameters")
        data.start(params, modules)  # every rank starts from rank 0's parameters
        optimizer = make_optimizer(params, optim, lr)
        scheduler = lr_scheduler(optimizer) if lr_scheduler is not None else None
        stopping = early_stopping
        if stopping is not None:
            stopping.bind(modules, result, elbo, kwargs, device)
            stopping.evaluate = data.mean(stopping.evaluate)
        start_step = 0
        if resume is not None:
            result, start_step = resume_from(
                resume, model, guide, optimizer, scheduler, stopping, device
            )
        elif stopping is not None:
            stopping.score_start()
        saver = checkpoint if is_main() else None  # rank 0 writes
        if saver is not None and not isinstance(saver, Checkpoint):
            saver = Checkpoint(saver)

        def saved() -> dict:
            return {
                "model": model,
                "guide": guide,
                "optimizer": optimizer.state_dict(),
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "result": result,
                "best_state": None if stopping is None else stopping.best_state,
                "bad_evals": 0 if stopping is None else stopping.bad_evals,
                "rng": get_rng_state(),
                "cuda_rng": _cuda_rng_state(),
            }

        mid_step = [False]  # a KeyboardInterrupt that lands inside a step leaves it half done

        # a loop that nothing watches step by step reads its losses at the evaluations
        reads = callback is not None and getattr(callback, "reads_loss", True)
        watched = reads or saver is not None or data.parallel
        read_every = 1 if watched else (_READ_EVERY if stopping is None else stopping.eval_every)
        steps_done = [start_step]

        def step_fn() -> torch.Tensor | float:
            mid_step[0] = True
            optimizer.zero_grad()
            value = data.loss(elbo, steps_done[0])
            value.backward()
            value = data.reduce(params, float(value.detach())) if data.parallel else value.detach()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            steps_done[0] += 1
            mid_step[0] = False
            return value

        def after_step(step: int, loss_value: float) -> bool:
            if callback is not None and data.agree(callback(step, loss_value) is True):
                result.stopped = "callback"
                return True
            if stopping is not None and stopping.after_step(step + 1, step + 1 == num_steps):
                result.stopped = "early_stopping"
                return True
            if saver is not None:
                saver.after_step(step + 1, saved)
            return False

        bar = None
        if progress and is_main():
            from tqdm.auto import tqdm

            desc = progress if isinstance(progress, str) else "fit"
            bar = tqdm(total=num_steps, initial=start_step, desc=desc, leave=False)
        t0 = time.perf_counter()
        try:
            train_steps(
                step_fn,
                start_step,
                num_steps,
                result,
                after_step=after_step,
                bar=bar,
                read_every=read_every,
            )
        except KeyboardInterrupt:
            # Held to the end of a step (or raised by the callback, after its step):
            # the checkpoint then holds the state after the last finished step, and
            # resuming it continues as the uninterrupted run. An interrupt inside a
            # step (a second Ctrl-C) leaves a half-updated state: the last periodic
            # checkpoint stands.
            result.stopped = "interrupted"
            result.seconds += time.perf_counter() - t0
            if saver is not None and not mid_step[0]:
                saver.save(len(result.losses), saved())
            raise
        finally:
            if bar is not None:
                bar.close()
        result.seconds += time.perf_counter() - t0
        # The last checkpoint holds the training state before the best one is restored:
        # resuming it with more steps continues the run, as a longer run would have.
        if saver is not None:
            saver.save(len(result.losses), saved())
        if stopping is not None:
            stopping.restore()
    return result
