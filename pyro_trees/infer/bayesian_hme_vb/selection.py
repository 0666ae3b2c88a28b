"""Model selection over tree topologies for the Bayesian HME by the variational bound:
every topology fitted from many random starts, batched, raced and pooled."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from pyro_trees.infer.compiled import CompiledLoss
from pyro_trees.models.bayesian_hme_vb_run import fused_cycle, init_state, run_vb
from pyro_trees.models.bayesian_hme_vb_updates import VBData, VBState, bound
from pyro_trees.topology import Topology, enumerate_topologies, sign_matrices

__all__ = [
    "ModelSelection",
    "cycle_program",
    "merge_selections",
    "select_topology",
]


@dataclass
class ModelSelection:
    """Output of :func:`select_topology`.

    :ivar topologies: every topology searched.
    :ivar bounds: best bound of each topology over its restarts, ``(K,)``.
    :ivar states: the best state of each topology.
    :ivar all_bounds: the final bound of every restart, list of ``(R,)`` tensors (of the
        search's dtype; ``-inf`` for a restart that was pruned or failed).
    :ivar seconds: wall-clock seconds of the search.
    :ivar cycles: coordinate-ascent cycles run, summed over all restarts (the work done).
    :ivar grown: ``(K,)`` bools, where the best state comes from a start grown out of a
        smaller topology (:func:`grow_selection`); ``None`` if none was grown.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import select_topology
    >>> x = torch.linspace(-1, 1, 40).unsqueeze(-1)
    >>> y = x.squeeze(-1).abs()
    >>> sel = select_topology(x, y, 2, num_restarts=2, num_cycles=5,
    ...                       generator=torch.Generator().manual_seed(0))
    >>> [str(t) for t in sel.topologies]
    ['E', '(E E)']
    >>> sel.bounds.shape, float(sel.weights.sum())
    (torch.Size([2]), 1.0)
    >>> sel.topologies[sel.best].num_experts in (1, 2)
    True
    """

    topologies: list
    bounds: torch.Tensor
    states: list
    all_bounds: list
    seconds: float
    cycles: int = 0
    grown: torch.Tensor | None = None

    @property
    def best(self) -> int:
        """Index of the topology with the highest bound."""
        return int(self.bounds.argmax())

    @property
    def weights(self) -> torch.Tensor:
        r"""Model-averaging weights :math:`\propto \exp(\mathcal{L}_k)`, normalised."""
        return torch.softmax(self.bounds, 0)


def _cat_states(states: Sequence[VBState]) -> VBState:
    """Concatenate states with a flat batch dimension ``(B,)``."""
    return VBState(
        **{f.name: torch.cat([getattr(s, f.name) for s in states]) for f in fields(VBState)}
    )


def cycle_program(compile: bool | str = False):
    """The VB cycle of a search: :func:`~pyro_trees.infer.bayesian_hme_vb.fused_cycle`,
    or with ``compile`` (``True`` or a ``torch.compile`` backend name) the same function
    as one compiled program (:class:`~pyro_trees.infer.CompiledLoss`: compiled once per
    process and shape, an eager fallback with one warning where it cannot compile).
    Called ``(data, state, temperature, sq_a)``, as ``fused_cycle``; the compiled one
    holds its :class:`~pyro_trees.infer.CompiledLoss` as ``program``.

    The compiled cycle takes the temperature as a 0-dim tensor (an annealing schedule
    compiles no program per temperature), runs a race's first cycle eagerly (it computes
    the gates' moments that later cycles receive, a branch of its own), computes the
    data's cached statistics before the program, and allows a program per number of
    experts and batch regime (a race's batch shrinks as its restarts converge)."""
    if not compile:
        return fused_cycle
    program = CompiledLoss(fused_cycle, compile)

    def compiled_cycle(data: VBData, state: VBState, temperature: float = 1.0, sq_a=None):
        if sq_a is None:
            return fused_cycle(data, state, temperature, sq_a)
        data.precompute()  # not inside the program: a cached_property holds a lock
        temp = torch.tensor(float(temperature), dtype=data.x.dtype, device=data.x.device)
        # one program per number of experts (the gates' count and the arrays' widths follow
        # from it), each for a static and then a symbolic batch size: within the
        # CompiledLoss's recompile limit
        return program(data, state, temp, sq_a)

    compiled_cycle.program = program  # its compiler state (``failed``: why it fell back)
    return compiled_cycle


def _race(
    data: VBData, state: VBState, temps: Sequence[float], tol: float | None, cycle=fused_cycle
):
    """Cycle a flat batch (``batch_shape == (B,)``, ``data.signs`` ``(B, G, E)``) through
    ``temps`` with ``cycle`` (:func:`cycle_program`). At temperature 1 an element whose
    bound moved by at most ``tol * N`` in a cycle has converged and leaves the batch (as
    does one whose bound is not finite), so the remaining cycles only work on the
    elements still moving.

    :returns: the final states, their bounds ``(B,)`` and the number of element-cycles.
    """
    n = data.num_rows
    bsz = state.batch_shape[0]
    active = torch.arange(bsz, device=data.x.device)
    done_idx, done_states, done_values = [], [], []
    prev = None
    sq_a = None
    value = None
    work = 0
    for k, temp in enumerate(temps):
        state, sq_a, value = cycle(data, state, temp, sq_a)
        work += len(active)
        last = k == len(temps) - 1
        if temp != 1.0 or tol is None or last:
            prev = value if temp == 1.0 else None
            continue
        if prev is not None:
            stop = ~((value - prev).abs() > tol * n)  # converged, or NaN
            if bool(stop.any()):
                go = (~stop).nonzero().squeeze(-1)
                halt = stop.nonzero().squeeze(-1)
                done_idx.append(active[halt])
                done_states.append(state.index(halt))
                done_values.append(value[halt])
                active, state, sq_a, value = active[go], state.index(go), sq_a[go], value[go]
                data = data.with_signs(data.signs[go])
                if not len(active):
                    break
        prev = value
    if value is None:
        raise ValueError("the temperature schedule is empty")
    if len(active):
        done_idx.append(active)
        done_states.append(state)
        done_values.append(value)
    order = torch.cat(done_idx).argsort()
    final = _cat_states(done_states).index(order)
    values = torch.cat(done_values)[order].nan_to_num(-math.inf)
    return final, values, work


def select_topology(
    x,
    t,
    topologies: Sequence[Topology] | int = 5,
    *,
    num_restarts: int = 20,
    temperatures: Sequence[float] | None = None,
    num_cycles: int = 200,
    tol: float | None = 1e-6,
    prior_a: float = 1e-3,
    prior_b: float = 1e-3,
    generator: torch.Generator | None = None,
    prune_after: int | None = None,
    keep: int = 5,
    max_batch: int = 512,
    search_dtype: torch.dtype | None = None,
    polish_cycles: int = 100,
    reduce=None,
    compile: bool | str = False,
) -> ModelSelection:
    """Fit every topology from ``num_restarts`` random starts and keep the best bound.

    The restarts of all topologies with the same number of experts form one flat batch,
    cycled in chunks of whole topologies of at most about ``max_batch * 1024 / (E N)``
    elements (``max_batch`` restarts at ``N = 1024`` points and one expert): chunks that
    fit the processor's cache run faster than one huge batch. At temperature 1 each
    restart stops as soon as its bound moves by at most ``tol * N`` in a cycle (it
    leaves the batch; the others go on).

    With ``prune_after``, only the ``keep`` restarts of each topology with the highest
    (tempered) bound after ``prune_after`` cycles are run to the end: a race that spends
    most of the time on the promising starts. ``all_bounds`` then holds ``-inf`` for the
    pruned starts.

    With ``search_dtype`` (e.g. ``torch.float32``, faster on a CPU) the
    search runs in that dtype; the best restart of every topology is then *polished*
    in the dtype of ``x``: up to ``polish_cycles`` more cycles at temperature 1 (stopping
    on ``tol``), so that the reported bounds and states are computed at full precision
    (each polishing cycle can only raise the bound).

    :param x: inputs ``(N, L)`` (no bias column; one is appended).
    :param t: targets ``(N,)`` or ``(N, D)``.
    :param topologies: a list of :class:`~pyro_trees.topology.Topology`, or an int ``E``: every
        topology with ``1..E`` experts.
    :param reduce: applied to every sum over rows (:class:`~pyro_trees.infer.VBData`): a
        data-parallel fit passes the sum over ranks, each rank holding its own rows.
    :param compile: ``False`` (default), ``True`` or a ``torch.compile`` backend name:
        the search's cycles as one compiled program (:func:`cycle_program`; the same
        values, to rounding). The polishing cycles stay eager.
    """

    start = time.perf_counter()
    cycle = cycle_program(compile)
    if isinstance(topologies, int):
        topologies = enumerate_topologies(topologies)
    topologies = list(topologies)
    x = torch.as_tensor(x)
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    work_dtype = x.dtype if search_dtype is None else search_dtype
    xs, ts = x.to(work_dtype), t.to(work_dtype)
    temps = list(temperatures) if temperatures is not None else [1.0] * num_cycles
    if not temps:
        raise ValueError("select_topology needs at least one iteration")
    pruning = prune_after is not None and keep < num_restarts and 0 < prune_after < len(temps)
    groups: dict[int, list[int]] = {}
    for k, top in enumerate(topologies):
        groups.setdefault(top.num_experts, []).append(k)
    n = x.shape[0] if reduce is None else int(reduce(x.new_tensor(float(x.shape[0]))))
    all_bounds = [None] * len(topologies)
    best_states = [None] * len(topologies)
    work = 0
    for e, members in sorted(groups.items()):
        cap = max(1, int(max_batch * 1024 / max(1, e * n)))
        per_chunk = max(1, cap // num_restarts)
        base = VBData.build(
            xs, ts, topologies[members[0]], prior_a=prior_a, prior_b=prior_b, reduce=reduce
        )
        signs = sign_matrices([topologies[k] for k in members], xs)  # (K, G, E)
        phase1 = temps[:prune_after] if pruning else temps
        results = []  # (state, bounds (K_c, R), member indices) per chunk
        for c in range(0, len(members), per_chunk):
            chunk = list(range(c, min(c + per_chunk, len(members))))
            sg = signs[chunk].repeat_interleave(num_restarts, 0)  # (K_c R, G, E)
            data = base.with_signs(sg)
            state = init_state(data, (len(sg),), generator=generator)
            state, values, w = _race(data, state, phase1, None if pruning else tol, cycle)
            work += w
            results.append((state, values.view(len(chunk), num_restarts), chunk))
        if pruning:
            # keep the best `keep` starts of each topology, then race them together
            survivors, owners = [], []
            for state, values, chunk in results:
                top = values.topk(keep, -1).indices  # (K_c, keep)
                flat = (top + num_restarts * torch.arange(len(chunk)).unsqueeze(-1)).flatten()
                survivors.append(state.index(flat))
                owners.extend((i, int(j)) for i, row in zip(chunk, top, strict=True) for j in row)
            state = _cat_states(survivors)
            sg = signs[torch.tensor([i for i, _ in owners])]
            data = base.with_signs(sg)
            finals, values_all = [], []
            cap2 = max(1, cap)
            for c in range(0, len(owners), cap2):
                sl = slice(c, c + cap2)
                st, vals, w = _race(
                    data.with_signs(sg[sl]), state.index(sl), temps[prune_after:], tol, cycle
                )
                work += w
                finals.append(st)
                values_all.append(vals)
            state = _cat_states(finals)
            values = torch.cat(values_all)
            results = []
            full = {
                i: torch.full((num_restarts,), -math.inf, dtype=values.dtype)
                for i in range(len(members))
            }
            pos = {}
            for q, (i, j) in enumerate(owners):
                full[i][j] = values[q]
                pos[(i, j)] = q
            for i in range(len(members)):
                j = int(full[i].argmax())
                all_bounds[members[i]] = full[i]
                best_states[members[i]] = state.index(pos[(i, j)] if (i, j) in pos else 0)
        else:
            for state, values, chunk in results:
                for row, i in enumerate(chunk):
                    j = int(values[row].argmax())
                    all_bounds[members[i]] = values[row]
                    best_states[members[i]] = state.index(row * num_restarts + j)
    # polish the best restart of every topology in the input's dtype
    bounds, states = [], []
    for k, top in enumerate(topologies):
        data = VBData.build(x, t, top, prior_a=prior_a, prior_b=prior_b, reduce=reduce)
        st = best_states[k].to(x.dtype)
        if search_dtype is not None and search_dtype != x.dtype and polish_cycles > 0:
            res = run_vb(data, st, num_cycles=polish_cycles, tol=tol)
            st, value = res.state, res.bound
            work += res.iterations
        else:
            value = bound(data, st) if temps[-1] != 1.0 or search_dtype is not None else None
            if value is None:
                value = all_bounds[k].max().to(x.dtype)
        bounds.append(value.nan_to_num(-math.inf))
        states.append(st)
    return ModelSelection(
        topologies,
        torch.stack(bounds),
        states,
        all_bounds,
        time.perf_counter() - start,
        work,
    )


def merge_selections(selections: Sequence[ModelSelection]) -> ModelSelection:
    """Pool searches of the same topologies (e.g. restarts under different annealing
    schedules): the best bound and state per topology, every restart's bound, the summed
    time and work."""
    first = selections[0]
    if any(
        [str(t) for t in s.topologies] != [str(t) for t in first.topologies] for s in selections
    ):
        raise ValueError("merge_selections needs searches over the same topologies")
    stacked = torch.stack([s.bounds for s in selections])  # (S, K)
    pick = stacked.argmax(0)
    return ModelSelection(
        first.topologies,
        stacked.max(0).values,
        [selections[int(i)].states[k] for k, i in enumerate(pick)],
        [torch.cat([s.all_bounds[k] for s in selections]) for k in range(len(first.topologies))],
        sum(s.seconds for s in selections),
        sum(s.cycles for s in selections),
    )
