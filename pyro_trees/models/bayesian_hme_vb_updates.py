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

The public names are exported from :mod:`pyro_trees.infer.bayesian_hme_vb`; they live
here, below the guides, because :class:`~pyro_trees.guides.BayesianHMEGuide` starts
from them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from pyro_trees.topology import sign_matrices

__all__ = [
    "UPDATES",
    "VBData",
    "VBState",
    "bound",
    "expected_expert_loglik",
    "expert_factor_terms",
    "gate_factor_terms",
    "gate_terms",
    "jj_lambda",
    "update_assignments",
    "update_expert_precisions",
    "update_experts",
    "update_gate_precisions",
    "update_gates",
    "update_noise",
    "update_xi",
]

_LOG_2PI = math.log(2 * math.pi)


def _exp_floor(dtype) -> float:
    """The floor of :func:`_exp`'s arguments, ``log(tiny) + 1``."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _exp(value: torch.Tensor) -> torch.Tensor:
    """``exp`` with arguments below ``log(tiny) + 1`` raised to it: the result changes by
    less than three times the dtype's smallest normal number, and CPU ``exp`` avoids its
    slow path for subnormal results. (``exp`` runs in place on the clamped copy: the same
    bits, one array fewer.)"""
    return value.clamp_min(_exp_floor(value.dtype)).exp_()


def _exp_(value: torch.Tensor) -> torch.Tensor:
    """:func:`_exp` of a temporary, in its own memory (the same bits)."""
    return value.clamp_min_(_exp_floor(value.dtype)).exp_()


@dataclass(frozen=True)
class VBData:
    """Training data and hyperparameters, shared by every batch element.

    :ivar x: inputs with the bias column appended, ``(N, P)``.
    :ivar t: targets ``(N, D)``.
    :ivar signs: path signs broadcastable to ``batch_shape + (G, E)`` (``+1`` right,
        ``-1`` left, ``0`` off the path), same dtype as ``x``.
    :ivar prior_a: Gamma shape of every precision's prior (``a0``).
    :ivar prior_b: Gamma rate of every precision's prior (``b0``).
    :ivar reduce: ``None``, or a function applied to every sum over the rows (the
        sufficient statistics of the updates and the bound's sum over points), e.g. the
        sum over the ranks of a data-parallel fit whose ranks hold different rows: the
        updates then use every rank's rows and every rank gets the same factors.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import VBData
    >>> from pyro_trees.topology import Topology
    >>> data = VBData.build(torch.randn(5, 2), torch.randn(5), Topology.balanced(1))
    >>> data.x.shape, data.t.shape, data.signs.shape
    (torch.Size([5, 3]), torch.Size([5, 1]), torch.Size([1, 2]))
    >>> data.quad(torch.eye(3).expand(2, 3, 3)).shape
    torch.Size([2, 5])
    """

    x: torch.Tensor
    t: torch.Tensor
    signs: torch.Tensor
    prior_a: float = 1e-3
    prior_b: float = 1e-3
    reduce: Callable | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(
        cls, x, t, topology, *, prior_a: float = 1e-3, prior_b: float = 1e-3, reduce=None
    ) -> VBData:
        """From raw inputs ``x`` ``(N, L)`` (a bias column is appended), targets ``(N,)`` or
        ``(N, D)``, and a :class:`~pyro_trees.topology.Topology`, a sequence of topologies with the
        same number of experts (stacked along a leading batch dim), or a sign tensor."""
        x = torch.as_tensor(x)
        x = torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device)
        if t.dim() == 1:
            t = t.unsqueeze(-1)
        return cls(x, t, sign_matrices(topology, x), prior_a, prior_b, reduce)

    def rows_sum(self, value: torch.Tensor) -> torch.Tensor:
        """A sum over rows, reduced by ``reduce`` (unchanged without one)."""
        return value if self.reduce is None else self.reduce(value)

    @functools.cached_property
    def num_rows(self) -> int:
        """The number of rows over every rank (``N`` without ``reduce``)."""
        return int(self.rows_sum(self.x.new_tensor(float(self.x.shape[0]))).item())

    def with_signs(self, signs) -> VBData:
        """The same data with other path ``signs``, sharing the per-row statistics already
        computed.

        :param signs: a :class:`~pyro_trees.topology.Topology`, a sequence of topologies
            with the same number of experts, or sign matrices ``batch + (G, G + 1)``
            (as :meth:`build` takes them; converted to ``x``'s dtype and device).
        :raises ValueError: for sign matrices that are not ``(..., G, G + 1)``.
        """
        signs = sign_matrices(signs, self.x)
        if signs.dim() < 2 or signs.shape[-1] != signs.shape[-2] + 1:
            raise ValueError(
                "signs must be sign matrices (..., G, G + 1): G gates, G + 1 experts; got "
                f"{tuple(signs.shape)}"
            )
        new = replace(self, signs=signs)
        for key in ("_pairs", "_xt", "num_rows"):
            if key in self.__dict__:
                new.__dict__[key] = self.__dict__[key]
        return new

    def precompute(self) -> VBData:
        """Compute the per-row statistics the updates share (the row count over every
        rank, the packed products ``x x^T`` and ``x t^T``) now, once; a compiled program
        then reads them instead of computing them inside (a first computation of a
        cached property inside a compiled graph would break it). Returns ``self``."""
        self.num_rows, self._pairs, self._xt  # noqa: B018
        return self

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
        """``sum_n w_kn x_n x_n^T`` (over every rank's rows with ``reduce``):
        ``batch + (K, N)`` -> ``batch + (K, P, P)``."""
        iu, xxp, _ = self._pairs
        p = self.x.shape[-1]
        packed = self.rows_sum(w @ xxp)
        full = packed.new_zeros(packed.shape[:-1] + (p, p))
        full[..., iu[0], iu[1]] = packed
        full[..., iu[1], iu[0]] = packed
        return full


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

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import VBData, bayesian_hme_vb as vb
    >>> from pyro_trees.topology import Topology
    >>> data = VBData.build(torch.randn(30, 1), torch.randn(30), Topology.balanced(1))
    >>> state = vb.init_state(data, (4,), generator=torch.Generator().manual_seed(0))
    >>> state.batch_shape, state.w_mean.shape, state.log_r.shape
    (torch.Size([4]), torch.Size([4, 2, 1, 2]), torch.Size([4, 30, 2]))
    >>> state = vb.vb_cycle(data, state)
    >>> state.index(0).batch_shape
    torch.Size([])
    >>> vb.bound(data, state).shape
    torch.Size([4])
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

    def clone(self) -> VBState:
        """A copy whose factors own their memory. A state taken by :meth:`index` from a
        batch views the whole batch's storage, which pickling it would write out in
        full."""
        return VBState(**{f.name: getattr(self, f.name).clone() for f in fields(self)})


def jj_lambda(xi: torch.Tensor) -> torch.Tensor:
    r""":math:`\lambda(\xi) = \tanh(\xi/2)/(4\xi)`, with its limit ``1/8`` at ``0``."""
    # below 1e-6 the clamp changes the value by less than 1e-14 relative
    xi = xi.abs().clamp_min(1e-6)  # a temporary: the steps below run in place
    return xi.mul(0.5).tanh_().div_(xi.mul_(4))


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


def gate_factor_terms(data: VBData, state: VBState) -> torch.Tensor:
    r"""Each gate's share of the bound's global terms:
    :math:`E[\log p(v_g \mid \beta_g)] + H[q(v_g)] - \mathrm{KL}(q(\beta_g) \| p(\beta_g))`
    (the constants in :math:`2\pi` cancel).

    :returns: ``batch_shape + (G,)``.
    """
    p = data.x.shape[-1]
    e_beta = state.beta_a / state.beta_b
    vv = state.v_mean.pow(2).sum(-1) + state.v_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    gates = 0.5 * p * _elog(state.beta_a, state.beta_b) - 0.5 * e_beta * vv
    gates = gates + 0.5 * p + 0.5 * _logdet(state.v_cov)
    return gates - _gamma_kl(state.beta_a, state.beta_b, data.prior_a, data.prior_b)


def expert_factor_terms(data: VBData, state: VBState) -> torch.Tensor:
    r"""Each expert's share of the bound's global terms:
    :math:`E[\log p(W_j \mid \alpha_j)] + H[q(W_j)] - \mathrm{KL}(q(\alpha_j) \|
    p(\alpha_j)) - \mathrm{KL}(q(\tau_j) \| p(\tau_j))`.

    :returns: ``batch_shape + (E,)``.
    """
    p = data.x.shape[-1]
    d = data.t.shape[-1]
    a0, b0 = data.prior_a, data.prior_b
    e_alpha = state.alpha_a / state.alpha_b
    ww = state.w_mean.pow(2).sum((-1, -2)) + d * state.w_cov.diagonal(dim1=-2, dim2=-1).sum(-1)
    experts = 0.5 * d * p * _elog(state.alpha_a, state.alpha_b) - 0.5 * e_alpha * ww
    experts = experts + 0.5 * d * p + 0.5 * d * _logdet(state.w_cov)
    experts = experts - _gamma_kl(state.alpha_a, state.alpha_b, a0, b0)
    return experts - _gamma_kl(state.tau_a, state.tau_b, a0, b0)


def _global_terms(data: VBData, state: VBState) -> torch.Tensor:
    """The bound's terms of the global factors (everything but the assignments)."""
    return gate_factor_terms(data, state).sum(-1) + expert_factor_terms(data, state).sum(-1)


def bound(data: VBData, state: VBState, temperature: float = 1.0) -> torch.Tensor:
    r"""The variational lower bound in closed form, shape ``batch_shape``.

    At ``temperature != 1`` the expected log-likelihood is divided by ``temperature``
    (the objective that annealed updates maximise); at 1 it is the evidence lower bound
    of the model with the Jaakkola-Jordan bound on the gates.
    """
    r = state.log_r.exp()
    point = gate_terms(data, state) + expected_expert_loglik(data, state) / temperature
    assign = data.rows_sum((r * (point - state.log_r)).nan_to_num(0.0).sum(-1)).sum(-1)
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
    rxt = data.rows_sum(r.transpose(-1, -2) @ data._xt).unflatten(-1, (p, data.t.shape[-1]))
    mean = scale[..., None, None] * (cov @ rxt)
    return replace(state, w_mean=mean.transpose(-1, -2), w_cov=cov)


def update_noise(data: VBData, state: VBState, temperature: float = 1.0) -> VBState:
    """Optimal Gamma ``q(tau_j)`` for every expert's noise precision."""
    return _noise_from_sq(data, state, _expert_sq(data, state), temperature)


def _noise_from_sq(data, state, sq, temperature, r=None):
    d = data.t.shape[-1]
    r = state.log_r.exp() if r is None else r
    a = data.prior_a + 0.5 * d * data.rows_sum(r.sum(-2)) / temperature
    b = data.prior_b + 0.5 * data.rows_sum((r * sq).sum(-2)) / temperature
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
    mean = (cov @ data.rows_sum(turn @ data.x).unsqueeze(-1)).squeeze(-1)
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
