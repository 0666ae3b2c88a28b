"""Checkpoints of :func:`~pyro_trees.infer.fit`: the whole training state, written
atomically every few steps, and read back into freshly built modules."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
from pyro.util import set_rng_state

__all__ = ["Checkpoint", "resume_from"]


def _cuda_rng_state():
    """Every CUDA device's generator state, or ``None`` when CUDA has not been used (so
    a CPU run never initialises CUDA for its checkpoint)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [t.cpu() for t in torch.cuda.get_rng_state_all()]
    return None


def _set_cuda_rng_state(states) -> None:
    """Restore :func:`_cuda_rng_state`'s states where this machine has as many CUDA
    devices; otherwise (a CUDA checkpoint resumed on CPU, say) leave CUDA alone."""
    if states is None or not torch.cuda.is_available():
        return
    if len(states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in states])


class Checkpoint:
    """Writes the whole training state every ``every`` steps and reads it back.

    :param path: the file (written atomically through ``path.tmp``); :func:`fit`'s
        ``checkpoint``.
    :param int every: steps between writes; :func:`fit`'s ``checkpoint_every``.

    .. rubric:: Examples

    >>> import os
    >>> import tempfile
    >>> import torch
    >>> from pyro_trees.infer import Checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "run.pt")
    >>> saver = Checkpoint(path, every=2)
    >>> for step in (1, 2, 3):
    ...     saver.after_step(step, lambda: {"weights": torch.ones(2)})
    >>> sorted(torch.load(path).items(), key=lambda kv: kv[0])  # written at step 2 only
    [('step', 2), ('weights', tensor([1., 1.]))]
    """

    def __init__(self, path: str | os.PathLike, every: int = 500):
        self.path = path
        self.every = every

    def after_step(self, done: int, state: Callable[[], dict]) -> None:
        """Write ``state()`` when ``done`` is a multiple of ``every``."""
        if done % self.every == 0:
            self.save(done, state())

    def save(self, step: int, state: dict) -> None:
        """Write ``{"step": step, **state}``."""
        tmp = f"{os.fspath(self.path)}.tmp"
        torch.save({"step": step, **state}, tmp)
        os.replace(tmp, self.path)


def resume_from(path, model, guide, optimizer, scheduler, stopping, device=None):
    """Load a checkpoint written by :func:`fit` into the model, the guide, the optimiser,
    the scheduler, early stopping's bookkeeping and the random generators.

    :returns: ``(result, step)``: the run's :class:`FitResult` so far and its step count.
    """
    state = torch.load(path, map_location=device, weights_only=False)
    for m, key in ((model, "model"), (guide, "guide")):
        if isinstance(m, torch.nn.Module):
            m.load_state_dict(state[key].state_dict())
    optimizer.load_state_dict(state["optimizer"])
    # Checkpoints written before the scheduler was saved have no entry; the scheduler
    # then starts afresh from the optimiser's saved learning rate.
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    result = copy.deepcopy(state["result"])
    result.stopped = "num_steps"
    # Early stopping's bookkeeping and the random streams (absent from older
    # checkpoints): a resumed run then continues exactly as an uninterrupted one.
    if stopping is not None:
        stopping.result = result
        stopping.best_state = state.get("best_state")
        stopping.bad_evals = state.get("bad_evals", 0)
    if state.get("rng") is not None:
        rng = dict(state["rng"])
        rng["torch"] = rng["torch"].cpu()
        set_rng_state(rng)
    _set_cuda_rng_state(state.get("cuda_rng"))
    return result, state["step"]
