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
  (:class:`~pyro_trees.guides.dgp.JointGaussianSlice`) and gives
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
from pyro.distributions import TorchDistribution
from pyro.distributions.transforms import LowerCholeskyAffine
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints, register_kl

__all__ = ["DGPFactorisedGuide", "DGPIntermediateGuide", "DGPJointGuide", "JointGaussianSlice"]


def _like(model):
    z = model.inducing_inputs[0]
    return {"dtype": z.dtype, "device": z.device}


def _check_model(model, inducing: str, cls: str):
    if getattr(model, "inducing", None) != inducing:
        raise ValueError(
            f"{cls} needs a DeepGP with inducing={inducing!r}; got "
            f"{getattr(model, 'inducing', type(model).__name__)!r}"
        )


class _PerSiteGaussianGuide(PyroModule):
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


class DGPJointGuide(PyroModule):
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
    factor grows with the row's length ``T``, not with the data. On concrete
    (``T = 320``, ``M = 64``) an unscaled factor ends with whitened inducing variances
    above the prior's (about 1.1 against 1) and loses 0.4 nats to GPyTorch's DeepGP.
    Scaling the cross entries by ``c`` is a reparameterisation (same family, same
    optimum) that shrinks their diffusion by the factor ``c``: a row's spurious variance is that
    of about ``M / 2 + c^2 (T - M)`` entries instead of ``T / 2``, and the default keeps
    the cross part to 1% of the in-block part (what the factorised guide and
    GPyTorch's Cholesky-factor variational distributions already carry). On concrete,
    against GPyTorch's DeepGP, the joint guide trained with a Monte Carlo KL loses 0.40
    nats unscaled, 0.15 with ``c = 0.11`` (cross part 10%), 0.055 with the default
    ``c = 0.035``, and 0.041 with the default and the closed-form KL of
    :class:`~pyro_trees.guides.dgp.JointGaussianSlice`: couplings the data do not support cost
    accuracy in proportion to their diffusion. Couplings the data do support still grow, ``1 / c``
    times more slowly per step; raise ``cross_scale`` (up to 1, the plain factor) when cross-layer
    dependence is the point, as on the composition toy problem.

    **Why relative to the row's diagonal.** With an absolute scale the diffusion has a
    fixed size while the posterior shrinks with the data: on kin40k (36,000 points) the
    last layer's whitened variances fall to about 0.07, the cross entries (``c =
    0.035``) still diffuse to about 0.007 per row, i.e. 10% spurious variance in the
    output layer rather than 1%, and the joint guide lost 0.43 nats to GPyTorch's DeepGP
    after 500 steps (0.35 nats or a stuck fit across seeds, against 0.03 for the
    factorised guide). In units of the row's diagonal the cross part keeps the same
    fraction of the row whatever the posterior's scale: the joint guide then loses 0.029
    nats on kin40k and 0.015 on concrete. The price: couplings also grow more slowly
    where the posterior is narrow, and on the composition toy problem the inner-layer
    spread of the joint guide falls to about that of the factorised guide; there
    ``cross_relative=False`` keeps 2-4x more spread. The map is still a bijection onto the
    lower-triangular factors with positive diagonal (the same family).
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
        :class:`~pyro_trees.guides.dgp.JointGaussianSlice`). Low rank: one auxiliary draw of the
        joint vector, then each ``u_i`` a :class:`~pyro.distributions.Delta` on its slice (train
        with :class:`~pyro.infer.Trace_ELBO`).
        """
        out = {}
        if self.rank is None:
            L, mu = self.scale_tril, self.loc
            start, noise = 0, []
            for name, (P, M), n in zip(self.site_names, self.site_shapes, self.sizes, strict=True):
                Lii = L[start : start + n, start : start + n]
                C = L[start : start + n, :start]
                loc = mu[start : start + n]
                if start:
                    eps = torch.cat(noise, dim=-1)
                    loc = loc + (C @ eps.unsqueeze(-1)).squeeze(-1)
                q = JointGaussianSlice(loc, Lii, (P, M), mean=mu[start : start + n], cross=C)
                value = pyro.sample(name, q)
                flat = value.reshape(*value.shape[:-2], n)
                loc = loc.expand(flat.shape)
                eps = torch.linalg.solve_triangular(
                    Lii, (flat - loc).unsqueeze(-1), upper=False
                ).squeeze(-1)
                noise.append(eps)
                out[name] = value
                start += n
            return out
        U = pyro.sample("_dgp_joint_u", self.distribution(), infer={"is_auxiliary": True})
        for name, (P, M), piece in zip(
            self.site_names, self.site_shapes, U.split(self.sizes, dim=-1), strict=True
        ):
            value = piece.reshape(*piece.shape[:-1], P, M)
            out[name] = pyro.sample(name, dist.Delta(value, event_dim=2))
        return out


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
    :math:`|F_i^Z|^2 / \\text{jitter}`. A small jitter then makes the fit explode, and the
    large one it needs (``1e-2`` on the composition problem) turns the inducing
    outputs into noisy observations: the conditional mean shrinks (amplitude 0.7
    instead of 1 on ``sin(7 exp(x))``), the inducing points merge in clusters to
    average the noise out, and the likelihood noise absorbs the rest (0.3 against the
    data's 0.05). The jitter needed depends on the data: on the UCI sets of
    ``benchmarks/dgp_uci.py`` (64 inducing points) ``1e-4`` trains, and ``1e-3``
    already costs 0.03 nats of test NLL on kin40k. The whitened draw is always a
    smooth function of its own inputs, so it works with the default jitter.

    **Restarts.** On small problems the whitened guide's objective has poor local optima:
    on the 50-point composition problem one start of six stuck with the likelihood noise
    at 0.29 (the data's is 0.05). Fitting twice from different kernel hyperparameters and
    keeping the fit with the higher ELBO found the good optimum on all six
    (``benchmarks/dgp_composition.py``, ``DGP_RESTARTS``). :func:`pyro_trees.infer.fit_restarts`
    does this for any model and guide.

    Unwhitened, the means start at the layers' mean functions applied to ``Z`` in turn
    (``Z`` itself through identity layers, zero through zero-mean ones) and the
    covariances at ``init_scale**2`` times the prior covariance given those means;
    whitened, ``a_i = 0`` and ``B_i = init_scale I``, the same start.
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
        with self._model._store_params():
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
