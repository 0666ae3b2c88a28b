"""Mixture of tree-structured Gaussians (MTreeVI, Xiao & Su 2024, eqs. 14-15)."""

from __future__ import annotations

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

from pyro_trees._forest import validate_parents
from pyro_trees.distributions.tree_normal import TreeNormal

__all__ = ["MixtureOfTreeNormals"]


class MixtureOfTreeNormals(TorchDistribution):
    r"""Weighted mixture of :class:`TreeNormal` components with different trees (eq. 14):

    .. math::

        q(z) = \sum_{m=1}^M \pi_m\, q^{\mathcal T_m}(z).

    ``log_prob`` is exact (a log-sum-exp over the components, :math:`O(M N D)`). The
    entropy has no closed form; :meth:`entropy_lower_bound` is the paper's bound
    :math:`\sum_m \pi_m H[q^{\mathcal T_m}]` (concavity of the entropy) and
    :meth:`entropy_upper_bound` adds :math:`H[\pi]`. :meth:`rsample_components` draws one
    reparameterised sample from *every* component, which is what the MTreeVI objective
    (eq. 15, :math:`\sum_m \pi_m (\log p(x, z^{(m)}) + H[q^{\mathcal T_m}])`) needs.

    ``sample`` picks a component per draw; the draw is not reparameterisable in the
    weights, so ``has_rsample`` is ``False``.

    :param torch.Tensor loc: means, ``batch_shape + (M, N, D)`` (use a singleton ``M``
        axis to share them across components).
    :param torch.Tensor scale: standard deviations, broadcastable with ``loc``.
    :param parents: integer array ``(M, N)``, one parent array per tree.
    :param torch.Tensor rho: edge correlations, ``batch_shape + (M, N, D)`` or
        ``(M, N, D)``.
    :param torch.Tensor logits: unnormalised log weights, ``batch_shape + (M,)`` or any
        shape broadcastable to it (e.g. ``(M,)``, shared by the batch).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import MixtureOfTreeNormals
    >>> parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    >>> q = MixtureOfTreeNormals(torch.zeros(1, 3, 2), torch.ones(1, 3, 2), parents,
    ...                          torch.full((2, 3, 2), 0.5), logits=torch.zeros(2))
    >>> z = q.sample((5,))
    >>> z.shape, q.log_prob(z).shape
    (torch.Size([5, 3, 2]), torch.Size([5]))
    >>> q.rsample_components().shape  # one draw from every tree
    torch.Size([2, 3, 2])
    """

    arg_constraints = {"logits": constraints.real_vector}
    support = constraints.independent(constraints.real, 2)
    has_rsample = False

    def __init__(self, loc, scale, parents, rho, logits, *, validate_args=None):
        if not isinstance(parents, torch.Tensor):
            parents = torch.as_tensor(parents)
        if parents.dim() != 2:
            raise ValueError(f"parents must have shape (M, N), got {tuple(parents.shape)}")
        m, n = parents.shape
        for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
            if not isinstance(t, torch.Tensor) or t.dim() < 3:
                raise ValueError(f"{name} must be a tensor of shape batch_shape + (M, N, D)")
            if t.shape[-3] not in (1, m):
                raise ValueError(f"{name} has {t.shape[-3]} components but parents has {m}")
        if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] != m:
            raise ValueError(f"logits must have shape batch_shape + ({m},)")
        parents = torch.stack([validate_parents(p, num_nodes=n) for p in parents.to(loc.device)])
        self.components = [
            TreeNormal(
                loc.select(-3, min(k, loc.shape[-3] - 1)),
                scale.select(-3, min(k, scale.shape[-3] - 1)),
                parents[k],
                rho.select(-3, min(k, rho.shape[-3] - 1)),
                validate_args=validate_args,
            )
            for k in range(m)
        ]
        batch_shape = torch.broadcast_shapes(
            self.components[0].batch_shape,
            *(c.batch_shape for c in self.components[1:]),
            logits.shape[:-1],
        )
        event_shape = self.components[0].event_shape
        # the weights are expanded to the full batch shape, so that ``sample`` draws one
        # component index per batch element even when ``logits`` is only ``(M,)``
        logits = logits - logits.logsumexp(-1, keepdim=True)
        self.logits = logits.expand(batch_shape + (m,))
        self.parents = parents
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @property
    def num_components(self) -> int:
        """Number of mixture components (trees)."""
        return len(self.components)

    @lazy_property
    def probs(self):
        return self.logits.exp()

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(MixtureOfTreeNormals, _instance)
        batch_shape = torch.Size(batch_shape)
        new.components = [c.expand(batch_shape) for c in self.components]
        new.logits = self.logits.expand(batch_shape + (self.num_components,))
        new.parents = self.parents
        super(MixtureOfTreeNormals, new).__init__(batch_shape, self.event_shape, False)
        new._validate_args = self._validate_args
        return new

    def component_log_probs(self, value):
        """``log q^{T_m}(value)`` stacked on the last axis: ``... + (M,)``."""
        return torch.stack([c.log_prob(value) for c in self.components], dim=-1)

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        return (self.component_log_probs(value) + self.logits).logsumexp(-1)

    def rsample_components(self, sample_shape=()):
        """One reparameterised draw per component: ``sample_shape + batch_shape + (M, N, D)``."""
        sample_shape = torch.Size(sample_shape)
        draws = [c.expand(self.batch_shape).rsample(sample_shape) for c in self.components]
        return torch.stack(draws, dim=-3)

    def sample(self, sample_shape=()):
        sample_shape = torch.Size(sample_shape)
        with torch.no_grad():
            draws = self.rsample_components(sample_shape)
            idx = torch.distributions.Categorical(logits=self.logits).sample(sample_shape)
            idx = idx.reshape(idx.shape + (1, 1, 1)).expand(idx.shape + (1,) + self.event_shape)
            return draws.gather(-3, idx).squeeze(-3)

    def component_entropies(self):
        """Exact entropies of the components, ``batch_shape + (M,)``."""
        return torch.stack([c.entropy().expand(self.batch_shape) for c in self.components], -1)

    def entropy_lower_bound(self):
        r""":math:`\sum_m \pi_m H[q^{\mathcal T_m}] \le H[q]` (the bound of eq. 15)."""
        return (self.probs * self.component_entropies()).sum(-1)

    def entropy_upper_bound(self):
        r""":math:`\sum_m \pi_m H[q^{\mathcal T_m}] + H[\pi] \ge H[q]`."""
        h_pi = -(self.probs * self.logits).sum(-1)
        return self.entropy_lower_bound() + h_pi

    @property
    def mean(self):
        means = torch.stack(
            [c.mean.expand(self.batch_shape + self.event_shape) for c in self.components], -3
        )
        return (self.probs[..., None, None] * means).sum(-3)

    def __repr__(self):
        return (
            f"MixtureOfTreeNormals(batch_shape: {tuple(self.batch_shape)}, event_shape: "
            f"{tuple(self.event_shape)}, num_components: {self.num_components})"
        )
