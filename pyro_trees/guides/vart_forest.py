"""The truncated VaRT family for every tree of a :class:`~pyro_trees.models.VaRTForest`,
batched over the trees.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023 (Sec. 2.4).
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroParam
from torch.distributions import constraints

from pyro_trees import trees
from pyro_trees.distributions.split_indicator import RelaxedSplitIndicator
from pyro_trees.guides.base import TreeGuide
from pyro_trees.guides.vart import RelaxedSplitGuide
from pyro_trees.models.vart import node_weights, weighted
from pyro_trees.models.vart_forest import VaRTForest, forest_tree

__all__ = ["VaRTForestGuide"]


class VaRTForestGuide(RelaxedSplitGuide, TreeGuide, AutoGuide):
    r"""Mean-field variational family of a :class:`~pyro_trees.models.VaRTForest`: the
    truncated VaRT family of :class:`~pyro_trees.guides.VaRTGuide` for each of the ``K``
    trees, independent across trees, plus a Gaussian on the log noise scale.

    Tree :math:`k`, node :math:`i`: :math:`s_{ki} \sim \mathrm{RelaxedBernoulli}(
    \tilde\gamma_{ki}, \tau)` and :math:`\beta_{ki} \sim \mathcal N(\tilde\mu_{ki},
    \tilde S_{ki})` for internal positions, :math:`\theta_{ki} \sim \mathcal
    N(\tilde\zeta_{ki}, \tilde\Psi_{ki})` for every node (diagonal covariances);
    :math:`\log\sigma \sim \mathcal N(\tilde m, \tilde v^2)`; for a model with
    ``missing=True``, :math:`\rho_{ki}` as :class:`~pyro_trees.guides.VaRTGuide`'s
    (``rho_logits``, ``rho_concentration`` ``(K, 2**D - 1)``). The parameters carry a
    leading dimension of trees (``split_logits`` ``(K, 2**D - 1)``, ``beta_loc``
    ``(K, 2**D - 1, L + 1)``, ``theta_loc`` ``(K, 2**(D+1) - 1, L + 1)``, ...) and every
    level is one batched sample site in the plates ``trees`` and ``nodes_d``: the cost
    of a step grows with the number of nodes, not with a Python loop over trees. Sites
    are weighted as the model's (eqs. 25-26) and scaled by its ``kl_weight``.

    The parameter ``theta_loc`` holds :math:`K` times the leaves' locations
    :math:`\tilde\zeta_{ki}` (:meth:`params` returns them): Adam moves every parameter
    by about its learning rate per step, so a step moves the sum of :math:`K` trees as
    far as it moves one tree, whatever :math:`K`.

    Lazy start, ``temperature`` (``0``: hard trees) and
    :meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.temperature_set_to` are those of
    :class:`~pyro_trees.guides.VaRTGuide` (both from
    :class:`~pyro_trees.guides.vart.RelaxedSplitGuide`); with ``init="data"`` each split rule
    starts (almost) axis-aligned through a random training point at the first call.

    :param model: the :class:`~pyro_trees.models.VaRTForest` (not registered as a
        submodule).
    :param float temperature: initial :math:`\tau` (default 0.5).
    :param str init: ``"data"`` (default) or ``"random"`` (hyperplanes through the origin).
    :param float init_split_prob: initial :math:`\tilde\gamma_{ki}` (default 0.9).
    :param float init_scale: initial standard deviations (default 0.05; the leaves'
        divided by :math:`\\sqrt K`).
    :param float init_noise: initial :math:`e^{\tilde m}` (default 0.5).
    :param generator: optional ``torch.Generator`` for the random initial values.
    :param str name: prefix of the parameters in Pyro's parameter store (default none).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import VaRTForestGuide
    >>> from pyro_trees.models import VaRTForest
    >>> guide = VaRTForestGuide(VaRTForest(2, num_trees=4, depth=2))
    >>> draw = guide(torch.randn(5, 2))
    >>> draw["split_1"].shape, draw["theta_2"].shape  # (K, 2**d), (K, 2**d, L + 1)
    (torch.Size([4, 2]), torch.Size([4, 4, 3]))
    """

    missing = False  # guides pickled before missing inputs existed

    _PARAMS = (
        "split_logits",
        "beta_loc",
        "beta_scale",
        "theta_loc",
        "theta_scale",
        "log_sigma_loc",
        "log_sigma_scale",
    )

    def __init__(
        self,
        model: VaRTForest,
        *,
        temperature: float = 0.5,
        init: str = "data",
        init_split_prob: float = 0.9,
        init_scale: float = 0.05,
        init_noise: float = 0.5,
        generator: torch.Generator | None = None,
        name: str | None = None,
    ):
        if not isinstance(model, VaRTForest):
            raise ValueError(f"model must be a VaRTForest, got {type(model).__name__}")
        super().__init__(model)
        self._pyro_name = "" if name is None else str(name)
        if init not in ("data", "random"):
            raise ValueError(f"init must be 'data' or 'random', got {init!r}")
        if not 0 < init_split_prob < 1:
            raise ValueError(f"init_split_prob must lie in (0, 1), got {init_split_prob}")
        if not init_scale > 0 or not init_noise > 0:
            raise ValueError("init_scale and init_noise must be > 0")
        self.depth = model.depth
        self.num_trees = model.num_trees
        self.temperature = float(temperature)
        self.init = init
        self._started = False
        k, width = model.num_trees, model.in_features + 1
        n_int, n_all = trees.num_internal(self.depth), trees.num_internal(self.depth + 1)
        logit = math.log(init_split_prob) - math.log1p(-init_split_prob)
        self.split_logits = PyroParam(torch.full((k, n_int), logit))
        loc = torch.randn(k, n_int, width, generator=generator) / math.sqrt(width)
        self.beta_loc = PyroParam(loc)
        self.beta_scale = PyroParam(torch.full((k, n_int, width), init_scale), constraints.positive)
        self.theta_loc = PyroParam(torch.zeros(k, n_all, width))
        leaf = init_scale / math.sqrt(k)  # the sum's initial spread does not grow with K
        self.theta_scale = PyroParam(torch.full((k, n_all, width), leaf), constraints.positive)
        self.log_sigma_loc = PyroParam(torch.tensor(math.log(init_noise)))
        self.log_sigma_scale = PyroParam(torch.tensor(init_scale), constraints.positive)
        self.missing = bool(getattr(model, "missing", False))
        if self.missing:  # as VaRTGuide's: rho starts at its prior
            self.rho_logits = PyroParam(torch.zeros(k, n_int))
            conc = torch.full((k, n_int), 2.0 * model.missing_concentration)
            self.rho_concentration = PyroParam(conc, constraints.positive)

    def params(self, x: torch.Tensor) -> dict:
        """Every (constrained) parameter, read once, in ``x``'s dtype and device, with
        ``theta_loc`` the leaves' locations (the parameter over :math:`K`) and, with
        missing inputs, ``rho_a``, ``rho_b`` the Beta concentrations of ``rho``."""
        return super().params(x)

    def _read_params(self, q: dict) -> dict:
        q["theta_loc"] = q["theta_loc"] / self.num_trees
        return q

    def sites(self, params: dict, noise: dict, temperature) -> dict:
        """The sites of :meth:`rsample` from parameters ``params``, draws ``noise``
        (:meth:`noise`) and the relaxation ``temperature`` (a number or a 0-dim
        tensor): plain tensor code, the part of a draw a compiled loss traces."""
        depth, model = self.depth, self.model
        split, beta, theta, log_sigma = self.relaxed(params, noise, temperature)
        out = {}
        for d in range(depth):
            sl = slice((1 << d) - 1, (2 << d) - 1)
            out[model.site(f"split_{d}")] = split[:, sl]
            out[model.site(f"beta_{d}")] = beta[:, sl]
        for d in range(depth + 1):
            out[model.site(f"theta_{d}")] = theta[:, (1 << d) - 1 : (2 << d) - 1]
        out[model.site("log_sigma")] = log_sigma
        if "rho" in noise:
            for d in range(depth):
                out[model.site(f"rho_{d}")] = noise["rho"][:, (1 << d) - 1 : (2 << d) - 1]
        return out

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Sample the ``K`` truncated trees and the log noise; the arguments only fix
        dtype and device.

        :returns: dict of the sampled values by site name.
        """
        model = self.model
        model.check(x, y)
        q = self.params(x)
        plates = self._create_plates(x, y, subsample_size)
        out = {}
        exist = torch.ones(1, dtype=x.dtype, device=x.device)
        tree_plate = _plate(plates, model.site("trees"), model.num_trees, -2)
        with poutine.scale(scale=model.kl_weight):
            with tree_plate:
                for d in range(self.depth + 1):
                    n = 1 << d
                    sl = slice(n - 1, 2 * n - 1)
                    name = model.site(f"nodes_{d}")
                    with _plate(plates, name, n, -1):
                        if d < self.depth:
                            name = model.site(f"split_{d}")
                            rel = RelaxedSplitIndicator(q["split_logits"][:, sl], self.temperature)
                            with weighted(exist):
                                split = out[name] = pyro.sample(name, rel)
                            psi, kappa, child = node_weights(exist, split)
                            name = model.site(f"beta_{d}")
                            beta = dist.Normal(q["beta_loc"][:, sl], q["beta_scale"][:, sl])
                            with weighted(psi):
                                out[name] = pyro.sample(name, beta.to_event(1))
                                if "rho_a" in q:
                                    name = model.site(f"rho_{d}")
                                    rho = dist.Beta(q["rho_a"][:, sl], q["rho_b"][:, sl])
                                    out[name] = pyro.sample(name, rho)
                        else:
                            kappa = exist
                        name = model.site(f"theta_{d}")
                        theta = dist.Normal(q["theta_loc"][:, sl], q["theta_scale"][:, sl])
                        with weighted(kappa):
                            out[name] = pyro.sample(name, theta.to_event(1))
                    if d < self.depth:
                        exist = child
            name = model.site("log_sigma")
            out[name] = pyro.sample(name, dist.Normal(q["log_sigma_loc"], q["log_sigma_scale"]))
        return out

    @torch.no_grad()
    def mean_tree(self) -> dict:
        """The central forest: hard indicators :math:`\\tilde\\gamma_{ki} > 1/2` and the
        Gaussians' locations, per-tree tensors with batch shape ``(K,)`` for
        :func:`~pyro_trees.models.forest_mean` (a fast point prediction)."""
        hard = (self.split_logits > 0).to(self.theta_loc.dtype)
        bounds = [((1 << d) - 1, (2 << d) - 1) for d in range(self.depth + 1)]
        rho = None
        if getattr(self, "missing", False):
            mean = torch.sigmoid(self.rho_logits.detach())
            rho = [mean[:, a:b] for a, b in bounds[:-1]]
        return forest_tree(
            [hard[:, a:b] for a, b in bounds[:-1]],
            [self.beta_loc.detach()[:, a:b] for a, b in bounds[:-1]],
            [self.theta_loc.detach()[:, a:b] / self.num_trees for a, b in bounds],
            rho,
        )

    @torch.no_grad()
    def split_probs(self) -> torch.Tensor:
        """:math:`\\tilde\\gamma_{ki}` of the internal positions, ``(K, 2**D - 1)``."""
        return torch.sigmoid(self.split_logits)

    @torch.no_grad()
    def node_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Under hard indicators: ``(P(internal), P(leaf))`` of every node, each
        ``(K, 2**(D+1) - 1)``."""
        gamma = self.split_probs()
        gamma = torch.cat([gamma, gamma.new_zeros(gamma.shape[0], 1 << self.depth)], -1)
        exist = gamma.new_ones(gamma.shape[0], 1)
        psi_all, kappa_all = [], []
        for d in range(self.depth + 1):
            psi, kappa, exist = node_weights(exist, gamma[:, (1 << d) - 1 : (2 << d) - 1])
            psi_all.append(psi)
            kappa_all.append(kappa)
        return torch.cat(psi_all, -1), torch.cat(kappa_all, -1)

    def extra_repr(self) -> str:
        """Trees, depth, input size and temperature, for ``repr``."""
        return (
            f"num_trees={self.num_trees}, depth={self.depth}, "
            f"in_features={self.model.in_features}, temperature={self.temperature:.4g}"
        )


def _plate(plates: dict, name: str, size: int, dim: int):
    """The plate ``name`` of an enclosing ``AutoGuideList`` (its master made them), or
    a new one."""
    return plates[name] if name in plates else pyro.plate(name, size, dim=dim)
