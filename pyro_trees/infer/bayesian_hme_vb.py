r"""Closed-form variational Bayes for the Bayesian hierarchical mixture of experts.

The model (Bishop & Svensén, 2003) is the one of :class:`pyro_trees.models.BayesianHME`:
inputs :math:`x_n` with a constant 1 appended (length ``P``), targets
:math:`t_n \in \mathbb{R}^D`, gates :math:`g` with weights :math:`v_g` and logit
:math:`a_{gn} = v_g^\top x_n` (log-odds of going right), linear-Gaussian experts
:math:`N(t \mid W_j x, \tau_j^{-1} I_D)`, priors :math:`v_g \sim N(0, \beta_g^{-1} I)`,
rows of :math:`W_j \sim N(0, \alpha_j^{-1} I)`, and
:math:`\alpha_j, \beta_g, \tau_j \sim \mathrm{Gamma}(a_0, b_0)`.

The variational posterior is

.. math:: q = q(Z) \prod_g q(v_g) q(\beta_g) \prod_j q(W_j) q(\alpha_j) q(\tau_j)

with Gaussian :math:`q(v_g)`, :math:`q(W_j)` (the ``D`` rows of :math:`W_j` share one
covariance, which is exact for this model), Gamma precisions, and an **exact**
categorical :math:`q(Z)` over the ``E`` experts for every point (responsibilities
:math:`r_{nj}`), the tractable alternative to the paper's product over gates noted in
``bayesian-hme-notes.md``; it can only tighten the bound. The sigmoid of every gate
on the path is replaced by the Jaakkola-Jordan bound

.. math:: \log\sigma(s a) \ge \log\sigma(\xi) + \tfrac{1}{2}(s a - \xi)
          - \lambda(\xi)(a^2 - \xi^2), \qquad \lambda(\xi) = \tanh(\xi/2)/(4\xi),

with one :math:`\xi_{gn}` per gate and point, so that every factor has a conjugate
coordinate update and the lower bound :math:`\mathcal{L}` is available in closed form
(:func:`bound`). Each update (:func:`update_assignments`, :func:`update_experts`,
:func:`update_noise`, :func:`update_expert_precisions`, :func:`update_gates`,
:func:`update_xi`, :func:`update_gate_precisions`) maximises the bound exactly over its
factor, so the bound never decreases.

**Deterministic annealing.** With a likelihood temperature ``T`` the expected expert
log-likelihood enters the objective divided by ``T`` (a flattened likelihood); all
updates maximise that tempered bound, which equals :math:`\mathcal{L}` at ``T = 1``.
:func:`temperature_schedule` gives the paper's schedule.

**Restarts as a batch dimension.** Every array of :class:`VBState` has leading batch
dimensions ``batch_shape`` (e.g. ``(num_topologies, num_restarts)``): all restarts, and
all topologies with the same number of experts, are updated together in one set of
batched tensor operations. A topology enters only through its sign matrix
(:meth:`pyro_trees.topology.Topology.sign_matrix`), broadcastable to
``batch_shape + (G, E)``.

References: C. M. Bishop and M. Svensén, *Bayesian Hierarchical Mixtures of Experts*,
UAI 2003; T. Jaakkola and M. Jordan, *Bayesian parameter estimation via variational
methods*, Statistics and Computing 10, 2000.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from pyro_trees.topology import Topology, enumerate_topologies, mirror_map

__all__ = [
    "ModelSelection",
    "SCHEDULES",
    "UPDATES",
    "VBData",
    "VBResult",
    "VBState",
    "bound",
    "expected_expert_loglik",
    "gate_terms",
    "grow_selection",
    "grow_state",
    "init_state",
    "jj_lambda",
    "merge_selections",
    "mirror_state",
    "run_vb",
    "schedule_by_name",
    "select_topology",
    "split_directions",
    "split_gain",
    "temperature_schedule",
    "update_assignments",
    "update_expert_precisions",
    "update_experts",
    "update_gate_precisions",
    "update_gates",
    "update_noise",
    "update_xi",
    "vb_cycle",
]

_LOG_2PI = math.log(2 * math.pi)


def _exp(value: torch.Tensor) -> torch.Tensor:
    """``exp`` with arguments below ``log(tiny) + 1`` raised to it: the result changes by
    less than three times the dtype's smallest normal number, and CPU ``exp`` avoids its
    slow path for subnormal results (ten times slower in float32)."""
    return value.clamp_min(math.log(torch.finfo(value.dtype).tiny) + 1.0).exp()


@dataclass(frozen=True)
class VBData:
    """Training data and hyperparameters, shared by every batch element.

    :ivar x: inputs with the bias column appended, ``(N, P)``.
    :ivar t: targets ``(N, D)``.
    :ivar signs: path signs broadcastable to ``batch_shape + (G, E)`` (``+1`` right,
        ``-1`` left, ``0`` off the path), same dtype as ``x``.
    :ivar prior_a: Gamma shape of every precision's prior (``a0``).
    :ivar prior_b: Gamma rate of every precision's prior (``b0``).
    """

    x: torch.Tensor
    t: torch.Tensor
    signs: torch.Tensor
    prior_a: float = 1e-3
    prior_b: float = 1e-3

    @classmethod
    def build(cls, x, t, topology, *, prior_a: float = 1e-3, prior_b: float = 1e-3) -> VBData:
        """From raw inputs ``x`` ``(N, L)`` (a bias column is appended), targets ``(N,)`` or
        ``(N, D)``, and a :class:`~pyro_trees.topology.Topology`, a sequence of topologies with the
        same number of experts (stacked along a leading batch dim), or a sign tensor."""
        x = torch.as_tensor(x)
        x = torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
        if t.dim() == 1:
            t = t.unsqueeze(-1)
        return cls(x, t, _signs(topology, x), prior_a, prior_b)

    @functools.cached_property
    def _pairs(self):
        p = self.x.shape[-1]
        iu = torch.triu_indices(p, p, device=self.x.device)
        xxp = self.x[:, iu[0]] * self.x[:, iu[1]]  # (N, P(P+1)/2): packed x x^T
        mult = torch.where(iu[0] == iu[1], 1.0, 2.0).to(self.x)
        return iu, xxp, mult

    @functools.cached_property
    def _xt(self) -> torch.Tensor:
        """``x_n t_n^T`` flattened, ``(N, P * D)``."""
        return (self.x.unsqueeze(-1) * self.t.unsqueeze(-2)).flatten(-2)

    def quad(self, cov: torch.Tensor) -> torch.Tensor:
        """``x_n^T C_k x_n`` for every point and every symmetric ``C_k``:
        ``batch + (K, P, P)`` -> ``batch + (K, N)`` (packed, half the work of a full product)."""
        iu, xxp, mult = self._pairs
        return (cov[..., iu[0], iu[1]] * mult) @ xxp.T

    def weighted_outer(self, w: torch.Tensor) -> torch.Tensor:
        """``sum_n w_kn x_n x_n^T``: ``batch + (K, N)`` -> ``batch + (K, P, P)``."""
        iu, xxp, _ = self._pairs
        p = self.x.shape[-1]
        packed = w @ xxp
        full = packed.new_zeros(packed.shape[:-1] + (p, p))
        full[..., iu[0], iu[1]] = packed
        full[..., iu[1], iu[0]] = packed
        return full


def _signs(topology, like: torch.Tensor) -> torch.Tensor:
    if isinstance(topology, torch.Tensor):
        return topology.to(like)
    if isinstance(topology, Topology):
        return topology.sign_matrix(dtype=like.dtype, device=like.device)
    tops = list(topology)
    if len({t.num_experts for t in tops}) != 1:
        raise ValueError("topologies batched together must have the same number of experts")
    return torch.stack([t.sign_matrix(dtype=like.dtype, device=like.device) for t in tops])


@dataclass(frozen=True)
class VBState:
    """Parameters of every variational factor, with leading ``batch_shape``.

    ``G`` gates, ``E`` experts, ``P`` inputs (with bias), ``D`` outputs, ``N`` points.

    :ivar v_mean: ``batch_shape + (G, P)``.
    :ivar v_cov: ``batch_shape + (G, P, P)``.
    :ivar beta_a: Gamma shape of the gate precisions, ``batch_shape + (G,)``.
    :ivar beta_b: Gamma rate of the gate precisions, ``batch_shape + (G,)``.
    :ivar w_mean: ``batch_shape + (E, D, P)``.
    :ivar w_cov: ``batch_shape + (E, P, P)`` (shared by the ``D`` rows).
    :ivar alpha_a: Gamma shape of the expert weight precisions, ``batch_shape + (E,)``.
    :ivar alpha_b: Gamma rate of the expert weight precisions, ``batch_shape + (E,)``.
    :ivar tau_a: Gamma shape of the expert noise precisions, ``batch_shape + (E,)``.
    :ivar tau_b: Gamma rate of the expert noise precisions, ``batch_shape + (E,)``.
    :ivar xi: Jaakkola-Jordan parameters, ``batch_shape + (G, N)``.
    :ivar log_r: log responsibilities ``batch_shape + (N, E)``.
    """

    v_mean: torch.Tensor
    v_cov: torch.Tensor
    beta_a: torch.Tensor
    beta_b: torch.Tensor
    w_mean: torch.Tensor
    w_cov: torch.Tensor
    alpha_a: torch.Tensor
    alpha_b: torch.Tensor
    tau_a: torch.Tensor
    tau_b: torch.Tensor
    xi: torch.Tensor
    log_r: torch.Tensor

    @property
    def batch_shape(self) -> torch.Size:
        """The leading batch dims shared by every factor (``()`` for one state)."""
        return self.beta_a.shape[:-1]

    def index(self, idx) -> VBState:
        """The state of the batch elements ``idx`` (any index of ``batch_shape``)."""
        return VBState(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def to(self, *args, **kwargs) -> VBState:
        """A copy with every factor moved by ``Tensor.to(*args, **kwargs)``."""
        return VBState(**{f.name: getattr(self, f.name).to(*args, **kwargs) for f in fields(self)})


def jj_lambda(xi: torch.Tensor) -> torch.Tensor:
    r""":math:`\lambda(\xi) = \tanh(\xi/2)/(4\xi)`, with its limit ``1/8`` at ``0``."""
    # below 1e-6 the clamp changes the value by less than 1e-14 relative
    xi = xi.abs().clamp_min(1e-6)
    return torch.tanh(0.5 * xi) / (4 * xi)


def _gauss_from_precision(prec: torch.Tensor):
    """Covariance and log-determinant of the covariance from a precision matrix."""
    chol, info = torch.linalg.cholesky_ex(prec)
    cov = torch.cholesky_inverse(chol)
    logdet_cov = -2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    if prec.dim() > 2:  # a failed factorisation (lost precision) poisons only its element
        bad = info > 0
        cov = torch.where(bad[..., None, None], math.nan, cov)
        logdet_cov = torch.where(bad, math.nan, logdet_cov)
    elif int(info):
        raise torch.linalg.LinAlgError("precision matrix is not positive definite")
    return cov, logdet_cov


def _logdet(cov: torch.Tensor) -> torch.Tensor:
    return 2 * torch.linalg.cholesky(cov).diagonal(dim1=-2, dim2=-1).log().sum(-1)


def _elog(a, b):
    return torch.digamma(a) - b.log()


def _gamma_kl(a, b, a0: float, b0: float) -> torch.Tensor:
    """KL(Gamma(a, b) || Gamma(a0, b0)), shape/rate."""
    return (
        (a - a0) * torch.digamma(a)
        - torch.lgamma(a)
        + math.lgamma(a0)
        + a0 * (b.log() - math.log(b0))
        + a * (b0 - b) / b
    )


def _expert_sq(data: VBData, state: VBState) -> torch.Tensor:
    """``E||t_n - W_j x_n||^2``, ``batch_shape + (N, E)``."""
    d = data.t.shape[-1]
    mean = torch.einsum("np,...jdp->...njd", data.x, state.w_mean)
    sq = (data.t.unsqueeze(-2) - mean).pow(2).sum(-1)
    return sq + d * data.quad(state.w_cov).transpose(-1, -2)


def _ell_from_sq(data: VBData, state: VBState, sq: torch.Tensor) -> torch.Tensor:
    d = data.t.shape[-1]
    e_tau = state.tau_a / state.tau_b
    elog_tau = _elog(state.tau_a, state.tau_b)
    return 0.5 * d * (elog_tau - _LOG_2PI).unsqueeze(-2) - 0.5 * (e_tau.unsqueeze(-2) * sq)


def expected_expert_loglik(data: VBData, state: VBState) -> torch.Tensor:
    r""":math:`E_q[\log N(t_n \mid W_j x_n, \tau_j^{-1} I)]`, shape ``batch_shape + (N, E)``."""
    return _ell_from_sq(data, state, _expert_sq(data, state))


def _gate_moments(data: VBData, state: VBState):
    mean_a = state.v_mean @ data.x.T  # (..., G, N)
    sq_a = mean_a.pow(2) + data.quad(state.v_cov)
    return mean_a, sq_a


def gate_terms(data: VBData, state: VBState) -> torch.Tensor:
    r"""Jaakkola-Jordan lower bound on :math:`E_q[\log \pi_j(x_n)]`, ``batch_shape + (N, E)``:

    .. math:: \sum_{g \in \mathrm{path}(j)} \tfrac{1}{2} s_{gj} E[a_{gn}]
        - \lambda(\xi_{gn})(E[a_{gn}^2] - \xi_{gn}^2) + \log\sigma(\xi_{gn}) - \xi_{gn}/2.
    """
    return _gate_terms_from(data, state, *_gate_moments(data, state))


def _gate_terms_from(data, state, mean_a, sq_a, lam=None):
    xi = state.xi
    lam = jj_lambda(xi) if lam is None else lam
    c = -lam * (sq_a - xi.square()) + F.logsigmoid(xi) - 0.5 * xi  # (..., G, N)
    s = data.signs
    return (0.5 * mean_a).transpose(-1, -2) @ s + c.transpose(-1, -2) @ s.abs()


def _global_terms(data: VBData, state: VBState) -> torch.Tensor:
    """The bound's terms of the global factors (everything but the assignments)."""
    p = data.x.shape[-1]
    d = data.t.shape[-1]
    a0, b0 = data.prior_a, data.prior_b
    # gates: E[log p(v | beta)] + H[q(v)] - KL(q(beta) || p(beta)), constants 2 pi cancel
    e_beta = state.beta_a / state.beta_b
    vv = state.v_mean.pow(2).sum(-1) + state.v_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    gates = 0.5 * p * _elog(state.beta_a, state.beta_b) - 0.5 * e_beta * vv
    gates = gates + 0.5 * p + 0.5 * _logdet(state.v_cov)
    gates = gates - _gamma_kl(state.beta_a, state.beta_b, a0, b0)

    e_alpha = state.alpha_a / state.alpha_b
    ww = state.w_mean.pow(2).sum((-1, -2)) + d * state.w_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    experts = 0.5 * d * p * _elog(state.alpha_a, state.alpha_b) - 0.5 * e_alpha * ww
    experts = experts + 0.5 * d * p + 0.5 * d * _logdet(state.w_cov)
    experts = experts - _gamma_kl(state.alpha_a, state.alpha_b, a0, b0)
    experts = experts - _gamma_kl(state.tau_a, state.tau_b, a0, b0)
    return gates.sum(-1) + experts.sum(-1)


def bound(data: VBData, state: VBState, temperature: float = 1.0) -> torch.Tensor:
    r"""The variational lower bound in closed form, shape ``batch_shape``.

    At ``temperature != 1`` the expected log-likelihood is divided by ``temperature``
    (the objective that annealed updates maximise); at 1 it is the evidence lower bound
    of the model with the Jaakkola-Jordan bound on the gates.
    """
    r = state.log_r.exp()
    point = gate_terms(data, state) + expected_expert_loglik(data, state) / temperature
    assign = (r * (point - state.log_r)).nan_to_num(0.0).sum((-1, -2))
    return assign + _global_terms(data, state)


# ---------------------------------------------------------------------- updates
def update_assignments(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """Optimal categorical ``q(Z)`` given every other factor."""
    point = gate_terms(data, state) + expected_expert_loglik(data, state) / temperature
    return replace(state, log_r=point.log_softmax(-1))


def update_experts(data: VBData, state: VBState, temperature: float = 1.0, *, r=None) -> VBState:
    """Optimal Gaussian ``q(W_j)`` for every expert."""
    p = data.x.shape[-1]
    r = state.log_r.exp() if r is None else r  # (..., N, E)
    scale = (state.tau_a / state.tau_b) / temperature  # (..., E)
    rxx = data.weighted_outer(r.transpose(-1, -2))  # (..., E, P, P)
    eye = torch.eye(p, dtype=data.x.dtype, device=data.x.device)
    e_alpha = state.alpha_a / state.alpha_b
    prec = e_alpha[..., None, None] * eye + scale[..., None, None] * rxx
    cov, _ = _gauss_from_precision(prec)
    rxt = (r.transpose(-1, -2) @ data._xt).unflatten(-1, (p, data.t.shape[-1]))  # (..., E, P, D)
    mean = scale[..., None, None] * (cov @ rxt)
    return replace(state, w_mean=mean.transpose(-1, -2), w_cov=cov)


def update_noise(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """Optimal Gamma ``q(tau_j)`` for every expert's noise precision."""
    return _noise_from_sq(data, state, _expert_sq(data, state), temperature)


def _noise_from_sq(data, state, sq, temperature, r=None):
    d = data.t.shape[-1]
    r = state.log_r.exp() if r is None else r
    a = data.prior_a + 0.5 * d * r.sum(-2) / temperature
    b = data.prior_b + 0.5 * (r * sq).sum(-2) / temperature
    return replace(state, tau_a=a, tau_b=b)


def update_expert_precisions(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """Optimal Gamma ``q(alpha_j)`` for every expert's weight precision."""
    p = data.x.shape[-1]
    d = data.t.shape[-1]
    ww = state.w_mean.pow(2).sum((-1, -2)) + d * state.w_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    a = torch.full_like(state.alpha_a, data.prior_a + 0.5 * d * p)
    return replace(state, alpha_a=a, alpha_b=data.prior_b + 0.5 * ww)


def update_gates(
    data: VBData, state: VBState, temperature: float = 1.0, *, r=None, lam=None
) -> VBState:
    """Optimal Gaussian ``q(v_g)`` for every gate, given the ``xi`` and ``q(Z)``."""
    p = data.x.shape[-1]
    r = state.log_r.exp() if r is None else r  # (..., N, E)
    lam = jj_lambda(state.xi) if lam is None else lam
    s = data.signs
    reach = s.abs() @ r.transpose(-1, -2)  # (..., G, N): probability of passing gate g
    turn = 0.5 * (s @ r.transpose(-1, -2))  # (right - left) / 2
    wgt = 2 * reach * lam
    eye = torch.eye(p, dtype=data.x.dtype, device=data.x.device)
    e_beta = state.beta_a / state.beta_b
    prec = e_beta[..., None, None] * eye + data.weighted_outer(wgt)
    cov, _ = _gauss_from_precision(prec)
    mean = (cov @ (turn @ data.x).unsqueeze(-1)).squeeze(-1)
    return replace(state, v_mean=mean, v_cov=cov)


def update_xi(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    r"""Optimal Jaakkola-Jordan parameters :math:`\xi_{gn}^2 = E[a_{gn}^2]`."""
    _, sq_a = _gate_moments(data, state)
    return replace(state, xi=sq_a.clamp_min(0).sqrt())


def update_gate_precisions(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """Optimal Gamma ``q(beta_g)`` for every gate's weight precision."""
    p = data.x.shape[-1]
    vv = state.v_mean.pow(2).sum(-1) + state.v_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    a = torch.full_like(state.beta_a, data.prior_a + 0.5 * p)
    return replace(state, beta_a=a, beta_b=data.prior_b + 0.5 * vv)


#: The coordinate updates in the order of one cycle of :func:`vb_cycle`.
UPDATES = (
    update_experts,
    update_noise,
    update_expert_precisions,
    update_xi,
    update_gates,
    update_gate_precisions,
    update_assignments,
)


def vb_cycle(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """One pass through every coordinate update, in the order of :data:`UPDATES` (experts,
    noise, expert precisions, ``xi``, gates, gate precisions, assignments)."""
    return _fused_cycle(data, state, temperature)[0]


def _fused_cycle(data, state, temperature, sq_a=None):
    """:func:`vb_cycle` computing each ``O(N P^2)`` quantity once; also returns the
    gates' ``E[a^2]`` (reused by the next cycle's ``xi`` update) and the bound.

    Internally the per-point arrays are laid out ``(..., K, N)`` (points last, so that
    elementwise work and the sums over experts run along contiguous memory); the
    returned ``log_r`` is a transposed view of that layout.
    """
    x, t = data.x, data.t
    p, d = x.shape[-1], t.shape[-1]
    a0, b0 = data.prior_a, data.prior_b
    eye = torch.eye(p, dtype=x.dtype, device=x.device)
    r = _exp(state.log_r.transpose(-1, -2))  # (..., E, N)
    # experts q(W_j): one Cholesky per expert
    inv_t = 1.0 / temperature
    scale = (state.tau_a / state.tau_b) * inv_t  # (..., E)
    e_alpha = state.alpha_a / state.alpha_b
    prec = e_alpha[..., None, None] * eye + scale[..., None, None] * data.weighted_outer(r)
    w_cov, _ = _gauss_from_precision(prec)
    rxt = (r @ data._xt).unflatten(-1, (p, d))  # (..., E, P, D)
    w_mean = (scale[..., None, None] * (w_cov @ rxt)).transpose(-1, -2)  # (..., E, D, P)
    # E||t - W x||^2, (..., E, N)
    resid = t.T - w_mean @ x.T  # (..., E, D, N)
    sq = resid.square().sum(-2) if d > 1 else resid.squeeze(-2).square()
    sq = sq + d * data.quad(w_cov)
    # noise and weight precisions
    tau_a = a0 + (0.5 * d * inv_t) * r.sum(-1)
    tau_b = b0 + (0.5 * inv_t) * (r * sq).sum(-1)
    ww = w_mean.square().sum((-1, -2)) + d * w_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    alpha_a = torch.full_like(state.alpha_a, a0 + 0.5 * d * p)
    alpha_b = b0 + 0.5 * ww
    # xi and gates q(v_g)
    if sq_a is None:
        sq_a = _gate_moments(data, state)[1]
    xi = sq_a.clamp_min(0).sqrt()  # (..., G, N)
    lam = jj_lambda(xi)
    s = data.signs
    reach = s.abs() @ r  # (..., G, N)
    turn = (0.5 * s) @ r
    e_beta = state.beta_a / state.beta_b
    prec = e_beta[..., None, None] * eye + data.weighted_outer(2 * reach * lam)
    v_cov, _ = _gauss_from_precision(prec)
    v_mean = (v_cov @ (turn @ x).unsqueeze(-1)).squeeze(-1)
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
    sq_a = mean_a.square() + data.quad(v_cov)
    c = F.logsigmoid(xi) - 0.5 * xi - lam * (sq_a - xi.square())
    st = s.transpose(-1, -2)
    point = (0.5 * st) @ mean_a + st.abs() @ c
    e_tau = tau_a / tau_b
    const = (0.5 * d * inv_t) * (_elog(tau_a, tau_b) - _LOG_2PI)
    point = point + const.unsqueeze(-1) - (0.5 * inv_t * e_tau).unsqueeze(-1) * sq
    top = point.amax(-2, keepdim=True)
    log_z = top + _exp(point - top).sum(-2, keepdim=True).log()  # (..., 1, N)
    state = replace(state, log_r=(point - log_z).transpose(-1, -2))
    log_z = log_z.squeeze(-2)
    value = log_z.sum(-1) + _global_terms(data, state)
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
    log_pi = (F.logsigmoid(logits.unsqueeze(-1) * s.unsqueeze(-2)) * s.abs().unsqueeze(-2)).sum(-3)
    log_r = log_pi.log_softmax(-1) if g else x.new_zeros(batch_shape + (n, e))
    ones_e = torch.ones(batch_shape + (e,), **opts)
    ones_g = torch.ones(batch_shape + (g,), **opts)
    var_t = t.var(0).mean().clamp_min(1e-12) if n > 1 else t.new_tensor(1.0)
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
    num_iters: int = 800,
    *,
    initial: float = 5.85,
    factor: float = 0.97,
    anneal_iters: int = 200,
    floor: bool = False,
    inverse: bool = False,
) -> list[float]:
    """Deterministic annealing of the likelihood temperature:
    ``1 + (initial - 1) * factor**k`` for the first ``anneal_iters`` cycles, then 1
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
    if num_iters < 1:
        raise ValueError(f"num_iters must be >= 1, got {num_iters}")
    if floor:
        values = [
            max(1.0, initial * factor**k) if k < anneal_iters else 1.0 for k in range(num_iters)
        ]
    else:
        values = [
            1.0 + (initial - 1.0) * factor**k if k < anneal_iters else 1.0 for k in range(num_iters)
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


def schedule_by_name(name: str, num_iters: int = 800) -> list[float]:
    """The temperatures of one of :data:`SCHEDULES` over ``num_iters`` cycles, annealing
    over the first quarter (the paper's 200 of 800); ``"none"`` is ``num_iters`` ones."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown annealing schedule {name!r}: use one of {sorted(SCHEDULES)}")
    if SCHEDULES[name] is None:
        return [1.0] * num_iters
    return temperature_schedule(num_iters, anneal_iters=max(1, num_iters // 4), **SCHEDULES[name])


@dataclass
class VBResult:
    """Output of :func:`run_vb`: the final state, its bound (``batch_shape``) and the bound
    after every cycle (``(num_iters,) + batch_shape``, tempered while annealing)."""

    state: VBState
    bound: torch.Tensor
    history: torch.Tensor
    iterations: int


def run_vb(
    data: VBData,
    state: VBState,
    *,
    temperatures: Sequence[float] | None = None,
    num_iters: int = 200,
    tol: float | None = 1e-6,
) -> VBResult:
    """Cycle the coordinate updates.

    :param temperatures: one likelihood temperature per cycle (overrides ``num_iters``);
        default: ``num_iters`` cycles at 1.
    :param tol: stop early, once at temperature 1, when no batch element's bound moved
        by more than ``tol * N`` in a cycle (``None``: never).
    """
    temps = list(temperatures) if temperatures is not None else [1.0] * num_iters
    if not temps:
        raise ValueError("run_vb needs at least one iteration")
    history = []
    prev = None
    sq_a = None
    n = data.x.shape[0]
    for temp in temps:
        state, sq_a, value = _fused_cycle(data, state, temp, sq_a)
        history.append(value)
        if tol is not None and temp == 1.0 and prev is not None:
            if float((value - prev).abs().nan_to_num(0.0).max()) <= tol * n:
                break
        prev = value if temp == 1.0 else None
    it = len(history)
    final = bound(data, state) if temps[it - 1] != 1.0 else history[-1]
    return VBResult(state, final, torch.stack(history), it)


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


def _with_signs(data: VBData, signs: torch.Tensor) -> VBData:
    """``data`` with other signs, keeping the cached per-point statistics."""
    new = replace(data, signs=signs)
    for key in ("_pairs", "_xt"):
        if key in data.__dict__:
            new.__dict__[key] = data.__dict__[key]
    return new


def _race(data: VBData, state: VBState, temps: Sequence[float], tol: float | None):
    """Cycle a flat batch (``batch_shape == (B,)``, ``data.signs`` ``(B, G, E)``) through
    ``temps``. At temperature 1 an element whose bound moved by at most ``tol * N`` in a
    cycle has converged and leaves the batch (as does one whose bound is not finite), so
    the remaining cycles only work on the elements still moving.

    :returns: the final states, their bounds ``(B,)`` and the number of element-cycles.
    """
    n = data.x.shape[0]
    bsz = state.batch_shape[0]
    active = torch.arange(bsz, device=data.x.device)
    done_idx, done_states, done_values = [], [], []
    prev = None
    sq_a = None
    value = None
    work = 0
    for k, temp in enumerate(temps):
        state, sq_a, value = _fused_cycle(data, state, temp, sq_a)
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
                data = _with_signs(data, data.signs[go])
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
    num_iters: int = 200,
    tol: float | None = 1e-6,
    prior_a: float = 1e-3,
    prior_b: float = 1e-3,
    generator: torch.Generator | None = None,
    prune_after: int | None = None,
    keep: int = 5,
    max_batch: int = 512,
    search_dtype: torch.dtype | None = None,
    polish_iters: int = 100,
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

    With ``search_dtype`` (e.g. ``torch.float32``, about twice as fast on a CPU) the
    search runs in that dtype; the best restart of every topology is then *polished*
    in the dtype of ``x``: up to ``polish_iters`` more cycles at temperature 1 (stopping
    on ``tol``), so that the reported bounds and states are computed at full precision
    (each polishing cycle can only raise the bound).

    :param x: inputs ``(N, L)`` (no bias column; one is appended).
    :param t: targets ``(N,)`` or ``(N, D)``.
    :param topologies: a list of :class:`~pyro_trees.topology.Topology`, or an int ``E``: every
        topology with ``1..E`` experts.
    """
    import time

    start = time.perf_counter()
    if isinstance(topologies, int):
        topologies = enumerate_topologies(topologies)
    topologies = list(topologies)
    x = torch.as_tensor(x)
    t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
    work_dtype = x.dtype if search_dtype is None else search_dtype
    xs, ts = x.to(work_dtype), t.to(work_dtype)
    temps = list(temperatures) if temperatures is not None else [1.0] * num_iters
    if not temps:
        raise ValueError("select_topology needs at least one iteration")
    pruning = prune_after is not None and keep < num_restarts and 0 < prune_after < len(temps)
    groups: dict[int, list[int]] = {}
    for k, top in enumerate(topologies):
        groups.setdefault(top.num_experts, []).append(k)
    n = x.shape[0]
    all_bounds = [None] * len(topologies)
    best_states = [None] * len(topologies)
    work = 0
    for e, members in sorted(groups.items()):
        cap = max(1, int(max_batch * 1024 / max(1, e * n)))
        per_chunk = max(1, cap // num_restarts)
        base = VBData.build(xs, ts, topologies[members[0]], prior_a=prior_a, prior_b=prior_b)
        signs = _signs([topologies[k] for k in members], xs)  # (K, G, E)
        phase1 = temps[:prune_after] if pruning else temps
        results = []  # (state, bounds (K_c, R), member indices) per chunk
        for c in range(0, len(members), per_chunk):
            chunk = list(range(c, min(c + per_chunk, len(members))))
            sg = signs[chunk].repeat_interleave(num_restarts, 0)  # (K_c R, G, E)
            data = _with_signs(base, sg)
            state = init_state(data, (len(sg),), generator=generator)
            state, values, w = _race(data, state, phase1, None if pruning else tol)
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
            data = _with_signs(base, sg)
            finals, values_all = [], []
            cap2 = max(1, cap)
            for c in range(0, len(owners), cap2):
                sl = slice(c, c + cap2)
                st, vals, w = _race(
                    _with_signs(data, sg[sl]), state.index(sl), temps[prune_after:], tol
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
        data = VBData.build(x, t, top, prior_a=prior_a, prior_b=prior_b)
        st = best_states[k].to(x.dtype)
        if search_dtype is not None and search_dtype != x.dtype and polish_iters > 0:
            res = run_vb(data, st, num_iters=polish_iters, tol=tol)
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


# ---------------------------------------------------------------------- growing


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
    w = r / r.sum().clamp_min(torch.finfo(r.dtype).tiny)
    mu = w @ x
    xc = x - mu
    cov = (xc * w.unsqueeze(-1)).T @ xc
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
    p = data.x.shape[-1]
    d = data.t.shape[-1]
    a0, b0 = data.prior_a, data.prior_b
    m, cov = grown.v_mean[..., gate, :], grown.v_cov[..., gate, :, :]
    mean_a = m @ data.x.T
    sq_a = mean_a.square() + data.quad(cov.unsqueeze(-3)).squeeze(-2)
    xi = grown.xi[..., gate, :]
    c = -jj_lambda(xi) * (sq_a - xi.square()) + F.logsigmoid(xi) - 0.5 * xi
    split = torch.logaddexp(c - 0.5 * mean_a, c + 0.5 * mean_a)
    r = parent.log_r[..., expert].exp()
    ba, bb = grown.beta_a[..., gate], grown.beta_b[..., gate]
    vv = m.square().sum(-1) + cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    gate_terms_ = 0.5 * p * _elog(ba, bb) - 0.5 * (ba / bb) * vv + 0.5 * p + 0.5 * _logdet(cov)
    gate_terms_ = gate_terms_ - _gamma_kl(ba, bb, a0, b0)
    aa, ab = parent.alpha_a[..., expert], parent.alpha_b[..., expert]
    wm, wc = parent.w_mean[..., expert, :, :], parent.w_cov[..., expert, :, :]
    ww = wm.square().sum((-1, -2)) + d * wc.diagonal(dim1=-2, dim2=-1).sum(-1)
    expert_terms = 0.5 * d * p * _elog(aa, ab) - 0.5 * (aa / ab) * ww + 0.5 * d * p
    expert_terms = expert_terms + 0.5 * d * _logdet(wc) - _gamma_kl(aa, ab, a0, b0)
    expert_terms = expert_terms - _gamma_kl(
        parent.tau_a[..., expert], parent.tau_b[..., expert], a0, b0
    )
    return (r * split).sum(-1) + gate_terms_ + expert_terms


def grow_selection(
    x,
    t,
    selection: ModelSelection,
    *,
    starts_per_split: int = 3,
    num_iters: int = 400,
    tol: float | None = 1e-6,
    prior_a: float = 1e-3,
    prior_b: float = 1e-3,
    generator: torch.Generator | None = None,
    max_batch: int = 512,
    search_dtype: torch.dtype | None = None,
    polish_iters: int = 100,
    sharpness: float = 2.0,
) -> ModelSelection:
    """Search each topology again from starts grown out of the smaller topologies' best
    solutions, smallest sizes first.

    Random restarts of large topologies rarely find the basins of their best solutions.
    For every topology with ``E`` experts and every one of its cherries (a gate whose two
    children are experts), removing the cherry gives a topology with ``E - 1`` experts;
    if its mirror class was searched, its best state is split at that leaf
    (:func:`~pyro_trees.infer.bayesian_hme_vb.grow_state`; ``starts_per_split`` gates through the
    leaf's data, :func:`~pyro_trees.infer.bayesian_hme_vb.split_directions`) and the grown starts
    of all topologies of the size run together as one batch for up to ``num_iters`` cycles at
    temperature 1 (in ``search_dtype``, the best per topology polished in the dtype of ``x`` as
    in :func:`select_topology`). A topology keeps the better of its previous best and its
    best grown start, so its bound never decreases; sizes are done in increasing order,
    so grown solutions seed the next size. The choice uses the training bound only.

    :returns: a new :class:`ModelSelection` (``grown`` marks the topologies whose best
        state now comes from a grown start; ``all_bounds`` gains the grown starts' bounds).
    """
    import time

    start = time.perf_counter()
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
    n = x.shape[0]
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
                data = VBData.build(x, t, smaller, prior_a=prior_a, prior_b=prior_b)
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
        base = VBData.build(xs, ts, tops[owners[0]], prior_a=prior_a, prior_b=prior_b)
        sg = _signs([tops[k] for k in owners], xs)
        cap = max(1, int(max_batch * 1024 / max(1, e * n)))
        finals, values = [], []
        for c in range(0, len(owners), cap):
            sl = slice(c, c + cap)
            st, vals, w = _race(_with_signs(base, sg[sl]), state.index(sl), [1.0] * num_iters, tol)
            work += w
            finals.append(st)
            values.append(vals)
        state, values = _cat_states(finals), torch.cat(values)
        own = torch.tensor(owners)
        for k in sorted(set(owners)):
            idx = (own == k).nonzero().squeeze(-1)
            j = int(idx[values[idx].argmax()])
            data = VBData.build(x, t, tops[k], prior_a=prior_a, prior_b=prior_b)
            st = state.index(j).to(x.dtype)
            if work_dtype != x.dtype and polish_iters > 0:
                res = run_vb(data, st, num_iters=polish_iters, tol=tol)
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
