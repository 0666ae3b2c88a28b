"""Running the closed-form variational Bayes of the Bayesian HME: one fused cycle of the
coordinate updates of :mod:`pyro_trees.models.bayesian_hme_vb_updates`, random starts,
deterministic annealing of the likelihood temperature (Bishop & Svensén, 2003), and the
loop :func:`run_vb`. The public names are exported from
:mod:`pyro_trees.infer.bayesian_hme_vb`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pyro_trees._interrupts import raise_if_interrupted
from pyro_trees.models.bayesian_hme_vb_updates import (
    _LOG_2PI,
    VBData,
    VBState,
    _elog,
    _exp,
    _exp_,
    _gate_moments,
    _gauss_from_precision,
    _global_terms,
    bound,
    jj_lambda,
)
from pyro_trees.topology import expert_log_probs

__all__ = [
    "SCHEDULES",
    "VBResult",
    "fused_cycle",
    "init_state",
    "run_vb",
    "schedule_by_name",
    "temperature_schedule",
    "vb_cycle",
]


def vb_cycle(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """One pass through every coordinate update, in the order of :data:`UPDATES` (experts,
    noise, expert precisions, ``xi``, gates, gate precisions, assignments)."""
    return fused_cycle(data, state, temperature)[0]


def fused_cycle(
    data: VBData, state: VBState, temperature: float = 1.0, sq_a: torch.Tensor | None = None
):
    """:func:`vb_cycle` computing each ``O(N P^2)`` quantity once; also returns the
    gates' ``E[a^2]`` (reused by the next cycle's ``xi`` update) and the bound. The
    step of :func:`run_vb` and of the topology search's races.

    :param VBData data: the data.
    :param VBState state: the state before the cycle.
    :param float temperature: the likelihood temperature of the cycle's updates.
    :param sq_a: the gates' ``E[a^2]`` ``batch_shape + (G, N)`` from the previous cycle
        (``None``: computed from ``state``).
    :returns: ``(state, sq_a, value)``: the state after the cycle, the gates' ``E[a^2]``
        under it, and the bound at ``temperature`` ``batch_shape``.

    Internally the per-point arrays are laid out ``(..., K, N)`` (points last, so that
    elementwise work and the sums over experts run along contiguous memory); the
    returned ``log_r`` is a transposed view of that layout.

    The start of a cycle is a safe point for Ctrl-C held by
    :func:`~pyro_trees.infer.deferred_interrupts` (an estimator's ``fit``).
    """
    raise_if_interrupted()
    x, t = data.x, data.t
    p, d = x.shape[-1], t.shape[-1]
    a0, b0 = data.prior_a, data.prior_b
    eye = torch.eye(p, dtype=x.dtype, device=x.device)
    # fresh temporaries are updated in place below (the same kernels in the same order: the
    # same bits, half the memory traffic of the (..., K, N) arrays)
    r = _exp(state.log_r.transpose(-1, -2))  # (..., E, N)
    # experts q(W_j): one Cholesky per expert
    inv_t = 1.0 / temperature
    scale = (state.tau_a / state.tau_b) * inv_t  # (..., E)
    e_alpha = state.alpha_a / state.alpha_b
    prec = e_alpha[..., None, None] * eye + scale[..., None, None] * data.weighted_outer(r)
    w_cov, _ = _gauss_from_precision(prec)
    rxt = data.rows_sum(r @ data._xt).unflatten(-1, (p, d))  # (..., E, P, D)
    w_mean = (scale[..., None, None] * (w_cov @ rxt)).transpose(-1, -2)  # (..., E, D, P)
    # E||t - W x||^2, (..., E, N)
    sq = (w_mean @ x.T).neg_().add_(t.T).square_()  # (t - W x)^2, (..., E, D, N)
    sq = sq.sum(-2) if d > 1 else sq.squeeze(-2)
    sq = sq.add_(data.quad(w_cov) if d == 1 else d * data.quad(w_cov))
    # noise and weight precisions
    tau_a = a0 + (0.5 * d * inv_t) * data.rows_sum(r.sum(-1))
    tau_b = b0 + (0.5 * inv_t) * data.rows_sum((r * sq).sum(-1))
    ww = w_mean.square().sum((-1, -2)) + d * w_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    alpha_a = torch.full_like(state.alpha_a, a0 + 0.5 * d * p)
    alpha_b = b0 + 0.5 * ww
    # xi and gates q(v_g)
    if sq_a is None:
        sq_a = _gate_moments(data, state)[1]
    xi = sq_a.clamp_min(0).sqrt_()  # (..., G, N)
    lam = jj_lambda(xi)
    s = data.signs
    reach = s.abs() @ r  # (..., G, N)
    turn = (0.5 * s) @ r
    e_beta = state.beta_a / state.beta_b
    prec = e_beta[..., None, None] * eye + data.weighted_outer(reach.mul_(2).mul_(lam))
    v_cov, _ = _gauss_from_precision(prec)
    v_mean = (v_cov @ data.rows_sum(turn @ x).unsqueeze(-1)).squeeze(-1)
    vv = v_mean.square().sum(-1) + v_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    beta_a = torch.full_like(state.beta_a, a0 + 0.5 * p)
    beta_b = b0 + 0.5 * vv
    state = replace(
        state,
        w_mean=w_mean,
        w_cov=w_cov,
        tau_a=tau_a,
        tau_b=tau_b,
        alpha_a=alpha_a,
        alpha_b=alpha_b,
        xi=xi,
        v_mean=v_mean,
        v_cov=v_cov,
        beta_a=beta_a,
        beta_b=beta_b,
    )
    # assignments q(Z): every term of the point-wise objective, (..., E, N)
    mean_a = v_mean @ x.T
    sq_a = mean_a.square().add_(data.quad(v_cov))
    # logsigmoid(xi) - xi / 2 - lam (sq_a - xi^2)
    c = F.logsigmoid(xi).sub_(0.5 * xi).sub_(xi.square().neg_().add_(sq_a).mul_(lam))
    st = s.transpose(-1, -2)
    point = ((0.5 * st) @ mean_a).add_(st.abs() @ c)
    e_tau = tau_a / tau_b
    const = (0.5 * d * inv_t) * (_elog(tau_a, tau_b) - _LOG_2PI)
    point = point.add_(const.unsqueeze(-1)).sub_((0.5 * inv_t * e_tau).unsqueeze(-1) * sq)
    top = point.amax(-2, keepdim=True)
    log_z = top + _exp_(point - top).sum(-2, keepdim=True).log()
    state = replace(state, log_r=point.sub_(log_z).transpose(-1, -2))
    log_z = log_z.squeeze(-2)
    value = data.rows_sum(log_z.sum(-1)) + _global_terms(data, state)
    return state, sq_a, value


def init_state(
    data: VBData,
    batch_shape: Sequence[int] = (),
    *,
    gate_scale: float = 2.0,
    generator: torch.Generator | None = None,
) -> VBState:
    """A random starting point for every batch element.

    Gate weights are drawn from ``N(0, gate_scale**2 / P)`` per component, the
    responsibilities set to the gating probabilities those gates give, and the expert
    precisions set so that the first expert update is a lightly regularised weighted
    least-squares fit (``E[alpha] = 1e-2``, ``E[tau] = 1 / var(t)``). ``xi`` starts at the
    gates' ``|E[a]|``.
    """
    x, t, s = data.x, data.t, data.signs
    batch_shape = torch.Size(batch_shape)
    batch_shape = torch.broadcast_shapes(batch_shape, s.shape[:-2])
    n, p = x.shape
    g, e = s.shape[-2:]
    opts = {"dtype": x.dtype, "device": x.device}
    noise = torch.randn(batch_shape + (g, p), generator=generator, **{"dtype": x.dtype})
    v_mean = noise.to(x.device) * (gate_scale / math.sqrt(p))
    v_cov = torch.eye(p, **opts).expand(batch_shape + (g, p, p)) * 1e-2
    logits = v_mean @ x.T  # (..., G, N)
    log_pi = expert_log_probs(logits.transpose(-1, -2), s.unsqueeze(-3))  # (..., N, E)
    log_r = log_pi.log_softmax(-1) if g else x.new_zeros(batch_shape + (n, e))
    ones_e = torch.ones(batch_shape + (e,), **opts)
    ones_g = torch.ones(batch_shape + (g,), **opts)
    n_all = data.num_rows
    if data.reduce is None:
        var_t = t.var(0).mean().clamp_min(1e-12) if n > 1 else t.new_tensor(1.0)
    elif n_all > 1:  # two passes over every rank's rows
        mean_t = data.rows_sum(t.sum(0)) / n_all
        var_t = (data.rows_sum((t - mean_t).square().sum(0)) / (n_all - 1)).mean()
        var_t = var_t.clamp_min(1e-12)
    else:
        var_t = t.new_tensor(1.0)
    d = t.shape[-1]
    return VBState(
        v_mean=v_mean,
        v_cov=v_cov,
        beta_a=ones_g,
        beta_b=ones_g.clone(),
        w_mean=torch.zeros(batch_shape + (e, d, p), **opts),
        w_cov=torch.eye(p, **opts).expand(batch_shape + (e, p, p)).clone(),
        alpha_a=ones_e,
        alpha_b=ones_e * 100.0,
        tau_a=ones_e.clone(),
        tau_b=ones_e * var_t,
        xi=logits.abs(),
        log_r=log_r,
    )


def temperature_schedule(
    num_cycles: int = 800,
    *,
    initial: float = 5.85,
    factor: float = 0.97,
    anneal_cycles: int = 200,
    floor: bool = False,
    inverse: bool = False,
) -> list[float]:
    """Deterministic annealing of the likelihood temperature:
    ``1 + (initial - 1) * factor**k`` for the first ``anneal_cycles`` cycles, then 1
    (with ``floor=True``: ``max(1, initial * factor**k)``). With ``inverse=True`` these
    values are inverse temperatures (the likelihood is *sharpened* at the start, which
    weakens the priors' pull towards switching experts off) and their reciprocals are
    returned.

    The paper (kin8nm) reads: start at 5.85, multiply by 0.97 at each of the first 200
    iterations, then 600 iterations at 1.0. Multiplying the temperature itself would
    end far below 1 (``5.85 * 0.97**200 = 0.013``); two readings fit: the excess over 1
    decays (the default; ``1.011`` after 200 cycles, a smooth hand-over to the cycles
    at 1), or the temperature is multiplied and floored at 1 (``floor=True``; it
    reaches 1 after 58 cycles). The paper calls the parameter an *inverse* temperature
    that "scales the conditional probability of the data", which gives the
    ``inverse=True`` readings.
    """
    if num_cycles < 1:
        raise ValueError(f"num_cycles must be >= 1, got {num_cycles}")
    if floor:
        values = [
            max(1.0, initial * factor**k) if k < anneal_cycles else 1.0 for k in range(num_cycles)
        ]
    else:
        values = [
            1.0 + (initial - 1.0) * factor**k if k < anneal_cycles else 1.0
            for k in range(num_cycles)
        ]
    return [1.0 / v for v in values] if inverse else values


#: Named readings of the paper's annealing for :func:`schedule_by_name`.
SCHEDULES = {
    "none": None,
    "excess": {},
    "floor": {"floor": True},
    "inverse": {"inverse": True},
    "inverse_floor": {"floor": True, "inverse": True},
}


def schedule_by_name(name: str, num_cycles: int = 800) -> list[float]:
    """The temperatures of one of :data:`SCHEDULES` over ``num_cycles`` cycles, annealing
    over the first quarter (the paper's 200 of 800); ``"none"`` is ``num_cycles`` ones."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown annealing schedule {name!r}: use one of {sorted(SCHEDULES)}")
    if SCHEDULES[name] is None:
        return [1.0] * num_cycles
    return temperature_schedule(
        num_cycles, anneal_cycles=max(1, num_cycles // 4), **SCHEDULES[name]
    )


@dataclass
class VBResult:
    """Output of :func:`run_vb`: the final state, its bound (``batch_shape``) and the bound
    after every cycle (``(num_cycles,) + batch_shape``, tempered while annealing).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import VBData, bayesian_hme_vb as vb
    >>> from pyro_trees.topology import Topology
    >>> data = VBData.build(torch.randn(30, 1), torch.randn(30), Topology.balanced(1))
    >>> state = vb.init_state(data, (3,), generator=torch.Generator().manual_seed(0))
    >>> res = vb.run_vb(data, state, num_cycles=5, tol=None)
    >>> res.bound.shape, res.history.shape, res.iterations
    (torch.Size([3]), torch.Size([5, 3]), 5)
    >>> bool((res.history[-1] >= res.history[0]).all())
    True
    """

    state: VBState
    bound: torch.Tensor
    history: torch.Tensor
    iterations: int


def run_vb(
    data: VBData,
    state: VBState,
    *,
    temperatures: Sequence[float] | None = None,
    num_cycles: int = 200,
    tol: float | None = 1e-6,
) -> VBResult:
    """Cycle the coordinate updates.

    :param temperatures: one likelihood temperature per cycle (overrides ``num_cycles``);
        default: ``num_cycles`` cycles at 1.
    :param tol: stop early, once at temperature 1, when no batch element's bound moved
        by more than ``tol * N`` in a cycle (``None``: never).
    """
    temps = list(temperatures) if temperatures is not None else [1.0] * num_cycles
    if not temps:
        raise ValueError("run_vb needs at least one iteration")
    history = []
    prev = None
    sq_a = None
    n = data.num_rows
    for temp in temps:
        state, sq_a, value = fused_cycle(data, state, temp, sq_a)
        history.append(value)
        if tol is not None and temp == 1.0 and prev is not None:
            if float((value - prev).abs().nan_to_num(0.0).max()) <= tol * n:
                break
        prev = value if temp == 1.0 else None
    it = len(history)
    final = bound(data, state) if temps[it - 1] != 1.0 else history[-1]
    return VBResult(state, final, torch.stack(history), it)
