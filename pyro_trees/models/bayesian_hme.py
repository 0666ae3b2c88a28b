r"""The Bayesian hierarchical mixture of experts (Bishop & Svensén, 2003) as a Pyro model.

Generative story, for a :class:`~pyro_trees.topology.Topology` with ``G`` gates and ``E``
experts, inputs :math:`x_n \in \mathbb{R}^L` with a constant 1 appended
(:math:`\tilde x_n \in \mathbb{R}^P`, ``P = L + 1``), and targets
:math:`y_n \in \mathbb{R}^D`:

.. math::

    \beta_g &\sim \mathrm{Gamma}(a_0, b_0), & v_g \mid \beta_g &\sim N(0, \beta_g^{-1} I_P),\\
    \alpha_j, \tau_j &\sim \mathrm{Gamma}(a_0, b_0), & W_j \mid \alpha_j &\sim
        N(0, \alpha_j^{-1} I_{D \times P}),\\
    \pi_j(x_n) &= \prod_{g \in \mathrm{path}(j)} \sigma(s_{gj}\, v_g^\top \tilde x_n), &
    y_n &\sim \sum_j \pi_j(x_n)\, N(W_j \tilde x_n, \tau_j^{-1} I_D),

with :math:`s_{gj} = +1` when the path to expert ``j`` turns right at gate ``g`` (the
gate logit is the log-odds of going right, as in :mod:`pyro_trees.trees`) and ``-1``
when it turns left. The expert assignment is **summed out exactly**: the observation
site is a :class:`~pyro.distributions.MixtureSameFamily` over the ``E`` experts, so the
model trains with plain :class:`~pyro.infer.Trace_ELBO` and no enumeration.

Sites and plates (one class owns each plate):

* ``"gates"`` plate (size ``G``, dim -1): ``beta`` ``(G,)``; ``v`` ``(G, P)`` (event 1).
  Absent for a single expert.
* ``"experts"`` plate (size ``E``, dim -1): ``alpha`` ``(E,)``; ``tau`` ``(E,)``;
  ``W`` ``(E, D, P)`` (event 2).
* ``"data"`` plate (size ``N``, dim -1, ``subsample_size`` allowed): ``obs`` ``(N, D)``.

The closed-form variational Bayes of :mod:`pyro_trees.infer.bayesian_hme_vb` fits the
same model; :class:`pyro_trees.guides.BayesianHMEGuide` is the matching SVI guide.

References: C. M. Bishop and M. Svensén, *Bayesian Hierarchical Mixtures of Experts*,
UAI 2003.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule

from pyro_trees.topology import Topology, expert_log_probs

__all__ = ["BayesianHME"]


class BayesianHME(PyroModule):
    """Bayesian HME with linear-Gaussian experts and sigmoid gates on ``x`` (with bias).

    :param int in_features: input dimension ``L`` (the bias is added inside).
    :param int out_features: output dimension ``D``.
    :param topology: a :class:`~pyro_trees.topology.Topology` (any full binary tree);
        default: two experts under one gate.
    :param float prior_a: Gamma shape ``a0`` of every precision's prior.
    :param float prior_b: Gamma rate ``b0`` of every precision's prior.
    :param str name: parameter-store prefix (the model has no parameters; its guide,
        :class:`~pyro_trees.guides.BayesianHMEGuide`, takes it as its default name).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models import BayesianHME
    >>> from pyro_trees.topology import Topology
    >>> model = BayesianHME(2, 1, Topology.balanced(1))
    >>> x = torch.randn(10, 2)
    >>> model(x).shape
    torch.Size([10, 1])
    >>> model.num_gates, model.num_experts
    (1, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int = 1,
        topology: Topology | None = None,
        *,
        prior_a: float = 1e-3,
        prior_b: float = 1e-3,
        name: str = "",
    ):
        super().__init__(name=name)
        self.name = name
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        topology = Topology.balanced(1) if topology is None else topology
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a Topology, got {topology!r}")
        if not (prior_a > 0 and prior_b > 0):
            raise ValueError(f"prior_a and prior_b must be positive, got {prior_a}, {prior_b}")
        self.in_features = in_features
        self.out_features = out_features
        self.topology = topology
        self.prior_a = float(prior_a)
        self.prior_b = float(prior_b)
        self.register_buffer("signs", topology.sign_matrix(dtype=torch.get_default_dtype()))

    @property
    def num_gates(self) -> int:
        """Number of gates of ``topology``."""
        return self.topology.num_gates

    @property
    def num_experts(self) -> int:
        """Number of experts of ``topology``."""
        return self.topology.num_experts

    def _check(self, x, y):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (N, {self.in_features}), got {shape}")
        if y is not None:
            if y.dim() == 1 and self.out_features == 1:
                y = y.unsqueeze(-1)
            if y.dim() != 2 or y.shape[-1] != self.out_features:
                raise ValueError(
                    f"y must have shape (N, {self.out_features}), got {tuple(y.shape)}"
                )
            if y.shape[0] != x.shape[0]:
                raise ValueError(
                    f"x and y have mismatched lengths: {x.shape[0]} and {y.shape[0]} rows"
                )
        return y

    def _gamma(self, like: torch.Tensor, size: int):
        a = like.new_tensor(self.prior_a)
        b = like.new_tensor(self.prior_b)
        return dist.Gamma(a, b).expand([size])

    def mixture(self, x: torch.Tensor, v, W, tau) -> dist.MixtureSameFamily:
        """The conditional ``p(y | x, v, W, tau)`` with the assignment summed out.

        Leading batch dims of the globals (restarts, vectorised particles) broadcast.
        Noise precisions below ``finfo.tiny ** 0.25`` (``6e-10`` in float32) are raised to
        it: an unused expert's broad ``q(tau)`` draws values that underflow, whose
        ``tau ** -0.5`` and its gradient would overflow (the component's density is
        negligible either way).

        :param x: inputs ``(N, L)``; ``v``: ``batch + (G, P)``; ``W``: ``batch + (E, D, P)``;
            ``tau``: ``batch + (E,)``.
        :returns: a distribution with batch shape ``batch + (N,)`` and event shape ``(D,)``.
        """
        xb = torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)
        if self.num_gates:
            logits = xb @ v.transpose(-1, -2)  # (N, G)
            log_pi = self.topology_log_probs(logits)
        else:
            log_pi = xb.new_zeros(xb.shape[:-1] + (1,))
        means = torch.einsum("np,...jdp->...njd", xb, W)
        tau = tau.clamp_min(torch.finfo(tau.dtype).tiny ** 0.25)
        scale = tau.rsqrt()[..., None, :, None].expand(means.shape)
        comp = dist.Normal(means, scale).to_event(1)
        return dist.MixtureSameFamily(dist.Categorical(logits=log_pi), comp)

    def topology_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log gate probabilities ``log pi_j`` of every expert, ``(..., G) -> (..., E)``."""
        return expert_log_probs(logits, self.signs.to(logits))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Sample the globals and the targets (observed when ``y`` is given).

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N, D)`` (``(N,)`` accepted when ``D == 1``) or ``None``.
        :param subsample_size: minibatch size of the ``"data"`` plate.
        :returns: the targets ``(N, D)`` (of the subsample).
        """
        y = self._check(x, y)
        p, d = self.in_features + 1, self.out_features
        v = None
        if self.num_gates:
            with pyro.plate("gates", self.num_gates, dim=-1):
                beta = pyro.sample("beta", self._gamma(x, self.num_gates))
                scale = beta.rsqrt().unsqueeze(-1).expand(beta.shape + (p,))
                v = pyro.sample("v", dist.Normal(torch.zeros_like(scale), scale).to_event(1))
        with pyro.plate("experts", self.num_experts, dim=-1):
            alpha = pyro.sample("alpha", self._gamma(x, self.num_experts))
            tau = pyro.sample("tau", self._gamma(x, self.num_experts))
            scale = alpha.rsqrt()[..., None, None].expand(alpha.shape + (d, p))
            W = pyro.sample("W", dist.Normal(torch.zeros_like(scale), scale).to_event(2))
        with pyro.plate("data", x.shape[0], subsample_size=subsample_size, dim=-1) as idx:
            xs = x[idx]
            ys = None if y is None else y[idx]
            return pyro.sample("obs", self.mixture(xs, v, W, tau), obs=ys)
