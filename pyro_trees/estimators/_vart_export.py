"""Reading a fitted :class:`~pyro_trees.estimators.VaRTRegressor`: its most probable tree
as text and the features' shares in its splits."""

from __future__ import annotations

import math

import numpy as np
import torch

from pyro_trees import trees
from pyro_trees.models.vart_mixture import observed, route_log_probs, with_bias


@torch.no_grad()
def _split_importances(guide, Xs: torch.Tensor, ranks=None) -> np.ndarray:
    """Expected share of each feature in the splits, weighted by how many training
    points reach each node: :math:`\\sum_i E[\\psi_i]\\,\\overline{P(x \\to i)}\\,
    |\\tilde\\mu_{ij}| / \\sum_k |\\tilde\\mu_{ik}|` for the standardised inputs
    ``Xs`` ``(N, L)`` under ``guide``, a :class:`~pyro_trees.guides.VaRTGuide`: ``(L,)``,
    summing to one. With ``ranks`` whose rows are spread, the reach is averaged over
    every rank's rows. Rows with missing inputs reach the nodes as the guide's central
    tree routes them (:func:`_node_reach`)."""
    g = guide  # a VaRTGuide, or a VaRTForestGuide (a leading dimension of trees)
    psi, _ = g.node_probs()
    n_int = trees.num_internal(g.depth)
    loc = g.beta_loc.detach()
    rho = torch.sigmoid(g.rho_logits.detach()) if g.missing else None
    reach = _node_reach(loc, rho, Xs)[..., :n_int]
    w = loc[..., :-1].abs()
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
    if ranks is not None and ranks.spread:
        reach = (ranks.sum(reach.sum(-2)) / ranks.count(reach.shape[-2])).to(reach)
    else:
        reach = reach.mean(-2)
    imp = ((psi[..., :n_int] * reach).unsqueeze(-1) * w).reshape(-1, w.shape[-1]).sum(0)
    total = imp.sum()
    imp = imp / total if total > 0 else torch.full_like(imp, 1 / imp.numel())
    return imp.cpu().numpy()


@torch.no_grad()
def most_probable_tree(guide, x_scaler=None) -> dict:
    """The most probable tree under ``guide``
    (:meth:`~pyro_trees.guides.VaRTGuide.most_probable_structure`) as nested dicts, with
    its unreachable regions folded away (the rules of
    :meth:`VaRTRegressor.export_text <pyro_trees.estimators.VaRTRegressor.export_text>`).

    A leaf is ``{"node": i}`` (heap number); a split is ``{"node": i, "feature": j,
    "threshold": t, "share": s, "children": [(op, empty, subtree), (op, empty,
    subtree)]}`` in heap order (left child first), with ``op`` the side's test of
    feature ``j`` against ``t`` (``">"`` or ``"<="``; the left child is the side where
    :math:`\\tilde\\mu_i^\\top x > 0`) and ``empty`` whether the side is empty where the
    other inputs sit at their means. ``t`` is in the units of ``x_scaler`` (``mean``
    and ``scale`` ``(L,)``; ``None``: the guide's own units). A guide of missing inputs
    adds ``"rho"``, the mean probability that a missing input goes right, to every
    split, and a split whose empty side is where missing inputs mostly go is kept.
    """
    g = guide
    split = g.most_probable_structure().tolist()
    n_int = len(split)
    mu = g.beta_loc.detach().double().cpu()
    rho = torch.sigmoid(g.rho_logits.detach().double().cpu()) if g.missing else None
    n_feat = mu.shape[-1] - 1
    if x_scaler is None:
        xm, xs = torch.zeros(n_feat, dtype=torch.float64), torch.ones(n_feat, dtype=torch.float64)
    else:
        xm = torch.as_tensor(x_scaler.mean, dtype=torch.float64)
        xs = torch.as_tensor(x_scaler.scale, dtype=torch.float64)

    def visit(i: int, box: dict) -> dict:
        if i - 1 >= n_int or not split[i - 1]:
            return {"node": i}
        b = mu[i - 1]
        j = int(b[:-1].abs().argmax())
        share = float(b[j].abs() / b[:-1].abs().sum().clamp_min(1e-300))
        t_std = -float(b[-1]) / float(b[j]) if float(b[j]) != 0 else math.inf
        t = float(xm[j] + xs[j] * t_std)
        exact = share >= 1.0 - 1e-9 or n_feat == 1
        # the children's intervals of feature j: (lo, hi], exact flags of the bounds
        lo, hi = box.get(j, ((-math.inf, True), (math.inf, True)))
        cut = (t, exact)
        upper = (max(lo, cut, key=lambda v: v[0]), hi)  # x_j > t
        lower = (lo, min(hi, cut, key=lambda v: v[0]))  # x_j <= t
        left, right = (upper, lower) if float(b[j]) > 0 else (lower, upper)
        children = []
        for child, (c_lo, c_hi), op in (
            (2 * i, left, ">" if float(b[j]) > 0 else "<="),
            (2 * i + 1, right, "<=" if float(b[j]) > 0 else ">"),
        ):
            empty = c_lo[0] >= c_hi[0]
            children.append((child, (c_lo, c_hi), op, empty, empty and c_lo[1] and c_hi[1]))
        # missing inputs mostly take the right side when rho > 1/2
        miss_side = None if rho is None else int(float(rho[i - 1]) > 0.5)
        vacuous = [k for k, c in enumerate(children) if c[4] and k != miss_side]
        if vacuous:  # one side is empty (and no missing input goes there): fold it
            child, bounds, *_ = children[1 - vacuous[0]]
            return visit(child, {**box, j: bounds})
        sides = [(op, empty, visit(c, {**box, j: bd})) for c, bd, op, empty, _ in children]
        out = {"node": i, "feature": j, "threshold": t, "share": share, "children": sides}
        if rho is not None:
            out["rho"] = float(rho[i - 1])
        return out

    return visit(1, {})


@torch.no_grad()
def _export_text(
    guide, x_scaler, y_scaler, feature_names=None, decimals: int = 3, leaf_text=None
) -> str:
    """:meth:`VaRTRegressor.export_text <pyro_trees.estimators.VaRTRegressor.export_text>`
    of a fitted guide and the estimator's scalers (the rules it prints are described
    there), or with ``leaf_text`` (a function of the leaf's heap number, 1-based, that
    returns its text) another estimator's leaves. A guide of missing inputs marks the
    side a missing input of the split's feature mostly takes (``or missing``, with the
    guide's mean probability of that side).

    Unreachable regions are not printed: a split on a single feature (every split in
    1-D) whose one side is empty given its ancestors' single-feature rules (say
    ``x > 2`` under ``x <= 1``) sends every point the same way, so it is left out and
    its reachable side printed in its place. A side that is empty only by the printed
    thresholds of oblique splits, which hold where the other inputs sit at their means,
    is kept and marked, since points away from the means can reach it.

    :param guide: the fitted :class:`~pyro_trees.guides.VaRTGuide` (standardised units).
    :param x_scaler: the inputs' ``mean`` and ``scale`` ``(L,)``.
    :param y_scaler: the target's ``mean`` and ``scale`` (unused with ``leaf_text``).
    :param feature_names: ``L`` names (default ``x_0``, ``x_1``, ...).
    :param int decimals: printed digits.
    """
    g = guide
    theta = g.theta_loc.detach().double().cpu()
    sig = g.log_sigma_loc.detach().double().exp().cpu()
    xs = torch.as_tensor(x_scaler.scale, dtype=torch.float64)
    ym, ysc = (0.0, 1.0) if y_scaler is None else (float(y_scaler.mean), float(y_scaler.scale))

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

    def visit(node: dict, level: int) -> None:
        indent = "|   " * level + "|--- "
        if "children" not in node:
            lines.append(indent + (leaf_text or leaf)(node["node"]))
            return
        j, t, share = node["feature"], node["threshold"], node["share"]
        for side, (op, empty, child) in enumerate(node["children"]):
            note = "  (empty where the other inputs sit at their means)" if empty else ""
            if "rho" in node:  # the side missing inputs mostly take, and how often
                p_side = node["rho"] if side else 1.0 - node["rho"]
                note = (f" or missing (p = {p_side:.2f})" if p_side > 0.5 else "") + note
            op = "> " if op == ">" and node["children"][0][0] == "<=" else op
            lines.append(f"{indent}{name(j)} {op} {t:.{decimals}f}  [{share:.0%}]{note}")
            visit(child, level + 1)

    visit(most_probable_tree(g, x_scaler), 0)
    return "\n".join(lines) + "\n"


@torch.no_grad()
def _importance_draws(samples: dict, site, depth: int, Xs: torch.Tensor) -> np.ndarray:
    """The split-usage importances of :func:`_split_importances` under each posterior
    draw instead of the guide's expectations: for draw :math:`s`,
    :math:`\\sum_i \\psi_i^{(s)}\\,\\overline{P^{(s)}(x \\to i)}\\,|\\beta^{(s)}_{ij}| /
    \\sum_k |\\beta^{(s)}_{ik}|`, normalised to sum to one, with the draw's hard split
    indicators, its split weights and the reach averaged over the standardised rows
    ``Xs`` ``(N, L)``.

    :param samples: hard draws of a VaRT guide or VaRT forest guide by site name
        (``split_d`` ``(S, [K,] 2**d)``, ``beta_d`` ``(S, [K,] 2**d, L + 1)``; ``rho_d``
        ``(S, [K,] 2**d)`` where ``Xs`` has missing values).
    :param site: the model's site-name function.
    :param int depth: the guide's truncation depth.
    :returns: ``(S, L)``, rows summing to one.
    """
    split = torch.cat([samples[site(f"split_{d}")] for d in range(depth)], -1)
    beta = torch.cat([samples[site(f"beta_{d}")] for d in range(depth)], -2)
    split, beta = split.to(Xs.dtype), beta.to(Xs.dtype)
    n_int = split.shape[-1]
    exist = torch.ones_like(split[..., :1])
    psi = []
    for d in range(depth):  # existence times split, level by level
        s = split[..., (1 << d) - 1 : (2 << d) - 1]
        psi.append(exist * s)
        exist = (exist * s).repeat_interleave(2, dim=-1)
    psi = torch.cat(psi, -1)  # (S, [K,] I)
    rho = [None] * split.shape[0]
    if site("rho_0") in samples:
        rho = torch.cat([samples[site(f"rho_{d}")] for d in range(depth)], -1).to(Xs.dtype)
    out = []
    for b, p, r in zip(beta, psi, rho, strict=True):  # one draw at a time: stays small
        reach = _node_reach(b, r, Xs)[..., :n_int].mean(-2)
        w = b[..., :-1].abs()
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
        imp = ((p * reach).unsqueeze(-1) * w).reshape(-1, w.shape[-1]).sum(0)
        total = imp.sum()
        out.append(imp / total if total > 0 else torch.full_like(imp, 1 / imp.numel()))
    return torch.stack(out).double().cpu().numpy()


def _node_reach(beta: torch.Tensor, rho, Xs: torch.Tensor) -> torch.Tensor:
    """:math:`P(x \\to i)` of every node ``([K,] N, 2**(D+1) - 1)`` for the splits
    ``beta`` ``([K,] 2**D - 1, L + 1)`` at the standardised rows ``Xs`` ``(N, L)``; rows
    with missing inputs (NaN) go by :func:`~pyro_trees.models.vart_mixture.route_log_probs`
    with ``rho`` ``([K,] 2**D - 1)``."""
    x1, missing = observed(with_bias(Xs))
    if missing is None:
        logits = -torch.matmul(x1, beta.transpose(-1, -2))  # ([K,] N, I)
        return trees.node_log_reach(trees.leaf_log_probs(logits)).exp()
    u = torch.matmul(x1, beta.transpose(-1, -2))
    log_left, log_right = route_log_probs(u, beta, missing, rho)
    return trees.splits_log_reach(log_left, log_right).exp()
