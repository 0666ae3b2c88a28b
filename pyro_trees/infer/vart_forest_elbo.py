"""``VaRTForestELBO``: the ELBO of a VaRT forest in one batched function.

The same single-sample estimator that :class:`pyro.infer.Trace_ELBO` computes for
:class:`~pyro_trees.models.VaRTForest` and :class:`~pyro_trees.guides.VaRTForestGuide`
(the same sites, weights and scaling; tested equal on the same draws), with every
tree's nodes in one tensor instead of Pyro's per-site tracing.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
"""

from __future__ import annotations

import pyro.distributions as dist
import torch
import torch.nn.functional as F

from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesVaRTLoss
from pyro_trees.infer.vart_elbo import (
    _batch,
    _node_draws,
    _normal_log_ratio,
    _normal_lp,
    _split_prior,
)
from pyro_trees.models.vart_forest import VaRTForest, forest_mean, forest_of_nodes

__all__ = ["VaRTForestELBO", "vart_forest_elbo"]


def vart_forest_elbo(
    model: VaRTForest,
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
    """The single-sample ELBO estimate that ``Trace_ELBO`` computes for
    ``model(x, y, subsample_size)`` and its :class:`~pyro_trees.guides.VaRTForestGuide`:
    :math:`\\frac NB \\sum_{n \\in \\text{batch}} \\log \\mathcal N(y_n; f(x_n), \\sigma^2)
    + \\lambda \\sum_k w_k (\\log p_k - \\log q_k)` over every site of every tree, with
    the node weights of eqs. 23-29.

    :param values: the guide's draws by site name
        (:meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.rsample`);
        drawn afresh when ``None``.
    :param subsample: minibatch indices; drawn as ``pyro.plate`` draws them when
        ``None`` and ``subsample_size < N``.
    :param num_rows: the rows the likelihood of ``subsample`` (or without it, of all
        of ``x``) stands for (default ``N``; several processes each holding a shard
        pass the global count; a compiled step passes a 0-dim tensor).
    :param params: the guide's parameters (:meth:`VaRTForestGuide.params
        <pyro_trees.guides.VaRTForestGuide.params>`), when already read.
    :param weight: row weights ``B + (N,)`` of the likelihood (a full batch only): with a
        :class:`~pyro_trees.guides.StackedGuides` of ``F`` guides (``B = (F,)``), fit
        ``j`` learns from the rows where ``weight[j]`` is 1 (its training rows) and
        ignores those where it is 0 (the rows it holds out).
    :returns: the ELBO estimate, a scalar tensor (maximise it); for a
        :class:`~pyro_trees.guides.StackedGuides` of ``F`` guides, the ``(F,)`` ELBOs
        of the fits.
    """
    q = guide.params(x) if params is None else params
    draws = _node_draws(model, guide, q, values)
    xb, yb, scale = _batch(x, y, subsample_size, subsample, num_rows, weight)
    return _forest_elbo(model, q, *draws, xb, yb, scale, weight)


def _forest_elbo(
    model, q, split, beta, theta, log_sigma, rho, xb, yb, scale, weight=None
) -> torch.Tensor:
    """:func:`vart_forest_elbo` from the draw of every node (heap order, a dimension of
    trees after the batch shape ``B`` of forests, ``()`` for one) and the batch
    ``(xb, yb)`` weighted by ``scale`` (and by ``weight`` ``B + (N,)``, where given):
    one ELBO per forest, ``B``. Each site's
    :math:`\\log p - \\log q` is one expression (the Gaussians' constants cancel, and
    :math:`(\\beta - \\tilde\\mu) / \\tilde S` is the standard normal draw), so that a
    step dispatches few operations: on a CPU at a few hundred rows their number, not
    the arithmetic, sets the step's time."""
    forest = forest_of_nodes(split, beta, theta, rho)
    n_int = split.shape[-1]
    exist = forest["log_exist"].exp()  # B + (K, M): A_i
    psi = exist[..., :n_int] * split
    kappa = exist * (1 - forest["split"])

    # split indicators: log q = s l + logsigmoid(-l) (the Bernoulli of logit l);
    # log p = s log(g / (1 - g)) + log(1 - g)
    logits = q["split_logits"]
    depth = (n_int + 1).bit_length() - 1
    probs = tuple(float(model.split_prob(d)) for d in range(depth))
    log_odds, log_no = _split_prior(probs, dtype=split.dtype, device=split.device)
    d_split = split * (log_odds - logits) + (log_no - F.logsigmoid(-logits))
    # Gaussians: log N(v; 0, s0) - log N(v; m, s) = ((v - m) / s)^2 / 2 - (v / s0)^2 / 2
    # + log s - log s0
    d_beta = _normal_log_ratio(beta, q["beta_loc"], q["beta_scale"], model.split_scale)
    d_theta = _normal_log_ratio(theta, q["theta_loc"], q["theta_scale"], model.tree_leaf_scale)
    d_ls = _normal_lp(log_sigma, model.noise_prior_loc, model.noise_prior_scale) - _normal_lp(
        log_sigma, q["log_sigma_loc"], q["log_sigma_scale"]
    )
    nodes = (-2, -1)  # every node of every tree of a forest
    kl_terms = (
        (exist[..., :n_int] * d_split).sum(nodes)
        + (psi * d_beta.sum(-1)).sum(nodes)
        + (kappa * d_theta.sum(-1)).sum(nodes)
        + d_ls
    )
    if rho is not None:
        prior = model.rho_prior(rho.shape, dtype=rho.dtype, device=rho.device)
        d_rho = prior.log_prob(rho) - dist.Beta(q["rho_a"], q["rho_b"]).log_prob(rho)
        kl_terms = kl_terms + (psi * d_rho).sum(nodes)

    f = forest_mean(forest, xb)  # B + (N,)
    obs_lp = _normal_lp(yb, f, log_sigma.exp().unsqueeze(-1))
    obs_ll = (obs_lp if weight is None else obs_lp * weight).sum(-1)
    return scale * obs_ll + model.kl_weight * kl_terms


def _vart_forest_program(model, guide, xb, yb, q, noise, temperature, num_rows):
    """:func:`vart_forest_elbo` of the batch ``(xb, yb)`` standing for ``num_rows`` rows
    (a 0-dim tensor, or ``None``: all rows) from the step's draws: the part of a step
    that compiles."""
    _, _, scale = _batch(xb, yb, None, None, num_rows)
    draws = (*guide.relaxed(q, noise, temperature), noise.get("rho"))
    return _forest_elbo(model, q, *draws, xb, yb, scale)


class VaRTForestELBO(CompilesVaRTLoss, DifferentiableLossELBO):
    """Drop-in replacement of :class:`pyro.infer.Trace_ELBO` for
    :class:`~pyro_trees.models.VaRTForest` with :class:`~pyro_trees.guides.VaRTForestGuide`
    (:func:`vart_forest_elbo`); it takes the model's arguments ``(x, y,
    subsample_size=None)``. One particle.

    With ``compile=True`` each step's loss runs as one compiled program, as
    :class:`~pyro_trees.infer.VaRTELBO`'s does (:mod:`pyro_trees.infer.compiled`).

    **Several fits at once.** With a :class:`~pyro_trees.guides.StackedGuides` of ``F``
    forest guides for the guide and row weights ``weight`` ``(F, N)`` (full batch), the
    loss is the sum of the ``F`` fits' negative ELBOs, fit ``j`` learning from the rows
    of weight 1 in ``weight[j]``; their values after the last call are kept in
    ``fit_losses`` ``(F,)`` (detached). This path runs eagerly.

    :param compile: ``False`` (default), ``True`` or a ``torch.compile`` backend name.
    :param str mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import VaRTForestGuide
    >>> from pyro_trees.infer import VaRTForestELBO
    >>> from pyro_trees.models import VaRTForest
    >>> x, y = torch.randn(5, 2), torch.randn(5)
    >>> model = VaRTForest(2, num_trees=3, depth=2)
    >>> loss = VaRTForestELBO().differentiable_loss(model, VaRTForestGuide(model), x, y)
    >>> bool(torch.isfinite(loss))
    True
    """

    _model_cls = VaRTForest
    _model_name = "a VaRTForest"
    _elbo = staticmethod(vart_forest_elbo)
    _program = staticmethod(_vart_forest_program)
