"""The predictive distribution of :meth:`~pyro_trees.models.HeteroscedasticGP.predict`."""

from __future__ import annotations

from typing import NamedTuple

import pyro.distributions as dist
import torch

__all__ = ["HGPPrediction"]


class HGPPrediction(NamedTuple):
    """Predictive distribution of :meth:`HeteroscedasticGP.predict` at ``N`` inputs.

    :ivar mean: predictive mean of ``f`` (and of ``y``), ``(N,)``.
    :ivar f_var: variance of ``f``, ``(N,)``.
    :ivar leaf_probs: routing weights ``(N, 2**D)`` (one-hot for ``routing="hard"``).
    :ivar leaf_log_scale: :math:`s_\\ell`, ``(2**D,)``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models import HGPPrediction
    >>> pred = HGPPrediction(
    ...     mean=torch.zeros(2),
    ...     f_var=torch.full((2,), 0.5),
    ...     leaf_probs=torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
    ...     leaf_log_scale=torch.tensor([0.0, -1.0]),
    ... )
    >>> pred.variance.round(decimals=3)
    tensor([1.5000, 0.6350])
    >>> pred.log_prob(torch.zeros(2)).shape
    torch.Size([2])
    """

    mean: torch.Tensor
    f_var: torch.Tensor
    leaf_probs: torch.Tensor
    leaf_log_scale: torch.Tensor

    @property
    def noise_var(self) -> torch.Tensor:
        """Expected noise variance :math:`\\sum_\\ell q_\\ell e^{2 s_\\ell}`, ``(N,)``."""
        return self.leaf_probs @ torch.exp(2 * self.leaf_log_scale)

    @property
    def log_sigma(self) -> torch.Tensor:
        """Noise log standard deviation, ``0.5 * log(noise_var)``, ``(N,)``."""
        return 0.5 * torch.log(self.noise_var)

    @property
    def variance(self) -> torch.Tensor:
        """Variance of ``y``: ``f_var + noise_var``, ``(N,)``."""
        return self.f_var + self.noise_var

    def log_prob(self, y: torch.Tensor) -> torch.Tensor:
        """Log predictive density of ``y`` ``(N,)`` under the mixture over leaves, ``(N,)``."""
        var = self.f_var.unsqueeze(-1) + torch.exp(2 * self.leaf_log_scale)  # (N, 2**D)
        comp = dist.Normal(self.mean.unsqueeze(-1), var.sqrt()).log_prob(y.unsqueeze(-1))
        return torch.logsumexp(comp + self.leaf_probs.clamp_min(1e-300).log(), dim=-1)
