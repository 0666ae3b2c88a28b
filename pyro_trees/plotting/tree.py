"""The most probable tree of a fitted model, drawn as boxes and arrows (matplotlib only).

:func:`plot_tree` draws what ``export_text`` prints, with what sets a Bayesian tree
apart from a CART tree: how sure each rule and each leaf is. It reads

* a VaRT tree (:class:`~pyro_trees.estimators.VaRTRegressor`,
  :class:`~pyro_trees.estimators.VaRTClassifier` or a bare
  :class:`~pyro_trees.guides.VaRTGuide`): the most probable structure under the guide
  (:meth:`~pyro_trees.guides.VaRTGuide.most_probable_structure`); each split shows its
  dominant feature, the threshold at the other inputs' training means with its
  posterior credible interval (from the guide's Gaussian over the split weights) and
  the probability :math:`\\tilde\\gamma_i` that the node splits at all; each leaf shows
  the predictive mean and interval of its linear model at the inputs' training means
  (the leaf's posterior and its noise, calibrated by ``noise_factor_``), or its class
  probabilities;
* an RNN-Tree (:class:`~pyro_trees.estimators.RNNTreeRegressor`,
  :class:`~pyro_trees.estimators.RNNTreeClassifier`, a bare
  :class:`~pyro_trees.guides.RNNTreeGuide` or :class:`~pyro_trees.guides.RNNTree`): the
  single most likely tree (:meth:`~pyro_trees.guides.RNNTree.rules`); each split shows
  the band of inputs it routes unsure and the probability that it routes on its
  feature at all (:meth:`~pyro_trees.guides.RNNTree.rule_spread`); each leaf its value
  with the experts' noise interval, or its class probabilities.

Regions that no input reaches are left out, as ``export_text`` leaves them out. The
layout is scikit-learn's ``plot_tree``'s: the root on top, the side where the printed
test holds on the left, ``max_depth`` to cut the drawing short (deeper subtrees are
drawn as ``(...)``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["plot_tree"]

#: Monte Carlo draws behind the credible intervals of thresholds and leaves (seeded)
_DRAWS = 4000
_SPLIT_COLOUR = "#e8eef7"
_LEAF_COLOUR = "#eaf5e6"
_MORE_COLOUR = "#f2f2f2"


def plot_tree(
    tree,
    *,
    max_depth: int | None = None,
    feature_names=None,
    class_names=None,
    leaf_labels=None,
    level: float = 0.9,
    decimals: int = 2,
    fontsize: float | None = None,
    ax=None,
):
    """Draw the most probable tree of a fitted tree model with its uncertainty.

    The interface mirrors ``sklearn.tree.plot_tree``: a box per node, an arrow to each
    child, the side where the node's test holds on the left (the root's arrows are
    marked ``True`` and ``False``), matplotlib only.

    Split boxes of a VaRT tree read ``feature <= t``, ``90% [a, b]`` (the credible
    interval of the threshold under the guide, the other inputs at their training
    means), ``P(split) p`` (the probability that the node splits at all) and, for an
    oblique split, the dominant feature's share of the split weights. Leaf boxes read
    ``mean m`` and ``90% [a, b]`` (the predictive interval of the leaf's linear model
    at the inputs' training means), or one line per class with its probability. Split
    boxes of an RNN-Tree read ``feature <= t``, ``soft in [a, b]`` (the inputs routed
    with a probability between 5 % and 95 %, at ``level=0.9``) and ``P(feature) p``
    (the probability that the node routes on this feature). A tree fitted with missing
    values adds ``missing: >`` (or ``<=``) to each split box, the side a missing value of
    the feature takes (a VaRT tree's with its mean probability).

    :param tree: a fitted :class:`~pyro_trees.estimators.VaRTRegressor`,
        :class:`~pyro_trees.estimators.VaRTClassifier`,
        :class:`~pyro_trees.estimators.RNNTreeRegressor` or
        :class:`~pyro_trees.estimators.RNNTreeClassifier`, or a guide:
        :class:`~pyro_trees.guides.VaRTGuide` (thresholds and leaves in the units it was
        trained in, leaves at inputs zero), :class:`~pyro_trees.guides.RNNTreeGuide` or
        :class:`~pyro_trees.guides.RNNTree` (leaves named ``leaf k`` unless
        ``leaf_labels`` names them). An estimator with ``num_fits > 1`` shows its first
        fit (``guide_``), as ``export_text`` does. A forest is not one tree: see
        :func:`~pyro_trees.plotting.plot_importances`.
    :param max_depth: the deepest level drawn (the root is level 0); deeper subtrees
        are drawn as one ``(...)`` box. ``None``: the whole tree.
    :param feature_names: ``L`` names of the inputs (default: the estimator's
        ``feature_names_in_`` when it was fitted on a frame, else ``x_0``, ``x_1``, ...).
    :param class_names: names of the classes (default: the estimator's ``classes_``).
    :param leaf_labels: RNN-Tree only: ``2**D`` strings that replace the computed leaf
        texts, in leaf order (for a bare RNN-Tree, whose leaves' values live in the
        model).
    :param float level: probability of every interval drawn, in ``(0, 1)``.
    :param int decimals: digits of thresholds and values.
    :param fontsize: of the box texts; ``None``: smaller for wider trees.
    :param ax: the matplotlib axes to draw in; ``None``: a new figure sized to the tree.
    :returns: the list of node annotations (one per box drawn, root first), as
        scikit-learn's ``plot_tree`` returns.
    :raises TypeError: for an object that is not one of the above.
    :raises ValueError: for a forest, or ``feature_names`` of the wrong length.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTRegressor
    >>> from pyro_trees.plotting import plot_tree
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> est = VaRTRegressor(depth=2, num_steps=3, num_samples=5, random_state=0)
    >>> boxes = plot_tree(est.fit(X, X[:, 0]), feature_names=["a", "b"])
    >>> boxes[0].get_text().splitlines()[0].split(" <= ")[0] in ("a", "b")
    True
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    root = _structure(tree, feature_names, class_names, leaf_labels, level, decimals)
    return _draw(root, max_depth, fontsize, ax)


# ----------------------------------------------------------------------------- sources
def _structure(tree, feature_names, class_names, leaf_labels, level, decimals) -> dict:
    """The boxes to draw: nested ``{"lines": [...], "kind": ..., "children": [...]}``
    (children in drawing order, the side where the test holds first)."""
    from pyro_trees.guides import RNNTree, RNNTreeGuide, VaRTForestGuide, VaRTGuide

    kind = type(tree).__name__
    if isinstance(tree, VaRTForestGuide) or hasattr(tree, "num_trees"):
        raise ValueError(
            f"{kind} is a sum of trees, not one tree: plot_importances shows what it learnt"
        )
    vart = isinstance(tree, VaRTGuide) or isinstance(getattr(tree, "guide_", None), VaRTGuide)
    if vart and leaf_labels is not None:
        raise ValueError("leaf_labels names the leaves of an RNN-Tree; a VaRT tree's are computed")
    if isinstance(tree, VaRTGuide):
        return _vart(tree, None, feature_names, class_names, leaf_labels, level, decimals)
    if isinstance(tree, RNNTreeGuide):
        tree = tree.tree
    if isinstance(tree, RNNTree):
        return _rnn(tree, None, feature_names, class_names, leaf_labels, level, decimals)
    guide = getattr(tree, "guide_", None)
    if isinstance(guide, VaRTGuide):
        return _vart(guide, tree, feature_names, class_names, leaf_labels, level, decimals)
    if isinstance(guide, RNNTreeGuide) and hasattr(tree, "rules_"):
        return _rnn(guide.tree, tree, feature_names, class_names, leaf_labels, level, decimals)
    if hasattr(tree, "get_params") and not hasattr(tree, "guide_"):
        from sklearn.exceptions import NotFittedError

        raise NotFittedError(f"This {kind} instance is not fitted yet: call fit first")
    raise TypeError(
        "plot_tree draws a fitted VaRTRegressor, VaRTClassifier, RNNTreeRegressor or "
        f"RNNTreeClassifier, or a VaRTGuide, RNNTreeGuide or RNNTree; got {kind}"
    )


def _names(est, given, width: int, default) -> list[str]:
    """``given`` names checked against ``width``, else the estimator's, else ``default``."""
    if given is None and est is not None:
        given = getattr(est, "feature_names_in_", None)
    if given is None:
        return [default(j) for j in range(width)]
    given = [str(g) for g in given]
    if len(given) != width:
        raise ValueError(f"{len(given)} names given for {width} inputs")
    return given


def _class_names(est, given, width: int) -> list[str]:
    if given is None and est is not None:
        given = getattr(est, "classes_", None)
    if given is None:
        return [str(k) for k in range(width)]
    given = [str(g) for g in given]
    if len(given) != width:
        raise ValueError(f"{len(given)} class names given for {width} classes")
    return given


def _interval(lo: float, hi: float, level: float, decimals: int) -> str:
    def f(v: float) -> str:
        return f"{v:.{decimals}f}" if math.isfinite(v) else ("inf" if v > 0 else "-inf")

    return f"{level:.0%} [{f(lo)}, {f(hi)}]"


def _quantiles(draws: torch.Tensor, level: float) -> tuple[float, float]:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=draws.dtype)
    lo, hi = torch.quantile(draws, q, dim=0).tolist()
    return lo, hi


def _class_lines(probs, names: list[str]) -> list[str]:
    """One line per class (the four likeliest when there are more, then ``...``)."""
    order = np.argsort(-np.asarray(probs), kind="stable")
    shown = sorted(order[:4].tolist()) if len(order) > 4 else range(len(order))
    lines = [f"{names[k]}: {float(probs[k]):.2f}" for k in shown]
    return lines + (["..."] if len(order) > 4 else [])


@torch.no_grad()
def _vart(guide, est, feature_names, class_names, leaf_labels, level, decimals) -> dict:
    """The boxes of a VaRT guide's most probable tree (an estimator's, with its units)."""
    from pyro_trees.estimators import most_probable_tree
    from pyro_trees.models.vart_classification import VaRTClassification, class_logits

    model = guide.model
    n_feat = model.in_features
    names = _names(est, feature_names, n_feat, lambda j: f"x_{j}")
    x_scaler = None if est is None else est.x_scaler_
    xm = np.zeros(n_feat) if x_scaler is None else np.asarray(x_scaler.mean, dtype=float)
    xs = np.ones(n_feat) if x_scaler is None else np.asarray(x_scaler.scale, dtype=float)
    gen = torch.Generator().manual_seed(0)
    gamma = guide.split_probs().double().cpu()
    n_int = gamma.shape[0]
    b_loc = guide.beta_loc.detach().double().cpu()
    b_scale = guide.beta_scale.detach().double().cpu()
    t_loc = guide.theta_loc.detach().double().cpu()
    t_scale = guide.theta_scale.detach().double().cpu()
    s_loc = guide.log_sigma_loc.detach().double().cpu()
    s_scale = guide.log_sigma_scale.detach().double().cpu()
    eps = torch.randn(_DRAWS, 2, generator=gen, dtype=torch.float64)
    classifier = isinstance(model, VaRTClassification)
    if classifier:
        outputs = model.num_outputs
        classes = _class_names(est, class_names, model.num_classes)
        temperature = 1.0 if est is None else float(getattr(est, "temperature_", 1.0))
    else:
        ym = 0.0 if est is None else float(est.y_scaler_.mean)
        ysc = 1.0 if est is None else float(est.y_scaler_.scale)
        factor = 1.0 if est is None else float(getattr(est, "noise_factor_", 1.0))

    def fmt(v: float) -> str:
        return f"{v:.{decimals}f}"

    def leaf(i: int) -> dict:
        k = i - 1
        if classifier:
            width = model.in_features + 1
            loc = t_loc[k].reshape(outputs, width)[:, -1]
            if model.offset is not None:  # the base rate the leaves' values start from
                loc = loc + model.offset.double().cpu()
            scale = t_scale[k].reshape(outputs, width)[:, -1]
            z = torch.randn(_DRAWS, outputs, generator=gen, dtype=torch.float64)
            probs = class_logits(loc + scale * z, model.link).exp().mean(0)
            if temperature != 1.0:  # calibrate's temperature, as predict_proba applies it
                probs = (probs.clamp_min(1e-300).log() / temperature).softmax(-1)
            lines = _class_lines(probs.cpu().numpy(), classes)
        else:  # the leaf's linear model at the training means: its intercept, plus noise
            mean = ym + ysc * float(t_loc[k, -1])
            # the intercept, the log noise scale and the noise: independent normals
            sigma = (s_loc[k] + s_scale[k] * eps[:, 1]).exp() * factor
            z = torch.randn(_DRAWS, generator=gen, dtype=torch.float64)
            draws = ym + ysc * (t_loc[k, -1] + t_scale[k, -1] * eps[:, 0] + sigma * z)
            lines = [f"mean {fmt(mean)}", _interval(*_quantiles(draws, level), level, decimals)]
        if k < n_int:  # above the truncation the guide could still split it
            lines.append(f"P(split) {float(gamma[k]):.2f}")
        return {"lines": lines, "kind": "leaf", "children": []}

    def visit(node: dict) -> dict:
        if "children" not in node:
            return leaf(node["node"])
        i, j = node["node"], node["feature"]
        k = i - 1
        # the threshold along feature j with the other inputs at their means (0 here)
        z = torch.randn(_DRAWS, n_feat + 1, generator=gen, dtype=torch.float64)
        beta = b_loc[k] + b_scale[k] * z
        t = -beta[:, -1] / beta[:, j]
        lo, hi = _quantiles(xm[j] + xs[j] * t, level)
        lines = [f"{names[j]} <= {fmt(node['threshold'])}", _interval(lo, hi, level, decimals)]
        lines.append(f"P(split) {float(gamma[k]):.2f}")
        if n_feat > 1 and node["share"] < 0.995:
            lines[-1] += f", weight {node['share']:.0%}"
        if "rho" in node:  # the side a missing input mostly takes (heap right: rho)
            side = int(node["rho"] > 0.5)
            p = node["rho"] if side else 1.0 - node["rho"]
            lines.append(f"missing: {node['children'][side][0]} (p {p:.2f})")
        children = []
        for op, empty, sub in node["children"]:
            box = visit(sub)
            if empty:
                box["lines"].append("(empty at the means)")
            children.append((op, box))
        children.sort(key=lambda c: c[0] != "<=")  # the side where the test holds first
        return {"lines": lines, "kind": "split", "children": [c[1] for c in children]}

    return visit(most_probable_tree(guide, x_scaler))


@torch.no_grad()
def _rnn(tree, est, feature_names, class_names, leaf_labels, level, decimals) -> dict:
    """The boxes of an RNN-Tree's most likely tree (an estimator's, with its units)."""
    from pyro_trees.infer import isolated_params

    with isolated_params():
        rules = tree.rules() if est is None else est.rules_
        spread = tree.rule_spread(level)
    feature = rules.feature.cpu()
    n_feat = tree.in_features
    names = _names(est, feature_names, n_feat, lambda j: f"x_{j}")
    if est is None:  # the tree's own units (rules() and rule_spread() give them)
        mean, scale = torch.zeros(n_feat, dtype=torch.float64), torch.ones(n_feat)
    else:  # the estimator's tree reads standardised inputs
        mean = torch.as_tensor(est.x_scaler_.mean, dtype=torch.float64)
        scale = torch.as_tensor(est.x_scaler_.scale, dtype=torch.float64)
    mean, scale = mean[feature], scale.to(torch.float64)[feature]
    threshold = rules.threshold.cpu().double() * scale + mean
    lower = spread["lower"].cpu().double() * scale + mean
    upper = spread["upper"].cpu().double() * scale + mean
    prob = spread["feature_prob"].cpu()
    labels = _rnn_leaves(est, class_names, level, decimals)
    if leaf_labels is not None:
        labels = [[str(v)] for v in leaf_labels]

    def visit(node: dict) -> dict:
        if "leaf" in node:
            k = node["leaf"]
            lines = labels[k] if labels is not None else [f"leaf {k}"]
            return {"lines": list(lines), "kind": "leaf", "children": []}
        j = node["node"] - 1
        f = int(feature[j])
        children = sorted(node["children"], key=lambda c: c[0] not in ("<=", "<"))
        op = children[0][0]
        lines = [
            f"{names[f]} {op} {float(threshold[j]):.{decimals}f}",
            f"soft in [{float(lower[j]):.{decimals}f}, {float(upper[j]):.{decimals}f}]",
            f"P(feature) {float(prob[j]):.2f}",
        ]
        if show_missing:  # the side a missing value of the feature takes
            side = int(bool(rules.missing_right[j]))
            sides = dict(zip(node["sides"], node["children"], strict=True))
            lines.append(f"missing: {sides[side][0]}")
        return {"lines": lines, "kind": "split", "children": [visit(c[1]) for c in children]}

    # an estimator's tree routes missing values when its fit saw some
    show_missing = rules.missing_right is not None and getattr(tree, "missing", False)
    return visit(rules._structure(missing=show_missing))


def _rnn_leaves(est, class_names, level, decimals):
    """Each leaf's lines for an RNN-Tree estimator (``None`` for a bare tree): the value
    in the units of ``y`` with the experts' noise interval, or the class
    probabilities."""
    if est is None:
        return None
    from pyro_trees.infer import isolated_params

    loc = est.leaf_loc_.double()  # (2**D, width), standardised
    if hasattr(est, "classes_"):
        names = _class_names(est, class_names, len(est.classes_))
        return [_class_lines(p.cpu().numpy(), names) for p in loc.softmax(-1)]
    with isolated_params():
        noise = est.model_.scale().detach().double().cpu()
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor((1 + level) / 2)))
    value = est.y_scaler_.inverse(loc.cpu().numpy())
    half = z * est.y_scaler_.inverse_scale(noise.cpu().numpy())
    out = []
    for row in np.atleast_2d(value):
        if row.shape[0] == 1:
            lo, hi = row[0] - half[0], row[0] + half[0]
            out.append([f"mean {row[0]:.{decimals}f}", _interval(lo, hi, level, decimals)])
        else:
            out.append(["mean " + ", ".join(f"{v:.{decimals}f}" for v in row)])
    return out


# ------------------------------------------------------------------------------ drawing
def _draw(root: dict, max_depth, fontsize, ax) -> list:
    """Lay the boxes out as scikit-learn does (leaves evenly spread, each parent above
    the middle of its children) and draw them."""
    if max_depth is not None and int(max_depth) < 0:
        raise ValueError(f"max_depth must be >= 0 or None, got {max_depth}")
    placed: list = []  # (box, depth, x, parent index)
    count = [0]

    def place(box: dict, depth: int, parent) -> float:
        index = len(placed)
        if max_depth is not None and depth > int(max_depth):
            box = {"lines": ["(...)"], "kind": "more", "children": []}
        placed.append([box, depth, 0.0, parent])
        if not box["children"]:
            x = float(count[0])
            count[0] += 1
        else:
            xs = [place(child, depth + 1, index) for child in box["children"]]
            x = (xs[0] + xs[-1]) / 2
        placed[index][2] = x
        return x

    place(root, 0, None)
    n_leaves, levels = count[0], max(p[1] for p in placed) + 1
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(max(4.0, 1.8 * n_leaves), 0.3 + 1.1 * levels))
    if fontsize is None:
        fontsize = max(5.0, min(9.0, 3.5 + 18.0 / n_leaves))
    colours = {"split": _SPLIT_COLOUR, "leaf": _LEAF_COLOUR, "more": _MORE_COLOUR}

    def where(p) -> tuple[float, float]:
        return (p[2] + 0.5) / n_leaves, 1.0 - (p[1] + 0.5) / levels

    artists = []
    for p in placed:
        box, parent = p[0], p[3]
        style = {
            "ha": "center",
            "va": "center",
            "fontsize": fontsize,
            "bbox": {"boxstyle": "round", "fc": colours[box["kind"]], "ec": "0.35"},
            "xycoords": "axes fraction",
            "zorder": 2,
        }
        text = "\n".join(box["lines"])
        if parent is None:
            artists.append(ax.annotate(text, where(p), **style))
            continue
        arrow = {
            "arrowstyle": "<-",
            "color": "0.35",
            "shrinkA": 0,
            "shrinkB": 0,
            "patchB": artists[parent].get_bbox_patch(),  # ends at the parent's box
        }
        artists.append(
            ax.annotate(
                text,
                where(placed[parent]),
                xytext=where(p),
                textcoords="axes fraction",
                arrowprops=arrow,
                **style,
            )
        )
    root_children = [p for p in placed if p[3] == 0]
    if len(root_children) == 2:  # as scikit-learn marks them
        (x0, y0) = where(placed[0])
        for p, label in zip(root_children, ("True", "False"), strict=True):
            x1, y1 = where(p)
            ax.text(
                (x0 + x1) / 2,
                (y0 + y1) / 2,
                label,
                ha="right" if label == "True" else "left",
                va="center",
                fontsize=fontsize * 0.9,
                transform=ax.transAxes,
                color="0.3",
            )
    ax.set_axis_off()
    return artists
