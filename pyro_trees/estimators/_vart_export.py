"""Reading a fitted :class:`~pyro_trees.estimators.VaRTRegressor`: its most probable tree
as text and the features' shares in its splits."""

from __future__ import annotations

import math

import numpy as np
import torch

from pyro_trees import trees
from pyro_trees.models._vart_mixture import with_bias


@torch.no_grad()
def _split_importances(guide, Xs: torch.Tensor) -> np.ndarray:
    """Expected share of each feature in the splits, weighted by how many training
    points reach each node: :math:`\\sum_i E[\\psi_i]\\,\\overline{P(x \\to i)}\\,
    |\\tilde\\mu_{ij}| / \\sum_k |\\tilde\\mu_{ik}|` for the standardised inputs
    ``Xs`` ``(N, L)`` under ``guide``, a :class:`~pyro_trees.guides.VaRTGuide`: ``(L,)``,
    summing to one."""
    g = guide  # a VaRTGuide, or a VaRTForestGuide (a leading dimension of trees)
    psi, _ = g.node_probs()
    n_int = trees.num_internal(g.depth)
    loc = g.beta_loc.detach()
    logits = -torch.matmul(with_bias(Xs), loc.transpose(-1, -2))
    reach = trees.node_log_reach(trees.leaf_log_probs(logits)).exp()[..., :n_int]
    w = loc[..., :-1].abs()
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    imp = ((psi[..., :n_int] * reach.mean(-2)).unsqueeze(-1) * w).reshape(-1, w.shape[-1]).sum(0)
    total = imp.sum()
    imp = imp / total if total > 0 else torch.full_like(imp, 1 / imp.numel())
    return imp.cpu().numpy()


@torch.no_grad()
def _export_text(guide, x_scaler, y_scaler, feature_names=None, decimals: int = 3) -> str:
    """The most probable tree under the guide
    (:meth:`~pyro_trees.guides.VaRTGuide.most_probable_structure`) as indented text in the style
    of ``sklearn.tree.export_text``.

    Splits are oblique (:math:`x` goes left iff :math:`\\tilde\\mu_i^\\top x > 0`); each
    is printed as its dominant feature (largest standardised weight, its share in
    brackets) with the threshold where the rule flips when the other inputs sit at
    their training means. Leaves (linear models) print their prediction at the
    training mean of the inputs, their noise scale and their three largest slopes.

    :param guide: the fitted :class:`~pyro_trees.guides.VaRTGuide` (standardised units).
    :param x_scaler: the inputs' ``mean`` and ``scale`` ``(L,)``.
    :param y_scaler: the target's ``mean`` and ``scale``.
    :param feature_names: ``L`` names (default ``x_0``, ``x_1``, ...).
    :param int decimals: printed digits.
    """
    g = guide
    split = g.most_probable_structure().tolist()
    n_int = len(split)
    mu = g.beta_loc.detach().double().cpu()
    theta = g.theta_loc.detach().double().cpu()
    sig = g.log_sigma_loc.detach().double().exp().cpu()
    xm = torch.as_tensor(x_scaler.mean, dtype=torch.float64)
    xs = torch.as_tensor(x_scaler.scale, dtype=torch.float64)
    ym, ysc = float(y_scaler.mean), float(y_scaler.scale)

    def name(j: int) -> str:
        return str(feature_names[j]) if feature_names is not None else f"x_{j}"

    def leaf(i: int) -> str:
        th = theta[i - 1]
        value = ym + ysc * float(th[-1])
        slopes = ysc * th[:-1] / xs
        order = torch.argsort(th[:-1].abs(), descending=True)[:3].tolist()
        terms = ", ".join(f"{name(j)}: {float(slopes[j]):+.{decimals}g}" for j in order)
        return (
            f"value: {value:.{decimals}f} (sd {ysc * float(sig[i - 1]):.{decimals}f}; "
            f"slopes {terms})"
        )

    lines: list[str] = []

    def visit(i: int, level: int) -> None:
        indent = "|   " * level + "|--- "
        if i - 1 >= n_int or not split[i - 1]:
            lines.append(indent + leaf(i))
            return
        b = mu[i - 1]
        j = int(b[:-1].abs().argmax())
        share = float(b[j].abs() / b[:-1].abs().sum().clamp_min(1e-300))
        t_std = -float(b[-1]) / float(b[j]) if float(b[j]) != 0 else math.inf
        t = float(xm[j] + xs[j] * t_std)
        left_op, right_op = (">", "<=") if float(b[j]) > 0 else ("<=", "> ")
        lines.append(f"{indent}{name(j)} {left_op} {t:.{decimals}f}  [{share:.0%}]")
        visit(2 * i, level + 1)
        lines.append(f"{indent}{name(j)} {right_op} {t:.{decimals}f}  [{share:.0%}]")
        visit(2 * i + 1, level + 1)

    visit(1, 0)
    return "\n".join(lines) + "\n"
