"""Growing Bayesian HME solutions: a fitted expert split into a gate over two copies of
itself, so that the best solution of a topology seeds the search of the topologies one
expert larger."""

from __future__ import annotations

import math
import time
from dataclasses import fields

import torch
import torch.nn.functional as F

from pyro_trees.infer.bayesian_hme_vb.selection import (
    ModelSelection,
    _cat_states,
    _race,
    cycle_program,
)
from pyro_trees.models.bayesian_hme_vb_run import run_vb
from pyro_trees.models.bayesian_hme_vb_updates import (
    VBData,
    VBState,
    bound,
    expert_factor_terms,
    gate_factor_terms,
    jj_lambda,
)
from pyro_trees.topology import Topology, mirror_map, sign_matrices

__all__ = [
    "grow_selection",
    "grow_state",
    "mirror_state",
    "split_directions",
    "split_gain",
]


def _select_experts(state: VBState, index: torch.Tensor) -> dict:
    """The expert fields of ``state`` (weights, their precisions, noise) at the experts
    ``index`` (a reordering or repetition), as ``VBState`` keyword arguments."""
    return {
        "w_mean": state.w_mean[..., index, :, :],
        "w_cov": state.w_cov[..., index, :, :],
        "alpha_a": state.alpha_a[..., index],
        "alpha_b": state.alpha_b[..., index],
        "tau_a": state.tau_a[..., index],
        "tau_b": state.tau_b[..., index],
    }


def mirror_state(state: VBState, source: Topology, target: Topology) -> VBState:
    """A state of ``source`` relabelled for its mirror image ``target`` (gates and experts
    permuted, the gate weights of swapped gates negated): the same distribution, so the
    bound is unchanged."""
    gate_src, gate_flip, expert_src = mirror_map(source, target)
    dev = state.v_mean.device
    gi = torch.tensor(gate_src, dtype=torch.long, device=dev)
    ei = torch.tensor(expert_src, dtype=torch.long, device=dev)
    sign = 1.0 - 2.0 * torch.tensor(gate_flip, dtype=state.v_mean.dtype, device=dev)
    return VBState(
        v_mean=state.v_mean[..., gi, :] * sign.unsqueeze(-1),
        v_cov=state.v_cov[..., gi, :, :],
        beta_a=state.beta_a[..., gi],
        beta_b=state.beta_b[..., gi],
        **_select_experts(state, ei),
        xi=state.xi[..., gi, :],
        log_r=state.log_r[..., ei],
    )


def grow_state(
    data: VBData,
    state: VBState,
    topology: Topology,
    leaf: int,
    gate_mean: torch.Tensor,
    gate_var: float = 1e-2,
) -> tuple[Topology, VBState]:
    r"""Split the expert at heap node ``leaf`` of ``topology`` into a gate with two
    copies of that expert.

    The new gate ``q(v) = N(gate_mean, gate_var I)`` (``gate_mean`` broadcastable to
    ``batch_shape + (P,)``) gets its optimal ``q(beta)`` and ``xi``; both children copy
    the parent expert's ``q(W)``, ``q(alpha)``, ``q(tau)``, and its responsibility is
    shared by the optimal split given the rest, :math:`r_{n,\pm} = r_n\,\sigma(\pm E[a_n])`.
    The bound then changes by exactly

    .. math:: \sum_n r_n \log\big(e^{h_-(n)} + e^{h_+(n)}\big) + \mathcal{G}_{gate}
              + \mathcal{G}_{expert},

    with :math:`h_\pm` the new gate's Jaakkola-Jordan terms, and the global terms of the
    new gate and of the copied expert (see :func:`split_gain`): the fit to the data is
    unchanged, the extra factors cost their prior penalties.

    :param data: data whose signs are those of ``topology`` (only ``x`` and the priors
        are used).
    :returns: the grown topology (the gates of ``topology`` plus ``leaf``) and its state.
    """
    if leaf not in topology.experts:
        raise ValueError(f"{leaf} is not an expert of {topology}")
    child = Topology(set(topology.gates) | {leaf})
    k = child.gates.index(leaf)
    j = topology.experts.index(leaf)
    x = data.x
    p = x.shape[-1]
    batch = state.batch_shape
    m = torch.as_tensor(gate_mean, dtype=x.dtype, device=x.device).expand(batch + (p,))
    cov = torch.eye(p, dtype=x.dtype, device=x.device).expand(batch + (p, p)) * gate_var
    mean_a = m @ x.T  # (..., N)
    xi = (mean_a.square() + gate_var * x.square().sum(-1)).sqrt()
    vv = m.square().sum(-1) + gate_var * p
    beta_a = torch.full_like(vv, data.prior_a + 0.5 * p)
    beta_b = data.prior_b + 0.5 * vv

    def ins(old, new, dim):
        return torch.cat([old.narrow(dim, 0, k), new, old.narrow(dim, k, old.shape[dim] - k)], dim)

    e_idx = list(range(j + 1)) + list(range(j, topology.num_experts))
    ei = torch.tensor(e_idx, dtype=torch.long, device=x.device)
    log_r = state.log_r[..., ei].clone()
    log_r[..., j] = state.log_r[..., j] + F.logsigmoid(-mean_a)
    log_r[..., j + 1] = state.log_r[..., j] + F.logsigmoid(mean_a)
    g = state.v_mean.dim() - 2  # dim of the gates in (..., G, P)
    grown = VBState(
        v_mean=ins(state.v_mean, m.unsqueeze(-2), g),
        v_cov=ins(state.v_cov, cov.unsqueeze(-3), g),
        beta_a=ins(state.beta_a, beta_a.unsqueeze(-1), g),
        beta_b=ins(state.beta_b, beta_b.unsqueeze(-1), g),
        **_select_experts(state, ei),
        xi=ins(state.xi, xi.unsqueeze(-2), g),
        log_r=log_r,
    )
    return child, grown


def split_directions(
    data: VBData,
    state: VBState,
    expert: int,
    num: int,
    *,
    sharpness: float = 2.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Gate means ``(num, P)`` for splitting expert number ``expert`` of an unbatched
    ``state``: hyperplanes through the responsibility-weighted mean of the expert's
    inputs, the first normal to their principal direction, the others to random
    directions; the logit's standard deviation over those inputs is ``sharpness``."""
    x = data.x[:, :-1]
    r = state.log_r[:, expert].exp()
    total = data.rows_sum(r.sum()).clamp_min(torch.finfo(r.dtype).tiny)
    if data.reduce is None:
        w = r / total
        mu = w @ x
        xc = x - mu
        cov = (xc * w.unsqueeze(-1)).T @ xc
    else:  # moments over every rank's rows
        mu = data.rows_sum(r @ x) / total
        xc = x - mu
        cov = data.rows_sum((xc * r.unsqueeze(-1)).T @ xc) / total
    dirs = [torch.linalg.eigh(cov)[1][:, -1]] if num > 0 else []
    if num > 1:
        rand = torch.randn(num - 1, x.shape[-1], generator=generator, dtype=x.dtype)
        dirs.extend(rand.to(x.device))
    out = []
    for u in dirs:
        sd = (u @ cov @ u).clamp_min(1e-12).sqrt()
        scale = sharpness / sd
        out.append(torch.cat([u * scale, (-(u @ mu) * scale).reshape(1)]))
    return torch.stack(out) if out else x.new_zeros(0, x.shape[-1] + 1)


def split_gain(data: VBData, parent: VBState, grown: VBState, gate: int, expert: int):
    """The closed-form change of the bound from ``parent`` to the output of
    :func:`~pyro_trees.infer.bayesian_hme_vb.grow_state` (``gate`` and ``expert`` are the positions
    of the new gate and of the split expert)."""
    m, cov = grown.v_mean[..., gate, :], grown.v_cov[..., gate, :, :]
    mean_a = m @ data.x.T
    sq_a = mean_a.square() + data.quad(cov.unsqueeze(-3)).squeeze(-2)
    xi = grown.xi[..., gate, :]
    c = -jj_lambda(xi) * (sq_a - xi.square()) + F.logsigmoid(xi) - 0.5 * xi
    split = torch.logaddexp(c - 0.5 * mean_a, c + 0.5 * mean_a)
    r = parent.log_r[..., expert].exp()
    # the global terms of the new gate (in grown) and of the split expert (in parent)
    gate_terms_ = gate_factor_terms(data, grown)[..., gate]
    expert_terms = expert_factor_terms(data, parent)[..., expert]
    return data.rows_sum((r * split).sum(-1)) + gate_terms_ + expert_terms


def grow_selection(
    x,
    t,
    selection: ModelSelection,
    *,
    starts_per_split: int = 3,
    num_cycles: int = 400,
    tol: float | None = 1e-6,
    prior_a: float = 1e-3,
    prior_b: float = 1e-3,
    generator: torch.Generator | None = None,
    max_batch: int = 512,
    search_dtype: torch.dtype | None = None,
    polish_cycles: int = 100,
    sharpness: float = 2.0,
    reduce=None,
    compile: bool | str = False,
) -> ModelSelection:
    """Search each topology again from starts grown out of the smaller topologies' best
    solutions, smallest sizes first.

    Random restarts of large topologies rarely find the basins of their best solutions.
    For every topology with ``E`` experts and every one of its cherries (a gate whose two
    children are experts), removing the cherry gives a topology with ``E - 1`` experts;
    if its mirror class was searched, its best state is split at that leaf
    (:func:`~pyro_trees.infer.bayesian_hme_vb.grow_state`; ``starts_per_split`` gates through the
    leaf's data, :func:`~pyro_trees.infer.bayesian_hme_vb.split_directions`) and the grown starts
    of all topologies of the size run together as one batch for up to ``num_cycles`` cycles at
    temperature 1 (in ``search_dtype``, the best per topology polished in the dtype of ``x`` as
    in :func:`select_topology`). A topology keeps the better of its previous best and its
    best grown start, so its bound never decreases; sizes are done in increasing order,
    so grown solutions seed the next size. The choice uses the training bound only.

    ``reduce``: see :class:`~pyro_trees.infer.VBData` (data-parallel fits); ``compile``:
    see :func:`~pyro_trees.infer.select_topology`.

    :returns: a new :class:`ModelSelection` (``grown`` marks the topologies whose best
        state now comes from a grown start; ``all_bounds`` gains the grown starts' bounds).
    """

    start = time.perf_counter()
    cycle = cycle_program(compile)
    tops = list(selection.topologies)
    x = torch.as_tensor(x)
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    work_dtype = x.dtype if search_dtype is None else search_dtype
    xs, ts = x.to(work_dtype), t.to(work_dtype)
    canon = {}
    for k, top in enumerate(tops):
        canon.setdefault(top.canonical(), k)
    bounds = selection.bounds.clone()
    states = list(selection.states)
    all_bounds = list(selection.all_bounds)
    grown_flags = (
        selection.grown.clone()
        if selection.grown is not None
        else torch.zeros(len(tops), dtype=torch.bool)
    )
    work = 0
    n = x.shape[0] if reduce is None else int(reduce(x.new_tensor(float(x.shape[0]))))
    for e in sorted({top.num_experts for top in tops}):
        owners, starts = [], []
        for k, child in enumerate(tops):
            if child.num_experts != e or e < 2:
                continue
            seen = set()
            gates = set(child.gates)
            for c in child.gates:
                if 2 * c in gates or 2 * c + 1 in gates:
                    continue  # not a cherry
                smaller = Topology(gates - {c})
                pk = canon.get(smaller.canonical())
                if pk is None or not bool(torch.isfinite(bounds[pk])):
                    continue
                _, _, expert_src = mirror_map(tops[pk], smaller)
                key = (pk, expert_src[smaller.experts.index(c)])
                if key in seen:
                    continue  # the same leaf of the same solution, mirrored
                seen.add(key)
                data = VBData.build(x, t, smaller, prior_a=prior_a, prior_b=prior_b, reduce=reduce)
                pstate = mirror_state(states[pk], tops[pk], smaller)
                dirs = split_directions(
                    data,
                    pstate,
                    smaller.experts.index(c),
                    starts_per_split,
                    sharpness=sharpness,
                    generator=generator,
                )
                batch = VBState(
                    **{
                        f.name: getattr(pstate, f.name).expand(
                            (len(dirs),) + getattr(pstate, f.name).shape
                        )
                        for f in fields(VBState)
                    }
                )
                grown_top, gstate = grow_state(data, batch, smaller, c, dirs)
                if grown_top != child:
                    raise RuntimeError(f"growing {smaller} at {c} gave {grown_top}, not {child}")
                owners.extend([k] * len(dirs))
                starts.append(gstate)
        if not starts:
            continue
        state = _cat_states(starts).to(work_dtype)
        base = VBData.build(
            xs, ts, tops[owners[0]], prior_a=prior_a, prior_b=prior_b, reduce=reduce
        )
        sg = sign_matrices([tops[k] for k in owners], xs)
        cap = max(1, int(max_batch * 1024 / max(1, e * n)))
        finals, values = [], []
        for c in range(0, len(owners), cap):
            sl = slice(c, c + cap)
            sub = base.with_signs(sg[sl])
            st, vals, w = _race(sub, state.index(sl), [1.0] * num_cycles, tol, cycle)
            work += w
            finals.append(st)
            values.append(vals)
        state, values = _cat_states(finals), torch.cat(values)
        own = torch.tensor(owners)
        for k in sorted(set(owners)):
            idx = (own == k).nonzero().squeeze(-1)
            j = int(idx[values[idx].argmax()])
            data = VBData.build(x, t, tops[k], prior_a=prior_a, prior_b=prior_b, reduce=reduce)
            st = state.index(j).to(x.dtype)
            if work_dtype != x.dtype and polish_cycles > 0:
                res = run_vb(data, st, num_cycles=polish_cycles, tol=tol)
                st, value = res.state, res.bound
                work += res.iterations
            else:
                value = bound(data, st)
            value = value.nan_to_num(-math.inf)
            all_bounds[k] = torch.cat([all_bounds[k], values[idx].to(all_bounds[k].dtype)])
            if bool(value > bounds[k]):
                bounds[k] = value
                states[k] = st
                grown_flags[k] = True
    return ModelSelection(
        tops,
        bounds,
        states,
        all_bounds,
        selection.seconds + time.perf_counter() - start,
        selection.cycles + work,
        grown_flags,
    )
