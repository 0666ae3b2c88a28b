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

**Missing inputs** (NaN; beyond the paper). Each node :math:`i` has, per input dimension
:math:`l`, the log-odds :math:`a_{il}` that a point missing :math:`x_l` goes right when
the node splits on :math:`l` (the soft analogue of XGBoost's default direction, per
split feature): the term :math:`\sigma(w_{l0} + w_{l1} x_l)` of eq. 13 becomes
:math:`\sigma(a_{il})` for such a point,

.. math:: q(m_i = 1 \mid x) = \sum_{l \notin M(x)} \pi_l\, \sigma(w_{l0} + w_{l1} x_l)
          + \sum_{l \in M(x)} \pi_l\, \sigma(a_{il}),

and the hard tree sends a missing :math:`x_{l^*}` right iff :math:`a_{il^*} > 0`. The
log-odds (``missing_logits``: ``(2**D - 1, L)`` per node under hard feedback,
``(D, L)`` per depth under soft feedback) start where :meth:`RNNTree.init_balanced`
puts them (the greedy side of the missing points, or the side most observed points
take) and are trained with ``missing=True`` (a buffer otherwise, used as started).

.. rubric:: Recipe: an RNN-Tree partition inside your own Pyro model

Any model that needs an input-dependent discrete partition of its data can take the
RNN-Tree as the posterior of that partition. Three lines in the model, three in the
guide:

1. In the model, inside the data plate, sample the region of each point from the
   tree-balance prior's per-point marginal and index your per-region parameters with
   it (it may be an enumerated ``(2**D, 1)`` tensor, so index, don't branch)::

       with pyro.plate("data", n, subsample_size=b, dim=-1) as idx:
           leaf = pyro.sample("leaf", BalancedLeaf(depth, n, dtype=x.dtype))
           pyro.sample("obs", dist.Poisson(rate[leaf]), obs=y[idx])

2. In the guide (the model's signature), sample the same site from the RNN-Tree's leaf
   logits and mark it for parallel enumeration::

       tree = RNNTree(in_features, depth, feedback="hard")
       ...
       with pyro.plate("data", n, subsample_size=b, dim=-1) as idx:
           pyro.sample("leaf", dist.Categorical(logits=tree(x[idx])),
                       infer={"enumerate": "parallel"})

3. Train with :class:`~pyro_trees.infer.TreeELBO` (``TraceEnum_ELBO`` plus the
   balance prior's coupling). Start the tree balanced with
   ``tree.init_balanced(x, targets)`` (median cuts, dimensions chosen with any
   targets you have), read the partition back with ``tree.rules(leaf_values=...)``
   and route new inputs with ``tree.hard_leaf(x)``.

``tests/models/test_heteroscedastic_gp.py::test_recipe_user_model`` writes such a model
(Poisson counts whose rate changes by region) and checks that the partition is found.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import nn

from pyro_trees import trees
from pyro_trees._tree_start import balanced_start, input_scaling
from pyro_trees.guides._node_split import _log_right_left, _NodeSplitLogProbs

__all__ = ["RNNTree"]


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
    :param bool missing: train where points missing an input go (``missing_logits`` a
        parameter; default ``False``: a buffer, routing missing inputs as started).
    :param str name: parameter-store prefix (``PyroModule`` name of a root module).

    Inputs are standardised inside, ``(x - x_loc) / x_scale`` with the buffers
    ``x_loc``, ``x_scale`` ``(L,)`` (0 and 1 until :meth:`init_scaling` sets them), so
    that split weights live on the unit scale whatever the units of ``x``;
    :meth:`rules` reports thresholds in the units of ``x``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import RNNTree
    >>> x = torch.randn(5, 2)
    >>> tree = RNNTree(2, 2, hidden_size=8)
    >>> tree.init_scaling(x)
    >>> tree.init_balanced(x)
    >>> tree(x).shape
    torch.Size([5, 4])
    >>> bool(torch.allclose(tree(x).exp().sum(-1), torch.ones(5)))
    True
    >>> tree.rules().route(x).shape
    torch.Size([5])
    """

    missing = False  # trees pickled before missing inputs existed

    def __init__(
        self,
        in_features: int,
        depth: int,
        *,
        hidden_size: int = 32,
        feedback: str = "hard",
        noise: float = 0.5,
        missing: bool = False,
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
        # where a point missing an input goes: per node (hard) or per depth (soft);
        # created last and without random draws, so that nothing else changes
        if not isinstance(missing, bool):
            raise ValueError(f"missing must be True or False, got {missing!r}")
        self.missing = missing
        rows = trees.num_internal(self.depth) if feedback == "hard" else self.depth
        miss = torch.zeros(rows, self.in_features)
        if missing:
            self.missing_logits = nn.Parameter(miss)
        else:
            self.register_buffer("missing_logits", miss)

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
        sharpness: float = 40.0,
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
        ``sharpness / std`` (the node's points' standard deviation along it: the
        sigmoid's 10-90 % band spans 11 % of that deviation at ``sharpness=40``), and the
        chosen dimension's logit exceeds the others' by ``dim_margin + log(L - 1)``, so
        that it carries probability
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

        Missing inputs (NaN) are allowed: the cuts sit among the observed values, and
        ``missing_logits`` start at the side that the greedy cut found best for the
        points missing its dimension, or else at the log-odds of the node's observed
        points going right (its hard limit: the side most of them take).

        ``cuts="greedy"`` (needs ``y``) instead grows the start as CART does: every node
        takes the dimension and cut that most reduce the impurity of its points' targets,
        each side keeping at least ``min_leaf`` points (other dimensions start at their
        own best cuts); a node where no cut reduces it falls back to the balanced rule.
        End-to-end training then refines a greedy tree instead of a balanced one.

        :param x: inputs ``(N, L)`` in the units the tree is called with (standardised
            by the tree's own ``x_loc``, ``x_scale``).
        :param y: optional targets, used only to choose split dimensions (and, with
            ``cuts="greedy"``, the cuts).
        :param float sharpness: the start's slope times the node's spread. Training moves
            a slope by about the learning rate a step, so the start's is the one that
            lasts: 40 (default) measured better than 20 on unseen step functions (the
            band blurs fewer points into the neighbouring leaf; ``benchmarks/pyro_path``)
            and than 80-100, from which a misplaced cut can no longer move.
        :param str cuts: ``"balanced"`` (median cuts) or ``"greedy"`` (impurity cuts).
        :param int min_leaf: fewest points on either side of a greedy cut.
        """
        L = self.in_features
        x = self.standardise(x)
        states = self.node_states().to(x.dtype)  # (I, H)
        targets, _, missing = balanced_start(
            x,
            y,
            self.depth,
            sharpness=sharpness,
            dim_margin=dim_margin,
            cuts=cuts,
            min_leaf=min_leaf,
            with_missing=True,
        )
        miss = self._missing_logits()
        if miss is not None:  # per node, or averaged over each depth's nodes
            if self.feedback == "soft":
                missing = torch.stack(
                    [missing[(1 << d) - 1 : (2 << d) - 1].mean(0) for d in range(self.depth)]
                )
            miss.copy_(missing.to(miss))
        base = torch.cat([self.dim_head(states), self.split_head(states)], dim=-1)
        if self.feedback == "hard":
            self.node_offset.copy_(targets - base)
            return
        design = torch.cat([states, torch.ones_like(states[:, :1])], dim=-1).double()
        gram = design.T @ design + ridge * torch.eye(
            design.shape[1], dtype=design.dtype, device=design.device
        )
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
        missing = torch.isnan(x)
        if bool(missing.any()):
            x = torch.where(missing, torch.zeros_like(x), x)
            miss = self._missing_logits().to(x.dtype)
        else:
            missing = miss = None
        n = x.shape[0]
        h = self.h0.to(x.dtype).expand(n, -1)
        inp = x.new_zeros(n, 1)
        rights, lefts = [], []
        for d in range(self.depth):
            h = self.cell(inp, h)
            log_dim, w0, w1 = self._heads(h)
            if missing is None:
                log_right, log_left = _log_right_left(x, log_dim, w0, w1)
            else:
                log_right, log_left = _log_right_left(x, log_dim, w0, w1, missing, miss[d])
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
            missing = torch.isnan(flat)
            if bool(missing.any()):
                log_right, log_left = self._missing_log_probs(flat, missing, log_dim, w0, w1)
            else:
                log_right, log_left = _NodeSplitLogProbs.apply(flat, log_dim, w0, w1)
            return (log_right - log_left).reshape(*x.shape[:-1], -1)  # (N, 2**D - 1)
        raise ValueError(f"feedback must be 'soft' or 'hard', got {feedback!r}")

    def node_params(self, dtype=None) -> dict:
        """Every learnt tensor that hard-feedback routing reads, read once: the per-node
        heads ``log_dim``, ``w0``, ``w1`` ``(2**D - 1, L)`` (from :meth:`node_states`)
        and the input scaling ``x_loc``, ``x_scale`` ``(L,)``. A compiled loss takes them
        as inputs (:meth:`leaf_log_probs_of`), so that the program reads no module.

        :param dtype: the dtype of the returned tensors (default: the parameters').
        """
        with self._pyro_context:  # through Pyro's store, so that plain SVI trains them
            log_dim, w0, w1 = self._node_heads(dtype)
            dtype = log_dim.dtype
            return {
                "log_dim": log_dim,
                "w0": w0,
                "w1": w1,
                "x_loc": self.x_loc.to(dtype),
                "x_scale": self.x_scale.to(dtype),
            }

    @staticmethod
    def leaf_log_probs_of(x: torch.Tensor, params: dict) -> torch.Tensor:
        """Hard-feedback leaf log-probabilities ``(N, 2**D)`` of complete rows ``x``
        ``(N, L)`` (no NaN) from :meth:`node_params`: :meth:`forward`'s values, written
        as one expression in log space over ``(N, 2**D - 1, L)`` that ``torch.compile``
        fuses (the eager :meth:`forward` computes them blockwise, within a memory bound,
        and also routes missing inputs)."""
        xs = (x - params["x_loc"]) / params["x_scale"]
        log_right, log_left = _log_right_left(
            xs.unsqueeze(-2), params["log_dim"], params["w0"], params["w1"]
        )
        return trees.leaf_log_probs(log_right - log_left)

    def _missing_logits(self) -> torch.Tensor | None:
        """``missing_logits`` (``None`` for a tree pickled before missing inputs)."""
        return getattr(self, "missing_logits", None)

    def _missing_log_probs(self, x, missing, log_dim, w0, w1):
        """Eq. 13 under hard feedback for standardised rows ``x`` ``(N, L)`` with missing
        values where ``missing`` says: the rows with none through
        :class:`_NodeSplitLogProbs`, the others in log space with the nodes'
        ``missing_logits``; ``(log_right, log_left)``, each ``(N, 2**D - 1)``."""
        miss = self._missing_logits()
        if miss is None:
            raise ValueError("this RNNTree predates missing inputs; refit it to route NaN")
        x = torch.where(missing, torch.zeros_like(x), x)
        rows = missing.any(-1)
        full = (~rows).nonzero().flatten()
        part = rows.nonzero().flatten()
        right_p, left_p = _log_right_left(
            x[part].unsqueeze(-2), log_dim, w0, w1, missing[part].unsqueeze(-2), miss.to(x.dtype)
        )
        shape = (x.shape[0], w0.shape[0])
        log_right = x.new_zeros(shape).index_put((part,), right_p)
        log_left = x.new_zeros(shape).index_put((part,), left_p)
        if full.numel():
            right_f, left_f = _NodeSplitLogProbs.apply(x[full], log_dim, w0, w1)
            log_right = log_right.index_put((full,), right_f)
            log_left = log_left.index_put((full,), left_f)
        return log_right, log_left

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
        ``-inf``/``+inf``). A missing value of ``x_{l*}`` goes right iff the node's
        ``missing_logits`` for ``l*`` are positive (``DecisionRules.missing_right``).
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
        missing_right = None
        miss = self._missing_logits()
        if miss is not None:  # a missing x_l* goes right iff its log-odds are positive
            if self.feedback == "soft":
                miss = trees.depth_logits_to_node_logits(miss.T).T
            missing_right = miss.gather(-1, feature.unsqueeze(-1)).squeeze(-1) > 0
        return trees.DecisionRules(feature, threshold, greater, list(leaf_values), missing_right)

    @torch.no_grad()
    def rule_spread(self, level: float = 0.9) -> dict:
        """How firmly each rule of :meth:`rules` routes, per internal node, heap order.

        :param float level: the routing probability that counts as sure.
        :returns: a dict of tensors ``(2**D - 1,)``: ``"feature_prob"``, the probability
            :math:`\\mathrm{softmax}_l(f(h_i))` of the node's feature :math:`l^*` (the
            chance that the node routes on it at all); ``"lower"`` and ``"upper"``, in the
            units of ``x``, the inputs :math:`x_{l^*}` whose probability of going right
            on that feature, :math:`\\sigma(w_{l^*0} + w_{l^*1} x_{l^*})`, lies between
            :math:`(1 - \\mathrm{level})/2` and :math:`(1 + \\mathrm{level})/2`: the
            band about the threshold where the soft tree routes unsure (the threshold
            itself where the slope is infinite, the whole line where it is zero).
        """
        if not 0 < level < 1:
            raise ValueError(f"level must lie in (0, 1), got {level}")
        log_dim, w0, w1 = self._node_heads()
        feature = log_dim.argmax(-1)
        prob = log_dim.gather(-1, feature.unsqueeze(-1)).squeeze(-1).exp()
        a = w0.gather(-1, feature.unsqueeze(-1)).squeeze(-1)
        b = w1.gather(-1, feature.unsqueeze(-1)).squeeze(-1)
        half = math.log((1 + level) / (1 - level)) / b.abs()  # inf where b == 0
        centre = torch.where(b == 0, torch.zeros_like(a), -a / torch.where(b == 0, 1.0, b))
        loc, scale = self.x_loc.to(a)[feature], self.x_scale.to(a)[feature]
        return {
            "feature_prob": prob,
            "lower": loc + scale * (centre - half),
            "upper": loc + scale * (centre + half),
        }

    def hard_leaf(self, x: torch.Tensor) -> torch.Tensor:
        """Leaf ``(N,)`` of each input under the single most likely tree."""
        return self.rules().route(x)
