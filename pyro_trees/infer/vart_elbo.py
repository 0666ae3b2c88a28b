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

import functools
import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F
from torch.distributions.utils import clamp_probs

from pyro_trees import trees
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesVaRTLoss, plate_subsample
from pyro_trees.models.vart import VaRT, log_existence
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
    weight: torch.Tensor | None = None,
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
    :param weight: row weights ``T + (N,)`` of the likelihood (a full batch only): with a
        :class:`~pyro_trees.guides.StackedGuides` of ``F`` tree guides (``T = (F,)``),
        fit ``j`` learns from the rows of weight 1 in ``weight[j]``.
    :returns: the ELBO estimate, a scalar tensor (maximise it); for a
        :class:`~pyro_trees.guides.StackedGuides` of ``F`` guides, the ``(F,)`` ELBOs
        of the fits.
    """
    q = guide.params(x) if params is None else params
    draws = _node_draws(model, guide, q, values)
    xb, yb, scale = _batch(x, y, subsample_size, subsample, num_rows, weight)
    return _tree_elbo(model, q, *draws, xb, yb, scale, weight)


def _node_draws(model, guide, q: dict, values: dict | None) -> tuple:
    """``(split, beta, theta, log_sigma, rho)`` of every node, heap-ordered (a leading
    dimension of trees in a forest): the sites ``values`` put back together, or without
    them the draw :meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.rsample` makes, taken
    at once (:meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.relaxed`). ``rho`` is
    ``None`` without missing inputs; a forest's ``log_sigma`` is one site, a tree's one
    per level."""
    if values is None:
        noise = guide.noise(q)
        return (*guide.relaxed(q, noise, guide.temperature), noise.get("rho"))
    depth, site = guide.depth, model.site

    def nodes(name: str, levels: int, dim: int) -> torch.Tensor:
        return torch.cat([values[site(f"{name}_{d}")] for d in range(levels)], dim)

    if site("log_sigma") in values:  # a forest's one noise scale
        log_sigma = values[site("log_sigma")]
    else:
        log_sigma = nodes("log_sigma", depth + 1, -1)
    rho = nodes("rho", depth, -1) if "rho_a" in q else None
    split, beta, theta = (
        nodes("split", depth, -1),
        nodes("beta", depth, -2),
        nodes("theta", depth + 1, -2),
    )
    return split, beta, theta, log_sigma, rho


def _batch(x, y, subsample_size, subsample, num_rows, weight=None) -> tuple:
    """``(xb, yb, scale)``: the minibatch (``subsample``, drawn as ``pyro.plate`` draws
    it when ``None`` and ``subsample_size < N``; else all rows) and the factor that
    makes its likelihood stand for ``num_rows`` rows (default ``N``). Row weights
    ``weight`` weigh all rows: they refuse a subsample."""
    if weight is not None and (subsample is not None or subsample_size is not None):
        raise ValueError("row weights need a full batch (no subsample)")
    n = x.shape[0]
    if subsample is None:
        subsample = plate_subsample(n, subsample_size, x.device)
    if subsample is not None:
        total = n if num_rows is None else _rows(num_rows)
        return x[subsample], y[subsample], total / subsample.shape[0]
    # x is the batch; num_rows, where given, the rows it stands for
    return x, y, 1.0 if num_rows is None else _rows(num_rows) / n


def _tree_elbo(
    model, q, split, beta, theta, log_sigma, rho, xb, yb, scale, weight=None
) -> torch.Tensor:
    r""":func:`vart_elbo` from the draw of every node (heap order: ``split`` and ``beta``
    at the internal nodes, ``theta`` and ``log_sigma`` at every node, after a batch
    shape ``T`` of trees, ``()`` for one) and the batch ``(xb, yb)`` weighted by
    ``scale`` (and by ``weight`` ``T + (N,)``, where given): one ELBO per tree, ``T``.
    Each site's :math:`\log p - \log q` is one expression (the Gaussians' constants
    cancel), so that a step dispatches few
    operations: on a CPU at a few hundred rows their number, not the arithmetic, sets
    the step's time."""
    opts = {"dtype": split.dtype, "device": split.device}
    n_int = split.shape[-1]
    depth = (n_int + 1).bit_length() - 1
    # existence A_i: the product of the ancestors' indicators, through its log
    log_exist = log_existence(split)
    exist = log_exist.exp()
    leaves = split.new_zeros(split.shape[:-1] + (n_int + 1,))  # the depth-D nodes: leaves
    split_all = torch.cat([split, leaves], -1)
    psi = exist[..., :n_int] * split
    kappa = exist * (1 - split_all)

    # split indicators of every node (the truncated level scores log(1 - g_D)): log p =
    # s log(g / (1 - g)) + log(1 - g); the guide's of the internal ones: s l + logsigmoid(-l)
    prior = model.node_prior(0, split_all.shape[0], **opts)
    if prior is None:  # the depth rule and scalar scales
        probs = tuple(float(model.split_prob(d)) for d in range(depth + 1))
        log_odds, log_no = _split_prior(probs, **opts)
        d_beta = _normal_log_ratio(beta, q["beta_loc"], q["beta_scale"], model.split_scale).sum(-1)
        d_theta = _normal_log_ratio(theta, q["theta_loc"], q["theta_scale"], model.leaf_scale)
        d_theta = d_theta.sum(-1)
    else:  # per-node values (VaRT's node_* tensors) where given
        gamma = clamp_probs(prior["split_prob"])
        log_no = (-gamma).log1p()
        log_odds = gamma.log() - log_no
        lp_beta = gaussian(prior["split_loc"][:n_int], prior["split_scale"][:n_int]).log_prob(beta)
        d_beta = lp_beta - _normal_lp(beta, q["beta_loc"], q["beta_scale"]).sum(-1)
        lp_theta = gaussian(prior["leaf_loc"], prior["leaf_scale"]).log_prob(theta)
        d_theta = lp_theta - _normal_lp(theta, q["theta_loc"], q["theta_scale"]).sum(-1)
    logits = q["split_logits"]
    lq_split = split * logits + F.logsigmoid(-logits)  # = s logsigmoid(l) + (1 - s) logsigmoid(-l)
    d_ls = _normal_lp(log_sigma, model.noise_prior_loc, model.noise_prior_scale) - _normal_lp(
        log_sigma, q["log_sigma_loc"], q["log_sigma_scale"]
    )
    kl_terms = (
        (exist * (split_all * log_odds + log_no)).sum(-1)
        - (exist[..., :n_int] * lq_split).sum(-1)
        + (psi * d_beta).sum(-1)
        + (kappa * (d_theta + d_ls)).sum(-1)
    )
    if rho is not None:  # where a missing input goes: Beta sites weighted by psi
        d_rho = model.rho_prior(rho.shape, **opts).log_prob(rho) - dist.Beta(
            q["rho_a"], q["rho_b"]
        ).log_prob(rho)
        kl_terms = kl_terms + (psi * d_rho).sum(-1)

    # eq. 27 (as mixture_params computes it): log P(x -> i) level by level, in one pass
    x1, missing = observed(with_bias(xb))  # missing inputs read 0 (their routes: rho)
    z = x1 @ beta.transpose(-1, -2)  # T + (B, 2**D - 1): beta^T x, the log-odds of left
    if missing is None:
        log_reach = trees.logits_log_reach(z)
    else:
        log_left, log_right = route_log_probs(z, beta, missing, rho)
        log_reach = trees.splits_log_reach(log_left, log_right)
    mix_logits = (log_exist + torch.log1p(-split_all)).unsqueeze(-2) + log_reach
    obs_lp = model.obs_log_lik(mix_logits, x1, theta, log_sigma, yb)  # T + (B,)
    obs_ll = (obs_lp if weight is None else obs_lp * weight).sum(-1)
    return scale * obs_ll + model.kl_weight * kl_terms


def _normal_log_ratio(value, loc, scale, prior_scale: float) -> torch.Tensor:
    r"""Elementwise ``Normal(0, prior_scale).log_prob(value) - Normal(loc,
    scale).log_prob(value)`` in one expression (the constants cancel):
    :math:`\frac12 \bigl((v - m)/s\bigr)^2 - \frac12 (v / s_0)^2 + \log s - \log s_0`.

    :param value: draws, any shape.
    :param loc: the guide's locations, broadcastable with ``value``.
    :param scale: the guide's standard deviations (a tensor), likewise.
    :param float prior_scale: :math:`s_0`, the prior's standard deviation (mean 0).
    """
    eps = (value - loc) / scale
    return 0.5 * (eps * eps - (value * (1.0 / prior_scale)) ** 2) + (
        scale.log() - math.log(prior_scale)
    )


def _split_prior(probs: tuple, *, dtype=None, device=None) -> tuple:
    """``(log(g / (1 - g)), log(1 - g))`` ``(2**D - 1,)`` of the prior split
    probabilities ``probs`` of the levels ``0..D-1`` (``probs[d]`` for each of the
    ``2**d`` nodes of level ``d``, clamped away from 0 and 1 as Pyro clamps them),
    cached: the constants of every training step."""
    cached = _split_log_odds.__wrapped__ if torch.compiler.is_compiling() else _split_log_odds
    return cached(tuple(float(p) for p in probs), dtype or torch.get_default_dtype(), device)


@functools.lru_cache(maxsize=64)
def _split_log_odds(probs: tuple, dtype, device) -> tuple:
    per_node = [p for d, p in enumerate(probs) for _ in range(1 << d)]
    with torch.inference_mode(False):  # a pair first made there still enters backward
        # clamped by the step dtype's eps, as Pyro's clamp_probs; the logs in double
        eps = torch.finfo(dtype).eps
        gamma = torch.tensor(per_node, dtype=torch.float64).clamp(eps, 1 - eps)
        log_no = (-gamma).log1p()
        opts = {"dtype": dtype, "device": device}
        return (gamma.log() - log_no).to(**opts), log_no.to(**opts)


def _vart_program(model, guide, xb, yb, q, noise, temperature, num_rows):
    """:func:`vart_elbo` of the batch ``(xb, yb)`` standing for ``num_rows`` rows (a
    0-dim tensor, or ``None``: all rows) from the step's draws: the part of a step that
    compiles."""
    _, _, scale = _batch(xb, yb, None, None, num_rows)
    draws = (*guide.relaxed(q, noise, temperature), noise.get("rho"))
    return _tree_elbo(model, q, *draws, xb, yb, scale)


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
