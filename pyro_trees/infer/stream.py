"""``Stream``: train :func:`~pyro_trees.infer.fit` on minibatches read one at a time
(a :class:`torch.utils.data.DataLoader` or any re-iterable of tensors), so that no
process ever holds all the rows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

__all__ = ["Stream"]


class Stream:
    """Minibatches for :func:`~pyro_trees.infer.fit` in place of full tensors:
    ``fit(model, guide, Stream(loader, num_rows=N))``.

    Every step takes the next batch and calls ``model(*batch)`` and ``guide(*batch)``
    (a tensor batch is one argument, a tuple or list several, a dict keyword
    arguments); at the end of ``batches`` the next epoch starts (calling
    ``batches.sampler.set_epoch(epoch)`` when the sampler has one, as
    :class:`~torch.utils.data.distributed.DistributedSampler` does). The model sees only
    the batch, so its plate over rows (named ``plate``) has the batch's size; every
    sample site inside that plate is scaled by ``num_rows / batch size``, so the loss
    estimates the ELBO of all ``num_rows`` rows, as ``pyro.plate(size=N,
    subsample_size=B)`` does for tensors in memory.

    Under ``torchrun`` each rank iterates its own ``batches`` (its shard, e.g. through a
    ``DistributedSampler``, or data it reads itself) and ``num_rows`` is the GLOBAL row
    count, the same on every rank; batches should have the same size on every rank.

    :param batches: a re-iterable of batches (iterated once per epoch).
    :param int num_rows: the number of rows of the whole data set (all ranks together).
    :param str plate: the name of the model's plate over rows (default ``"data"``; a
        prefixed model's ``"<name>.data"``).

    .. rubric:: Examples

    >>> import pyro
    >>> import pyro.distributions as dist
    >>> import torch
    >>> from pyro.infer.autoguide import AutoNormal
    >>> from pyro_trees.infer import Stream, fit
    >>> def model(y):
    ...     mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    ...     with pyro.plate("data", len(y)):
    ...         pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
    >>> batches = [torch.full((10,), 3.0) for _ in range(5)]  # 50 rows, 10 at a time
    >>> result = fit(model, AutoNormal(model), Stream(batches, num_rows=50),
    ...              num_steps=3, progress=False)
    >>> result.num_steps
    3
    """

    def __init__(self, batches, num_rows: int, plate: str = "data"):
        if isinstance(batches, torch.Tensor | Iterator):
            raise ValueError(
                "Stream needs a re-iterable of batches (a DataLoader, a list, an object "
                "whose __iter__ starts a new pass), not a tensor or a one-shot iterator"
            )
        if isinstance(num_rows, bool) or int(num_rows) != num_rows or num_rows < 1:
            raise ValueError(f"num_rows must be an integer >= 1, got {num_rows!r}")
        self.batches = batches
        self.num_rows = int(num_rows)
        self.plate = str(plate)

    def __iter__(self):
        """``(args, kwargs)`` of every step, epoch after epoch, without end."""
        for epoch in itertools.count():
            sampler = getattr(self.batches, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            empty = True
            for batch in self.batches:
                empty = False
                yield _as_call(batch)
            if empty:
                raise ValueError(f"the stream yielded no batch in epoch {epoch}")

    def scale(self) -> StreamScale:
        """The handler that scales the sites of the plate over rows."""
        return StreamScale(self.num_rows, self.plate)


def _as_call(batch) -> tuple[tuple, dict]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, tuple | list):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise ValueError(
        f"a batch must be a tensor, a tuple or list, or a dict; got {type(batch).__name__}"
    )


class StreamScale(Messenger):
    """Scales every sample site inside the plate named ``plate`` by ``num_rows /
    plate size``: a batch's plate then stands for all ``num_rows`` rows.

    :ivar bool seen: whether a site inside the plate was met (a misnamed plate is an
        error in :func:`~pyro_trees.infer.fit`).
    """

    def __init__(self, num_rows: int, plate: str = "data"):
        super().__init__()
        self.num_rows = int(num_rows)
        self.plate = plate
        self.seen = False

    def _process_message(self, msg) -> None:
        if msg["type"] != "sample" or isinstance(msg["fn"], _Subsample):
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name == self.plate:
                full = frame.full_size if frame.full_size is not None else frame.size
                msg["scale"] = msg["scale"] * (self.num_rows / full)
                self.seen = True
                return
