r"""The tree-balance prior over the routing of a whole data set (Antorán et al., eqs. 4, 6).

The prior believes that every decision node splits the points that reach it into two
halves. Antorán et al. write it per depth as :math:`\binom{N}{K} 0.5^N`, which is not
normalised over routing vectors; pyro_trees uses its normalised, node-wise form

.. math::

    p(M) = \prod_{i \in \text{internal}} \binom{N_i}{K_i} \Big/ \binom{2 N_i}{N_i},

where :math:`N_i` points reach node :math:`i` and :math:`K_i` of them go right. Each
factor sums to one over the :math:`2^{N_i}` splits (Vandermonde's identity), so
:math:`p` is a proper distribution; at depth 1 it is eq. 4 normalised. Per node it
equals the paper's per-depth prior conditioned on the path so far, which is what its
aggregate posteriors (eq. 24) and the link to Frosst & Hinton (App. D) use.

**Encoding.** A value is a long tensor of leaf indices, one per point: event shape
``(num_points,)``, leaf ``l`` in ``[0, 2**depth)`` as in :mod:`pyro_trees.trees`.

**Factorisation used for inference.** Each point's marginal under :math:`p` is uniform
over the leaves (every split is symmetric), so :math:`p(M) = \prod_n 2^{-D}\, c(M)`
with a *coupling* :math:`c(M)`. Models put the per-point marginal,
:class:`BalancedLeaf`, inside their data plate; :class:`~pyro_trees.infer.TreeELBO`
adds :math:`\mathbb{E}_q[\log c(M)]`, which depends on all points at once.

**Stirling approximation** (App. B, with the sign of eq. 9, which eqs. 19-21 give;
eq. 22 has the entropy sign flipped). With :math:`\log\binom{n}{k}\approx n H(k/n)`,
:math:`\log\binom{2n}{n} \approx 2n\log 2`, and the aggregate posterior of eq. 24,
:math:`\alpha_i = \sum_n P_n(i\to\text{right}) / \sum_n P_n(i)`, at each node

.. math::

    \mathbb{E}_q[\log c(M)] \approx -\sum_i \hat N_i\,
        \mathrm{KL}\big(\mathrm{Bern}(\alpha_i)\,\|\,\mathrm{Bern}(\tfrac12)\big),
    \qquad \hat N_i = \sum_n P_n(i),

so :math:`\mathrm{KL}(q\,\|\,p) \approx -\sum_n H(q_n) + N D \log 2 + \sum_i \hat N_i
\mathrm{KL}(\mathrm{Bern}(\alpha_i)\|\mathrm{Bern}(\frac12))`: eq. 9 up to a constant.
The :math:`O(\log N)` terms of Stirling's series cancel between numerator and
denominator, so the error is :math:`O(1)` per node while the KL grows like :math:`N`.
"""

from __future__ import annotations

import itertools
import math

import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistribution
from torch.distributions import register_kl

from pyro_trees import trees

__all__ = [
    "BalancedLeaf",
    "TreeBalance",
    "TreeRouting",
    "expected_log_coupling",
    "tree_balance_kl",
]


def _log_binom(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)


def _node_counts(leaf_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N_i, K_i)`` of every internal node (heap order) from per-leaf counts ``(..., 2**D)``."""
    levels = []  # per depth, from the leaves up: counts of the nodes at that depth
    current = leaf_counts
    while current.shape[-1] > 1:
        levels.append(current)
        current = current.reshape(current.shape[:-1] + (-1, 2)).sum(-1)
    levels.append(current)
    levels = levels[::-1]  # levels[d] = counts of nodes at depth d
    reach = torch.cat(levels[:-1], dim=-1)  # internal nodes, heap order
    right = torch.cat([lv[..., 1::2] for lv in levels[1:]], dim=-1)
    return reach, right


def _log_coupling_from_counts(reach: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    log2 = math.log(2.0)
    per_node = _log_binom(reach, right) - _log_binom(2 * reach, reach) + reach * log2
    return per_node.sum(-1)


class TreeBalance(TorchDistribution):
    r"""Tree-balance prior over the leaves of ``num_points`` points (see module docs).

    :param int depth: depth :math:`D` of the complete binary tree (``2**D`` leaves).
    :param int num_points: number of points :math:`N` routed together.

    ``event_shape = (num_points,)``; values are long leaf indices.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import TreeBalance
    >>> prior = TreeBalance(depth=1, num_points=4)
    >>> balanced, lopsided = torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 0, 0])
    >>> bool(prior.log_prob(balanced) > prior.log_prob(lopsided))
    True
    >>> prior.event_shape
    torch.Size([4])
    """

    arg_constraints: dict = {}
    has_enumerate_support = False

    def __init__(self, depth: int, num_points: int, *, batch_shape=(), validate_args=None):
        self.depth = trees.check_depth(depth, what="the per-leaf and per-node counts")
        if int(num_points) < 1:
            raise ValueError(f"num_points must be >= 1, got {num_points}")
        self.num_points = int(num_points)
        super().__init__(
            batch_shape=torch.Size(batch_shape),
            event_shape=torch.Size([self.num_points]),
            validate_args=validate_args,
        )

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self):
        return constraints.independent(
            constraints.integer_interval(0, trees.num_leaves(self.depth) - 1), 1
        )

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(TreeBalance, _instance)
        new.depth, new.num_points = self.depth, self.num_points
        super(TreeBalance, new).__init__(
            batch_shape=torch.Size(batch_shape), event_shape=self.event_shape, validate_args=False
        )
        new._validate_args = self._validate_args
        return new

    @property
    def marginal(self) -> BalancedLeaf:
        """The distribution of one point's leaf: uniform over the leaves."""
        return BalancedLeaf(self.depth, self.num_points)

    def _counts(self, value: torch.Tensor) -> torch.Tensor:
        """Points per leaf, ``value.shape[:-1] + (2**depth,)`` (no ``(N, 2**depth)`` one-hot)."""
        value = value.long()
        counts = torch.zeros(
            value.shape[:-1] + (trees.num_leaves(self.depth),),
            dtype=torch.get_default_dtype(),
            device=value.device,
        )
        return counts.scatter_add_(-1, value, torch.ones_like(value, dtype=counts.dtype))

    def log_coupling(self, value: torch.Tensor) -> torch.Tensor:
        r""":math:`\log c(M) = \log p(M) + N D \log 2`, shape ``sample_shape + batch_shape``."""
        reach, right = _node_counts(self._counts(value))
        return _log_coupling_from_counts(reach, right)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        return self.log_coupling(value) - self.num_points * self.depth * math.log(2.0)

    def sample(self, sample_shape=()):
        """Exact sampling: at every node the number going right ``K`` follows
        :math:`p(K) \\propto \\binom{N_i}{K}^2` (hypergeometric), then a uniformly random
        subset of that size goes right."""
        shape = torch.Size(sample_shape) + self.batch_shape
        n = self.num_points
        # The deepest level holds (2**(D-1), N + 1) split-size logits.
        trees.check_depth(
            self.depth, n + 1, what=f"sampling the routing of {n:,} points (split-size logits)"
        )
        flat = max(1, math.prod(shape))
        out = torch.empty(flat, n, dtype=torch.long)
        k = torch.arange(n + 1, dtype=torch.get_default_dtype())
        for s in range(flat):
            node = torch.ones(n, dtype=torch.long)
            for d in range(self.depth):
                first = 1 << d
                local = node - first  # position among the 2**d nodes of this depth
                sizes = torch.bincount(local, minlength=first).to(k.dtype)
                logits = 2 * _log_binom(sizes.unsqueeze(-1), k.clamp(max=sizes.unsqueeze(-1)))
                logits = logits.masked_fill(k > sizes.unsqueeze(-1), -math.inf)
                num_right = dist.Categorical(logits=logits).sample()
                # Random ranks within each node: sort by (node, uniform key).
                order = torch.argsort(local.to(k.dtype) + torch.rand(n).clamp(max=0.999))
                starts = torch.cumsum(sizes, 0) - sizes
                rank = torch.empty(n, dtype=torch.long)
                rank[order] = torch.arange(n) - starts.long()[local[order]]
                node = 2 * node + (rank < num_right[local]).long()
            out[s] = node - (1 << self.depth)
        return out.reshape(shape + (n,))


class BalancedLeaf(dist.Categorical):
    """One point's leaf under :class:`TreeBalance`: uniform over ``2**depth`` leaves.

    ``dtype``/``device`` follow the data (pass those of the inputs).

    Use it for the per-point routing site inside a data plate;
    :class:`~pyro_trees.infer.TreeELBO` recognises it and adds the coupling term
    that makes the joint over the plate :class:`TreeBalance` (``num_points`` is the
    full data size, also under subsampling).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import BalancedLeaf
    >>> leaf = BalancedLeaf(depth=2, num_points=10)
    >>> leaf.probs
    tensor([0.2500, 0.2500, 0.2500, 0.2500])
    >>> leaf.joint.event_shape
    torch.Size([10])
    """

    def __init__(self, depth: int, num_points: int, *, dtype=None, device=None, validate_args=None):
        self.depth = trees.check_depth(
            depth,
            dtype=torch.get_default_dtype() if dtype is None else dtype,
            device=device,
            what="the leaf logits",
        )
        self.num_points = int(num_points)
        logits = torch.zeros(trees.num_leaves(self.depth), dtype=dtype, device=device)
        super().__init__(logits=logits, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        """A copy with batch shape ``batch_shape``, keeping ``depth`` and ``num_points``."""
        new = self._get_checked_instance(BalancedLeaf, _instance)
        new.depth, new.num_points = self.depth, self.num_points
        return super().expand(batch_shape, _instance=new)

    @property
    def joint(self) -> TreeBalance:
        """The joint over all ``num_points`` points: :class:`TreeBalance`."""
        return TreeBalance(self.depth, self.num_points)


class TreeRouting(dist.TorchDistribution):
    """Independent per-point routing over leaves: the form of every amortised guide.

    :param torch.Tensor logits: leaf logits of shape ``batch_shape + (N, 2**D)``.

    ``event_shape = (N,)``; ``kl_divergence(TreeRouting, TreeBalance)`` is registered
    (the Stirling approximation, see :func:`tree_balance_kl`).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import TreeBalance, TreeRouting
    >>> q = TreeRouting(torch.zeros(3, 4))
    >>> q.event_shape, q.sample().shape
    (torch.Size([3]), torch.Size([3]))
    >>> kl = torch.distributions.kl_divergence(q, TreeBalance(2, 3))
    >>> kl.shape
    torch.Size([])
    """

    arg_constraints = {"logits": constraints.real_vector}
    has_enumerate_support = False

    def __init__(self, logits: torch.Tensor, validate_args=None):
        self.logits = logits - logits.logsumexp(-1, keepdim=True)
        self._cat = dist.Categorical(logits=self.logits)
        super().__init__(
            batch_shape=logits.shape[:-2],
            event_shape=logits.shape[-2:-1],
            validate_args=validate_args,
        )

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self):
        return constraints.independent(
            constraints.integer_interval(0, self.logits.shape[-1] - 1), 1
        )

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        return TreeRouting(self.logits.expand(batch_shape + self.logits.shape[-2:]))

    def log_prob(self, value):
        return self._cat.log_prob(value).sum(-1)

    def sample(self, sample_shape=()):
        return self._cat.sample(sample_shape)

    def entropy(self):
        return self._cat.entropy().sum(-1)


def expected_log_coupling(
    leaf_logits: torch.Tensor, depth: int | None = None, *, scale: float = 1.0
) -> torch.Tensor:
    r"""Stirling approximation of :math:`\mathbb{E}_q[\log c(M)]` (module docs).

    :param leaf_logits: ``(..., N, 2**D)`` per-point leaf logits (normalised or not).
    :param scale: weight of each point (``N_total / N`` under subsampling): node masses
        :math:`\hat N_i` are scaled by it; aggregates :math:`\alpha_i` are not.
    :returns: shape ``(...)``; always ``<= 0``.
    """
    log_q = leaf_logits - leaf_logits.logsumexp(-1, keepdim=True)
    if depth is not None and log_q.shape[-1] != trees.num_leaves(depth):
        raise ValueError(f"leaf_logits has {log_q.shape[-1]} leaves; depth {depth} has {2**depth}")
    # the aggregate posteriors of eq. 24 and the node masses, (..., I) each
    alpha, internal = trees.aggregate_right_probs(log_q)
    # alpha is kept inside (eps, 1 - eps): xlogy's gradient is infinite at 0 and 1.
    eps = torch.finfo(internal.dtype).eps
    alpha = alpha.clamp(eps, 1 - eps)
    kl_half = (
        torch.special.xlogy(alpha, alpha)
        + torch.special.xlogy(1 - alpha, 1 - alpha)
        + math.log(2.0)
    )
    return -(scale * internal * kl_half).sum(-1)


def _exact_expected_log_coupling(leaf_logits: torch.Tensor, depth: int) -> torch.Tensor:
    n, leaves = leaf_logits.shape[-2:]
    if leaves**n > 2**20:
        raise ValueError(
            f"exact enumeration needs {leaves}**{n} = {leaves**n:,} joint routings; "
            "use method='stirling' for more than a handful of points"
        )
    log_q = leaf_logits - leaf_logits.logsumexp(-1, keepdim=True)
    prior = TreeBalance(depth, n)
    values = torch.tensor(list(itertools.product(range(leaves), repeat=n)))  # (S, N)
    log_q_joint = log_q.gather(-1, values.T).sum(0)
    return (log_q_joint.exp() * prior.log_coupling(values).to(log_q.dtype)).sum()


def tree_balance_kl(
    leaf_logits: torch.Tensor, depth: int, *, method: str = "stirling"
) -> torch.Tensor:
    r""":math:`\mathrm{KL}(q(M)\,\|\,\mathrm{TreeBalance})` for independent per-point routing.

    :param leaf_logits: ``(N, 2**D)`` leaf logits of :math:`q`.
    :param str method: ``"stirling"`` (App. B, any ``N``) or ``"exact"`` (enumerates all
        ``(2**D)**N`` joint routings; tiny ``N`` only, for tests).
    """
    log_q = leaf_logits - leaf_logits.logsumexp(-1, keepdim=True)
    n = log_q.shape[-2]
    neg_entropy = (log_q.exp() * log_q).sum((-1, -2))
    per_point = neg_entropy + n * depth * math.log(2.0)  # sum_n KL(q_n || uniform)
    if method == "stirling":
        return per_point - expected_log_coupling(log_q, depth)
    if method == "exact":
        return per_point - _exact_expected_log_coupling(log_q, depth)
    raise ValueError(f"method must be 'stirling' or 'exact', got {method!r}")


@register_kl(TreeRouting, TreeBalance)
def _kl_routing_balance(q: TreeRouting, p: TreeBalance) -> torch.Tensor:
    if q.event_shape != p.event_shape or q.logits.shape[-1] != trees.num_leaves(p.depth):
        raise ValueError(
            f"routing over {tuple(q.logits.shape[-2:])} does not match TreeBalance("
            f"depth={p.depth}, num_points={p.num_points})"
        )
    return tree_balance_kl(q.logits, p.depth)
