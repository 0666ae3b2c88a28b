"""VaRT's mixture of leaves (eq. 27): the Gaussian mixture a tree gives each input row,
for one tree, a batch of trees, a forest, or posterior trees cut to their leaves.

A fitted guide's posterior predictive is a mixture over its draws: :func:`stack_trees`
stacks ``S`` draws into ``S`` trees, :func:`leaf_tree` cuts them to their leaves, and
:func:`row_mixtures` gives each row its ``S K`` Gaussians (the estimators' intervals and
quantiles come from there, :func:`~pyro_trees.distributions.row_mixture_quantiles`).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023 (Sec. 3).
"""

from __future__ import annotations

import math

import pyro.distributions as dist
import torch
import torch.nn.functional as F

from pyro_trees import trees

__all__ = [
    "gaussian",
    "leaf_mixtures",
    "leaf_tree",
    "missing_share",
    "mixture_params",
    "observed",
    "route_log_probs",
    "row_mixtures",
    "stack_trees",
    "tree_likelihood",
    "tree_mean",
    "with_bias",
]


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """Append a column of ones, the split and leaf intercepts.

    :param x: ``(..., L)``.
    :returns: ``(..., L + 1)``.
    """
    return torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], dim=-1)


def observed(x: torch.Tensor):
    """The inputs with every missing value (NaN) read as 0, the standardised mean, and
    where they were missing.

    :param x: ``(..., L)``, NaN where missing.
    :returns: ``(x0, missing)``: ``x`` itself and ``None`` when nothing is missing (so
        that complete inputs take exactly the arithmetic they always took), else ``x``
        with zeros for NaN and the bool mask ``(..., L)``.

    Inside a program being compiled (``torch.compiler.is_compiling()``) the inputs are
    taken as complete, without the check: a compiled program cannot branch on the data,
    and the losses of :mod:`pyro_trees.infer.compiled` compile only for inputs they
    have checked to be complete.
    """
    if torch.compiler.is_compiling():
        return x, None
    missing = torch.isnan(x)
    if not bool(missing.any()):
        return x, None
    return torch.where(missing, torch.zeros_like(x), x), missing


def missing_share(beta: torch.Tensor, missing: torch.Tensor) -> torch.Tensor:
    r"""The share :math:`m_i(x)` of each split's weight that falls on the missing inputs
    of each row: :math:`\sum_{j \in M(x)} \beta_{ij}^2 / \sum_{j \le L} \beta_{ij}^2`
    (the intercept left out), the share of the variance of :math:`\beta_i^\top x` that
    the missing inputs carry for standardised, uncorrelated inputs. A split with no weight
    on any input has share 0.

    :param beta: ``B + (J, L + 1)`` split weights, the intercept last.
    :param missing: bool ``(N, L)`` (or ``(N, L + 1)`` with the intercept column).
    :returns: ``B + (N, J)`` in ``[0, 1]``.
    """
    w = beta[..., :-1].square()
    miss = missing[..., : w.shape[-1]].to(w.dtype)
    num = torch.matmul(miss, w.transpose(-1, -2))
    den = w.sum(-1).unsqueeze(-2)
    return (num / den.clamp_min(torch.finfo(w.dtype).tiny)).clamp(0.0, 1.0)


def route_log_probs(u: torch.Tensor, beta: torch.Tensor, missing, rho):
    """``(log P(left), log P(right))`` ``B + (N, J)`` at every split of ``beta``
    ``B + (J, L + 1)`` for rows whose inputs are missing where ``missing`` ``(N, L)``
    says: :func:`pyro_trees.trees.split_log_probs` with the share of
    :func:`missing_share`, the one routing rule of every VaRT tree and forest.

    :param u: ``B + (N, J)``, :math:`\\beta^\\top x` over the inputs with missing values at 0.
    :param rho: ``B + (J,)``, the splits' probabilities of sending a missing value right.
    :raises ValueError: when inputs are missing and ``rho`` is ``None``.
    """
    if missing is None:
        return trees.split_log_probs(u)
    if rho is None:
        raise ValueError(
            "x has missing values (NaN) but the tree has no 'rho' (where a missing value "
            "goes); build the model with missing=True"
        )
    return trees.split_log_probs(u, missing_share(beta, missing), rho.unsqueeze(-2))


def log_leaf_weights(tree: dict, x1: torch.Tensor) -> torch.Tensor:
    """:math:`\\log \\kappa_i + \\log P(x \\to i)` of every node of ``tree`` (a
    :meth:`~pyro_trees.models.VaRT.sample_tree` output, batch shape ``B``, ``M`` nodes) at
    the inputs ``x1`` ``(N, L + 1)`` (intercept column included; NaN where an input is
    missing, routed by :func:`route_log_probs` with the tree's ``rho``): ``B + (N, M)``,
    ``-inf`` for absent nodes."""
    log_kappa = tree["log_exist"] + torch.log1p(-tree["split"])
    beta = tree["beta"]
    x1, missing = observed(x1)
    if missing is not None and beta is not None:
        u = torch.einsum("...jk,nk->...nj", beta, x1)
        log_left, log_right = route_log_probs(u, beta, missing, tree.get("rho"))
        return log_kappa.unsqueeze(-2) + trees.splits_log_reach(log_left, log_right)
    if beta is None:
        log_reach = x1.new_zeros(x1.shape[:1] + (1,))
    else:
        # node logit = log-odds of going right = -beta^T x (beta^T x routes left).
        node_logits = -torch.einsum("...jk,nk->...nj", beta, x1)
        log_reach = trees.node_log_reach(trees.leaf_log_probs(node_logits))
    return log_kappa.unsqueeze(-2) + log_reach


def mixture_params(tree: dict, x1: torch.Tensor):
    """Mixture logits, component means and scales of eq. 27 for inputs ``x1``.

    :param tree: output of :meth:`~pyro_trees.models.VaRT.sample_tree` (batch shape ``B``, ``M``
        nodes).
    :param x1: inputs with the intercept column, ``(N, L + 1)`` (NaN where missing:
        routed by the tree's ``rho``, read as 0 by the leaves).
    :returns: ``(logits, means, sigma)`` of shapes ``B + (N, M)``; ``logits`` is
        :math:`\\log\\kappa_i + \\log P(x \\to i)` (``-inf`` for absent nodes).
    """
    logits = log_leaf_weights(tree, x1)
    x1, _ = observed(x1)
    means = torch.einsum("...jk,nk->...nj", tree["theta"], x1)
    sigma = tree["log_sigma"].exp().unsqueeze(-2).expand(means.shape)
    return logits, means, sigma


def tree_likelihood(tree: dict, x: torch.Tensor) -> dist.MixtureSameFamily:
    r"""The likelihood of eq. 27 under ``tree``: for each input row the Gaussian mixture
    :math:`\sum_i \kappa_i P(x \to i)\, \mathcal N(\theta_i^\top x, \sigma_i^2)`.

    :param tree: output of :meth:`~pyro_trees.models.VaRT.sample_tree` (batch shape ``B``).
    :param x: inputs ``(N, L)`` (without the intercept column).
    :returns: a ``MixtureSameFamily`` with batch shape ``B + (N,)``; put it inside a
        plate over the ``N`` rows.
    """
    logits, means, sigma = mixture_params(tree, with_bias(x))
    return dist.MixtureSameFamily(dist.Categorical(logits=logits), dist.Normal(means, sigma))


def tree_mean(tree: dict, x: torch.Tensor) -> torch.Tensor:
    r"""The regression function of ``tree`` at the rows of ``x``:
    :math:`f(x) = \sum_i \kappa_i P(x \to i)\, \theta_i^\top x`, the mean of
    :func:`tree_likelihood`.

    :param tree: output of :meth:`~pyro_trees.models.VaRT.sample_tree` (batch shape ``B``).
    :param x: inputs ``(N, L)`` (without the intercept column).
    :returns: ``B + (N,)``.
    """
    logits, means, _ = mixture_params(tree, with_bias(x))
    return (logits.softmax(-1) * means).sum(-1)


def gaussian(loc: torch.Tensor, scale: torch.Tensor) -> dist.TorchDistribution:
    """``Normal(loc, scale).to_event(1)`` for standard deviations ``scale`` of the shape
    of ``loc``, ``MultivariateNormal(loc, scale_tril=scale)`` for Cholesky factors."""
    if scale.dim() == loc.dim():
        return dist.Normal(loc, scale).to_event(1)
    return dist.MultivariateNormal(loc, scale_tril=scale)


def row_mixtures(leaf: dict, x: torch.Tensor):
    """The posterior predictive mixtures of the rows ``x`` under ``S`` posterior trees:
    one Gaussian per tree and leaf, in double precision. Over trees and leaves together
    the weights are ``exp(log_w) / S``.

    :param dict leaf: posterior trees cut to their leaves (:func:`leaf_tree`), or a
        posterior forest (see :func:`leaf_mixtures`).
    :param x: inputs ``(n, L)`` (NaN where missing).
    :returns: ``(log_w, loc, scale)``, each ``(S, n, K)``: log leaf weights normalised
        within each tree, means and standard deviations.
    """
    logits, loc, log_scale = leaf_mixtures(leaf, x)
    logits, loc = logits.double(), loc.double()
    scale = log_scale.double().exp().expand_as(loc)
    return logits - logits.logsumexp(-1, keepdim=True), loc, scale


def stack_trees(samples: dict, depth: int) -> dict:
    """A VaRT guide's ``S`` posterior draws as ``S`` trees in the format of
    :meth:`~pyro_trees.models.VaRT.sample_tree`, batch shape ``(S,)``.

    :param dict samples: draws by site name, leading dimension ``S``: ``split_d``,
        ``beta_d``, ``theta_d``, ``log_sigma_d`` and, where present, ``rho_d``
        (a :class:`pyro.infer.Predictive` of the guide returns them).
    :param int depth: the guide's truncation depth ``D``.
    :returns: ``split``, ``log_exist``, ``log_sigma`` ``(S, 2**(D+1) - 1)``, ``beta``
        ``(S, 2**D - 1, L + 1)``, ``theta`` ``(S, 2**(D+1) - 1, L + 1)`` and, with the
        ``rho_d`` sites, ``rho`` ``(S, 2**D - 1)``.
    """
    num = samples["split_0"].shape[0]
    width = samples["theta_0"].shape[-1]
    split = [samples[f"split_{d}"].reshape(num, -1) for d in range(depth + 1)]
    log_exist = [split[0].new_zeros(num, 1)]
    for d in range(depth):
        log_exist.append((log_exist[-1] + split[d].log()).repeat_interleave(2, dim=-1))
    out = {
        "split": torch.cat(split, -1),
        "log_exist": torch.cat(log_exist, -1),
        "beta": torch.cat(
            [
                samples[f"beta_{d}"].reshape(num, -1, samples[f"beta_{d}"].shape[-1])
                for d in range(depth)
            ],
            -2,
        ),
        "theta": torch.cat(
            [samples[f"theta_{d}"].reshape(num, -1, width) for d in range(depth + 1)], -2
        ),
        "log_sigma": torch.cat(
            [samples[f"log_sigma_{d}"].reshape(num, -1) for d in range(depth + 1)], -1
        ),
    }
    if "rho_0" in samples:
        out["rho"] = torch.cat([samples[f"rho_{d}"].reshape(num, -1) for d in range(depth)], -1)
    return out


def leaf_tree(tree: dict) -> dict:
    """The stacked trees of :func:`stack_trees` cut to the ``K`` nodes that are a leaf of
    at least one of them (the other nodes have mixture weight zero in every tree), the
    input of :func:`leaf_mixtures` and :func:`row_mixtures`.

    :param dict tree: ``S`` trees of :func:`stack_trees`.
    :returns: ``keep`` ``(K,)`` the kept heap positions, ``log_kappa`` ``(S, K)``
        (``-inf`` where a node is no leaf of that tree), ``theta`` ``(S, K, L + 1)`` and
        ``log_sigma`` ``(S, K)``; ``beta`` ``(S, 2**D - 1, L + 1)`` and ``rho``
        ``(S, 2**D - 1)`` (where present) as given.
    """
    log_kappa = tree["log_exist"] + torch.log1p(-tree["split"])
    keep = (log_kappa > -math.inf).any(0).nonzero().flatten()
    out = {
        "keep": keep,
        "log_kappa": log_kappa[:, keep],
        "beta": tree["beta"],
        "theta": tree["theta"][:, keep],
        "log_sigma": tree["log_sigma"][:, keep],
    }
    if "rho" in tree:
        out["rho"] = tree["rho"]
    return out


def leaf_mixtures(leaf: dict, x: torch.Tensor):
    """The mixtures of eq. 27 for rows ``x`` ``(n, L)`` under the trees of
    :func:`leaf_tree`, over their ``K`` leaf nodes: unnormalised logits, means and
    log scales ``(S, n, K)`` (the values :func:`mixture_params`
    gives at those nodes; its other nodes have weight zero).

    :param dict leaf: ``S`` trees of :func:`leaf_tree`, or a posterior forest.
    :param x: inputs ``(n, L)`` (NaN where missing).
    :returns: ``(logits, loc, log_scale)``, ``(S, n, K)`` each (``log_scale``
        ``(S, 1, K)``, broadcastable).

    Posterior forests (a dict with ``forest``, trees of batch shape ``(S, K)``, and
    ``log_sigma`` ``(S,)``) give one component per draw: zero logits, the forest's mean
    (:func:`~pyro_trees.models.forest_mean`) and its noise, ``(S, n, 1)``, ``(S, 1, 1)``.

    The routing is computed top-down, level by level: a node's log reach is its
    parent's plus ``logsigmoid(beta^T x)`` (left child) or ``logsigmoid(-beta^T x)``;
    rows with missing inputs (NaN) go by :func:`route_log_probs` with the trees'
    ``rho``, and their leaves read a missing input as 0."""
    if "forest" in leaf:
        means = forest_mean(leaf["forest"], x).unsqueeze(-1)
        return torch.zeros_like(means), means, leaf["log_sigma"][:, None, None]
    x1, missing = observed(with_bias(x))
    beta = leaf["beta"]
    num, n = leaf["log_kappa"].shape[0], x1.shape[0]
    levels = [x1.new_zeros(num, n, 1)]
    if missing is not None and beta is not None and beta.shape[-2] > 0:
        u = torch.matmul(x1, beta.transpose(-1, -2))
        log_left, log_right = route_log_probs(u, beta, missing, leaf.get("rho"))
        levels = [trees.splits_log_reach(log_left, log_right)]
    elif beta is not None and beta.shape[-2] > 0:
        u = torch.matmul(x1, beta.transpose(-1, -2))  # (S, n, 2**D - 1): beta^T x
        depth = (beta.shape[-2] + 1).bit_length() - 1
        for d in range(depth):
            ud = u[..., (1 << d) - 1 : (1 << (d + 1)) - 1]
            pair = torch.stack([F.logsigmoid(ud), F.logsigmoid(-ud)], -1) + levels[-1].unsqueeze(-1)
            levels.append(pair.flatten(-2))
    log_reach = torch.cat(levels, -1)[..., leaf["keep"]]
    logits = leaf["log_kappa"].unsqueeze(-2) + log_reach
    means = torch.matmul(x1, leaf["theta"].transpose(-1, -2))
    return logits, means, leaf["log_sigma"].unsqueeze(-2)


def forest_mean(forest: dict, x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    r"""The regression function of a forest, :math:`f(x) = \sum_k f_k(x)`, with
    :math:`f_k(x) = \sum_i \kappa_{ki} P_k(x \to i)\, \theta_{ki}^\top x` the
    :func:`~pyro_trees.models.tree_mean` of tree :math:`k`, computed for all trees at
    once in probability space (the weights :math:`\kappa_{ki} P_k(x \to i)` sum to one
    over the nodes of each tree).

    :param forest: per-tree tensors in the format of
        :meth:`~pyro_trees.models.VaRT.sample_tree` with batch shape ``B + (K,)``
        (:func:`forest_tree` builds one from the sites).
    :param x: inputs ``(N, L)``, or ``batch + (N, L)`` with a batch that broadcasts
        against ``B`` (NaN where missing: routed by the trees' ``rho``
        ``B + (K, 2**D - 1)``, read as 0 by the leaves).
    :param bool keepdim: keep the summed tree dimension (size 1), as the model's sites do.
    :returns: ``B + (N,)`` (``B + (1, N)`` with ``keepdim``).
    :raises ValueError: if ``x`` has fewer than two dims or not the forest's ``L``
        inputs, or is not of the forest's dtype.
    """
    beta, theta = forest["beta"], forest["theta"]
    if x.dim() < 2 or x.shape[-1] != beta.shape[-1] - 1:
        raise ValueError(
            f"x must have shape (N, {beta.shape[-1] - 1}) (the forest's inputs); "
            f"got {tuple(x.shape)}"
        )
    if x.dtype != beta.dtype:
        raise ValueError(
            f"x is {x.dtype} but the forest's tensors are {beta.dtype}: convert x "
            f"(x.to({beta.dtype})) or the forest"
        )
    x1, missing = observed(with_bias(x))
    if missing is None and x1.dim() == 2:
        return _complete_forest_mean(forest, x1, keepdim)
    z = torch.matmul(x1, beta.transpose(-1, -2))  # B + (K, N, 2**D - 1): log-odds of left
    if missing is None:  # log P(x -> i): the sum over the ancestors of logsigmoid(+-z)
        log_reach = trees.logits_log_reach(z)
    else:  # the same sum with each side's own log-probability (route_log_probs)
        left, right = trees.ancestor_paths(beta.shape[-2], z.dtype, z.device)
        log_left, log_right = route_log_probs(z, beta, missing, forest.get("rho"))
        log_reach = torch.matmul(log_left, left) + torch.matmul(log_right, right)
    weight = (log_reach + forest["log_exist"].unsqueeze(-2)).exp()
    weight = weight * (1 - forest["split"]).unsqueeze(-2)  # kappa P(x -> i), B + (K, N, M)
    leaf = torch.matmul(weight, theta)  # B + (K, N, L + 1): the routed leaf weights
    return (leaf * x1).sum(-1).sum(-2, keepdim=keepdim)


def _complete_forest_mean(forest: dict, x1: torch.Tensor, keepdim: bool) -> torch.Tensor:
    r""":func:`forest_mean` of complete rows ``x1`` ``(N, L + 1)`` (the bias column
    appended), in probability space with the nodes first and the rows last: every split
    of every tree is one row of a single product with ``x1``'s transpose, and so is every
    leaf, its weight :math:`\kappa_{ki}` folded into :math:`\theta_{ki}`; the routing
    multiplies each level's reach by :math:`\sigma(\beta^\top x)` on the left and takes
    the rest on the right, over tensors ``(2**d,) + B + (K, N)``, and each level's nodes
    are summed as it is reached. The same values as the general path (up to rounding).
    On a CPU, where the products are batched over the trees with inner sizes of ``L + 1``
    and ``2**D - 1``, it takes about 0.4 of that path's time forward and backward: each
    level is a contiguous block, and both products and their gradients read contiguous
    operands."""
    beta, theta = forest["beta"], forest["theta"]
    width, n = x1.shape[-1], x1.shape[0]
    trees_shape = beta.shape[:-2]  # B + (K,)
    n_int, m = beta.shape[-2], theta.shape[-2]
    depth = (n_int + 1).bit_length() - 1
    xt = x1.t().contiguous()  # (L + 1, N)
    z = torch.matmul(beta.movedim(-2, 0).reshape(-1, width), xt)
    left = torch.sigmoid(z).view((n_int,) + trees_shape + (n,))  # P(left) at each split
    kappa = forest["log_exist"].exp() * (1 - forest["split"])  # B + (K, M)
    weights = (kappa.unsqueeze(-1) * theta).movedim(-2, 0).reshape(-1, width)
    leaf = torch.matmul(weights, xt).view((m,) + trees_shape + (n,))
    lefts = left.split([1 << d for d in range(depth)], 0)
    leaves = leaf.split([1 << d for d in range(depth + 1)], 0)
    f = leaves[0].sum(0)  # the root, reached with probability 1
    reach = None  # P(x -> i) of level d's nodes, (2**d,) + B + (K, N)
    for d in range(depth):
        to_left = lefts[0] if reach is None else reach * lefts[d]
        rest = 1 - to_left if reach is None else reach - to_left
        reach = torch.stack([to_left, rest], 1).flatten(0, 1)
        f = f + (reach * leaves[d + 1]).sum(0)
    f = f.sum(-2)  # B + (N,)
    return f.unsqueeze(-2) if keepdim else f
