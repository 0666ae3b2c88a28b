"""What :func:`~pyro_trees.infer.fit` feeds its ELBO at each step: the tensors it was
given or the next batch of a :class:`~pyro_trees.infer.Stream`, in one process or on
one rank of a :mod:`torch.distributed` group (``fit``'s data-parallel half)."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from pyro_trees.infer.distributed import (
    RankSubsample,
    _active,
    _dist,
    all_reduce_sum,
    average_gradients,
    broadcast_parameters,
    check_same_across_ranks,
    collective,
    comm_device,
    is_main,
    world,
)
from pyro_trees.infer.stream import Stream

__all__ = ["TrainingData", "local_device"]


def local_device(device):
    """``device``, with a bare ``"cuda"`` made this rank's GPU (``LOCAL_RANK``) under a
    multi-process launcher."""
    if device is None or "LOCAL_RANK" not in os.environ:
        return device
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return device


def _shapes(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, tuple | list):
        return tuple(_shapes(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(value.items()))
    return None


class TrainingData:
    """The data of one :func:`fit` run (see the module docstring).

    :param args: ``fit``'s positional arguments: tensors, or one :class:`Stream`.
    :param kwargs: its keyword arguments for the model.
    :param seed: ``fit``'s seed (the permutations of the ranks' minibatches).
    :param device: where batches go.
    """

    def __init__(self, args, kwargs, seed, device):
        self.stream = args[0] if len(args) == 1 and isinstance(args[0], Stream) else None
        if self.stream is None and any(isinstance(a, Stream) for a in args):
            raise ValueError("pass a Stream as fit's only positional argument")
        self.args, self.kwargs, self.device = args, kwargs, device
        world(device)  # joins the group when launched by torchrun
        self.parallel = _active()
        self.handlers: list = []
        self._pending = None
        if self.stream is not None:
            self.scale = self.stream.scale()
            self.handlers.append(self.scale)
            self._batches = iter(self.stream)
        if not self.parallel:
            return
        if self.stream is None:
            check_same_across_ranks(_shapes((args, kwargs)), "the shapes of fit's arguments")
        else:
            check_same_across_ranks(self.stream.num_rows, "Stream's num_rows")
        # One random stream on every rank: the same latent draws, so that the average
        # of the ranks' gradients is the gradient of one process on the global batch.
        state = torch.get_rng_state().to(comm_device())
        with collective("sharing rank 0's random state"):
            _dist().broadcast(state, 0)
        torch.set_rng_state(state.cpu())
        if seed is None:
            mine = int.from_bytes(os.urandom(4), "little") if is_main() else 0
            seed = int(all_reduce_sum(torch.tensor([mine], device=comm_device())).item())
        self.subsample = RankSubsample(seed)
        self.handlers.append(self.subsample)

    def _batch(self, step: int):
        if self.stream is None:
            return self.args, self.kwargs
        if self._pending is None:
            args, kwargs = next(self._batches)
            args, kwargs = _to_device((args, kwargs), self.device)
            self._pending = (args, {**self.kwargs, **kwargs})
        return self._pending

    def loss(self, elbo, step: int, warm_up: bool = False) -> torch.Tensor:
        """The loss of step ``step`` (``warm_up``: the first evaluation, which creates
        lazy parameters; its batch is kept for the first step)."""
        args, kwargs = self._batch(step)
        if not warm_up:
            self._pending = None
        if self.parallel:
            self.subsample.step = step
        with contextlib.ExitStack() as stack:
            for handler in self.handlers:
                stack.enter_context(handler)
            value = elbo(*args, **kwargs)
        if warm_up:
            self._check_started()
        return value

    def _check_started(self) -> None:
        if self.stream is not None and not self.scale.seen:
            raise ValueError(
                f"no sample site lies inside a plate named {self.stream.plate!r}: pass "
                "Stream(..., plate=) the name of the model's plate over rows"
            )
        if self.parallel and self.stream is None and not self.subsample.used and is_main():
            warnings.warn(
                "no plate subsamples its rows: every rank computes the full-batch gradient "
                "(pass subsample_size= to the model for data-parallel minibatches)",
                stacklevel=3,
            )

    def start(self, params, modules) -> None:
        """Give every rank rank 0's parameters and buffers (after lazy creation)."""
        if self.parallel:
            buffers = [b for m in modules for b in m.buffers() if b.is_floating_point()]
            broadcast_parameters(list(params) + buffers)

    def reduce(self, params, value: float) -> float:
        """Average the gradients (and the loss) across ranks; the mean loss."""
        return average_gradients(params, value) if self.parallel else value

    def agree(self, stop: bool) -> bool:
        """``True`` on every rank when ``stop`` is ``True`` on any."""
        if not self.parallel:
            return stop
        flag = torch.tensor([float(bool(stop))], device=comm_device())
        return bool(all_reduce_sum(flag).item() > 0)

    def mean(self, evaluate):
        """``evaluate`` averaged across ranks (one decision for early stopping)."""
        if not self.parallel:
            return evaluate

        def mean() -> float:
            value = torch.tensor([float(evaluate())], device=comm_device())
            return float(all_reduce_sum(value).item()) / _dist().get_world_size()

        return mean


def _to_device(value, device):
    """``value`` (tensors, possibly in tuples, lists and dicts) moved to ``device``."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
