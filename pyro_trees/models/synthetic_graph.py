"""The synthetic graph-structured latent-variable model of Xiao & Su (2024), Sec. 4.1.

:class:`SyntheticGraphVAE` puts the loopy graph-correlated prior
:math:`\\mathcal N(0, (I + \\lambda A) \\otimes I_D)` of eq. 18 on the latent codes of
each group of related instances; the exact posterior couples them, so a mean-field guide
cannot represent it. Pair it with :class:`~pyro_trees.guides.TreeVIGuide` (and its
mixture) under a plate over groups.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import nn

from pyro_trees._param_store import predicting, prepare
from pyro_trees.distributions.kronecker_normal import KroneckerNormal
from pyro_trees.validation import as_tensor, check_finite

__all__ = ["SYNTHETIC_AFFINITY", "SyntheticGraphVAE"]

#: The loopy affinity matrix of eq. 18 (four instances).
SYNTHETIC_AFFINITY = torch.tensor(
    [
        [0.0, 1.0, 0.0, 0.3],
        [1.0, 0.0, 1.0, 0.3],
        [0.0, 1.0, 0.0, 0.4],
        [0.3, 0.3, 0.4, 0.0],
    ]
)


class SyntheticGraphVAE(PyroModule):
    """The synthetic graph-structured latent-variable model of Sec. 4.1.

    Data come in ``G`` independent groups of ``N`` related instances (``N = 4`` with the
    affinity of eq. 18). Generative story, for every group ``g`` (plate ``"groups"``,
    dim -1)::

        Z_g ~ N(0, (I_N + strength * A) ⊗ I_D)          # site "z", event (N, D)
        X_g | Z_g ~ N(Z_g W^T + b, noise_var I)           # site "x", event (N, F)

    with a linear decoder ``W, b`` (identity and zero by default, frozen unless
    ``learn_decoder``), so :meth:`exact_log_likelihood` is available in closed form.

    :param torch.Tensor adjacency: ``(N, N)`` symmetric affinity (default eq. 18).
    :param float strength: :math:`\\lambda` (0.5 in the paper).
    :param int latent_dim: ``D``.
    :param int in_features: ``F`` (4 and 4 in the paper).
    :param float noise_var: :math:`\\sigma^2` (0.5 in the paper).
    :param bool learn_decoder: learn ``W, b`` (parameters ``"<name>.weight"``,
        ``"<name>.bias"``).
    :param str name: prefix of its names in Pyro's parameter store.

    Dtype and device follow the data (the buffers move to those of ``x`` at a call).
    Under ``Predictive`` the site ``"x"`` is drawn from the likelihood given the guide's
    ``z``: the posterior predictive of the groups (see :meth:`forward`).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.models import SyntheticGraphVAE
    >>> model = SyntheticGraphVAE()  # the loopy 4-instance graph of eq. 18
    >>> x = model.generate(5)  # 5 groups of 4 instances with 4 features
    >>> x.shape
    torch.Size([5, 4, 4])
    >>> model.exact_log_likelihood(x).shape  # log p(x) of each group
    torch.Size([5])
    >>> trace = pyro.poutine.trace(model).get_trace(x)
    >>> trace.nodes["z"]["value"].shape
    torch.Size([5, 4, 4])
    """

    def __init__(
        self,
        adjacency: torch.Tensor | None = None,
        strength: float = 0.5,
        latent_dim: int = 4,
        in_features: int = 4,
        noise_var: float = 0.5,
        learn_decoder: bool = False,
        *,
        name: str = "",
    ):
        super().__init__(name)
        adjacency = SYNTHETIC_AFFINITY if adjacency is None else torch.as_tensor(adjacency)
        prior = KroneckerNormal.from_affinity(adjacency.double(), strength, latent_dim)
        self.register_buffer("prior_tril", prior.scale_tril.float())
        if noise_var <= 0:
            raise ValueError(f"noise_var must be positive, got {noise_var}")
        self.noise_var = float(noise_var)
        self.latent_dim, self.in_features = latent_dim, in_features
        weight, bias = torch.eye(in_features, latent_dim), torch.zeros(in_features)
        if learn_decoder:
            self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)

    def decoder(self, z):
        """The linear decoder ``z W^T + b``."""
        return z @ self.weight.T + self.bias

    @property
    def num_instances(self) -> int:
        """Number of instances ``N`` per group (the size of the prior's covariance)."""
        return self.prior_tril.shape[-1]

    def forward(self, x=None, *, num_groups: int | None = None, subsample_size=None, **kwargs):
        """Run the generative story.

        ``x`` is observed, except under ``pyro.infer.Predictive`` (which masks every
        density out): there ``"x"`` is drawn from ``p(x | z)`` with ``z`` from the
        guide, so ``Predictive(model, guide=guide, num_samples=S)(x)`` returns
        reconstructions ``(S, G, N, F)`` of the data and the guide's ``z``
        ``(S, G, N, D)`` (without ``subsample_size``: ``Predictive`` does not pass the
        guide's subsample to the model; with it this raises).

        :param torch.Tensor x: observed data ``(G, N, F)``, or ``None`` to generate.
        :param int num_groups: ``G`` when generating (``x=None``).
        :param int subsample_size: minibatch size of the ``"groups"`` plate.
        :returns: ``x`` of the (subsampled) groups, ``(G', N, F)`` (with a leading batch
            shape under outer plates, e.g. ``Predictive(..., parallel=True)``).
        :raises ValueError: if ``x`` is not ``(G, N, F)``, the subsampled rows are not
            finite, or ``subsample_size`` is given under ``Predictive``.
        """
        if x is None and num_groups is None:
            raise ValueError("give the data x (G, N, F) or num_groups to generate")
        if x is not None:
            x = as_tensor(x, "x")
            shape = (self.num_instances, self.in_features)
            if x.dim() != 3 or tuple(x.shape[1:]) != shape:
                raise ValueError(
                    f"x must have shape (G, N, F) = (G, {shape[0]}, {shape[1]}), "
                    f"got {tuple(x.shape)}"
                )
        prepare(self, x)
        if predicting() and subsample_size is not None and x is not None:
            raise ValueError(
                "Predictive does not pass the guide's subsample of groups to the model, so "
                "with subsample_size the two would draw different groups: call Predictive "
                "without subsample_size (or on x[subset])"
            )
        g = x.shape[0] if x is not None else num_groups
        tril = self.prior_tril.to(self.weight.dtype)
        with pyro.plate("groups", g, subsample_size=subsample_size, dim=-1) as i:
            z = pyro.sample("z", KroneckerNormal(tril, self.latent_dim))
            obs = None if x is None else check_finite(x[i], "x")
            if predicting():
                obs = None
            scale = torch.tensor(self.noise_var, dtype=tril.dtype, device=tril.device).sqrt()
            return pyro.sample("x", dist.Normal(self.decoder(z), scale).to_event(2), obs=obs)

    @torch.no_grad()
    def marginal(self) -> torch.distributions.MultivariateNormal:
        """The exact marginal of one group, ``vec(X_g)`` of size ``N F``."""
        w = self.weight.double().cpu()
        tril = self.prior_tril.double().cpu()
        c = tril @ tril.T
        cov = torch.kron(c, w @ w.T) + self.noise_var * torch.eye(
            c.shape[0] * self.in_features, dtype=torch.float64
        )
        loc = self.bias.double().cpu().repeat(c.shape[0])
        return torch.distributions.MultivariateNormal(loc, cov)

    @torch.no_grad()
    def exact_log_likelihood(self, x) -> torch.Tensor:
        """:math:`\\log p(X_g)` per group, shape ``(G,)`` (float64)."""
        return self.marginal().log_prob(x.double().cpu().reshape(x.shape[0], -1))

    @torch.no_grad()
    def generate(self, num_groups: int, generator: torch.Generator | None = None):
        """Draw ``(G, N, F)`` data from the model."""
        m = self.marginal()
        eps = torch.randn(num_groups, m.loc.numel(), generator=generator, dtype=torch.float64)
        x = m.loc + eps @ m.scale_tril.T
        shape = (num_groups, self.num_instances, self.in_features)
        return x.reshape(shape).to(self.weight.dtype).to(self.weight.device)
