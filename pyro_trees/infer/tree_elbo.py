r"""``TreeELBO``: Pyro's enumerated ELBO plus the tree-balance coupling.

For a model whose per-point routing site is a
:class:`~pyro_trees.distributions.BalancedLeaf` and a guide that enumerates that site
in parallel (``infer={"enumerate": "parallel"}``), :class:`TreeELBO` is

.. math::

    \mathcal{L} = \sum_n \mathbb{E}_{q(\ell_n)}\big[\log p(y_n \mid \ell_n)\big]
        - \sum_n \mathrm{KL}\big(q(\ell_n)\,\|\,\mathrm{Unif}\big)
        + \mathbb{E}_q[\log c(M)],

which is eq. 7 of Antorán et al. with the tree-balance prior
:class:`~pyro_trees.distributions.TreeBalance` (joint over the data plate). The first
two terms are :class:`pyro.infer.TraceEnum_ELBO`'s exact sums over the ``2**D`` leaves
(no score-function estimator over routes); the coupling term is the Stirling
approximation of App. B, computed from the guide's leaf probabilities.

Under subsampling (``pyro.plate(..., subsample_size=B)``) the coupling is estimated
from the minibatch: node masses are scaled by ``N / B`` and the aggregate posteriors
:math:`\alpha_i` are the minibatch's (a consistent, slightly biased estimate).
"""

from __future__ import annotations

import math

import torch
from pyro.infer import TraceEnum_ELBO
from pyro.infer.traceenum_elbo import _compute_dice_elbo
from pyro.infer.util import is_identically_zero
from pyro.util import warn_if_nan

from pyro_trees.distributions.tree_balance import BalancedLeaf, expected_log_coupling

__all__ = ["TreeELBO"]


class TreeELBO(TraceEnum_ELBO):
    r""":class:`~pyro.infer.TraceEnum_ELBO` with the tree-balance coupling of every
    :class:`~pyro_trees.distributions.BalancedLeaf` site added.

    :param float balance_weight: multiplies the coupling term (``1`` is the ELBO;
        ``0`` drops the tree-balance prior, leaving a uniform per-point prior).
    :param float entropy_weight: multiplies the per-point term
        :math:`\sum_n \mathrm{KL}(q(\ell_n)\,\|\,\mathrm{Unif})`. ``1`` (default) is
        the ELBO. Confident routing costs up to :math:`D \log 2` nats per point there,
        so where the likelihood gains less (classification, deep trees) the bound
        prefers vague routing. ``0`` drops the term (expected log-likelihood plus
        balance, the objective of Frosst & Hinton); ``-1`` flips its sign, as eq. 22
        of Antorán et al. has it. Any value but 1 is no longer a bound on the
        evidence.
    :param kwargs: passed to :class:`~pyro.infer.TraceEnum_ELBO`;
        ``max_plate_nesting`` defaults to 1.

    Works with plain ``pyro.infer.SVI(model, guide, optim, loss=TreeELBO())`` and, as
    every Pyro ELBO, as ``TreeELBO()(model, guide)`` for module-local parameters.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import RNNTreeGuide
    >>> from pyro_trees.infer import TreeELBO
    >>> from pyro_trees.models import HME
    >>> x, y = torch.randn(8, 1), torch.randn(8)
    >>> model, guide = HME(1, 2), RNNTreeGuide(1, 2, hidden_size=8)
    >>> loss = TreeELBO().loss(model, guide, x, y)
    >>> isinstance(loss, float)
    True
    """

    def __init__(self, *, balance_weight: float = 1.0, entropy_weight: float = 1.0, **kwargs):
        kwargs.setdefault("max_plate_nesting", 1)
        super().__init__(**kwargs)
        self.balance_weight = float(balance_weight)
        self.entropy_weight = float(entropy_weight)

    @staticmethod
    def _routing_sites(model_trace, guide_trace):
        for name, site in model_trace.nodes.items():
            if site["type"] != "sample" or not isinstance(site["fn"], BalancedLeaf):
                continue
            if site["is_observed"]:
                continue
            guide_site = guide_trace.nodes.get(name)
            if guide_site is None or not hasattr(guide_site["fn"], "logits"):
                raise ValueError(
                    f"site {name!r} has a BalancedLeaf prior; its guide site must be a "
                    "distribution with per-point leaf logits (e.g. dist.Categorical)"
                )
            logits = guide_site["fn"].logits
            if logits.dim() < 2:
                logits = logits.expand(site["fn"].batch_shape + logits.shape[-1:])
            yield site, logits

    def per_point_kl(self, model_trace, guide_trace) -> torch.Tensor | float:
        """``sum_n KL(q(leaf_n) || Unif)`` over every ``BalancedLeaf`` site (scaled)."""
        total = 0.0
        for site, logits in self._routing_sites(model_trace, guide_trace):
            log_q = logits - logits.logsumexp(-1, keepdim=True)
            kl = (log_q.exp() * log_q).sum(-1) + site["fn"].depth * math.log(2.0)
            total = total + site["scale"] * kl.sum()
        return total

    def coupling(self, model_trace, guide_trace) -> torch.Tensor | float:
        """Sum of the Stirling coupling terms of every ``BalancedLeaf`` site."""
        total = 0.0
        for site, logits in self._routing_sites(model_trace, guide_trace):
            total = (
                total + expected_log_coupling(logits, site["fn"].depth, scale=site["scale"]).sum()
            )
        return total

    def _elbo_particles(self, model, guide, args, kwargs):
        for model_trace, guide_trace in self._get_traces(model, guide, args, kwargs):
            elbo = _compute_dice_elbo(model_trace, guide_trace)
            if self.balance_weight:
                elbo = elbo + self.balance_weight * self.coupling(model_trace, guide_trace)
            if self.entropy_weight != 1.0:
                # The enumerated ELBO already holds -1 x the per-point KL.
                extra = (1.0 - self.entropy_weight) * self.per_point_kl(model_trace, guide_trace)
                elbo = elbo + extra
            yield elbo, model_trace, guide_trace

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """A differentiable estimate of the negative ELBO."""
        elbo = 0.0
        for elbo_particle, _, _ in self._elbo_particles(model, guide, args, kwargs):
            elbo = elbo + elbo_particle
        loss = -elbo / self.num_particles
        if not torch.is_tensor(loss):
            loss = torch.tensor(float(loss))
        warn_if_nan(loss, "loss")
        return loss

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO as a float."""
        with torch.no_grad():
            return float(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO; also backpropagates it into the parameters."""
        elbo = 0.0
        for elbo_particle, _, _ in self._elbo_particles(model, guide, args, kwargs):
            if is_identically_zero(elbo_particle):
                continue
            elbo += float(elbo_particle.detach()) / self.num_particles
            if elbo_particle.requires_grad:
                (-elbo_particle / self.num_particles).backward(retain_graph=True)
        loss = -elbo
        warn_if_nan(loss, "loss")
        return loss
