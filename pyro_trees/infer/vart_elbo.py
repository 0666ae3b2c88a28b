"""``VaRTELBO``: the λ-weighted ELBO of VaRT (eq. 4) in one vectorised function.

:class:`pyro.infer.Trace_ELBO` on :class:`~pyro_trees.models.VaRT` and
:class:`~pyro_trees.guides.VaRTGuide` records about ``4 (D + 1)`` sample sites in each
of the model and the guide at every step; on small data sets that bookkeeping, not the
arithmetic, is most of the cost of a step. :class:`VaRTELBO` computes the *same*
single-sample Monte Carlo estimator with plain tensor operations over all nodes at once:
the same sites, the same weights (eqs. 23-29) and the same ``kl_weight`` and minibatch
scaling, so its value equals ``Trace_ELBO``'s on the same draws (tested), and its
gradients are those of the same surrogate. Only the order in which random numbers are
drawn differs.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch.distributions.utils import clamp_probs

from pyro_trees import trees
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesVaRTLoss
from pyro_trees.models.vart import VaRT
from pyro_trees.models.vart_mixture import gaussian, observed, route_log_probs, with_bias

__all__ = ["VaRTELBO", "vart_elbo"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _normal_lp(value, loc, scale):
    """Elementwise ``Normal(loc, scale).log_prob(value)`` (``scale`` a tensor or float)."""
    if isinstance(scale, torch.Tensor):
        log_scale = scale.log()
    else:
        log_scale = math.log(scale)
    return -0.5 * ((value - loc) / scale) ** 2 - log_scale - _HALF_LOG_2PI


def _rows(num_rows):
    """``num_rows`` as an ``int``, or as it is when a tensor (a compiled step's)."""
    return num_rows if isinstance(num_rows, torch.Tensor) else int(num_rows)


def _level_depths(num_nodes: int, device) -> torch.Tensor:
    """Depth of each heap node ``1..num_nodes`` (0-based positions), ``(num_nodes,)``."""
    heap = torch.arange(1, num_nodes + 1, device=device)
    return (heap.float().log2().floor()).long()


def vart_elbo(
    model: VaRT,
    guide,
    x: torch.Tensor,
    y: torch.Tensor,
    subsample_size: int | None = None,
    values: dict | None = None,
    subsample: torch.Tensor | None = None,
    num_rows: int | None = None,
    params: dict | None = None,
) -> torch.Tensor:
    """The single-sample estimate of the λ-weighted ELBO of eq. 4 that
    ``Trace_ELBO`` computes for ``model(x, y, subsample_size)`` and its
    :class:`~pyro_trees.guides.VaRTGuide`:

    .. math::
        \\frac{N}{B}\\sum_{n \\in \\text{batch}} \\log p(y_n \\mid x_n, T, \\Theta)
        + \\lambda \\sum_{\\text{sites } k} w_k \\bigl(\\log p_k - \\log q_k\\bigr),

    with the node weights :math:`w_k` of eqs. 23-29 (:math:`A_i` on ``split``,
    :math:`\\psi_i` on ``beta`` and, with missing inputs, ``rho``, :math:`\\kappa_i` on
    ``theta`` and ``log_sigma``) evaluated at the drawn indicators. Rows of ``x`` with
    missing values (NaN) are routed as :func:`~pyro_trees.models.mixture_params` routes
    them.

    :param values: the guide's draws keyed by site name (as
        :meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.rsample` returns them);
        drawn afresh when ``None``.
    :param subsample: indices of the minibatch; drawn like ``pyro.plate`` draws them
        (``torch.randperm(N)[:B]``) when ``None`` and ``subsample_size < N``.
    :param num_rows: the number of rows :math:`N` the likelihood of the minibatch
        (``subsample``, or without it all of ``x``) stands for (default ``x.shape[0]``;
        data-parallel training passes the rows of every rank; a compiled step passes a
        0-dim tensor, so that every data size shares one program).
    :param params: the guide's parameters (:meth:`RelaxedSplitGuide.params
        <pyro_trees.guides.vart.RelaxedSplitGuide.params>`), when already read.
    :returns: the ELBO estimate (a scalar tensor; maximise it).
    """
    depth, site = guide.depth, model.site
    q = guide.params(x) if params is None else params
    if values is None:
        values = guide.rsample(x, q)
    opts = {"dtype": x.dtype, "device": x.device}
    kl_weight = model.kl_weight
    split = torch.cat([values[site(f"split_{d}")] for d in range(depth + 1)])  # (M,)
    beta = torch.cat([values[site(f"beta_{d}")] for d in range(depth)], dim=-2)  # (M_int, L+1)
    theta = torch.cat([values[site(f"theta_{d}")] for d in range(depth + 1)], dim=-2)  # (M, L+1)
    log_sigma = torch.cat([values[site(f"log_sigma_{d}")] for d in range(depth + 1)])  # (M,)
    n_int = trees.num_internal(depth)

    # existence A_i (product of the ancestors' indicators) and log A_i, level by level
    exist_l, log_exist_l = [torch.ones(1, **opts)], [torch.zeros(1, **opts)]
    for d in range(depth):
        s = split[(1 << d) - 1 : (1 << (d + 1)) - 1]
        exist_l.append((exist_l[-1] * s).repeat_interleave(2))
        log_exist_l.append((log_exist_l[-1] + s.log()).repeat_interleave(2))
    exist = torch.cat(exist_l)
    log_exist = torch.cat(log_exist_l)
    psi = (exist * split)[:n_int]
    kappa = exist * (1 - split)

    # guide log q (the depth-D Delta sites score zero)
    logits = q["split_logits"]
    s_int = split[:n_int]
    lq_split = s_int * F.logsigmoid(logits) + (1 - s_int) * F.logsigmoid(-logits)
    lq_beta = _normal_lp(beta, q["beta_loc"], q["beta_scale"]).sum(-1)
    lq_theta = _normal_lp(theta, q["theta_loc"], q["theta_scale"]).sum(-1)
    lq_ls = _normal_lp(log_sigma, q["log_sigma_loc"], q["log_sigma_scale"])
    log_q = (
        (exist[:n_int] * lq_split).sum()
        + (psi * lq_beta).sum()
        + (kappa * (lq_theta + lq_ls)).sum()
    )
    rho = None
    if "rho_a" in q:  # where a missing input goes: Beta sites weighted by psi
        rho = torch.cat([values[site(f"rho_{d}")] for d in range(depth)])
        lq_rho = dist.Beta(q["rho_a"], q["rho_b"]).log_prob(rho)
        log_q = log_q + (psi * lq_rho).sum()

    # model log p: split indicators of every node (the truncated level scores log(1 - g_D))
    prior = model.node_prior(0, split.shape[0], **opts)
    if prior is None:  # the depth rule and scalar scales
        depths = _level_depths(split.shape[0], x.device)
        gamma = torch.tensor([model.split_prob(d) for d in range(depth + 1)], **opts)[depths]
        lp_beta = _normal_lp(beta, 0.0, model.split_scale).sum(-1)
        lp_theta = _normal_lp(theta, 0.0, model.leaf_scale).sum(-1)
    else:  # per-node values (VaRT's node_* tensors) where given
        gamma = prior["split_prob"]
        lp_beta = gaussian(prior["split_loc"][:n_int], prior["split_scale"][:n_int]).log_prob(beta)
        lp_theta = gaussian(prior["leaf_loc"], prior["leaf_scale"]).log_prob(theta)
    gamma = clamp_probs(gamma)
    lp_split = split * gamma.log() + (1 - split) * (-gamma).log1p()
    lp_ls = _normal_lp(log_sigma, model.noise_prior_loc, model.noise_prior_scale)
    log_p = (exist * lp_split).sum() + (psi * lp_beta).sum() + (kappa * (lp_theta + lp_ls)).sum()
    if rho is not None:
        log_p = log_p + (psi * model.rho_prior(rho.shape, **opts).log_prob(rho)).sum()

    # likelihood of the (sub)sampled points, scaled by N / B as pyro.plate does
    n = x.shape[0]
    if subsample is None and subsample_size is not None and int(subsample_size) < n:
        subsample = torch.randperm(n, device=x.device)[: int(subsample_size)]
    if subsample is not None:
        n = n if num_rows is None else _rows(num_rows)
        xb, yb, scale = x[subsample], y[subsample], n / subsample.shape[0]
    else:  # x is the batch; num_rows, where given, the rows it stands for
        xb, yb, scale = x, y, 1.0 if num_rows is None else _rows(num_rows) / n
    # eq. 27 (as mixture_params computes it): log P(x -> i) level by level, in one pass
    x1, missing = observed(with_bias(xb))  # missing inputs read 0 (their routes: rho)
    z = x1 @ beta.T  # (B, 2**D - 1): beta^T x, the log-odds of going left
    if missing is None:
        reach = [x1.new_zeros(x1.shape[0], 1)]
        for d in range(depth):
            zd = z[:, (1 << d) - 1 : (1 << (d + 1)) - 1]
            pair = torch.stack([reach[-1] + F.logsigmoid(zd), reach[-1] + F.logsigmoid(-zd)], -1)
            reach.append(pair.reshape(x1.shape[0], 1 << (d + 1)))
        log_reach = torch.cat(reach, -1)
    else:
        log_left, log_right = route_log_probs(z, beta, missing, rho)
        log_reach = trees.splits_log_reach(log_left, log_right)
    log_kappa = log_exist + torch.log1p(-split)
    mix_logits = log_kappa + log_reach
    obs_ll = model._obs_log_lik(mix_logits, x1, theta, log_sigma, yb)
    return scale * obs_ll + kl_weight * (log_p - log_q)


def _vart_program(model, guide, xb, yb, q, noise, temperature, num_rows):
    """:func:`vart_elbo` of the batch ``(xb, yb)`` standing for ``num_rows`` rows (a
    0-dim tensor, or ``None``: all rows) from the step's draws: the part of a step that
    compiles."""
    values = guide.sites(q, noise, temperature)
    return vart_elbo(model, guide, xb, yb, values=values, num_rows=num_rows, params=q)


class VaRTELBO(CompilesVaRTLoss, DifferentiableLossELBO):
    """Drop-in replacement of :class:`pyro.infer.Trace_ELBO` for
    :class:`~pyro_trees.models.VaRT` with :class:`~pyro_trees.guides.VaRTGuide`:
    the same estimator (:func:`vart_elbo`), without Pyro's per-site tracing.

    Use it as ``SVI(model, guide, optim, VaRTELBO())`` or ``fit(..., loss=VaRTELBO())``;
    it takes the model's arguments ``(x, y, subsample_size=None)``. One particle only
    (``num_particles`` of :class:`~pyro.infer.ELBO` is ignored).

    With ``compile=True`` each step's loss runs as one program compiled by
    ``torch.compile`` (:mod:`pyro_trees.infer.compiled`): the same estimator on the same
    draws, for complete inputs at a temperature above 0 (otherwise, and where
    compilation fails, eagerly).

    :param compile: ``False`` (default), ``True`` or a ``torch.compile`` backend name.
    :param str mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import VaRTGuide
    >>> from pyro_trees.infer import VaRTELBO
    >>> from pyro_trees.models import VaRT
    >>> x, y = torch.randn(5, 2), torch.randn(5)
    >>> model = VaRT(2)
    >>> guide = VaRTGuide(model, depth=2)
    >>> loss = VaRTELBO().differentiable_loss(model, guide, x, y)
    >>> loss.shape, bool(torch.isfinite(loss))
    (torch.Size([]), True)
    """

    _model_cls = VaRT
    _model_name = "a VaRT model"
    _elbo = staticmethod(vart_elbo)
    _program = staticmethod(_vart_program)
