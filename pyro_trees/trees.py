"""Binary-tree algebra of every tree model (over 600 lines: pickles name its DecisionRules).

Conventions (used by the HME, the Bayesian HME and VaRT alike):

* **Heap numbering.** The root is node ``1``; node ``i`` has the left child ``2i``
  and the right child ``2i + 1``. Internal nodes at depth ``d`` are
  ``2**d, ..., 2**(d+1) - 1``; the leaves of a complete tree of depth ``D`` are
  ``2**D, ..., 2**(D+1) - 1``.
* **Leaf index.** Leaf ``l`` (``0 <= l < 2**D``) is heap node ``2**D + l``; the bits of
  ``l``, most significant first, are the routing decisions ``m_0, ..., m_{D-1}``
  (``1`` = go right).
* **Node tensors.** A tensor over internal nodes has trailing size ``2**D - 1``;
  position ``j`` holds heap node ``j + 1``, so depth ``d`` occupies the slice
  ``[2**d - 1, 2**(d+1) - 1)``. A *node logit* is the log-odds of going right.

Everything is computed in log space and never forms a ``2**D x 2**D`` object:
the leaf log-probabilities of a depth-16 tree in float32 do not underflow.

The hard rules of a fitted tree (:class:`DecisionRules`, :func:`route_by_rules`) would
make a module of their own, but estimators cache a :class:`DecisionRules` in their state,
and a pickle names a class by its module: moved, they would no longer load. So this
module holds both and runs past 600 lines.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "DecisionRules",
    "aggregate_right_probs",
    "ancestor_paths",
    "check_depth",
    "conditional_right_logits",
    "depth_logits_to_node_logits",
    "depth_of",
    "hard_route",
    "leaf_bits",
    "leaf_log_probs",
    "left_child",
    "logits_log_reach",
    "node_log_reach",
    "num_internal",
    "num_leaves",
    "parent",
    "require_memory",
    "right_child",
    "route_by_rules",
    "split_log_probs",
    "splits_log_reach",
]


def num_leaves(depth: int) -> int:
    """Number of leaves ``2**depth`` of a complete binary tree."""
    return 1 << depth


def num_internal(depth: int) -> int:
    """Number of internal (decision) nodes ``2**depth - 1``."""
    return (1 << depth) - 1


def parent(node: int) -> int:
    """Heap index of the parent of ``node`` (``node >= 2``)."""
    if node < 2:
        raise ValueError(f"node {node} has no parent (the root is 1)")
    return node // 2


def left_child(node: int) -> int:
    """Heap index ``2 * node`` of the left child."""
    return 2 * node


def right_child(node: int) -> int:
    """Heap index ``2 * node + 1`` of the right child."""
    return 2 * node + 1


def depth_of(node: int) -> int:
    """Depth of heap node ``node`` (the root has depth 0)."""
    if node < 1:
        raise ValueError(f"heap nodes start at 1, got {node}")
    return node.bit_length() - 1


def leaf_bits(depth: int, device=None) -> torch.Tensor:
    """Routing decisions of every leaf.

    :returns: long tensor of shape ``(2**depth, depth)``; row ``l`` holds
        ``m_0, ..., m_{depth-1}`` of leaf ``l`` (1 = right).
    """
    leaves = torch.arange(num_leaves(depth), device=device)
    shifts = torch.arange(depth - 1, -1, -1, device=device)
    return (leaves.unsqueeze(-1) >> shifts) & 1


def _available_memory_bytes(device: torch.device | None) -> int:
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device(device)
        free, _ = torch.cuda.mem_get_info(device)
        # Blocks PyTorch's caching allocator holds but does not use are free to it too:
        # without them a check during training would see a full device.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0))
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * 2**30


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def check_depth(
    depth,
    num_points: int = 1,
    *,
    width: int = 1,
    dtype: torch.dtype = torch.float32,
    device=None,
    copies: int = 4,
    max_bytes: int | None = None,
    what: str | None = None,
) -> int:
    """Validate a tree depth before anything of size ``2**depth`` is allocated.

    The exact sums over leaves hold tensors of shape ``(num_points, 2**depth, width)``;
    about ``copies`` of them are alive at once during a backward pass. Modules that
    allocate per-leaf or per-node parameters pass ``num_points=1``, their values per
    leaf as ``width`` and ``copies=4`` (value, gradient and two optimiser moments).

    :param int depth: the tree depth; must be an integer ``>= 1``.
    :param int num_points: points processed at once (a minibatch).
    :param int width: trailing size per leaf (outputs or classes).
    :param max_bytes: memory budget; default: the device's free memory (CUDA)
        or the machine's physical memory (CPU). A need of at most 1 MiB is accepted
        without asking the device.
    :param str what: what would be allocated, for the error message; default: the
        exact sum over leaves for ``num_points`` points.
    :returns: ``depth`` as an ``int``.
    :raises ValueError: naming the cause and, for too deep a tree, the memory it needs.
    """
    if isinstance(depth, bool) or not isinstance(depth, int | torch.SymInt):
        if not (hasattr(depth, "__index__")):
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        depth = depth.__index__()
    if depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = float(copies) * max(num_points, 1) * float(2**depth) * max(width, 1) * itemsize
    if max_bytes is None and need <= 2**20:
        return depth  # too small to matter: spare the device query (called per step)
    if what is None:
        what = f"the exact sum over leaves for {num_points:,} points"
        advice = "Use a smaller depth or smaller minibatches (subsample_size)."
    else:
        advice = "Use a smaller depth."
    require_memory(
        need,
        what,
        advice,
        head=f"depth {depth} means 2**{depth} = {2**depth:,} leaves; ",
        device=device,
        max_bytes=max_bytes,
    )
    return depth


def require_memory(
    need: float,
    what: str,
    advice: str,
    *,
    head: str = "",
    device=None,
    max_bytes: int | None = None,
) -> None:
    """Raise a ``ValueError`` when ``need`` bytes exceed the memory budget, saying how
    much ``what`` would need and how much there is (the check behind
    :func:`check_depth`, for callers that count their memory themselves).

    :param float need: the bytes needed.
    :param str what: what needs them (``"training on 256 rows at a time"``).
    :param str advice: how to need less, a sentence (``"Use a smaller depth."``).
    :param str head: the start of the message: where the size comes from
        (``"depth 30 means 2**30 = 1,073,741,824 leaves; "``).
    :param device: whose memory: a CUDA device's free memory (with the blocks PyTorch
        has cached but does not use), else the machine's physical memory.
    :param max_bytes: a budget to use instead of the device's memory.
    """
    budget = _available_memory_bytes(device) if max_bytes is None else max_bytes
    if need > budget:
        raise ValueError(
            f"{head}{what} would need about {_format_bytes(need)} but only "
            f"{_format_bytes(budget)} is available. {advice}"
        )


def depth_logits_to_node_logits(depth_logits: torch.Tensor) -> torch.Tensor:
    """Spread per-depth logits to every node of that depth.

    :param depth_logits: shape ``batch_shape + (D,)``; the same log-odds at
        every node of a depth (a path-independent tree).
    :returns: node logits of shape ``batch_shape + (2**D - 1,)``.
    """
    depth = depth_logits.shape[-1]
    repeats = torch.tensor([1 << d for d in range(depth)], device=depth_logits.device)
    return torch.repeat_interleave(depth_logits, repeats, dim=-1)


def leaf_log_probs(node_logits: torch.Tensor) -> torch.Tensor:
    r"""Log-probability of reaching every leaf from per-node log-odds.

    .. math:: \log P(\ell) = \sum_{d=0}^{D-1} \log\sigma\big((2 m_d(\ell) - 1)\, z_{a_d(\ell)}\big)

    where :math:`a_d(\ell)` is the ancestor of leaf :math:`\ell` at depth :math:`d`.
    Computed depth by depth (each step vectorised over all nodes of that depth)
    with ``logsigmoid``, so nothing underflows.

    :param node_logits: shape ``batch_shape + (2**D - 1,)`` in heap order.
    :returns: shape ``batch_shape + (2**D,)``; ``logsumexp`` over the last dim is 0.
    """
    n = node_logits.shape[-1]
    depth = (n + 1).bit_length() - 1
    if n < 1 or (1 << depth) - 1 != n:
        raise ValueError(f"node_logits must have 2**D - 1 entries in its last dim, got {n}")
    batch = node_logits.shape[:-1]
    log_reach = node_logits.new_zeros(batch + (1,))
    for d in range(depth):
        z = node_logits[..., (1 << d) - 1 : (1 << (d + 1)) - 1]
        left = log_reach + F.logsigmoid(-z)
        right = log_reach + F.logsigmoid(z)
        log_reach = torch.stack([left, right], dim=-1).reshape(batch + (1 << (d + 1),))
    return log_reach


def split_log_probs(u: torch.Tensor, share=None, rho=None):
    r"""Log-probabilities of going left and right at soft splits whose inputs may be
    missing: the routing rule of every VaRT tree.

    A split with log-odds :math:`u = \beta^\top x` of going left sends :math:`x` right
    with probability :math:`\sigma(-u)`. When some inputs of :math:`x` are missing,
    :math:`u` is computed with them at 0 and the split mixes that rule with its own
    probability :math:`\rho` of sending a missing value right,

    .. math:: P(\text{right}) = (1 - m)\, \sigma(-u) + m\, \rho, \qquad
              P(\text{left}) = (1 - m)\, \sigma(u) + m\, (1 - \rho),

    with :math:`m \in [0, 1]` the share of the split's weight that falls on the missing
    inputs (``m = 0``: the plain rule; ``m = 1``: the split reads only missing inputs
    and sends right with probability :math:`\rho`). Computed in log space, with finite
    gradients at ``m = 0`` and ``m = 1``.

    :param u: ``(...)`` log-odds of going left.
    :param share: :math:`m`, broadcastable with ``u``, or ``None``: no missing input, and
        the result is exactly ``(logsigmoid(u), logsigmoid(-u))``.
    :param rho: :math:`\rho \in (0, 1)`, broadcastable with ``u`` (read only with
        ``share``).
    :returns: ``(log_left, log_right)``, each of the broadcast shape.
    """
    left, right = F.logsigmoid(u), F.logsigmoid(-u)
    if share is None:
        return left, right
    if rho is None:
        raise ValueError(
            "split_log_probs needs rho, the probability that a missing value goes right"
        )
    share = share.to(u.dtype)
    eps = torch.finfo(u.dtype).eps
    neg_inf = torch.full_like(share, -math.inf)
    observed = torch.where(share < 1, torch.log1p(-share.clamp(0.0, 1.0 - eps)), neg_inf)
    missing = torch.where(share > 0, share.clamp_min(torch.finfo(u.dtype).tiny).log(), neg_inf)
    rho = rho.to(u.dtype).clamp(eps, 1.0 - eps)
    log_left = torch.logaddexp(observed + left, missing + torch.log1p(-rho))
    log_right = torch.logaddexp(observed + right, missing + rho.log())
    return log_left, log_right


def splits_log_reach(log_left: torch.Tensor, log_right: torch.Tensor) -> torch.Tensor:
    """Log-probability of reaching every node from the log-probabilities of going left
    and right at every internal node, computed top-down level by level.

    :param log_left: ``batch_shape + (2**D - 1,)`` in heap order; ``log_right`` likewise.
    :returns: ``batch_shape + (2**(D+1) - 1,)``: position ``j`` is heap node ``j + 1``.
    """
    n = log_left.shape[-1]
    depth = (n + 1).bit_length() - 1
    if (1 << depth) - 1 != n:
        raise ValueError(f"the splits must have 2**D - 1 entries in their last dim, got {n}")
    shape = torch.broadcast_shapes(log_left.shape, log_right.shape)
    levels = [log_left.new_zeros(shape[:-1] + (1,))]
    for d in range(depth):
        sl = slice((1 << d) - 1, (1 << (d + 1)) - 1)
        pair = torch.stack([log_left[..., sl], log_right[..., sl]], -1) + levels[-1].unsqueeze(-1)
        levels.append(pair.flatten(-2))
    return torch.cat(levels, -1)


def ancestor_paths(n_int: int, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor matrices of a complete tree of ``n_int = 2**D - 1`` internal nodes,
    ``(left, right)``, each ``(n_int, 2**(D+1) - 1)`` in heap order: ``left[j, i] = 1``
    when node ``i + 1`` lies in the left subtree of internal node ``j + 1``, and
    ``right[j, i] = 1`` when it lies in the right one (their sum marks the proper
    ancestors). A sum over the ancestors of every node is then a product with them
    (:func:`logits_log_reach`). Cached per size, dtype and device: constants that every
    training step reads, built outside any ``inference_mode`` so that a pair first made
    there still enters a backward pass.

    :raises ValueError: if ``n_int`` is not ``2**D - 1`` for some ``D >= 1``.
    """
    n_int = int(n_int)
    if n_int < 1 or (n_int + 1) & n_int:
        raise ValueError(f"a complete tree has 2**D - 1 internal nodes, got {n_int}")
    cached = _ancestor_paths.__wrapped__ if torch.compiler.is_compiling() else _ancestor_paths
    return cached(n_int, dtype or torch.get_default_dtype(), device)


@functools.lru_cache(maxsize=64)
def _ancestor_paths(n_int: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    m = 2 * n_int + 1
    with torch.inference_mode(False):
        left = torch.zeros(n_int, m, dtype=dtype, device=device)
        right = torch.zeros(n_int, m, dtype=dtype, device=device)
        for i in range(2, m + 1):  # heap numbers; the parent of i is i // 2
            child, j = i, i // 2
            while j >= 1:
                (right if child % 2 else left)[j - 1, i - 1] = 1.0
                child, j = j, j // 2
    return left, right


def logits_log_reach(z: torch.Tensor) -> torch.Tensor:
    """:func:`splits_log_reach` of the splits' log-odds of going left ``z``
    ``batch_shape + (2**D - 1,)``: ``log P(x -> i)``, the sum over the ancestors of
    ``logsigmoid(z)`` on a left turn and ``logsigmoid(-z)`` on a right one, as two
    products with :func:`ancestor_paths` (on a CPU at a few hundred rows about 0.6 of the
    time of the level-by-level pass, forward and backward). Every summand is at most 0,
    so the sums do not cancel: float32 keeps its relative precision at any ``|z|``.
    Under ``torch.compile`` it is the level-by-level pass of the same two terms, whose
    elementwise steps the compiler fuses (and whose trace holds no construction of the
    matrices).

    :raises ValueError: if the last dimension of ``z`` is not ``2**D - 1``.
    :returns: ``batch_shape + (2**(D+1) - 1,)`` in heap order.
    """
    log_left, log_right = F.logsigmoid(z), F.logsigmoid(-z)
    if torch.compiler.is_compiling():
        return splits_log_reach(log_left, log_right)
    left, right = ancestor_paths(z.shape[-1], z.dtype, z.device)
    return torch.matmul(log_left, left) + torch.matmul(log_right, right)


def node_log_reach(leaf_log_prob: torch.Tensor) -> torch.Tensor:
    """Log-probability of reaching every node, from leaf log-probabilities.

    :param leaf_log_prob: shape ``batch_shape + (2**D,)``.
    :returns: shape ``batch_shape + (2**(D+1) - 1,)``; position ``j`` is heap node
        ``j + 1`` (internal nodes first, then the leaves).
    """
    levels = [leaf_log_prob]
    current = leaf_log_prob
    while current.shape[-1] > 1:
        pairs = current.reshape(current.shape[:-1] + (current.shape[-1] // 2, 2))
        current = torch.logsumexp(pairs, dim=-1)
        levels.append(current)
    return torch.cat(levels[::-1], dim=-1)


def conditional_right_logits(leaf_log_prob: torch.Tensor) -> torch.Tensor:
    r"""Log-odds of going right at every internal node, given that the node is reached.

    The conditional routing posterior of Antorán et al., App. C, eq. 23, recovered from
    a joint over paths by the product rule:

    .. math:: q(m_i = 1 \mid \text{reach } i, x) = \frac{q(\text{reach } 2i + 1 \mid x)}
              {q(\text{reach } i \mid x)},

    returned as the log-odds :math:`\log q(\text{reach } 2i+1) - \log q(\text{reach } 2i)`
    (the reach of node :math:`i` cancels). For leaf log-probabilities from per-node
    logits (:func:`leaf_log_probs`) this gives back those logits; a node reached with
    probability 0 gets ``nan``.

    :param leaf_log_prob: shape ``batch_shape + (2**D,)``.
    :returns: shape ``batch_shape + (2**D - 1,)`` in heap order.
    """
    log_reach = node_log_reach(leaf_log_prob)
    n_internal = leaf_log_prob.shape[-1] - 1
    return log_reach[..., 2::2] - log_reach[..., 1 : 2 * n_internal : 2]


def aggregate_right_probs(leaf_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Aggregate posterior of every internal node over a data set (App. C, eq. 24).

    .. math:: \alpha_i = \frac{\sum_n q(\text{reach } 2i + 1 \mid x_n)}
              {\sum_n q(\text{reach } i \mid x_n)}, \qquad
              \hat N_i = \sum_n q(\text{reach } i \mid x_n):

    the probability of going right at node :math:`i` with :math:`x` marginalised over
    the points, and the expected number of points that reach the node. A node that
    no point reaches (:math:`\hat N_i = 0`) gets :math:`\alpha_i = 0`.

    :param leaf_log_prob: ``batch_shape + (N, 2**D)`` per-point leaf log-probabilities
        (normalised); the points are the second-to-last dimension.
    :returns: ``(alpha, mass)``, each ``batch_shape + (2**D - 1,)`` in heap order.
    """
    log_reach = node_log_reach(leaf_log_prob)  # (..., N, 2**(D+1) - 1)
    n_internal = leaf_log_prob.shape[-1] - 1
    mass = log_reach[..., :n_internal].exp().sum(-2)  # sum_n P_n(i)
    right = log_reach[..., 2::2].exp().sum(-2)  # right children 2i + 1 of nodes 1..I
    return right / mass.clamp_min(torch.finfo(mass.dtype).tiny), mass


def hard_route(go_right: torch.Tensor) -> torch.Tensor:
    """Leaf reached by following hard decisions from the root.

    :param go_right: bool tensor ``batch_shape + (2**D - 1,)`` of per-node decisions.
    :returns: long tensor ``batch_shape`` of leaf indices in ``[0, 2**D)``.
    """
    n = go_right.shape[-1]
    depth = (n + 1).bit_length() - 1
    node = torch.zeros(go_right.shape[:-1] + (1,), dtype=torch.long, device=go_right.device)
    node += 1
    for _ in range(depth):
        bit = go_right.gather(-1, node - 1).long()
        node = 2 * node + bit
    return (node - (1 << depth)).squeeze(-1)


def route_by_rules(
    x: torch.Tensor,
    feature: torch.Tensor,
    threshold: torch.Tensor,
    greater: torch.Tensor,
    missing_right: torch.Tensor | None = None,
) -> torch.Tensor:
    """Route inputs down a hard tree of axis-aligned rules, in ``D`` gather steps.

    At internal node ``i`` an input goes right iff ``x[feature[i]] > threshold[i]``
    when ``greater[i]``, and iff ``x[feature[i]] < threshold[i]`` otherwise; a missing
    ``x[feature[i]]`` (NaN) goes right iff ``missing_right[i]`` (left without it).

    :param x: shape ``(N, L)``.
    :param feature: long ``(2**D - 1,)``; ``threshold``: ``(2**D - 1,)``; ``greater``: bool.
    :param missing_right: optional bool ``(2**D - 1,)``.
    :returns: long ``(N,)`` leaf indices.
    """
    n = feature.shape[-1]
    depth = (n + 1).bit_length() - 1
    node = torch.ones(x.shape[0], dtype=torch.long, device=x.device)
    for _ in range(depth):
        j = node - 1
        xv = x.gather(-1, feature[j].unsqueeze(-1)).squeeze(-1)
        thr = threshold[j].to(x.dtype)
        right = torch.where(greater[j], xv > thr, xv < thr)
        if missing_right is not None:
            right = torch.where(torch.isnan(xv), missing_right[j], right)
        node = 2 * node + right.long()
    return node - (1 << depth)


@dataclass(frozen=True)
class DecisionRules:
    """A hard binary tree of axis-aligned rules, in heap order.

    :ivar feature: long tensor ``(2**D - 1,)``: the input dimension tested at each node.
    :ivar threshold: tensor ``(2**D - 1,)``: the threshold at each node.
    :ivar greater: bool tensor ``(2**D - 1,)``: go right iff ``x > threshold`` when
        true, iff ``x < threshold`` when false.
    :ivar leaf_values: list of ``2**D`` strings describing each leaf's prediction.
    :ivar missing_right: optional bool tensor ``(2**D - 1,)``: where a missing value of
        the node's feature (NaN) goes, right when true; without it, left.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.trees import DecisionRules
    >>> rules = DecisionRules(
    ...     feature=torch.tensor([0]),
    ...     threshold=torch.tensor([0.5]),
    ...     greater=torch.tensor([True]),
    ...     leaf_values=["low", "high"],
    ... )
    >>> rules.route(torch.tensor([[0.2], [0.9]]))
    tensor([0, 1])
    >>> print(rules.export_text(feature_names=["x"]).rstrip())
    |--- x <= 0.500
    |   |--- low
    |--- x >  0.500
    |   |--- high
    """

    feature: torch.Tensor
    threshold: torch.Tensor
    greater: torch.Tensor
    leaf_values: list
    missing_right: torch.Tensor | None = None

    @property
    def depth(self) -> int:
        """Depth ``D`` of the tree (``2**D - 1`` internal nodes)."""
        return (self.feature.shape[-1] + 1).bit_length() - 1

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Leaf index ``(N,)`` of each input ``x`` of shape ``(N, L)``."""
        return route_by_rules(x, self.feature, self.threshold, self.greater, self.missing_right)

    def leaf_conditions(self) -> list[list[tuple[int, str, float]]]:
        """For each leaf, the conjunction ``[(feature, op, threshold), ...]`` that reaches it.

        ``op`` is one of ``"<="``, ``">"``, ``">="``, ``"<"``.
        """
        out = []
        depth = self.depth
        for leaf in range(1 << depth):
            node, conds = 1, []
            for d in range(depth - 1, -1, -1):
                bit = (leaf >> d) & 1
                j = node - 1
                f, t, g = int(self.feature[j]), float(self.threshold[j]), bool(self.greater[j])
                if g:
                    conds.append((f, ">" if bit else "<=", t))
                else:
                    conds.append((f, "<" if bit else ">=", t))
                node = 2 * node + bit
            out.append(conds)
        return out

    def leaf_reachable(self) -> torch.Tensor:
        """Whether some input reaches each leaf, bool ``(2**D,)``.

        A leaf is unreachable when the tests on its path contradict each other, e.g.
        ``x <= 0`` at the root and ``x > 1.5`` below it (an empty interval of ``x``).
        """
        out = []
        for conds in self.leaf_conditions():
            bounds: dict = {}
            for f, op, t in conds:
                bounds = _tighten(bounds, f, op, t)
            out.append(not any(_empty(*b) for b in bounds.values()))
        return torch.tensor(out, dtype=torch.bool)

    def export_text(
        self, feature_names=None, decimals: int = 3, prune: bool = True, show_missing: bool = False
    ) -> str:
        """The tree as indented text in the style of ``sklearn.tree.export_text``.

        :param bool prune: leave out every branch that no input can reach (its tests
            on one feature give an empty interval) and the tests that the path already
            decides; each reachable leaf is printed once, at the level of the tests
            that matter. ``False`` prints the complete tree of ``2**D`` leaves.
        :param bool show_missing: mark the side that a missing value takes at each
            split (``or missing``; needs ``missing_right``).
        """
        names = feature_names
        lines: list[str] = []

        def name(f: int) -> str:
            return str(names[f]) if names is not None else f"x_{f}"

        def fmt(t: float) -> str:
            return f"{t:.{decimals}f}" if math.isfinite(t) else str(t)

        def visit(node: dict, level: int) -> None:
            indent = "|   " * level + "|--- "
            if "leaf" in node:
                lines.append(indent + self.leaf_values[node["leaf"]])
                return
            for side, (op, child) in zip(node["sides"], node["children"], strict=True):
                line = f"{indent}{name(node['feature'])} {op:<2} {fmt(node['threshold'])}"
                if missing and side == int(self.missing_right[node["node"] - 1]):
                    line += " or missing"
                lines.append(line)
                visit(child, level + 1)

        missing = bool(show_missing) and self.missing_right is not None
        visit(self._structure(prune, missing=missing), 0)
        return "\n".join(lines) + "\n"

    def _structure(self, prune: bool = True, missing: bool = False) -> dict:
        """The tree as nested dicts, as :meth:`export_text` prints it: a leaf is
        ``{"leaf": k}`` (its index), a split ``{"node": i, "feature": f, "threshold": t,
        "children": [(op, subtree), (op, subtree)], "sides": [0, 1]}`` in heap order
        (left child first, ``op`` the side's test of ``x[f]`` against ``t``, ``sides``
        which side each child is: 0 left, 1 right). With ``prune``, a branch no input
        reaches is left out and a test the path already decides is replaced by its
        reachable side. With ``missing`` (and ``missing_right``), a side that a missing
        value reaches counts as reachable, unless the path has already tested its
        feature on an observed value."""
        depth = self.depth
        missing = missing and self.missing_right is not None

        def visit(node: int, bounds: dict, seen: dict) -> dict:
            if node >= 1 << depth:
                return {"leaf": node - (1 << depth)}
            j = node - 1
            f, t, g = int(self.feature[j]), float(self.threshold[j]), bool(self.greater[j])
            left_op, right_op = ("<=", ">") if g else (">=", "<")
            # seen[f]: whether x[f] may be observed, and may be missing, on this path
            can_obs, can_miss = seen.get(f, (True, missing))
            miss_side = int(bool(self.missing_right[j])) if missing else -1
            sides = []
            for side, (child, op) in enumerate(((2 * node, left_op), (2 * node + 1, right_op))):
                inner = _tighten(bounds, f, op, t)
                obs = can_obs and not _empty(*inner[f])
                mis = can_miss and side == miss_side
                if not prune or obs or mis:
                    sides.append((child, op, inner, {**seen, f: (obs, mis)}))
            if len(sides) == 1:  # the path decides this test: only one side is reachable
                return visit(sides[0][0], sides[0][2], sides[0][3])
            children = [(op, visit(child, inner, s)) for child, op, inner, s in sides]
            return {
                "node": node,
                "feature": f,
                "threshold": t,
                "children": children,
                "sides": [child % 2 for child, *_ in sides],
            }

        return visit(1, {}, {})


def _tighten(bounds: dict, feature: int, op: str, threshold: float) -> dict:
    """``bounds`` (feature -> ``((low, open), (high, open))``) with one more test."""
    low, high = bounds.get(feature, ((-math.inf, True), (math.inf, True)))
    if op in ("<=", "<"):
        new = (threshold, op == "<")
        if new[0] < high[0] or (new[0] == high[0] and new[1]):
            high = new
    else:
        new = (threshold, op == ">")
        if new[0] > low[0] or (new[0] == low[0] and new[1]):
            low = new
    return {**bounds, feature: (low, high)}


def _empty(low: tuple, high: tuple) -> bool:
    """Whether the interval from ``low`` to ``high`` (each ``(value, open)``) is empty."""
    return low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))
