"""One slice of a jointly Gaussian vector given the slices before it, with the KL to a
prior without parents registered in its expectation over those slices.

:class:`JointGaussianSlice` is what :class:`~pyro_trees.guides.DGPJointGuide` samples
layer by layer (the inducing outputs of each deep-GP layer given the earlier layers'), so
that :class:`~pyro.infer.TraceMeanField_ELBO` gets the exact KL of the joint.
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints, register_kl

__all__ = ["JointGaussianSlice"]


class JointGaussianSlice(TorchDistribution):
    """One layer's conditional :math:`q(u_i \\mid u_{<i})` of a jointly Gaussian guide.

    A Gaussian over the flattened ``(P, M)`` inducing outputs with mean ``loc`` (which
    holds :math:`\\mu_i + C_i \\epsilon_{<i}`) and lower Cholesky factor ``scale_tril``
    ``(n, n)``, ``n = P M``, and event shape ``(P, M)``. It also keeps the unconditional
    mean ``mean`` and the cross factor ``cross`` (``(n, s)``), so that the KL to a prior
    without parents (the layer's :math:`N(0, K_{ZZ})` or whitened :math:`N(0, I)`) is
    registered in its expectation over the earlier layers,

    .. math::

        E_{\\epsilon_{<i}} \\mathrm{KL}[q(u_i \\mid u_{<i}) \\| p(u_i)]
          = \\mathrm{KL}[N(\\mu_i, L_{ii} L_{ii}^\\top) \\| p(u_i)]
            + \\tfrac12 \\operatorname{tr}(K_p^{-1} C_i C_i^\\top),

    whose sum over the layers is exactly :math:`\\mathrm{KL}[q(U) \\| p(U)]` (the chain
    rule of the KL): :class:`~pyro.infer.TraceMeanField_ELBO` then estimates only the
    expected log-likelihood by Monte Carlo. Without this, every one of the factor's
    ``T (T - 1) / 2`` entries gets a Monte Carlo KL gradient (noise that Adam turns into
    a random walk).

    :param loc: the conditional mean :math:`\\mu_i + C_i \\epsilon_{<i}`, ``B + (n,)``.
    :param scale_tril: the conditional's lower Cholesky factor :math:`L_{ii}`, ``(n, n)``.
    :param event_shape: ``(P, M)`` with ``P M = n``.
    :param mean: the unconditional mean :math:`\\mu_i`, ``(n,)``.
    :param cross: the factor :math:`C_i` on the earlier slices' noise, ``(n, s)``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import JointGaussianSlice
    >>> q = JointGaussianSlice(torch.zeros(6), torch.eye(6), (2, 3),
    ...                        mean=torch.zeros(6), cross=torch.zeros(6, 4))
    >>> q.rsample().shape
    torch.Size([2, 3])
    """

    arg_constraints = {}
    has_rsample = True

    def __init__(self, loc, scale_tril, event_shape, *, mean, cross, validate_args=None):
        self.loc, self.scale_tril = loc, scale_tril
        self.mean_, self.cross = mean, cross
        self._shape = tuple(event_shape)
        super().__init__(loc.shape[:-1], torch.Size(self._shape), validate_args=False)

    @property
    def support(self):
        return constraints.independent(constraints.real, 2)

    @property
    def mean(self):
        return self.loc.reshape(*self.loc.shape[:-1], *self._shape)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        loc = self.loc.expand(*batch_shape, self.loc.shape[-1])
        return JointGaussianSlice(
            loc, self.scale_tril, self._shape, mean=self.mean_, cross=self.cross
        )

    def rsample(self, sample_shape=()):
        shape = torch.Size(sample_shape) + self.loc.shape
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        flat = self.loc + (self.scale_tril @ eps.unsqueeze(-1)).squeeze(-1)
        return flat.reshape(*shape[:-1], *self._shape)

    def log_prob(self, value):
        flat = value.reshape(*value.shape[:-2], -1)
        return dist.MultivariateNormal(self.loc, scale_tril=self.scale_tril).log_prob(flat)


@register_kl(JointGaussianSlice, dist.Independent)
def _kl_joint_slice_prior(q, p):
    base = p.base_dist
    if not (
        isinstance(base, torch.distributions.MultivariateNormal)
        and p.reinterpreted_batch_ndims == 1
        and tuple(p.event_shape) == q._shape
    ):
        raise NotImplementedError
    P, M = q._shape
    Lp = base._unbroadcasted_scale_tril  # (M, M) or (P, M, M), not expanded over particles
    Lp = Lp.expand(P, M, M) if Lp.dim() == 2 else Lp.reshape(P, M, M)
    n = P * M
    # rows of [L_ii, C_i] per output, whitened by the prior's factor: (P, M, n + s)
    rows = torch.cat([q.scale_tril, q.cross], dim=-1).reshape(P, M, -1)
    trace = torch.linalg.solve_triangular(Lp, rows, upper=False).pow(2).sum()
    p_loc = base.loc.reshape(-1, P, M)[0] if base.loc.dim() > 2 else base.loc
    diff = (q.mean_.reshape(P, M) - p_loc).unsqueeze(-1)
    maha = torch.linalg.solve_triangular(Lp, diff, upper=False).pow(2).sum()
    logdet_p = Lp.diagonal(dim1=-2, dim2=-1).log().sum()
    logdet_q = q.scale_tril.diagonal().log().sum()
    kl = 0.5 * (trace + maha - n) + logdet_p - logdet_q
    return kl.expand(q.batch_shape)
