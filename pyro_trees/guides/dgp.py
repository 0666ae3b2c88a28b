"""Guides of the deep GP: factorised, jointly Gaussian and intermediate-output inducing guides.

Each guide only defines the distribution of the model's inducing sites (``u_i`` or
``f_z_i``, see :class:`~pyro_trees.models.DeepGP`); the map from them to the layer
outputs is the model's conditional, shared by all three (the split of GPyTorch's
variational distribution and variational strategy).

* :class:`DGPFactorisedGuide`: :math:`q(U_1) \\cdots q(U_L)`, a full-covariance
  Gaussian per layer and output (the standard doubly stochastic DGP, eq. 2 of
  Ustyuzhaninov et al.). Train with :class:`~pyro.infer.TraceMeanField_ELBO` for the
  closed-form KL.
* :class:`DGPJointGuide`: :math:`q(U_1, \\dots, U_L) = N(\\mu, \\Sigma)` with covariance
  across layers, full or low-rank plus diagonal (``rank=``). The full factor samples
  the layers in turn from the joint's conditionals
  (:class:`~pyro_trees.distributions.JointGaussianSlice`) and gives
  :class:`~pyro.infer.TraceMeanField_ELBO` the exact KL of the joint; the low-rank one draws the
  joint vector at an auxiliary site with each ``u_i`` a
  :class:`~pyro.distributions.Delta` on its slice, as in
  :class:`~pyro.infer.autoguide.AutoMultivariateNormal`: train it with
  :class:`~pyro.infer.Trace_ELBO` (Monte Carlo KL).
* :class:`DGPIntermediateGuide`: free-form Gaussians :math:`q(F_i^Z) = N(m_i, S_i)` over
  each layer's outputs at the inducing inputs (eq. 4), for a model with
  ``inducing="propagated"``. With :class:`~pyro.infer.TraceMeanField_ELBO` the KL
  terms are :math:`\\mathrm{KL}[q(F_i^Z) \\| p(F_i^Z \\mid (F_{i-1}^Z)^s)]` in closed
  form for sampled :math:`F_{i-1}^Z`, i.e. the estimator of eq. (7). Its parameter
  count is :math:`\\sum_i P_i (M + M(M+1)/2)`, linear in the depth.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.transforms import LowerCholeskyAffine
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from pyro_trees.distributions import JointGaussianSlice
from pyro_trees.guides.base import TreeGuide

__all__ = ["DGPFactorisedGuide", "DGPIntermediateGuide", "DGPJointGuide"]


def _like(model):
    z = model.inducing_inputs[0]
    return {"dtype": z.dtype, "device": z.device}


def _check_model(model, inducing: str, cls: str):
    if getattr(model, "inducing", None) != inducing:
        raise ValueError(
            f"{cls} needs a DeepGP with inducing={inducing!r}; got "
            f"{getattr(model, 'inducing', type(model).__name__)!r}"
        )


class _PerSiteGaussianGuide(TreeGuide, PyroModule):
    """A Gaussian per model site, each with ``{name}_loc`` ``(P, M)`` and
    ``{name}_scale_tril`` ``(P, M, M)`` parameters; sites are independent."""

    site_names: list[str]

    def distribution(self, name: str):
        """The guide's Gaussian at one site, event shape ``(P_i, M_i)``."""
        return dist.MultivariateNormal(
            getattr(self, f"{name}_loc"), scale_tril=getattr(self, f"{name}_scale_tril")
        ).to_event(1)

    def forward(self, x=None, y=None, **kwargs):
        """Sample every site (the data arguments are ignored)."""
        return {name: pyro.sample(name, self.distribution(name)) for name in self.site_names}

    def site_params(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(loc, scale_tril)`` of every site, ``(P_i, M_i)`` and ``(P_i, M_i, M_i)``,
        read once through Pyro's store (so that plain ``SVI`` trains them), for a loss
        that draws the sites as plain tensor code."""
        with self._pyro_context:
            return [
                (getattr(self, f"{name}_loc"), getattr(self, f"{name}_scale_tril"))
                for name in self.site_names
            ]


class DGPFactorisedGuide(_PerSiteGaussianGuide):
    """Mean-field over layers: :math:`q(U_i) = N(m_i, S_i)` independently per layer.

    :param model: a :class:`~pyro_trees.models.DeepGP` with ``inducing="layer"``.
    :param float init_scale: initial standard deviation of q relative to the prior:
        the means start at zero and the Cholesky factors at ``init_scale`` times the
        prior's, i.e. ``init_scale * I`` when the model whitens and ``init_scale``
        times the Cholesky factor of :math:`K_{Z_i Z_i} + \\text{jitter}\\, I` at the
        initial inducing inputs otherwise.
    :param str name: prefix of the guide's names in Pyro's parameter store
        (``"<name>.u_1_loc"``), so that several guides share one store.

    .. rubric:: Examples

    >>> import gpytorch
    >>> import pyro
    >>> import torch
    >>> from pyro.infer import SVI, TraceMeanField_ELBO
    >>> from pyro_trees.guides import DGPFactorisedGuide
    >>> from pyro_trees.models import DeepGP
    >>> x = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(-1)
    >>> y = torch.sin(3 * x).squeeze(-1)
    >>> model = DeepGP([gpytorch.kernels.RBFKernel() for _ in range(2)], x[::2])
    >>> guide = DGPFactorisedGuide(model)
    >>> {name: tuple(u.shape) for name, u in guide().items()}
    {'u_1': (1, 4), 'u_2': (1, 4)}
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
    >>> isinstance(svi.step(x, y), float)
    True
    """

    def __init__(self, model, *, init_scale: float = 0.1, name: str = ""):
        super().__init__(name=name)
        _check_model(model, "layer", type(self).__name__)
        self.site_names = model.site_names()
        self.site_shapes = model.site_shapes()
        like = _like(model)
        for i, (name, (P, M)) in enumerate(zip(self.site_names, self.site_shapes, strict=True)):
            setattr(self, f"{name}_loc", PyroParam(torch.zeros(P, M, **like)))
            if model.whiten:
                tril = torch.eye(M, **like).expand(P, M, M) * init_scale
            else:
                with torch.no_grad():
                    prior = model.inducing_prior(i).base_dist.scale_tril
                tril = prior.detach().expand(P, M, M) * init_scale
            setattr(
                self,
                f"{name}_scale_tril",
                PyroParam(tril.clone(), constraint=constraints.lower_cholesky),
            )


class DGPJointGuide(TreeGuide, PyroModule):
    """Jointly Gaussian inducing outputs across layers, :math:`q(U_1..U_L) = N(\\mu, \\Sigma)`.

    The vector :math:`U` concatenates the flattened ``u_i`` (``T = sum_i P_i M_i``).

    :param model: a :class:`~pyro_trees.models.DeepGP` with ``inducing="layer"``.
    :param rank: ``None`` for a full ``(T, T)`` Cholesky factor; an integer for
        :math:`\\Sigma = W W^\\top + \\mathrm{diag}(d)` with ``W`` of shape ``(T, rank)``.
    :param float init_scale: initial standard deviation.
    :param cross_scale: full factor only: the entries of the Cholesky factor outside the
        per-output ``(M_i, M_i)`` blocks of the factorised guide (the couplings across
        outputs and layers) are ``cross_scale`` times their free parameter (times the
        row's diagonal entry with ``cross_relative``). Default
        ``sqrt(M / (200 (T - M)))`` with ``M = max_i M_i`` (at most 1).
    :param bool cross_relative: full factor only: measure the cross entries of each row
        in units of the row's diagonal entry, :math:`L_{rc} = c L_{rr} \\theta_{rc}`
        (default ``True``; ``False`` gives :math:`L_{rc} = c \\theta_{rc}`).
    :param str name: prefix of the guide's names in Pyro's parameter store
        (``"<name>.loc"``), so that several guides share one store.

    **Why the cross entries are scaled.** Most of the ``T (T - 1) / 2`` off-diagonal
    entries get a Monte Carlo gradient that is nearly pure noise. Adam normalises each
    coordinate's step, so every such entry random-walks by a fraction of ``lr`` per
    step whatever the noise level, and the spurious variance this adds to a row of the
    factor grows with the row's length ``T``, not with the data (an unscaled factor can
    end with whitened inducing variances above the prior's). Scaling the cross entries
    by ``c`` is a reparameterisation (same family, same optimum) that shrinks their
    diffusion by the factor ``c``: a row's spurious variance is that of about
    ``M / 2 + c^2 (T - M)`` entries instead of ``T / 2``, and the default keeps the cross
    part to 1% of the in-block part (what the factorised guide and GPyTorch's
    Cholesky-factor variational distributions already carry). Couplings the data do
    support still grow, ``1 / c`` times more slowly per step; raise ``cross_scale`` (up
    to 1, the plain factor) when cross-layer dependence is the point, as on the
    composition toy problem.

    **Why relative to the row's diagonal.** With an absolute scale the diffusion has a
    fixed size while the posterior shrinks with the data, so on a large data set it
    becomes a large fraction of a narrow layer's variance. In units of the row's
    diagonal the cross part keeps the same fraction of the row whatever the posterior's
    scale. The price: couplings also grow more slowly where the posterior is narrow;
    ``cross_relative=False`` keeps more cross-layer spread on small problems. The map is
    still a bijection onto the lower-triangular factors with positive diagonal (the same
    family). The measured effect of both choices is in :doc:`/guide/dgp`.

    .. rubric:: Examples

    >>> import gpytorch
    >>> import torch
    >>> from pyro.infer import Trace_ELBO
    >>> from pyro_trees.guides import DGPJointGuide
    >>> from pyro_trees.infer import fit
    >>> from pyro_trees.models import DeepGP
    >>> x = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(-1)
    >>> y = torch.sin(3 * x).squeeze(-1)
    >>> model = DeepGP([gpytorch.kernels.RBFKernel() for _ in range(2)], x[::2])
    >>> DGPJointGuide(model).scale_tril.shape  # T = 4 + 4 inducing outputs
    torch.Size([8, 8])
    >>> guide = DGPJointGuide(model, rank=2)  # low rank: train with Trace_ELBO
    >>> fit(model, guide, x, y, loss=Trace_ELBO(), num_steps=2, progress=False).num_steps
    2
    """

    def __init__(
        self,
        model,
        *,
        rank: int | None = None,
        init_scale: float = 0.1,
        cross_scale: float | None = None,
        cross_relative: bool = True,
        name: str = "",
    ):
        super().__init__(name=name)
        _check_model(model, "layer", type(self).__name__)
        self.cross_relative = bool(cross_relative)
        self.site_names = model.site_names()
        self.site_shapes = model.site_shapes()
        sizes = [P * M for P, M in self.site_shapes]
        self.sizes = sizes
        T = sum(sizes)
        like = _like(model)
        self.rank = rank
        self.loc = PyroParam(torch.zeros(T, **like))
        if rank is None:
            if cross_scale is None:
                Mmax = max(M for _, M in self.site_shapes)
                cross_scale = min(1.0, (Mmax / (200 * max(T - Mmax, 1))) ** 0.5)
            if not cross_scale > 0:
                raise ValueError(f"cross_scale must be positive; got {cross_scale}")
            self.cross_scale = float(cross_scale)
            block = torch.block_diag(
                *[torch.ones(M, M, **like) for P, M in self.site_shapes for _ in range(P)]
            )
            self.register_buffer("_tril_mult", block + self.cross_scale * (1 - block))
            self.scale_tril_param = PyroParam(
                torch.eye(T, **like) * init_scale, constraint=constraints.lower_cholesky
            )
        else:
            if not 1 <= int(rank) <= T:
                raise ValueError(f"rank must be between 1 and {T}; got {rank}")
            self.cov_factor = PyroParam(torch.randn(T, int(rank), **like) * init_scale * 0.1)
            self.cov_diag = PyroParam(
                torch.full((T,), init_scale**2, **like), constraint=constraints.positive
            )

    @property
    def scale_tril(self) -> torch.Tensor:
        """The lower Cholesky factor ``(T, T)`` of :math:`\\Sigma` (full factor only)."""
        P = self.scale_tril_param
        mult = self._tril_mult
        # checkpoints from before cross_relative existed used absolute cross entries
        if getattr(self, "cross_relative", False):
            # cross entries of row r in units of the row's diagonal entry
            block = self._tril_mult == 1
            mult = torch.where(block, mult, mult * P.diagonal().unsqueeze(-1))
        return P * mult

    @scale_tril.setter
    def scale_tril(self, value: torch.Tensor):
        mult = self._tril_mult
        if getattr(self, "cross_relative", False):
            block = self._tril_mult == 1
            mult = torch.where(block, mult, mult * value.diagonal().unsqueeze(-1))
        self.scale_tril_param = value / mult

    @classmethod
    def from_factorised(cls, model, guide: DGPFactorisedGuide, *, name: str = "") -> DGPJointGuide:
        """A joint guide with the block-diagonal covariance of a factorised guide."""
        joint = cls(model, name=name)
        locs, blocks = [], []
        with torch.no_grad():
            for name in guide.site_names:
                locs.append(getattr(guide, f"{name}_loc").reshape(-1))
                blocks.extend(getattr(guide, f"{name}_scale_tril").unbind(0))
            joint.loc = torch.cat(locs)
            joint.scale_tril = torch.block_diag(*blocks)
        return joint

    def site_params(self) -> list[dict]:
        """Per layer, the full factor's pieces as :meth:`forward` draws them, read once
        through Pyro's store (so that plain ``SVI`` trains them), for a loss that draws
        the sites as plain tensor code: ``{"mean": (n_i,), "tril": (n_i, n_i), "cross":
        (n_i, s_i)}`` with ``n_i = P_i M_i`` and ``s_i`` the earlier layers' size, so that
        ``u_i = mean + cross eps_<i + tril eps_i``. Full factor only (``rank=None``)."""
        if self.rank is not None:
            raise ValueError("site_params needs the full factor (rank=None)")
        with self._pyro_context:
            L, mu = self.scale_tril, self.loc
        out, start = [], 0
        for n in self.sizes:
            stop = start + n
            out.append(
                {
                    "mean": mu[start:stop],
                    "tril": L[start:stop, start:stop],
                    "cross": L[start:stop, :start],
                }
            )
            start = stop
        return out

    def distribution(self):
        """The joint ``q(U)`` over the concatenated vector of length ``T``."""
        if self.rank is None:
            # loc + L eps with the pair cached, so log q of a fresh draw reuses eps instead
            # of a triangular solve: in float32 the optimiser otherwise learns an
            # ill-conditioned L whose solve error inflates the Monte Carlo entropy.
            base = dist.Normal(torch.zeros_like(self.loc), 1.0).to_event(1)
            affine = LowerCholeskyAffine(self.loc, self.scale_tril, cache_size=1)
            return dist.TransformedDistribution(base, [affine])
        return dist.LowRankMultivariateNormal(self.loc, self.cov_factor, self.cov_diag)

    def forward(self, x=None, y=None, **kwargs):
        """Sample every ``u_i``.

        Full factor: layer by layer from the conditionals of the joint,
        :math:`q(u_i \\mid u_{<i}) = N(\\mu_i + C_i \\epsilon_{<i}, L_{ii} L_{ii}^\\top)` with
        ``C_i`` the factor's rows of layer ``i`` left of its diagonal block and
        :math:`\\epsilon_j = L_{jj}^{-1}(u_j - \\text{loc}_j)` the standard noise of the earlier
        layers; the product of the conditionals is the joint, and
        :class:`~pyro.infer.TraceMeanField_ELBO` gets a closed-form KL per site (see
        :class:`~pyro_trees.distributions.JointGaussianSlice`). Low rank: one auxiliary draw of the
        joint vector, then each ``u_i`` a :class:`~pyro.distributions.Delta` on its slice (train
        with :class:`~pyro.infer.Trace_ELBO`).
        """
        out = {}
        if self.rank is None:
            noise = []
            for name, shape, n, piece in zip(
                self.site_names, self.site_shapes, self.sizes, self.site_params(), strict=True
            ):
                Lii, C, loc = piece["tril"], piece["cross"], piece["mean"]
                if noise:
                    eps = torch.cat(noise, dim=-1)
                    loc = loc + (C @ eps.unsqueeze(-1)).squeeze(-1)
                q = JointGaussianSlice(loc, Lii, shape, mean=piece["mean"], cross=C)
                value = pyro.sample(name, q)
                flat = value.reshape(*value.shape[:-2], n)
                loc = loc.expand(flat.shape)
                eps = torch.linalg.solve_triangular(
                    Lii, (flat - loc).unsqueeze(-1), upper=False
                ).squeeze(-1)
                noise.append(eps)
                out[name] = value
            return out
        U = pyro.sample("_dgp_joint_u", self.distribution(), infer={"is_auxiliary": True})
        for name, (P, M), piece in zip(
            self.site_names, self.site_shapes, U.split(self.sizes, dim=-1), strict=True
        ):
            value = piece.reshape(*piece.shape[:-1], P, M)
            out[name] = pyro.sample(name, dist.Delta(value, event_dim=2))
        return out


class DGPIntermediateGuide(_PerSiteGaussianGuide):
    """Gaussians over the layer outputs at the inducing inputs (eq. 4).

    Default (``whiten=True``): each layer is drawn relative to its prior at the
    *sampled* previous layer, :math:`F_i^Z = \\mu_i(F_{i-1}^Z) + L_i (a_i + B_i \\epsilon_i)`
    with :math:`L_i L_i^\\top = K_i(F_{i-1}^Z) + \\text{jitter}\\, I` and
    :math:`\\epsilon_i \\sim N(0, I)`, learning ``a_i`` ``(P_i, M)`` and the lower
    triangular ``B_i`` ``(P_i, M, M)``: the same parameters as eq. (4) (linear in the
    depth), but :math:`q(F_i^Z \\mid F_{i-1}^Z)` is conditional, so the intermediate
    outputs are not jointly Gaussian. Each KL term of eq. (7) is then
    :math:`\\mathrm{KL}[N(a_i, B_i B_i^\\top) \\| N(0, I)]` whatever the sample (exact).
    ``whiten=False`` is the paper's free-form family, :math:`q(F_i^Z) = N(m_i, S_i)`
    independently per layer and output (``m_i`` ``(P_i, M)``, ``S_i`` full ``(M, M)``
    per output); it needs a large model jitter (see below).

    :param model: a :class:`~pyro_trees.models.DeepGP` with ``inducing="propagated"``.
    :param float init_scale: initial standard deviation relative to the prior, in both
        forms (see the end of this docstring).
    :param bool whiten: the whitened form (default) or eq. (4)'s free form.
    :param str name: prefix of the guide's names in Pyro's parameter store
        (``"<name>.f_z_1_loc"``), so that several guides share one store.

    The whitened guide keeps a reference to ``model`` (its kernels and ``Z``):
    pickle the two together, as :func:`~pyro_trees.infer.fit`'s checkpoints do.

    **Why whiten.** With the free-form :math:`q(F_i^Z)`, a draw of :math:`F_i^Z` is
    independent of the draw of its inputs :math:`F_{i-1}^Z`, so it is rarely a smooth
    function of them: the layer's conditional :math:`K_{xZ} K_i(F_{i-1}^Z)^{-1} F_i^Z`
    amplifies the mismatch by up to ``1 / jitter`` and the KL of eq. (7) grows like
    :math:`|F_i^Z|^2 / \\text{jitter}`. A small jitter then makes the fit explode, and a
    large one turns the inducing outputs into noisy observations: the conditional mean
    shrinks, the inducing points merge in clusters to average the noise out, and the
    likelihood noise absorbs the rest. The jitter needed depends on the data. The
    whitened draw is always a smooth function of its own inputs, so it works with the
    default jitter.

    **Restarts.** On small problems the whitened guide's objective has poor local
    optima (the likelihood noise stuck well above the data's); fitting a few times from
    different kernel hyperparameters and keeping the fit with the higher ELBO avoids
    them. :func:`pyro_trees.infer.fit_restarts` does this for any model and guide; the
    measured jitters and restarts are in :doc:`/guide/dgp`.

    Unwhitened, the means start at the layers' mean functions applied to ``Z`` in turn
    (``Z`` itself through identity layers, zero through zero-mean ones) and the
    covariances at ``init_scale**2`` times the prior covariance given those means;
    whitened, ``a_i = 0`` and ``B_i = init_scale I``, the same start.

    .. rubric:: Examples

    >>> import gpytorch
    >>> import torch
    >>> from pyro.infer import TraceMeanField_ELBO
    >>> from pyro_trees.guides import DGPIntermediateGuide
    >>> from pyro_trees.infer import fit
    >>> from pyro_trees.models import DeepGP
    >>> x = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(-1)
    >>> y = torch.sin(3 * x).squeeze(-1)
    >>> kernels = [gpytorch.kernels.RBFKernel() for _ in range(2)]
    >>> model = DeepGP(kernels, x[::2], inducing="propagated")
    >>> guide = DGPIntermediateGuide(model)
    >>> model.site_names(), guide.kl(model).shape  # one KL term of eq. (7) per layer
    (['f_z_1', 'f_z_2'], torch.Size([2]))
    >>> fit(model, guide, x, y, loss=TraceMeanField_ELBO(), num_steps=2, progress=False).stopped
    'num_steps'
    """

    def __init__(self, model, *, init_scale: float = 0.1, whiten: bool = True, name: str = ""):
        super().__init__(name=name)
        _check_model(model, "propagated", type(self).__name__)
        self.site_names = model.site_names()
        self.site_shapes = model.site_shapes()
        self.whiten = bool(whiten)
        # a plain reference, not a submodule: the model's parameters stay the model's
        object.__setattr__(self, "_model", model if self.whiten else None)
        like = _like(model)
        with torch.no_grad():
            f = model.inducing_inputs[0].detach()
            for i, (name, (P, M)) in enumerate(zip(self.site_names, self.site_shapes, strict=True)):
                if self.whiten:
                    loc = torch.zeros(P, M, **like)
                    tril = torch.eye(M, **like).expand(P, M, M) * init_scale
                else:
                    prior = model.inducing_prior(i, f.mT)
                    f = model.mean(i, f)
                    loc = f.mT.clone().contiguous()
                    tril = prior.base_dist.scale_tril.expand(P, M, M) * init_scale
                setattr(self, f"{name}_loc", PyroParam(loc))
                setattr(
                    self,
                    f"{name}_scale_tril",
                    PyroParam(tril.clone(), constraint=constraints.lower_cholesky),
                )

    def _whitened(self, i: int, prev, zs=None):
        """``q(F_i^Z | F_{i-1}^Z = prev)`` of the whitened guide."""
        name = self.site_names[i]
        base = self._model.inducing_prior(i, prev, zs=zs).base_dist
        L = base.scale_tril
        loc = base.loc + (L @ getattr(self, f"{name}_loc").unsqueeze(-1)).squeeze(-1)
        tril = L @ getattr(self, f"{name}_scale_tril")
        return dist.MultivariateNormal(loc, scale_tril=tril).to_event(1)

    def forward(self, x=None, y=None, **kwargs):
        """Sample every site, layer by layer (the data arguments are ignored)."""
        if not self.whiten:
            return super().forward(x, y, **kwargs)
        out, prev = {}, None
        with self._model.store_params():
            zs = self._model.inducing_inputs
            for i, name in enumerate(self.site_names):
                prev = out[name] = pyro.sample(name, self._whitened(i, prev, zs))
        return out

    def kl(self, model, num_samples: int = 1) -> torch.Tensor:
        """Monte Carlo estimate of eq. (7) per layer.

        Draws ``num_samples`` values of every :math:`F_{i-1}^Z` from this guide and
        averages :math:`\\mathrm{KL}[q(F_i^Z) \\| p(F_i^Z \\mid (F_{i-1}^Z)^s)]`, each in
        closed form (for the whitened guide, :math:`q(F_i^Z \\mid (F_{i-1}^Z)^s)`).

        :returns: a tensor ``(L,)`` of the layers' KL estimates.
        """
        out = []
        prev = None
        for i, name in enumerate(self.site_names):
            q = self._whitened(i, prev) if self.whiten else self.distribution(name)
            p = model.inducing_prior(i, prev)
            out.append(torch.distributions.kl_divergence(q, p).reshape(-1).mean())
            # whitened layers after the first already carry the sample dimension
            prev = q.rsample(() if self.whiten and prev is not None else (num_samples,))
        return torch.stack(out)
