"""``DGPELBO``: the deep GP's ELBO with closed-form KL terms, as one tensor program.

:class:`pyro.infer.TraceMeanField_ELBO` on a :class:`~pyro_trees.models.DeepGP` and its
:class:`~pyro_trees.guides.DGPFactorisedGuide` (the doubly stochastic deep GP of
Salimbeni & Deisenroth), its :class:`~pyro_trees.guides.DGPJointGuide` or, with
propagated inducing outputs, its :class:`~pyro_trees.guides.DGPIntermediateGuide`
(eq. 4 of Ustyuzhaninov et al.) runs
a poutine stack over the inducing sites, the layer draws
and the likelihood, and reads values back to the host at every step. :class:`DGPELBO`
computes the same estimator as plain tensor code: the draws of the inducing outputs,
the layers' conditionals (:func:`~pyro_trees.gp.conditional` with the kernels as
:class:`~pyro_trees.gp.TensorKernel`), the expected log-likelihood of the last layer
and the closed-form KL of every inducing site (:func:`~pyro_trees.gp.gaussian_kl`). Its
random numbers are drawn eagerly, in the order and shapes ``TraceMeanField_ELBO``
draws them, so on the same draws the two agree in value and gradients (tested), and
with ``compile=True`` the rest is one program under ``torch.compile``
(:mod:`pyro_trees.infer.compiled`).

References

* H. Salimbeni, M. Deisenroth, *Doubly stochastic variational inference for deep
  Gaussian processes*, NeurIPS 2017.
"""

from __future__ import annotations

import math

import torch
from pyro.infer import TraceMeanField_ELBO

from pyro_trees.gp import cholesky as retrying_cholesky
from pyro_trees.gp import conditional, gaussian_kl, kernel_matrix
from pyro_trees.guides.dgp import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.collapsed_elbo import _FirstTry
from pyro_trees.infer.compiled import (
    CompilesLoss,
    check_subsample_size,
    plate_subsample,
    xy_call,
)
from pyro_trees.models.dgp import DeepGP

__all__ = ["DGPELBO", "dgp_elbo_of"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _mean(mean, f: torch.Tensor, width: int) -> torch.Tensor:
    if isinstance(mean, str):
        return f if mean == "identity" else f.new_zeros(*f.shape[:-1], width)
    return mean(f)


def dgp_elbo_of(parts: dict, sites: list, x, y, eps_u: list, eps_f: list, scale, chol=None):
    """The ELBO of :class:`~pyro_trees.models.DeepGP` with a Gaussian per inducing site,
    one value per particle averaged, from its tensors: ``TraceMeanField_ELBO``'s
    estimator as plain code.

    With ``inducing="layer"`` the sites are ``q(u_i) = N(loc_i, S_i)`` (the factorised
    guide, ``(loc, scale_tril)`` per layer) or the joint guide's conditionals
    ``mean_i + cross_i eps_<i + tril_i eps_i`` (a dict per layer,
    :meth:`DGPJointGuide.site_params <pyro_trees.guides.DGPJointGuide.site_params>`), whose
    KL is its expectation over the earlier layers. With ``inducing="propagated"`` they
    are the intermediate guide's ``F_i^Z``: whitened (``parts["guide_whiten"]``),
    ``mu_i + L_i (loc_i + S_i eps)`` with ``mu_i`` and ``L_i L_i^T`` the prior's mean
    and covariance at the drawn ``F_{i-1}^Z``, whose KL is ``KL[N(loc_i, S_i) || N(0,
    I)]``; free-form, ``N(loc_i, S_i)`` with its KL to that prior, averaged over the
    particles.

    :param dict parts: :meth:`DeepGP.program_parts <pyro_trees.models.DeepGP.program_parts>`
        and ``"guide_whiten"``.
    :param list sites: ``(loc, scale_tril)`` per layer, ``(P_i, M_i)`` and
        ``(P_i, M_i, M_i)`` (:meth:`~pyro_trees.guides.DGPFactorisedGuide.site_params`).
    :param x: the rows of the step, ``(N, D_0)``; ``y`` their targets ``(N,)``.
    :param list eps_u: standard normal noise of each inducing site, ``(S, P_i, M_i)``.
    :param list eps_f: standard normal noise of each inner layer's draw, ``(S, N, P_i)``.
    :param scale: the likelihood's scale (the rows the step stands for over ``N``).
    :param chol: the Cholesky factorisation ``(K, jitter) -> L`` (default: the one that
        retries with more jitter).
    :returns: the ELBO estimate, a scalar (maximise it).
    """
    chol = retrying_cholesky if chol is None else chol
    jitter, whiten = parts["jitter"], parts["whiten"]
    propagated = parts["inducing"] == "propagated"
    f, kl, z = x, 0.0, parts["zs"][0]
    layers = len(parts["kernels"])
    earlier = []  # the joint guide's noise of the earlier layers, (S, s_i)
    for i, (kernel, site) in enumerate(zip(parts["kernels"], sites, strict=True)):
        width = parts["dims"][i + 1]
        if propagated:  # the inducing inputs are the previous layer's draw at Z
            loc, tril = site
            noise = (tril @ eps_u[i].unsqueeze(-1)).squeeze(-1)  # (S, P, M)
            Lzz = chol(kernel_matrix(kernel, z), jitter)  # (..., Pk, M, M)
            mu = _mean(parts["means"][i], z, width).mT  # (..., P, M)
            if parts["guide_whiten"]:
                draw = mu + (Lzz @ (loc + noise).unsqueeze(-1)).squeeze(-1)
                kl = kl + gaussian_kl(loc, tril).sum()
            else:
                draw = loc + noise
                prior = Lzz.expand(mu.shape + mu.shape[-1:])
                pair = torch.broadcast_tensors(loc, mu)
                kl = kl + gaussian_kl(pair[0], tril.expand_as(prior), pair[1], prior).sum(-1).mean()
            u = draw - mu
        else:
            z = parts["zs"][i]
            Lzz = chol(kernel_matrix(kernel, z), jitter)  # (Pk, M, M)
            if isinstance(site, dict):  # the joint guide's layer i given the earlier ones
                flat = site["mean"] + (site["tril"] @ eps_u[i].unsqueeze(-1)).squeeze(-1)
                if earlier:
                    noise = torch.cat(earlier, -1).unsqueeze(-1)
                    flat = flat + (site["cross"] @ noise).squeeze(-1)
                earlier.append(eps_u[i])
                M = z.shape[-2]
                u = flat.reshape(*flat.shape[:-1], width, M)
                prior = torch.eye(M, dtype=z.dtype, device=z.device) if whiten else Lzz
                kl = kl + _joint_kl(site, prior.expand(width, M, M))
            else:
                loc, tril = site
                u = loc + (tril @ eps_u[i].unsqueeze(-1)).squeeze(-1)  # (S, P, M)
                prior = None if whiten else Lzz.expand(tril.shape)
                kl = kl + gaussian_kl(loc, tril, None, prior).sum()
        mean, var = conditional(kernel, f, z, u, whiten=whiten, jitter=jitter, Lzz=Lzz)
        mean = mean.mT + _mean(parts["means"][i], f, width)
        var = var.mT.clamp_min(parts["min_variance"])
        if i < layers - 1:
            f = mean + var.sqrt() * eps_f[i]
            if propagated:
                z = draw.mT  # (S, M, P)
    f_loc, f_var = mean.squeeze(-1), var.squeeze(-1)
    noise = parts["noise"]
    log_lik = -0.5 * ((y - f_loc) / noise).pow(2) - noise.log() - _HALF_LOG_2PI
    log_lik = (log_lik - 0.5 * f_var / noise.pow(2)).sum(-1) * scale  # (S,)
    return log_lik.mean() - kl


def _joint_kl(site: dict, prior_tril: torch.Tensor) -> torch.Tensor:
    """``E KL[q(u_i | u_<i) || N(0, prior_tril prior_tril^T)]`` over the earlier layers
    (:class:`~pyro_trees.distributions.JointGaussianSlice`'s registered KL), from the
    layer's pieces of the joint factor; ``prior_tril`` ``(P, M, M)``."""
    P, M = prior_tril.shape[:2]
    rows = torch.cat([site["tril"], site["cross"]], -1).reshape(P, M, -1)
    trace = torch.linalg.solve_triangular(prior_tril, rows, upper=False).pow(2).sum()
    diff = site["mean"].reshape(P, M, 1)
    maha = torch.linalg.solve_triangular(prior_tril, diff, upper=False).pow(2).sum()
    logdet_p = prior_tril.diagonal(dim1=-2, dim2=-1).log().sum()
    logdet_q = site["tril"].diagonal().log().sum()
    return 0.5 * (trace + maha - P * M) + logdet_p - logdet_q


def _check_sizes(n: int, num_data, subsample_size) -> None:
    """``num_data`` a count of rows, ``subsample_size`` one in ``[1, N]``, as the data
    plate requires."""
    if num_data is not None and (isinstance(num_data, bool) or int(num_data) < 1):
        raise ValueError(f"num_data must be a positive number of rows, got {num_data!r}")
    check_subsample_size(subsample_size, n)


def _outputs(kernel) -> int:
    """The kernel's number of outputs (its batch size, 1 when shared)."""
    return kernel.batch_shape[0] if kernel.batch_shape else 1


def _layer_noise(S: int, n: int, p: int, by_output: bool, like: dict) -> torch.Tensor:
    """``(S, n, p)`` standard normal noise of an inner layer's draw, as the model's
    ``randn_like(mean)`` draws it: torch fills a strided tensor element by element in
    memory order (not as a contiguous one), so the noise takes the layout of the layer's
    mean, the conditional's ``(..., P, N)`` mean transposed, in memory ``(S, P, N)``;
    ``(P, S, N)`` where :func:`~pyro_trees.gp.conditional` projects particles without
    a batch of inputs one output at a time (``by_output``: the first layer, several
    particles, as many kernels as outputs)."""
    strides = (n, 1, S * n) if by_output else (p * n, 1, n)
    return torch.empty_strided((S, n, p), strides, **like).normal_()


def _dgp_program(parts, sites, x, y, eps_u, eps_f, scale):
    """:func:`dgp_elbo_of` with factorisations tried once, and whether one failed: the
    part of a step that compiles."""
    chol = _FirstTry()
    return dgp_elbo_of(parts, sites, x, y, eps_u, eps_f, scale, chol), chol.failed


class DGPELBO(CompilesLoss, DifferentiableLossELBO):
    """:class:`~pyro.infer.TraceMeanField_ELBO` of a deep GP with the factorised, joint or
    intermediate guide, as one tensor program.

    For a :class:`~pyro_trees.models.DeepGP` with RBF or Matérn kernels (optionally in a
    ``ScaleKernel``, batched over the layer's outputs or shared), trained with a
    :class:`~pyro_trees.guides.DGPFactorisedGuide` or a full-factor
    :class:`~pyro_trees.guides.DGPJointGuide` (``inducing="layer"``), or a
    :class:`~pyro_trees.guides.DGPIntermediateGuide`, whitened or free-form
    (``inducing="propagated"``), and called as
    ``model(x, y)``, ``model(x, y, subsample_size=B)`` or ``model(x, y,
    num_data=N)``, its value and gradients equal ``TraceMeanField_ELBO(num_particles,
    vectorize_particles=True, max_plate_nesting=1)``'s on the same draws (tested), with
    one operator stream and no poutine stack. Anything else trains with that
    ``TraceMeanField_ELBO`` after one warning that says why.

    The compiled program tries each Cholesky factorisation once and returns whether one
    failed; a step where one did is scored again eagerly on the same draws, where the
    factorisations retry with more jitter (one host read per step).

    "Equal" is up to rounding, which float32 can make large: with a Matérn 1/2 kernel
    (its kink at distance 0) the two losses' float32 gradients can differ by a good part
    of their size, each as far from a float64 computation as the other. The step does
    not validate the parameters (Pyro's distributions do, under ``TraceMeanField_ELBO``):
    a parameter that became NaN gives a NaN loss, which :func:`~pyro_trees.infer.fit`
    reports at its next read of the loss.

    :param int num_particles: Monte Carlo draws per step, vectorised.
    :param compile: ``False`` (eager), ``True`` or a ``torch.compile`` backend name.
    :param mode: ``torch.compile``'s ``mode``.

    .. rubric:: Examples

    >>> import gpytorch, pyro, torch
    >>> from pyro_trees.guides import DGPFactorisedGuide
    >>> from pyro_trees.infer import DGPELBO
    >>> from pyro_trees.models import DeepGP
    >>> x = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(-1)
    >>> y = torch.sin(3 * x).squeeze(-1)
    >>> model = DeepGP([gpytorch.kernels.RBFKernel() for _ in range(2)], x[::2])
    >>> guide = DGPFactorisedGuide(model)
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), DGPELBO(2))
    >>> isinstance(svi.step(x, y), float)
    True
    """

    _program = staticmethod(_dgp_program)

    def __init__(
        self, num_particles: int = 1, *, compile: bool | str = False, mode: str | None = None
    ):
        if int(num_particles) < 1:
            raise ValueError(f"num_particles must be >= 1, got {num_particles}")
        super().__init__(
            num_particles=int(num_particles),
            vectorize_particles=True,
            max_plate_nesting=1,
            compile=compile,
            mode=mode,
        )

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("DGPELBO scores the ELBO without traces")

    @staticmethod
    def unsupported(model, guide, args, kwargs) -> str | None:
        """Why the program does not apply to this model, guide and call, or ``None``."""
        if not isinstance(model, DeepGP):
            return f"the model is not a DeepGP (got {type(model).__name__})"
        if type(model).forward is not DeepGP.forward:
            return f"the model's class {type(model).__name__} overrides DeepGP.forward"
        if model.inducing == "layer":
            wanted = (DGPFactorisedGuide, DGPJointGuide)
            if type(guide) is DGPJointGuide and guide.rank is not None:
                return "the joint guide has a low-rank factor (train it with Trace_ELBO)"
        else:
            wanted = (DGPIntermediateGuide,)
        if type(guide) not in wanted:
            names = " or a ".join(w.__name__ for w in wanted)
            return (
                f"the guide is not a {names} (got {type(guide).__name__}) for a model with "
                f"inducing={model.inducing!r}"
            )
        x, y, extra = xy_call(args, kwargs, ("num_data", "subsample_size"))
        if x is None or y is None or extra:
            return "the model is not called as model(x, y) (with num_data or subsample_size)"
        return None

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Minus the ELBO estimate, differentiable in the parameters of both."""
        why = self.unsupported(model, guide, args, kwargs)
        parts = None if why is not None else model.program_parts()
        if parts is None:
            why = why or (
                "a layer's kernel is not one TensorKernel covers (an RBF or Matern kernel, "
                "alone or in a ScaleKernel of the same batch shape, without active_dims)"
            )
            self._fall_back("TraceMeanField_ELBO", why)
            loss = TraceMeanField_ELBO(
                num_particles=self.num_particles, vectorize_particles=True, max_plate_nesting=1
            )
            return loss.differentiable_loss(model, guide, *args, **kwargs)
        self.fallback = None
        x, y, _ = xy_call(args, kwargs, ("num_data", "subsample_size"))
        num_data, subsample_size = kwargs.get("num_data"), kwargs.get("subsample_size")
        x, y = model.checked_data(x, y, num_data=num_data, subsample_size=subsample_size)
        _check_sizes(x.shape[0], num_data, subsample_size)
        sites = guide.site_params()
        parts["guide_whiten"] = getattr(guide, "whiten", False)
        S, n, like = self.num_particles, x.shape[0], {"dtype": x.dtype, "device": x.device}
        # the draws, in TraceMeanField_ELBO's order: the guide's sites, the data plate's
        # subsample, each inner layer's noise
        shapes = [s["mean"].shape if isinstance(s, dict) else s[0].shape for s in sites]
        eps_u = [torch.randn((S,) + tuple(shape), **like) for shape in shapes]
        scale = 1.0
        if num_data is not None:
            scale = float(num_data) / n
        else:
            idx = plate_subsample(n, subsample_size, x.device)
            if idx is not None:
                x, y, scale = x[idx], y[idx], n / idx.shape[0]
        eps_f = [
            _layer_noise(S, x.shape[0], p, i == 0 and S > 1 and _outputs(k) == p, like)
            for i, (k, p) in enumerate(zip(parts["kernels"][:-1], parts["dims"][1:-1], strict=True))
        ]
        inputs = (parts, sites, x, y, eps_u, eps_f, torch.tensor(scale, **like))
        if self._compiled is not None:
            value, failed = self._compiled(*inputs)
            if not bool(failed):
                return -value
        return -dgp_elbo_of(*inputs)
