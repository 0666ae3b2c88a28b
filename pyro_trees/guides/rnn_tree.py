r"""The RNN-Tree: an amortised posterior over the routing of a hierarchical mixture.

Antorán et al., Sec. 4. A GRU runs for :math:`D` steps; at step :math:`d` its hidden
state :math:`h_d` gives, for every input dimension :math:`l`, a linear split
:math:`(w_{l0}, w_{l1})` (eq. 10) and a softmax over which dimension to split
(eq. 11). The probability of going right marginalises the split dimension (eqs. 12-13):

.. math:: q(m_d = 1 \mid h_d, x) = \sum_l \mathrm{softmax}_l(f(h_d))\,
          \sigma(w_{l0} + w_{l1} x_l).

Two ways to feed decisions back into the GRU:

* ``feedback="soft"`` (the paper, eq. 14): one roll-out per input; the decision
  probability plus quantisation noise :math:`\epsilon \sim U(-\frac12, \frac12)` is fed
  back, and the leaf probabilities are :math:`\prod_d q(m_d \mid h_d, x)`. Conditional
  and aggregate posteriors (App. C, eqs. 23-24) follow from these leaf probabilities
  (:meth:`RNNTree.conditional_posteriors`, :meth:`RNNTree.aggregate_posteriors`).
* ``feedback="hard"`` (the default): the GRU is fed the binary decision of each path, so every node
  of the tree has its own hidden state; these do not depend on ``x`` and cost
  ``2**D - 1`` GRU steps per evaluation, whatever the batch. The routing posterior is
  then an exact soft decision tree whose hard limit is the test-time tree
  (a step beyond the paper: no train/test mismatch).

At test time the single most likely tree replaces softmax by max and sigmoid by a step
(:meth:`RNNTree.rules`): node ``i`` tests ``x_l <= -w_{l0}/w_{l1}``.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from pyro.poutine.plate_messenger import PlateMessenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn

from pyro_trees import trees
from pyro_trees._param_store import adopt_param_store, follow_data, shared_plate, store_name

__all__ = ["RNNTree", "RNNTreeGuide"]

# Elements of one ``(rows, nodes, features)`` block of :class:`_NodeSplitLogProbs`:
# on CPU about a megabyte in float32, so each block's passes run from cache; on an
# accelerator, blocks large enough to fill it (64 MB in float32).
_BLOCK_ELEMENTS = 2**18
_BLOCK_ELEMENTS_ACCELERATOR = 2**24


def _sigmoid_pair(z: torch.Tensor):
    """``sigmoid(z)`` and ``sigmoid(-z)``, each accurate to relative precision (neither
    is formed as ``1 - sigmoid``)."""
    return torch.sigmoid(z), torch.sigmoid(-z)


def _log_right_left(x, log_dim, w0, w1):
    """``log q(m=1)``, ``log q(m=0)`` of eq. 13 through log-sum-exps over the last dim,
    broadcasting over ``x``: the soft-feedback roll-out's formula, and the reference
    where :class:`_NodeSplitLogProbs`' probability-space sums underflow."""
    z = w0 + w1 * x
    log_right = torch.logsumexp(log_dim + F.logsigmoid(z), dim=-1)
    log_left = torch.logsumexp(log_dim + F.logsigmoid(-z), dim=-1)
    return log_right, log_left


def _log_space_pairs(x, log_dim, w0, w1, rows, nodes):
    """:func:`_log_right_left` for the ``(row, node)`` pairs given, ``(P,)`` each."""
    return _log_right_left(x[rows], log_dim[nodes], w0[nodes], w1[nodes])


class _NodeSplitLogProbs(torch.autograd.Function):
    r"""Eq. 13 at every node for every input: ``log q(m=1)``, ``log q(m=0)``, ``(N, K)``.

    ``x`` is ``(N, L)``; ``log_dim``, ``w0``, ``w1`` are ``(K, L)``. The same values as
    ``logsumexp(log_dim + logsigmoid(+-(w0 + w1 x)), -1)``, computed blockwise over the
    rows (the ``(N, K, L)`` intermediates never exist whole; backward recomputes each
    block) and in probability space, :math:`q_R = \sum_l \pi_l \sigma(z_l)`, one
    pair of sigmoids per element. A ``(row, node)`` pair whose :math:`q_R` or
    :math:`q_L` falls below ``finfo.tiny * 2**(3 * finfo.bits / 4)`` (its terms
    underflowing, as with sharp splits far from every threshold) is redone in log
    space, forward and backward.
    Gradients: :math:`\partial \log q_R / \partial z_l =
    \pi_l \sigma(z_l) \sigma(-z_l) / q_R`, :math:`\partial \log q_L / \partial z_l =
    -\pi_l \sigma(z_l) \sigma(-z_l) / q_L`, :math:`\partial \log q_R / \partial
    \log \pi_l = \pi_l \sigma(z_l) / q_R`.
    """

    @staticmethod
    def forward(ctx, x, log_dim, w0, w1):
        n = x.shape[0]
        block = _BLOCK_ELEMENTS if x.device.type == "cpu" else _BLOCK_ELEMENTS_ACCELERATOR
        rows = max(1, block // max(1, w0.numel()))
        finfo = torch.finfo(x.dtype)
        floor = finfo.tiny * 2.0 ** (finfo.bits - finfo.bits // 4)  # 2**24 / 2**48 over tiny
        pi = log_dim.exp()
        log_right = x.new_empty(n, w0.shape[0])
        log_left = torch.empty_like(log_right)
        underflow = torch.empty(n, w0.shape[0], dtype=torch.bool, device=x.device)
        for s in range(0, n, rows):
            z = torch.addcmul(w0, w1, x[s : s + rows].unsqueeze(-2))  # (B, K, L)
            sig, sig_neg = _sigmoid_pair(z)
            right, left = sig.mul_(pi).sum(-1), sig_neg.mul_(pi).sum(-1)
            underflow[s : s + rows] = (right < floor) | (left < floor)
            log_right[s : s + rows] = right.clamp_min_(floor).log_()
            log_left[s : s + rows] = left.clamp_min_(floor).log_()
        bad_rows, bad_nodes = underflow.nonzero(as_tuple=True)  # redo these in log space
        if bad_rows.numel():
            log_right[bad_rows, bad_nodes], log_left[bad_rows, bad_nodes] = _log_space_pairs(
                x, log_dim, w0, w1, bad_rows, bad_nodes
            )
        ctx.save_for_backward(x, log_dim, w0, w1, log_right, log_left, bad_rows, bad_nodes)
        ctx.rows = rows
        return log_right, log_left

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_right, grad_left):
        x, log_dim, w0, w1, log_right, log_left, bad_rows, bad_nodes = ctx.saved_tensors
        rows = ctx.rows
        pi = log_dim.exp()
        grad_log_dim = torch.zeros_like(log_dim)
        grad_w0 = torch.zeros_like(w0)
        grad_w1 = torch.zeros_like(w1)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # d/dq of log q: grad / q; zero on the log-space rows, which are added below
        c_right = grad_right * log_right.neg().exp_()
        c_left = grad_left * log_left.neg().exp_()
        if bad_rows.numel():
            c_right[bad_rows, bad_nodes] = 0.0
            c_left[bad_rows, bad_nodes] = 0.0
        for s in range(0, x.shape[0], rows):
            xs = x[s : s + rows]
            cr, cl = c_right[s : s + rows], c_left[s : s + rows]
            z = torch.addcmul(w0, w1, xs.unsqueeze(-2))
            sig, sig_neg = _sigmoid_pair(z)
            cr, cl = cr.unsqueeze(-1), cl.unsqueeze(-1)
            grad_log_dim += (sig * cr).add_(sig_neg * cl).sum(0)
            dz = sig.mul_(sig_neg).mul_(cr - cl)  # (B, K, L), without pi
            grad_w0 += dz.sum(0)
            grad_w1 += (dz * xs.unsqueeze(-2)).sum(0)
            if grad_x is not None:
                grad_x[s : s + rows] = (dz * (w1 * pi)).sum(-2)
        grad_log_dim *= pi
        grad_w0 *= pi
        grad_w1 *= pi
        if bad_rows.numel():  # autograd through the log-space formula on those pairs
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (x, log_dim, w0, w1)]
                out_r, out_l = _log_space_pairs(*inputs, bad_rows, bad_nodes)
                total = (out_r * grad_right[bad_rows, bad_nodes]).sum()
                total = total + (out_l * grad_left[bad_rows, bad_nodes]).sum()
                g_x, g_ld, g_w0, g_w1 = torch.autograd.grad(total, inputs)
            grad_log_dim += g_ld
            grad_w0 += g_w0
            grad_w1 += g_w1
            if grad_x is not None:
                grad_x += g_x
        return grad_x, grad_log_dim, grad_w0, grad_w1


def _balanced_cuts(pts: torch.Tensor, like: torch.Tensor):
    """Per dimension: the cut between distinct values nearest the median, and the spread.

    :param pts: ``(n, L)`` points; ``like``: an ``(L,)`` tensor for dtype and device.
    :returns: ``(cut, std)``, each ``(L,)``; a constant dimension has cut = its value
        and std 0; with no points, cuts are 0 and spreads 0.
    """
    n = pts.shape[0]
    if n == 0:
        return torch.zeros_like(like), torch.zeros_like(like)
    if n == 1:
        return pts[0].clone(), torch.zeros_like(like)
    srt = pts.sort(dim=0).values  # (n, L)
    changes = srt[1:] > srt[:-1]  # (n - 1, L): a cut can sit between rows i and i + 1
    pos = torch.arange(1, n, device=pts.device, dtype=pts.dtype).unsqueeze(-1)
    cost = (pos - n / 2).abs().expand_as(changes).masked_fill(~changes, float("inf"))
    i = cost.argmin(0)  # (L,)
    lo = srt.gather(0, i.unsqueeze(0)).squeeze(0)
    hi = srt.gather(0, (i + 1).unsqueeze(0)).squeeze(0)
    cut = torch.where(changes.any(0), 0.5 * (lo + hi), srt[0])
    return cut, pts.std(0)


def _impurity(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Impurity times size of the points selected by each column of ``weights`` ``(n, L)``:
    Gini for long labels, squared error for real targets. Returns ``(L,)``."""
    if y.dtype in (torch.long, torch.int32, torch.int64, torch.bool):
        onehot = torch.nn.functional.one_hot(y.long()).to(weights.dtype)  # (n, C)
        counts = weights.T @ onehot  # (L, C)
        size = counts.sum(-1)
        return size - (counts**2).sum(-1) / size.clamp_min(1)
    y2 = y.reshape(y.shape[0], -1).to(weights.dtype)
    size = weights.sum(0).unsqueeze(-1)  # (L, 1)
    total = weights.T @ y2
    return ((weights.T @ y2**2) - total**2 / size.clamp_min(1)).sum(-1)


def _greedy_cuts(pts: torch.Tensor, y: torch.Tensor, min_leaf: int = 1):
    """Per dimension: the cut that most reduces the impurity of ``y``, as CART grows a node.

    Cuts sit midway between consecutive distinct values and leave at least ``min_leaf``
    points on each side. Vectorised over dimensions with prefix sums of the sorted
    targets, ``O(n L (log n + C))``.

    :param pts: ``(n, L)`` points, ``n >= 2``; ``y``: long labels ``(n,)`` or real
        targets ``(n,)``/``(n, K)``.
    :returns: ``(cut, gain)``, each ``(L,)``; ``gain`` is ``-inf`` where no admissible
        cut exists (e.g. a constant dimension).
    """
    n, L = pts.shape
    srt, order = pts.sort(dim=0)  # (n, L)
    if y.dtype in (torch.long, torch.int32, torch.int64, torch.bool):
        t = F.one_hot(y.long()).to(pts.dtype)  # (n, C)
        counts = t[order].cumsum(0)  # (n, L, C): counts left of a cut after row i
        total = counts[-1]
        size = torch.arange(1, n + 1, dtype=pts.dtype, device=pts.device)[:, None]
        left = size - (counts**2).sum(-1) / size
        right = (n - size) - ((total - counts) ** 2).sum(-1) / (n - size).clamp_min(1)
        whole = n - (total**2).sum(-1) / n  # (L,)
    else:
        t = y.reshape(n, -1).to(pts.dtype)  # (n, K)
        s1 = t[order].cumsum(0)  # (n, L, K)
        s2 = (t**2)[order].cumsum(0)
        size = torch.arange(1, n + 1, dtype=pts.dtype, device=pts.device)[:, None, None]
        left = (s2 - s1**2 / size).sum(-1)
        rsize = (n - size).clamp_min(1)
        right = ((s2[-1] - s2) - (s1[-1] - s1) ** 2 / rsize).sum(-1)
        whole = (s2[-1] - s1[-1] ** 2 / n).sum(-1)
    gain = (whole - left - right)[:-1]  # (n - 1, L): cut between rows i and i + 1
    pos = torch.arange(1, n, device=pts.device)[:, None]
    ok = (srt[1:] > srt[:-1]) & (pos >= min_leaf) & (n - pos >= min_leaf)
    gain = gain.masked_fill(~ok, -float("inf"))
    best, i = gain.max(0)  # (L,)
    lo = srt.gather(0, i.unsqueeze(0)).squeeze(0)
    hi = srt.gather(0, (i + 1).unsqueeze(0)).squeeze(0)
    return 0.5 * (lo + hi), best


def _choose_dimension(pts, y, cut, spread) -> int:
    """The widest dimension, or, with targets, the most informative wide dimension."""
    if y is None or pts.shape[0] < 2 or float(spread.max()) <= 0:
        return int(spread.argmax())
    right = (pts > cut).to(pts.dtype)  # (n, L)
    ones = torch.ones_like(right)
    gain = _impurity(y, ones) - _impurity(y, right) - _impurity(y, ones - right)
    eligible = spread >= 0.75 * spread.max()
    gain = gain.masked_fill(~eligible, -float("inf"))
    # A gain below 5 % of the node's impurity is noise (e.g. parity, where no single
    # split informs): then the widest dimension is taken.
    if float(gain.max()) <= 0.05 * float(_impurity(y, ones[:, :1])[0]):
        return int(spread.argmax())
    return int(gain.argmax())


def input_scaling(x: torch.Tensor):
    """Mean and standard deviation of every input dimension, ``(L,)`` each; a constant
    (or single-row) dimension gets scale 1."""
    loc = x.mean(0)
    scale = x.std(0) if x.shape[0] > 1 else torch.ones_like(loc)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return loc, scale


@torch.no_grad()
def balanced_start(
    x: torch.Tensor,
    y: torch.Tensor | None,
    depth: int,
    *,
    sharpness: float = 20.0,
    dim_margin: float = 3.0,
    cuts: str = "balanced",
    min_leaf: int = 1,
):
    """The balanced (or greedy) tree of :meth:`RNNTree.init_balanced` on inputs ``x``.

    :param x: ``(N, L)`` inputs, already standardised.
    :param y: optional targets (see :meth:`RNNTree.init_balanced`).
    :returns: ``(targets, leaf)``: per internal node the dimension logits, ``w0`` and
        ``w1`` ``(2**D - 1, 3L)``, and the leaf each point reaches ``(N,)``.
    """
    if cuts not in ("balanced", "greedy"):
        raise ValueError(f"cuts must be 'balanced' or 'greedy', got {cuts!r}")
    if cuts == "greedy" and y is None:
        raise ValueError("cuts='greedy' needs the targets y")
    L = x.shape[-1]
    n_internal = trees.num_internal(depth)
    targets = torch.zeros(n_internal, 3 * L, dtype=x.dtype, device=x.device)
    node_of_point = torch.ones(x.shape[0], dtype=torch.long, device=x.device)
    for j in range(n_internal):
        node = j + 1
        mask = node_of_point == node
        cut, spread = _balanced_cuts(x[mask], like=x[0])
        l = None
        if cuts == "greedy" and int(mask.sum()) >= 2 * max(1, min_leaf):
            g_cut, gain = _greedy_cuts(x[mask], y[mask], min_leaf=max(1, min_leaf))
            if float(gain.max()) > 0:
                l = int(gain.argmax())
                cut = torch.where(torch.isfinite(gain), g_cut, cut)
        if l is None:
            l = _choose_dimension(x[mask], None if y is None else y[mask], cut, spread)
        slope = sharpness / spread.clamp_min(1e-2)
        targets[j, l] = dim_margin + math.log(max(1, L - 1))
        targets[j, L : 2 * L] = -slope * cut
        targets[j, 2 * L :] = slope
        right = x[:, l] > cut[l]
        node_of_point = torch.where(mask, 2 * node + right.long(), node_of_point)
    return targets, node_of_point - trees.num_leaves(depth)


class RNNTree(PyroModule):
    """The routing network: maps inputs ``(N, L)`` to leaf logits ``(N, 2**D)``.

    A :class:`~pyro.nn.PyroModule` (a plain ``nn.Module`` with Pyro-aware parameters)
    that maps context to a distribution's parameters, as ``zuko``'s lazy distributions.

    :param int in_features: input dimension :math:`L`.
    :param int depth: tree depth :math:`D`.
    :param int hidden_size: GRU width.
    :param str feedback: ``"hard"`` (per-node states; default) or ``"soft"`` (the
        paper's single roll-out, eq. 14).
    :param float noise: half-width of the uniform quantisation noise fed back during
        training with soft feedback (the paper: 0.5); 0 disables it.
    :param str name: parameter-store prefix (``PyroModule`` name of a root module).

    Inputs are standardised inside, ``(x - x_loc) / x_scale`` with the buffers
    ``x_loc``, ``x_scale`` ``(L,)`` (0 and 1 until :meth:`init_scaling` sets them), so
    that split weights live on the unit scale whatever the units of ``x``;
    :meth:`rules` reports thresholds in the units of ``x``.
    """

    def __init__(
        self,
        in_features: int,
        depth: int,
        *,
        hidden_size: int = 32,
        feedback: str = "hard",
        noise: float = 0.5,
        name: str | None = None,
    ):
        super().__init__(name=name or "")
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        if feedback not in ("soft", "hard"):
            raise ValueError(f"feedback must be 'soft' or 'hard', got {feedback!r}")
        self.in_features = int(in_features)
        # Per node: the residual (3L values) and, for rules() and hard feedback, the
        # GRU state (H) and the heads (3L) of every node.
        per_node = 3 * self.in_features + int(hidden_size)
        self.depth = trees.check_depth(
            depth,
            width=per_node,
            dtype=torch.get_default_dtype(),
            what=(
                f"the per-node split parameters and GRU states ({per_node:,} values per "
                "node, with gradients and optimiser state)"
            ),
        )
        self.hidden_size = int(hidden_size)
        self.feedback = feedback
        self.noise = float(noise)
        self.h0 = nn.Parameter(torch.zeros(hidden_size))
        # PyroModule[...] so that plain SVI (global param store) also trains them.
        self.cell = PyroModule[nn.GRUCell](1, hidden_size)
        self.dim_head = PyroModule[nn.Linear](hidden_size, in_features)  # f_NN, eq. 11
        self.split_head = PyroModule[nn.Linear](hidden_size, 2 * in_features)  # g_NN, eq. 10
        # Hard feedback only: a per-node residual on the split weights. Nodes have an
        # identity there (their states do not depend on x); the residual starts at 0
        # and is what init_balanced() sets, since the GRU states of nearby nodes are
        # too collinear for the shared linear head to place per-node thresholds.
        # (I, 3L): residual dimension logits, w0 and w1 of every node.
        offset = torch.zeros(trees.num_internal(self.depth), 3 * in_features)
        if feedback == "hard":
            self.node_offset = nn.Parameter(offset)
        else:
            # Soft feedback never trains it (the roll-out has no per-node states): a
            # buffer of zeros, under the same state_dict key, so that rules() serves
            # both feedbacks and every parameter receives a gradient.
            self.register_buffer("node_offset", offset)
        self.register_buffer("x_loc", torch.zeros(self.in_features))
        self.register_buffer("x_scale", torch.ones(self.in_features))
        self.reset_split_parameters()

    @torch.no_grad()
    def init_scaling(self, x: torch.Tensor) -> None:
        """Set the input standardisation ``x_loc``, ``x_scale`` to the mean and standard
        deviation of ``x`` ``(N, L)`` (a constant dimension keeps scale 1)."""
        loc, scale = input_scaling(x)
        self.x_loc = loc.to(self.x_loc)
        self.x_scale = scale.to(self.x_scale)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - x_loc) / x_scale``: the inputs as the splits see them, ``(..., L)``."""
        return (x - self.x_loc.to(x.dtype)) / self.x_scale.to(x.dtype)

    def reset_split_parameters(self) -> None:
        """Spread the initial thresholds over the standardised input range.

        The split head's bias starts at ``w_0 ~ U(-1, 1)``, ``w_1 = 2``, i.e. thresholds
        in ``(-0.5, 0.5)`` and moderately sharp sigmoids on standardised inputs.
        """
        with torch.no_grad():
            self.split_head.weight.mul_(0.1)
            L = self.in_features
            self.split_head.bias[:L].uniform_(-1.0, 1.0)
            self.split_head.bias[L:].fill_(2.0)

    @torch.no_grad()
    def init_balanced(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        sharpness: float = 20.0,
        dim_margin: float = 3.0,
        ridge: float = 1e-2,
        cuts: str = "balanced",
        min_leaf: int = 1,
    ) -> None:
        """Data-dependent initialisation at a balanced tree, the tree-balance prior's mode.

        Walking the tree from the root, each node splits the points that reach it at the
        cut closest to their median (midway between two distinct values, so binary
        inputs split at 0.5) along the dimension of largest standard deviation; a
        dimension already split on the path has the smaller spread. Every dimension's
        split at the node starts at its own balanced cut with slope
        ``sharpness / std``, and the chosen dimension's logit exceeds the others' by
        ``dim_margin + log(L - 1)``, so that it carries probability
        ``sigmoid(dim_margin)`` (0.95) whatever the number of inputs ``L``: with a
        fixed margin, 64 inputs would leave it 24 %, and the soft tree that trains
        would be far from the hard tree it starts as. Label-blind, like a k-means++
        start for a mixture.

        With hard feedback the per-node residual takes these values exactly. With soft
        feedback (no per-node parameters) the heads are set by ridge regression on the
        node states (``ridge`` keeps the weights moderate, as nearby nodes have
        almost collinear states), which balances only approximately.

        With targets ``y`` (long class labels ``(N,)``, or real ``(N,)``/``(N, K)``), the
        dimension is chosen among those whose spread is at least 3/4 of the largest as
        the one whose balanced cut most reduces the impurity of ``y`` (Gini index, or
        squared error); the cuts themselves stay balanced. Without ``y``, or when no cut
        reduces it by 5 % or more, the widest dimension is taken.

        ``cuts="greedy"`` (needs ``y``) instead grows the start as CART does: every node
        takes the dimension and cut that most reduce the impurity of its points' targets,
        each side keeping at least ``min_leaf`` points (other dimensions start at their
        own best cuts); a node where no cut reduces it falls back to the balanced rule.
        End-to-end training then refines a greedy tree instead of a balanced one.

        :param x: inputs ``(N, L)`` in the units the tree is called with (standardised
            by the tree's own ``x_loc``, ``x_scale``).
        :param y: optional targets, used only to choose split dimensions (and, with
            ``cuts="greedy"``, the cuts).
        :param str cuts: ``"balanced"`` (median cuts) or ``"greedy"`` (impurity cuts).
        :param int min_leaf: fewest points on either side of a greedy cut.
        """
        L = self.in_features
        x = self.standardise(x)
        states = self.node_states().to(x.dtype)  # (I, H)
        targets, _ = balanced_start(
            x,
            y,
            self.depth,
            sharpness=sharpness,
            dim_margin=dim_margin,
            cuts=cuts,
            min_leaf=min_leaf,
        )
        base = torch.cat([self.dim_head(states), self.split_head(states)], dim=-1)
        if self.feedback == "hard":
            self.node_offset.copy_(targets - base)
            return
        design = torch.cat([states, torch.ones_like(states[:, :1])], dim=-1).double()
        gram = design.T @ design + ridge * torch.eye(design.shape[1], dtype=design.dtype)
        w = torch.linalg.solve(gram, design.T @ targets.double()).to(states.dtype)
        self.dim_head.weight.copy_(w[:-1, :L].T)
        self.dim_head.bias.copy_(w[-1, :L])
        self.split_head.weight.copy_(w[:-1, L:].T)
        self.split_head.bias.copy_(w[-1, L:])

    # -- per-node quantities -------------------------------------------------------
    def _heads(self, h: torch.Tensor):
        """Dimension log-probabilities and split weights from hidden states ``(..., H)``."""
        log_dim = F.log_softmax(self.dim_head(h), dim=-1)
        w = self.split_head(h)
        return log_dim, w[..., : self.in_features], w[..., self.in_features :]

    def _node_heads(self, dtype=None):
        """Per-node heads under hard feedback, including the per-node residual."""
        states = self.node_states()
        if dtype is not None:
            states = states.to(dtype)
        L = self.in_features
        off = self.node_offset.to(states.dtype)
        log_dim = F.log_softmax(self.dim_head(states) + off[:, :L], dim=-1)
        w = self.split_head(states)
        return log_dim, w[:, :L] + off[:, L : 2 * L], w[:, L:] + off[:, 2 * L :]

    def node_states(self) -> torch.Tensor:
        """Hidden states of every internal node under hard feedback, ``(2**D - 1, H)``.

        The root's input is 0; a node's children are fed its decision, 0 (left) or 1
        (right). These states do not depend on the input.
        """
        h = self.h0.unsqueeze(0)
        inp = h.new_zeros(1, 1)
        h = self.cell(inp, h)
        states = [h]
        for _ in range(self.depth - 1):
            n = h.shape[0]
            bits = torch.tensor([0.0, 1.0], dtype=h.dtype, device=h.device).repeat(n)
            h = self.cell(bits.unsqueeze(-1), h.repeat_interleave(2, dim=0))
            states.append(h)
        return torch.cat(states, dim=0)

    # -- routing posteriors --------------------------------------------------------
    def depth_log_probs(self, x: torch.Tensor, *, noise: bool | None = None, generator=None):
        """Soft-feedback roll-out (eq. 14): ``(log_right, log_left)``, each ``(N, D)``.

        :param noise: feed back quantisation noise; default: ``self.training``.
        :param generator: optional ``torch.Generator`` for the noise (drawn on its
            device, then moved to ``x``'s); default: the global generator.
        """
        noise = self.training if noise is None else noise
        x = self.standardise(x)
        n = x.shape[0]
        h = self.h0.to(x.dtype).expand(n, -1)
        inp = x.new_zeros(n, 1)
        rights, lefts = [], []
        for _ in range(self.depth):
            h = self.cell(inp, h)
            log_dim, w0, w1 = self._heads(h)
            log_right, log_left = _log_right_left(x, log_dim, w0, w1)
            rights.append(log_right)
            lefts.append(log_left)
            inp = log_right.exp().unsqueeze(-1)
            if noise and self.noise > 0:
                if generator is None:
                    u = torch.rand_like(inp)
                else:
                    u = torch.rand(
                        inp.shape, generator=generator, dtype=inp.dtype, device=generator.device
                    ).to(inp.device)
                inp = inp + (u * 2 - 1) * self.noise
        return torch.stack(rights, -1), torch.stack(lefts, -1)

    def node_logits(self, x: torch.Tensor, *, feedback: str | None = None, noise=None):
        """Log-odds of going right at every internal node, ``(N, 2**D - 1)``."""
        feedback = self.feedback if feedback is None else feedback
        if feedback == "soft":
            log_right, log_left = self.depth_log_probs(x, noise=noise)
            return trees.depth_logits_to_node_logits(log_right - log_left)
        if feedback == "hard":
            log_dim, w0, w1 = self._node_heads(x.dtype)
            flat = self.standardise(x).reshape(-1, x.shape[-1])
            log_right, log_left = _NodeSplitLogProbs.apply(flat, log_dim, w0, w1)
            return (log_right - log_left).reshape(*x.shape[:-1], -1)  # (N, 2**D - 1)
        raise ValueError(f"feedback must be 'soft' or 'hard', got {feedback!r}")

    def forward(self, x: torch.Tensor, *, feedback: str | None = None, noise=None):
        """Leaf logits (normalised log-probabilities) of shape ``(N, 2**D)``."""
        return trees.leaf_log_probs(self.node_logits(x, feedback=feedback, noise=noise))

    def conditional_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        r"""Conditional routing posteriors (App. C, eq. 23), ``(N, 2**D - 1)``.

        Entry ``[n, i - 1]`` is :math:`q(m_i = 1 \mid \text{reach } i, x_n)`, the
        probability that point :math:`n` goes right at heap node :math:`i` given that it
        reaches the node: the joint over paths (:meth:`forward`) divided by its prefix,
        by the product rule (:func:`pyro_trees.trees.conditional_right_logits`). Under
        hard feedback these are the sigmoids of :meth:`node_logits`; under soft
        feedback one roll-out gives every node of a depth the same value (the roll-out
        marginalises the hidden state with a single noise sample).

        :param x: ``(N, L)`` inputs.
        :param noise: feed back quantisation noise (soft feedback); default:
            ``self.training``.
        """
        return torch.sigmoid(trees.conditional_right_logits(self(x, noise=noise)))

    def aggregate_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        r"""Aggregate routing posteriors over the data ``x`` (App. C, eq. 24), ``(2**D - 1,)``.

        Entry ``[i - 1]`` is :math:`q(m_i = 1 \mid \text{reach } i) \approx
        \sum_n q(\text{reach } 2i + 1 \mid x_n) / \sum_n q(\text{reach } i \mid x_n)`:
        the conditional of eq. 23 with :math:`x` marginalised over the points. The
        tree-balance prior's KL (:func:`pyro_trees.distributions.expected_log_coupling`)
        pulls these towards 1/2. A node that no point reaches gets 0.

        :param x: ``(N, L)`` inputs, the sample standing in for :math:`p(x)`.
        :param noise: as in :meth:`conditional_posteriors`.
        """
        alpha, _ = trees.aggregate_right_probs(self(x, noise=noise))
        return alpha

    def leaf_probs(self, x, *, num_samples: int = 32, feedback=None, generator=None):
        """The routing posterior averaged over the quantisation noise, ``(N, 2**D)``.

        With soft feedback, averages ``num_samples`` noisy roll-outs (the distribution
        the ELBO was trained on); ``generator`` makes the average reproducible. With
        hard feedback the posterior is exact and no sampling happens.
        """
        feedback = self.feedback if feedback is None else feedback
        if feedback == "hard" or self.noise == 0 or num_samples < 1:
            return self.forward(x, feedback=feedback, noise=False).exp()
        total = 0.0
        for _ in range(num_samples):
            log_right, log_left = self.depth_log_probs(x, noise=True, generator=generator)
            logits = trees.depth_logits_to_node_logits(log_right - log_left)
            total = total + trees.leaf_log_probs(logits).exp()
        return total / num_samples

    # -- the most likely tree ----------------------------------------------------------
    @torch.no_grad()
    def rules(self, leaf_values=None) -> trees.DecisionRules:
        """The single most likely tree: max instead of softmax, step instead of sigmoid.

        Node ``i`` tests dimension ``l* = argmax_l f(h_i)`` against
        ``-w_{l*0} / w_{l*1}`` (mapped back to the units of ``x`` through ``x_loc``,
        ``x_scale``); a zero slope gives a constant decision (threshold
        ``-inf``/``+inf``).
        """
        # The per-node residual stays zero under soft feedback, so this serves both.
        log_dim, w0, w1 = self._node_heads()
        feature = log_dim.argmax(-1)
        a = w0.gather(-1, feature.unsqueeze(-1)).squeeze(-1)
        b = w1.gather(-1, feature.unsqueeze(-1)).squeeze(-1)
        greater = b >= 0
        safe_b = torch.where(b == 0, torch.ones_like(b), b)
        threshold = torch.where(
            b == 0,
            torch.where(a > 0, torch.full_like(a, -math.inf), torch.full_like(a, math.inf)),
            -a / safe_b,
        )
        # back to the units of x (the scale is positive: comparisons keep their sense)
        loc, scale = self.x_loc.to(threshold)[feature], self.x_scale.to(threshold)[feature]
        threshold = loc + scale * threshold
        if leaf_values is None:
            leaf_values = [f"leaf {i}" for i in range(trees.num_leaves(self.depth))]
        return trees.DecisionRules(feature, threshold, greater, list(leaf_values))

    def hard_leaf(self, x: torch.Tensor) -> torch.Tensor:
        """Leaf ``(N,)`` of each input under the single most likely tree."""
        return self.rules().route(x)


class RNNTreeGuide(PyroModule):
    """Guide for :class:`~pyro_trees.models.HME`: the RNN-Tree routing posterior.

    ``forward(x, y=None, subsample_size=None)`` has the model's signature and samples
    the per-point site ``"leaf"`` ``(N,)`` inside the plate ``"data"`` from
    ``Categorical(logits=RNNTree(x))``, marked for parallel enumeration so that
    :class:`~pyro_trees.infer.TreeELBO` (or ``TraceEnum_ELBO``) sums it out exactly.
    Outside enumeration (``pyro.infer.Predictive``, ``poutine.trace``) the site is an
    ordinary draw from the routing posterior, so posterior predictive draws need nothing
    else.

    **Lazy initialisation.** At its first call with targets ``y`` (the first
    ``svi.step(x, y)``) the guide moves to ``x``'s dtype and device, sets the tree's
    input standardisation (:meth:`RNNTree.init_scaling`) and starts the tree at the
    balanced tree of ``(x, y)`` (:meth:`RNNTree.init_balanced`, the tree-balance
    prior's mode), which :class:`~pyro_trees.models.HME` with the same ``init`` starts
    its experts from. If the param store already holds the guide's parameters (loaded
    with ``pyro.get_param_store().load``, or trained by an instance of the same
    ``name``), it uses them and initialises nothing. The standardisation is mirrored in
    the store as ``"<name>.tree.x_loc"``, ``"<name>.tree.x_scale"``.

    :param int in_features: input dimension.
    :param int depth: tree depth; must match the model's.
    :param str init: ``"balanced"`` (median cuts; default), ``"greedy"`` (CART's cuts)
        or ``None`` (no data-dependent start: random splits on unscaled inputs).
    :param str name: parameter-store prefix, e.g. ``"hme"`` gives ``"hme.tree.h0"``.
    :param kwargs: passed to :class:`RNNTree` (``hidden_size``, ``feedback``, ``noise``).
    """

    def __init__(
        self,
        in_features: int,
        depth: int,
        *,
        init: str | None = "balanced",
        name: str | None = None,
        **kwargs,
    ):
        super().__init__(name=name or "")
        if init not in ("balanced", "greedy", None):
            raise ValueError(f"init must be 'balanced', 'greedy' or None, got {init!r}")
        self.init = init
        self.tree = RNNTree(in_features, depth, **kwargs)
        self._init_state = "fresh"

    @property
    def depth(self) -> int:
        """Depth ``D`` of the tree (``2**D`` leaves)."""
        return self.tree.depth

    @property
    def initialised(self) -> bool:
        """Whether the first-call initialisation has happened (or was adopted)."""
        return self._init_state == "done"

    def _scaling_names(self) -> dict:
        return {store_name(self.tree, key): (self.tree, key) for key in ("x_loc", "x_scale")}

    @torch.no_grad()
    def _lazy_init(self, x: torch.Tensor, y) -> None:
        if self._init_state == "fresh":
            self._init_state = "pending"
            if adopt_param_store(self, buffers=self._scaling_names()):
                self._init_state = "done"
                return
            follow_data(self, x)
        if self.init is None:
            self._init_state = "done"
            return
        if y is None:
            return  # initialised at the first call with targets
        self.tree.init_scaling(x)
        self.tree.init_balanced(x, y, cuts=self.init)
        store = pyro.get_param_store()
        for name, (owner, key) in self._scaling_names().items():
            store[name] = getattr(owner, key).clone()
        self._init_state = "done"

    def conditional_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        """Eq. 23 per point and node, ``(N, 2**D - 1)``: :meth:`RNNTree.conditional_posteriors`."""
        return self.tree.conditional_posteriors(x, noise=noise)

    def aggregate_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        """Eq. 24 per node over ``x``, ``(2**D - 1,)``: :meth:`RNNTree.aggregate_posteriors`."""
        return self.tree.aggregate_posteriors(x, noise=noise)

    def rules(self, leaf_values=None) -> trees.DecisionRules:
        """The single most likely tree, thresholds in the units of ``x``: :meth:`RNNTree.rules`."""
        return self.tree.rules(leaf_values)

    def _leaf_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Leaf logits ``(N, 2**D)``; under outer vectorised plates (``Predictive(...,
        parallel=True)``) and a noisy soft-feedback roll-out, one roll-out per element of
        those plates, ``batch + (N, 2**D)``, so that parallel draws are independent as
        sequential ones are."""
        tree = self.tree
        batch = _outer_plate_shape()
        if tree.feedback == "hard" or not (tree.training and tree.noise > 0) or not batch:
            return tree(x)
        copies = math.prod(batch)
        logits = tree(x.expand(copies, *x.shape).reshape(-1, x.shape[-1]))
        return logits.reshape(*batch, x.shape[0], -1)

    def forward(self, x: torch.Tensor, y=None, subsample_size: int | None = None):
        """Sample each point's ``"leaf"`` from :class:`RNNTree` inside the ``"data"`` plate.

        :param torch.Tensor x: inputs ``(N, L)``.
        :param y: targets as the model takes them; used only by the first-call
            initialisation.
        :param int subsample_size: minibatch size of the ``"data"`` plate; must match the
            model's.
        """
        if x.dim() != 2 or x.shape[-1] != self.tree.in_features:
            raise ValueError(
                f"x must have shape (N, {self.tree.in_features}); got {tuple(x.shape)}"
            )
        if self._init_state != "done":
            self._lazy_init(x, y)
        with shared_plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            logits = self._leaf_logits(x[idx])
            pyro.sample("leaf", dist.Categorical(logits=logits), infer={"enumerate": "parallel"})


def _outer_plate_shape() -> tuple:
    """Sizes of the vectorised plates active outside the ``"data"`` plate (``dim=-1``),
    aligned on the dims left of it, e.g. ``(S,)`` inside ``Predictive(parallel=True)``;
    ``()`` when there are none."""
    sizes = {}
    for messenger in _PYRO_STACK:
        if isinstance(messenger, PlateMessenger) and messenger.dim is not None:
            if messenger.dim < -1:
                sizes[messenger.dim] = messenger.subsample_size
    if not sizes:
        return ()
    return tuple(sizes.get(d, 1) for d in range(min(sizes), -1))
