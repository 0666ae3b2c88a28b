"""Reading a fitted deep GP: predictive summaries, per-layer function samples, collapse.

* :func:`dgp_predict`: predictive mean, variance, intervals and log-likelihood on new
  inputs, from :class:`pyro.infer.Predictive` draws of the last layer's Gaussian.
* :func:`layer_samples`: posterior draws of every layer's function on a grid of its
  own inputs, and of the compositions :math:`f_i \\circ \\dots \\circ f_1` on an input
  grid, each draw a coherent function (figures like Figs. 2-5 of Ustyuzhaninov et al.).
* :func:`collapse_ratio`: the spread of a layer's function across posterior draws
  relative to its prior spread; near 0 means the layer collapsed to a deterministic
  transformation.
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro import poutine
from pyro.infer import Predictive

from pyro_trees.distributions.mixture_quantiles import gaussian_mixture_quantiles

from ..gp import kernel_matrix, sample_gaussian
from ..validation import check_level

__all__ = ["collapse_ratio", "dgp_predict", "layer_samples"]


@torch.no_grad()
def dgp_predict(
    model, guide, x, y=None, *, num_samples: int = 100, level: float = 0.95, parallel=True
):
    """Predictive summaries of a :class:`~pyro_trees.models.DeepGP` at ``x``.

    For each of ``num_samples`` draws of the inducing sites and inner layers (through
    :class:`~pyro.infer.Predictive`), the prediction is
    :math:`N(\\mu_s, v_s + \\sigma^2)`; the predictive is their equal mixture.

    :param x: inputs ``(N, D)``.
    :param y: targets ``(N,)``; when given, the mean log predictive density is returned.
    :param float level: central interval probability.
    :param bool parallel: draw all samples at once (vectorised); ``False`` loops.
    :returns: dict with ``mean``, ``var`` (``(N,)``, the mixture's), ``lower``,
        ``upper`` (``(N,)``: the central ``level`` interval of the mixture, its exact
        ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles from
        :func:`~pyro_trees.distributions.gaussian_mixture_quantiles`, so the only Monte
        Carlo error is that of the ``num_samples`` draws of the inner layers) and, with
        ``y``, ``log_lik`` (mean over points of
        :math:`\\log \\frac1S \\sum_s N(y; \\mu_s, v_s + \\sigma^2)`) and ``rmse``.
    """
    level = check_level(level)
    with _context(model):
        pred = Predictive(
            model,
            guide=guide,
            num_samples=num_samples,
            return_sites=("f_loc", "f_var"),
            parallel=parallel,
        )(x)
    loc, var = pred["f_loc"], pred["f_var"] + model.noise.detach() ** 2
    mean = loc.mean(0)
    out = {"mean": mean, "var": (var + loc**2).mean(0) - mean**2}
    alpha = (1 - level) / 2
    weight = torch.full_like(loc, 1.0 / loc.shape[0])
    q = gaussian_mixture_quantiles(weight, loc, var.sqrt(), [alpha, 1 - alpha], dim=0)
    out["lower"], out["upper"] = q[0], q[1]
    if y is not None:
        y = torch.as_tensor(y, dtype=loc.dtype, device=loc.device).reshape(-1)
        if y.shape != mean.shape:
            raise ValueError(f"y must have shape {tuple(mean.shape)}; got {tuple(y.shape)}")
        lp = torch.distributions.Normal(loc, var.sqrt()).log_prob(y)
        out["log_lik"] = float((lp.logsumexp(0) - math.log(num_samples)).mean())
        out["rmse"] = float((mean - y).pow(2).mean().sqrt())
    return out


def _context(module):
    """Run in the parameter mode the module was built in (module-local or global)."""
    local = hasattr(getattr(module, "_pyro_context", None), "param_state")
    return pyro.settings.context(module_local_params=local)


def _grid_over(values: torch.Tensor, num: int, margin: float = 0.1) -> torch.Tensor:
    """A grid ``(num, D)`` spanning the range of ``values`` (``(..., D)``) per column."""
    v = values.reshape(-1, values.shape[-1])
    lo, hi = v.min(0).values, v.max(0).values
    pad = margin * (hi - lo).clamp_min(1e-3)
    t = torch.linspace(0, 1, num, dtype=v.dtype, device=v.device).unsqueeze(-1)
    return lo - pad + t * (hi - lo + 2 * pad)


@torch.no_grad()
def layer_samples(model, guide, x_grid, *, num_samples: int = 10, grids=None, num_grid: int = 100):
    """Posterior function draws of every layer and of the compositions.

    Each draw takes the inducing sites from ``guide``, then for layer ``i`` draws its
    function jointly (full covariance) on its own input grid and at the composed
    outputs of the previous layers, so the plotted layer and the composition are one
    function.

    :param x_grid: input grid ``(G, D_0)``.
    :param grids: optional list of grids for layers ``2..L`` (``(G_i, D_{i-1})``); by
        default each spans the range of the previous composition over all draws
        (computed from a first pass of means).
    :returns: dict with ``grids`` (list of ``L`` tensors ``(G_i, D_{i-1})``),
        ``layers`` (list of ``(S, G_i, P_i)``: each layer's function on its grid) and
        ``compositions`` (list of ``(S, G, P_i)``: :math:`f_i \\circ \\dots \\circ f_1`
        at ``x_grid``).
    """
    x_grid, _ = model.checked_data(x_grid)
    L = model.num_layers
    draws = []
    with _context(guide):
        for _ in range(num_samples):
            tr = poutine.trace(guide).get_trace(x_grid)
            draws.append([tr.nodes[n]["value"] for n in model.site_names()])
    comps = [[x_grid] for _ in range(num_samples)]
    layers = [[] for _ in range(L)]
    out_grids = [x_grid]
    with _context(model), model.store_params():
        _fill_layers(model, draws, comps, layers, out_grids, grids, num_grid)
    return {
        "grids": out_grids,
        "layers": [torch.stack(v) for v in layers],
        "compositions": [torch.stack([c[i + 1] for c in comps]) for i in range(L)],
    }


def _fill_layers(model, draws, comps, layers, out_grids, grids, num_grid):
    x_grid = out_grids[0]
    num_samples = len(draws)
    for i in range(model.num_layers):
        if i > 0:
            if grids is not None:
                g = torch.as_tensor(grids[i - 1], dtype=x_grid.dtype, device=x_grid.device)
                g = g.reshape(len(g), -1)
            else:
                g = _grid_over(torch.stack([c[-1] for c in comps]), num_grid)
            out_grids.append(g)
        g = out_grids[i]
        for s in range(num_samples):
            inputs = torch.cat([g, comps[s][-1]], dim=0)
            f_z_prev = draws[s][i - 1] if i > 0 else None
            loc, cov = model.layer(i, inputs, draws[s][i], f_z_prev, full_cov=True)
            f = sample_gaussian(loc.mT, cov, full_cov=True, jitter=1e-6).mT
            layers[i].append(f[: len(g)])
            comps[s].append(f[len(g) :])


@torch.no_grad()
def collapse_ratio(model, samples: dict, layer: int) -> float:
    """Posterior spread of a layer's function relative to its prior spread.

    :param samples: the output of :func:`layer_samples`.
    :param int layer: 1-based layer index.
    :returns: mean over grid points and outputs of the standard deviation of
        :math:`f_i(g)` across posterior draws, divided by the mean prior standard
        deviation :math:`\\sqrt{k_i(g, g)}` on the same grid. About 1 for a layer
        as uncertain as its prior, near 0 for a collapsed (deterministic) layer.
    """
    i = layer - 1
    if not 0 <= i < model.num_layers:
        raise ValueError(f"layer must be between 1 and {model.num_layers}; got {layer}")
    f = samples["layers"][i]
    post = f.std(0).mean()
    prior = kernel_matrix(model.kernels[i], samples["grids"][i], diag=True).sqrt().mean()
    return float(post / prior)
