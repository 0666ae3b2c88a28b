"""Gaussian over ``N`` instances × ``D`` dimensions with covariance ``C ⊗ I_D``."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints

__all__ = ["KroneckerNormal"]


class KroneckerNormal(TorchDistribution):
    r"""Zero-mean matrix normal :math:`Z \sim \mathcal N(0, C \otimes I_D)` with rows
    (instances) correlated by ``C = scale_tril @ scale_tril.T`` and the ``D`` columns
    independent, as the graph-correlated priors of TreeVI (Xiao & Su 2024, Secs. 4.1,
    4.3, 4.4): :math:`C = I + \lambda A` for an affinity matrix ``A``.

    :param torch.Tensor scale_tril: lower Cholesky factor of ``C``,
        ``batch_shape + (N, N)``.
    :param int dim: ``D``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import KroneckerNormal
    >>> adjacency = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    >>> d = KroneckerNormal.from_affinity(adjacency, 0.3, dim=2)  # C = I + 0.3 A
    >>> d.event_shape, d.covariance_matrix[0]
    (torch.Size([3, 2]), tensor([1.0000, 0.3000, 0.0000]))
    >>> z = d.rsample((5,))
    >>> z.shape, d.log_prob(z).shape
    (torch.Size([5, 3, 2]), torch.Size([5]))
    """

    arg_constraints = {"scale_tril": constraints.lower_cholesky}
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(self, scale_tril: torch.Tensor, dim: int, *, validate_args=None):
        if scale_tril.dim() < 2 or scale_tril.shape[-1] != scale_tril.shape[-2]:
            raise ValueError(
                f"scale_tril must be square (..., N, N), got {tuple(scale_tril.shape)}"
            )
        if int(dim) < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        self.scale_tril = scale_tril
        self.dim = int(dim)
        n = scale_tril.shape[-1]
        super().__init__(scale_tril.shape[:-2], torch.Size((n, self.dim)), validate_args)

    @classmethod
    def from_affinity(cls, adjacency: torch.Tensor, strength: float, dim: int, **kwargs):
        """``C = I + strength * adjacency``; raises ValueError if ``C`` is not positive definite."""
        if adjacency.shape[-1] != adjacency.shape[-2]:
            raise ValueError(f"adjacency must be square, got {tuple(adjacency.shape)}")
        if not torch.allclose(adjacency, adjacency.transpose(-1, -2)):
            raise ValueError("adjacency must be symmetric")
        eye = torch.eye(adjacency.shape[-1], dtype=adjacency.dtype, device=adjacency.device)
        chol, info = torch.linalg.cholesky_ex(eye + strength * adjacency)
        if bool((info != 0).any()):
            raise ValueError(
                f"I + {strength} * adjacency is not positive definite; lower the strength"
            )
        return cls(chol, dim, **kwargs)

    @property
    def covariance_matrix(self):
        """The row covariance ``C = scale_tril @ scale_tril.T``, ``batch_shape + (N, N)``."""
        return self.scale_tril @ self.scale_tril.transpose(-1, -2)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(KroneckerNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new.scale_tril = self.scale_tril.expand(batch_shape + self.scale_tril.shape[-2:])
        new.dim = self.dim
        super(KroneckerNormal, new).__init__(batch_shape, self.event_shape, False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self):
        return self.scale_tril.new_zeros(self.batch_shape + self.event_shape)

    def rsample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        eps = torch.randn(shape, dtype=self.scale_tril.dtype, device=self.scale_tril.device)
        return self.scale_tril @ eps

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        tril = self.scale_tril.expand(value.shape[:-2] + self.scale_tril.shape[-2:])
        w = torch.linalg.solve_triangular(tril, value, upper=False)
        n = self.event_shape[0]
        half_logdet = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return (
            -0.5 * w.pow(2).sum((-2, -1))
            - self.dim * half_logdet
            - 0.5 * n * self.dim * math.log(2 * math.pi)
        )
