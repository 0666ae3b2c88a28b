"""Data-parallel training with :mod:`torch.distributed`: the few primitives that
:func:`~pyro_trees.infer.fit` and the estimators build on.

Launch a script with ``torchrun --nproc_per_node=2 script.py`` (or initialise a process
group yourself): :func:`world` then joins (or creates) the process group, every rank
draws its own disjoint minibatch of the rows (:func:`rank_subsample`,
:class:`RankSubsample`), gradients are averaged across ranks
(:func:`average_gradients`) and statistics of closed-form updates are summed
(:func:`all_reduce_sum`). Nothing here starts processes of its own.

Every process-group initialisation and every collective has a timeout: the environment
variable ``PYRO_TREES_DIST_TIMEOUT`` (seconds, default 300). A rank that dies or stops
answering makes the others raise a ``RuntimeError`` naming their rank and the cause
instead of hanging. ``PYRO_TREES_DIST_BACKEND`` overrides the backend chosen by
:func:`world` (``gloo`` on CPU, ``nccl`` for CUDA devices).
"""

from __future__ import annotations

import contextlib
import functools
import os
from datetime import timedelta

import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.subsample_messenger import _Subsample

__all__ = [
    "RankSubsample",
    "all_reduce_sum",
    "average_gradients",
    "broadcast_parameters",
    "check_same_across_ranks",
    "collective",
    "comm_device",
    "is_main",
    "rank_subsample",
    "world",
]

_TIMEOUT_VAR = "PYRO_TREES_DIST_TIMEOUT"
_BACKEND_VAR = "PYRO_TREES_DIST_BACKEND"


def _dist():
    import torch.distributed as dist

    return dist


def timeout() -> timedelta:
    """The timeout of process-group initialisation and collectives:
    ``PYRO_TREES_DIST_TIMEOUT`` seconds (default 300)."""
    raw = os.environ.get(_TIMEOUT_VAR, "300")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{_TIMEOUT_VAR} must be a number of seconds, got {raw!r}") from None
    if not seconds > 0:
        raise ValueError(f"{_TIMEOUT_VAR} must be > 0, got {raw!r}")
    return timedelta(seconds=seconds)


def _active() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def world(device=None) -> tuple[int, int]:
    """This process's ``(rank, world_size)``.

    Reads the initialised :mod:`torch.distributed` process group; when none is
    initialised but the launcher's variables say there are several processes
    (``WORLD_SIZE > 1``, ``RANK``, ``MASTER_ADDR``, as ``torchrun`` sets them), it
    initialises one with the timeout of :func:`timeout`: backend ``nccl`` when
    ``device`` is a CUDA device, ``gloo`` otherwise (``PYRO_TREES_DIST_BACKEND``
    overrides). Otherwise ``(0, 1)``: one process, nothing initialised.

    :param device: the device training will use (picks the backend).
    :returns: ``(rank, world_size)``.
    :raises RuntimeError: when the backend is unavailable or the group cannot be formed
        within the timeout (the message names the rank and the cause).

    .. rubric:: Examples

    >>> from pyro_trees.infer import world
    >>> world()  # a plain process
    (0, 1)
    """
    dist = _dist()
    if _active():
        return dist.get_rank(), dist.get_world_size()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return 0, 1
    rank = int(os.environ.get("RANK", "-1"))
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={size} but {', '.join(missing)} unset: launch with torchrun or "
            "initialise torch.distributed yourself"
        )
    is_cuda = device is not None and torch.device(device).type == "cuda"
    backend = os.environ.get(_BACKEND_VAR, "nccl" if is_cuda else "gloo")
    if not dist.is_available():
        raise RuntimeError(f"rank {rank}: torch.distributed is not available in this build")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError(
            f"rank {rank}: backend 'nccl' unavailable (no CUDA or no NCCL in this build); "
            f"set {_BACKEND_VAR}=gloo or train on CPU"
        )
    if backend == "gloo" and not dist.is_gloo_available():
        raise RuntimeError(f"rank {rank}: backend 'gloo' unavailable in this build")
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    try:
        dist.init_process_group(backend, timeout=timeout())
    except Exception as e:
        raise RuntimeError(
            f"rank {rank} of {size}: could not form the process group with backend "
            f"{backend!r} at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"within {timeout().total_seconds():g} s ({_TIMEOUT_VAR}): {e}"
        ) from e
    return dist.get_rank(), dist.get_world_size()


def is_main() -> bool:
    """``True`` on rank 0 (and in a plain process): the rank that shows progress and
    writes files.

    .. rubric:: Examples

    >>> from pyro_trees.infer import is_main
    >>> is_main()
    True
    """
    return not _active() or _dist().get_rank() == 0


def comm_device() -> torch.device:
    """The device the tensors of a collective live on: this rank's current CUDA device
    under the NCCL backend, else the CPU (Gloo). Call inside an initialised process group.

    :returns: a :class:`torch.device`.
    """
    if _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def collective(what: str):
    """A context for one collective (``all_reduce``, ``broadcast``, ...): a
    ``RuntimeError`` raised inside is raised again naming this rank, the world size,
    ``what`` failed, and the likely cause (another rank died or stopped answering within
    :func:`timeout`).

    :param str what: the collective in words (``"averaging gradients (all_reduce)"``).
    :raises RuntimeError: when the collective fails.
    """
    try:
        yield
    except RuntimeError as e:
        dist = _dist()
        rank, size = dist.get_rank(), dist.get_world_size()
        raise RuntimeError(
            f"rank {rank} of {size}: {what} failed: {e}. Another rank probably died or "
            f"stopped answering (timeout {timeout().total_seconds():g} s, {_TIMEOUT_VAR})"
        ) from e


def rank_subsample(
    size: int,
    subsample_size: int,
    step: int,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """This rank's minibatch of step ``step``: rows of a shuffled ``range(size)``.

    Every rank computes the same permutation of the rows from ``(seed, epoch)`` and
    takes its own slice: step ``s`` of an epoch uses the global batch
    ``perm[s*G:(s+1)*G]`` with ``G = world_size * subsample_size``, and rank ``r`` gets
    its ``r``-th block of ``subsample_size`` rows. Batches of different ranks are
    disjoint; an epoch has ``size // G`` steps and covers every row but ``size % G``
    (different ones each epoch). One process with ``subsample_size * world_size`` gets
    the union of the ranks' batches. Pass the result to ``pyro.plate("data", size,
    subsample=idx)``; ``subsample_size`` is per rank.

    :param int size: number of rows :math:`N`.
    :param int subsample_size: rows per rank and step.
    :param int step: the step (counted from 0 over the whole run).
    :param int seed: seed of the permutations.
    :param rank: this rank (default :func:`world`'s).
    :param world_size: number of ranks (default :func:`world`'s).
    :returns: ``LongTensor`` ``(subsample_size,)``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import rank_subsample
    >>> a = rank_subsample(10, 2, step=0, rank=0, world_size=2)
    >>> b = rank_subsample(10, 2, step=0, rank=1, world_size=2)
    >>> both = rank_subsample(10, 4, step=0, rank=0, world_size=1)
    >>> bool((torch.cat([a, b]) == both).all())
    True
    """
    if rank is None or world_size is None:
        r, w = world()
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    if subsample_size < 1:
        raise ValueError(f"subsample_size must be >= 1, got {subsample_size}")
    glob = world_size * subsample_size
    if glob > size:
        raise ValueError(
            f"{world_size} rank(s) x subsample_size {subsample_size} = {glob} rows per "
            f"step exceed the {size} rows: use a smaller subsample_size"
        )
    per_epoch = size // glob
    epoch, within = divmod(int(step), per_epoch)
    perm = _permutation(int(size), int(seed), epoch)
    start = within * glob + rank * subsample_size
    return perm[start : start + subsample_size].clone()


@functools.lru_cache(maxsize=2)
def _permutation(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled rows of one epoch (kept: a step only slices it)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63))
    return torch.randperm(size, generator=gen)


class RankSubsample(Messenger):
    """Gives every subsampling ``pyro.plate`` this rank's rows of the current step.

    Inside this handler a plate with ``subsample_size < size`` (as in
    ``pyro.plate("data", N, subsample_size=B)``) does not draw its own random rows: it
    gets :func:`rank_subsample` ``(N, B, step, seed, rank, world_size)``, the same in
    the model and the guide. Set :attr:`step` before each step. This is how
    :func:`~pyro_trees.infer.fit` trains unchanged models data-parallel.

    :param int seed: seed of the permutations.
    :param rank: this rank (default :func:`world`'s).
    :param world_size: number of ranks (default :func:`world`'s).

    .. rubric:: Examples

    >>> import pyro
    >>> from pyro_trees.infer import RankSubsample, rank_subsample
    >>> with RankSubsample(seed=0, rank=1, world_size=2) as handler:
    ...     handler.step = 0
    ...     with pyro.plate("data", 10, subsample_size=2) as idx:
    ...         pass
    >>> idx.tolist() == rank_subsample(10, 2, 0, 0, rank=1, world_size=2).tolist()
    True
    """

    def __init__(self, seed: int = 0, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        if rank is None or world_size is None:
            r, w = world()
            rank = r if rank is None else rank
            world_size = w if world_size is None else world_size
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self.step = 0
        self.used = False  # whether a plate was given rows
        self._cache: dict = {}

    def _process_message(self, msg) -> None:
        fn = msg["fn"]
        if msg["type"] != "sample" or not isinstance(fn, _Subsample):
            return
        if fn.subsample_size is None or fn.subsample_size >= fn.size:
            return
        key = (self.step, msg["name"], fn.size, fn.subsample_size)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == self.step}
            self._cache[key] = rank_subsample(
                fn.size, fn.subsample_size, self.step, self.seed, self.rank, self.world_size
            )
        msg["value"] = self._cache[key].to(fn.device)
        self.used = True


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def average_gradients(params, value: float | None = None) -> float | None:
    """Replace each parameter's ``.grad`` by its mean across ranks, in one all-reduce
    of a flat buffer (a parameter without a gradient counts as zero); also average the
    float ``value`` (a loss) in the same collective.

    :param params: the parameters, in the same order on every rank.
    :param value: a float to average along, or ``None``.
    :returns: the mean of ``value`` across ranks (``value`` itself in one process).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import average_gradients
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> w.sum().backward()
    >>> average_gradients([w], 3.0)  # one process: nothing to average
    3.0
    """
    if not _active() or _dist().get_world_size() == 1:
        return value
    dist = _dist()
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    ref = grads[0] if grads else torch.zeros(())
    extra = [torch.tensor([0.0 if value is None else value], dtype=ref.dtype, device=ref.device)]
    flat = _flat(grads + extra)
    with collective("averaging gradients (all_reduce)"):
        dist.all_reduce(flat)
    flat /= dist.get_world_size()
    _unflat(flat, grads + extra)
    return None if value is None else float(extra[0])


def broadcast_parameters(tensors, src: int = 0) -> None:
    """Overwrite ``tensors`` (parameters, buffers) on every rank with rank ``src``'s, in
    one broadcast of a flat buffer (nothing happens in one process).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import broadcast_parameters
    >>> broadcast_parameters([torch.ones(2)])
    """
    if not _active() or _dist().get_world_size() == 1:
        return
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return
    flat = _flat([t.detach() for t in tensors])
    with collective(f"broadcasting parameters from rank {src}"):
        _dist().broadcast(flat, src)
    _unflat(flat, tensors)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place, and return it: the sufficient statistics
    of a closed-form update or a calibration pass over sharded rows.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import all_reduce_sum
    >>> all_reduce_sum(torch.ones(2))  # one process: unchanged
    tensor([1., 1.])
    """
    if _active() and _dist().get_world_size() > 1:
        with collective("summing statistics (all_reduce)"):
            _dist().all_reduce(tensor)
    return tensor


def check_same_across_ranks(value, what: str) -> None:
    """Raise on every rank when ``value`` (a small picklable fingerprint, such as the
    number of rows and the shape of ``X``) is not the same on all ranks.

    :param value: the fingerprint of this rank.
    :param str what: what it describes, for the message.
    :raises ValueError: naming the ranks whose value differs from rank 0's.

    .. rubric:: Examples

    >>> from pyro_trees.infer import check_same_across_ranks
    >>> check_same_across_ranks((100, 3), "the shape of X")
    """
    if not _active() or _dist().get_world_size() == 1:
        return
    dist = _dist()
    values: list = [None] * dist.get_world_size()
    with collective(f"comparing {what} across ranks"):
        dist.all_gather_object(values, value)
    bad = [r for r, v in enumerate(values) if v != values[0]]
    if bad:
        rows = ", ".join(f"rank {r} has {values[r]!r}" for r in bad)
        raise ValueError(
            f"{what} differs across ranks: rank 0 has {values[0]!r}, {rows} "
            f"(seen on rank {dist.get_rank()}); every rank must pass the same"
        )
