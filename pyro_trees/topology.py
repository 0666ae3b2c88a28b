"""Binary tree topologies (balanced or not) for mixtures of experts, in heap numbering.

A :class:`Topology` is a full binary tree (every gate has two children) given by the
set of its **gates** (internal nodes) in the heap numbering of :mod:`pyro_trees.trees`:
the root is ``1`` and node ``i`` has the children ``2i`` (left) and ``2i + 1``
(right). Its **experts** (leaves) are the children of gates that are not gates
themselves, ordered left to right. A single expert (no gate) is the empty set.

Every gate ``g`` carries a logit, the log-odds of going **right** (the convention of
:func:`pyro_trees.trees.leaf_log_probs`); the path to expert ``j`` is encoded by the
*sign matrix* ``S[g, j]``: ``+1`` if the path turns right at gate ``g``, ``-1`` if
it turns left, ``0`` if ``g`` is not on it, so that

.. math:: \\log \\pi_j(x) = \\sum_g |S_{gj}|\\, \\log\\sigma(S_{gj}\\, a_g(x)).

:func:`enumerate_topologies` lists every full binary tree with a given number of
experts once up to mirror symmetry (swapping the two children of any gate); the counts
are the Wedderburn-Etherington numbers 1, 1, 1, 2, 3, 6, 11, 23, 46, ...
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from pyro_trees.trees import depth_of, left_child, num_internal, parent, right_child

__all__ = [
    "Topology",
    "enumerate_topologies",
    "expert_log_probs",
    "mirror_map",
    "num_topologies",
    "sign_matrices",
]


def expert_log_probs(gate_logits: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Log-probability of every expert from per-gate log-odds of going right, for any
    tree given by its path signs (:meth:`Topology.sign_matrix`, or a batch of them).

    :param gate_logits: ``batch_shape + (G,)``.
    :param signs: ``+1``/``-1``/``0`` path signs broadcastable to ``batch_shape + (G, E)``.
    :returns: ``batch_shape + (E,)``; logsumexp over the last dim is 0.
    """
    logsig = torch.nn.functional.logsigmoid(gate_logits.unsqueeze(-1) * signs)
    return (logsig * signs.abs()).sum(-2)


class Topology:
    """A full binary tree of gates and experts, balanced or not.

    :param gates: heap indices of the internal nodes. They must be positive
        integers, include the root ``1`` unless empty, and contain the parent of every
        non-root gate. The empty set is the single-expert tree.
    :raises ValueError: if ``gates`` is not a valid tree, naming the cause.

    Attributes (read only): ``gates`` (sorted tuple of heap indices), ``experts`` (heap
    indices of the leaves, left to right), ``num_gates == num_experts - 1``.

    ``Topology({1, 3})`` is the tree whose root's left child is an expert
    and whose right child is a gate with two experts: experts ``(2, 6, 7)``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.topology import Topology
    >>> top = Topology({1, 3})
    >>> top.experts, top.num_gates
    ((2, 6, 7), 2)
    >>> top.sign_matrix()
    tensor([[-1.,  1.,  1.],
            [ 0., -1.,  1.]])
    >>> top.expert_log_probs(torch.zeros(2)).exp()
    tensor([0.5000, 0.2500, 0.2500])
    """

    __slots__ = ("_gates", "_experts")

    def __init__(self, gates: Iterable[int] = ()):
        try:
            raw = list(gates)
        except TypeError:
            raise ValueError(f"gates must be an iterable of heap indices, got {gates!r}") from None
        checked = set()
        for g in raw:
            if isinstance(g, bool) or not hasattr(g, "__index__"):
                raise ValueError(f"gate indices must be integers, got {g!r}")
            g = g.__index__()
            if g < 1:
                raise ValueError(f"gate indices are heap nodes >= 1, got {g}")
            checked.add(g)
        if len(checked) != len(raw):
            raise ValueError(f"gates contain duplicates: {sorted(raw)}")
        if checked and 1 not in checked:
            raise ValueError(
                f"a non-empty topology must contain the root gate 1, got {sorted(raw)}"
            )
        for g in checked:
            if g > 1 and parent(g) not in checked:
                raise ValueError(
                    f"gate {g} has no parent gate {parent(g)}: the gates must form a "
                    "connected tree from the root"
                )
        self._gates = tuple(sorted(checked))
        self._experts = tuple(self._in_order(1)) if checked else (1,)

    def _in_order(self, node: int) -> list[int]:
        if node not in self._gate_set:
            return [node]
        return self._in_order(left_child(node)) + self._in_order(right_child(node))

    @property
    def _gate_set(self) -> frozenset:
        return frozenset(self._gates)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def balanced(cls, depth: int) -> Topology:
        """The complete tree of ``depth`` levels of gates (``2**depth`` experts)."""
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be an integer >= 0, got {depth!r}")
        return cls(range(1, num_internal(depth) + 1))

    @classmethod
    def from_experts(cls, experts: Iterable[int]) -> Topology:
        """The tree whose leaves are exactly the heap nodes ``experts``.

        :raises ValueError: if the leaves do not tile a full binary tree.
        """
        leaves = sorted(set(int(e) for e in experts))
        if not leaves or leaves[0] < 1:
            raise ValueError(f"experts must be heap nodes >= 1, got {leaves}")
        gates = {a for e in leaves for a in _ancestors(e)}
        clash = gates.intersection(leaves)
        if clash:
            raise ValueError(f"experts {sorted(clash)} are ancestors of other experts")
        topo = cls(gates)
        if sorted(topo.experts) != leaves:
            missing = sorted(set(topo.experts) - set(leaves))
            raise ValueError(f"experts {leaves} leave the subtrees {missing} without an expert")
        return topo

    @classmethod
    def from_nested(cls, tree) -> Topology:
        """Build from nested pairs: ``None`` is an expert, ``(left, right)`` a gate.

        ``((None, None), None)`` is a root with a gate on the left.
        """
        gates: list[int] = []

        def visit(t, node):
            if t is None:
                return
            if not (isinstance(t, tuple) and len(t) == 2):
                raise ValueError(f"a nested topology is None or a pair, got {t!r}")
            gates.append(node)
            visit(t[0], left_child(node))
            visit(t[1], right_child(node))

        visit(tree, 1)
        return cls(gates)

    # ------------------------------------------------------------------ structure
    @property
    def gates(self) -> tuple[int, ...]:
        """The gates' heap indices, sorted."""
        return self._gates

    @property
    def experts(self) -> tuple[int, ...]:
        """The experts' heap indices, left to right (in-order)."""
        return self._experts

    @property
    def num_gates(self) -> int:
        """Number of gates (internal nodes)."""
        return len(self._gates)

    @property
    def num_experts(self) -> int:
        """Number of experts (leaves): ``num_gates + 1``."""
        return len(self._experts)

    @property
    def depth(self) -> int:
        """Number of gates on the longest root-to-expert path."""
        return max(depth_of(e) for e in self._experts)

    def is_balanced(self) -> bool:
        """True for a complete tree (all experts at the same depth)."""
        return len({depth_of(e) for e in self._experts}) == 1

    def path(self, expert: int) -> list[tuple[int, int]]:
        """``[(gate position, sign), ...]`` from the root to expert number ``expert``;
        sign ``+1`` is a right turn."""
        node = self._experts[expert]
        pos = {g: k for k, g in enumerate(self._gates)}
        steps = []
        while node > 1:
            steps.append((pos[parent(node)], 1 if node % 2 else -1))
            node = parent(node)
        return steps[::-1]

    def sign_matrix(self, dtype=None, device=None) -> torch.Tensor:
        """Path signs ``S`` of shape ``(num_gates, num_experts)``: ``+1`` right, ``-1``
        left, ``0`` off the path (gates in heap order, experts left to right)."""
        out = torch.zeros(self.num_gates, self.num_experts, dtype=dtype, device=device)
        for j in range(self.num_experts):
            for g, s in self.path(j):
                out[g, j] = s
        return out

    def expert_log_probs(self, gate_logits: torch.Tensor) -> torch.Tensor:
        """Log-probability of every expert from per-gate log-odds of going right.

        :param gate_logits: shape ``batch_shape + (num_gates,)``.
        :returns: shape ``batch_shape + (num_experts,)``; logsumexp over the last dim is 0.
        """
        if gate_logits.shape[-1] != self.num_gates:
            raise ValueError(
                f"gate_logits must have {self.num_gates} entries in its last dim, "
                f"got {gate_logits.shape[-1]}"
            )
        s = self.sign_matrix(dtype=gate_logits.dtype, device=gate_logits.device)
        return expert_log_probs(gate_logits, s)

    def canonical(self) -> Topology:
        """The representative of this tree's mirror class used by :func:`enumerate_topologies`."""
        return Topology.from_nested(_canonical_nested(self._nested(1)))

    def _nested(self, node: int):
        if node not in self._gate_set:
            return None
        return (self._nested(left_child(node)), self._nested(right_child(node)))

    def to_nested(self):
        """Nested pairs (``None`` = expert), the inverse of :meth:`from_nested`."""
        return self._nested(1)

    # ------------------------------------------------------------------ protocol
    def __eq__(self, other) -> bool:
        return isinstance(other, Topology) and self._gates == other._gates

    def __hash__(self) -> int:
        return hash(self._gates)

    def __repr__(self) -> str:
        return f"Topology(gates={list(self._gates)})"

    def __str__(self) -> str:
        def show(t):
            return "E" if t is None else f"({show(t[0])} {show(t[1])})"

        return show(self.to_nested())

    def __reduce__(self):
        return (Topology, (self._gates,))


def _ancestors(node: int) -> list[int]:
    out = []
    while node > 1:
        node = parent(node)
        out.append(node)
    return out


def _shape_key(t) -> tuple:
    """A total order on nested shapes: by number of experts, then recursively."""
    if t is None:
        return (1,)
    a, b = _shape_key(t[0]), _shape_key(t[1])
    return (a[0] + b[0], a, b)


def _canonical_nested(t):
    if t is None:
        return None
    a, b = _canonical_nested(t[0]), _canonical_nested(t[1])
    return (a, b) if _shape_key(a) <= _shape_key(b) else (b, a)


@functools.cache
def _shapes(n: int) -> tuple:
    """All canonical nested shapes with ``n`` experts (smaller subtree on the left)."""
    if n == 1:
        return (None,)
    out = []
    for k in range(1, n // 2 + 1):
        left, right = _shapes(k), _shapes(n - k)
        for i, a in enumerate(left):
            for j, b in enumerate(right):
                if k == n - k and j < i:
                    continue
                out.append(_canonical_nested((a, b)))
    return tuple(out)


def enumerate_topologies(max_experts: int, min_experts: int = 1) -> list[Topology]:
    """Every binary topology with ``min_experts..max_experts`` experts, once up to mirror
    symmetry, ordered by number of experts (balanced-first order is not guaranteed).

    :raises ValueError: for bounds that are not integers with ``1 <= min <= max``.
    """
    for name, v in (("max_experts", max_experts), ("min_experts", min_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if min_experts > max_experts:
        raise ValueError(f"min_experts ({min_experts}) exceeds max_experts ({max_experts})")
    return [
        Topology.from_nested(t) for n in range(min_experts, max_experts + 1) for t in _shapes(n)
    ]


def mirror_map(source: Topology, target: Topology):
    """How the gates and experts of ``target`` correspond to those of a mirror image
    ``source`` (the same tree up to swapping the children of some gates).

    :returns: ``(gate_src, gate_flip, expert_src)``: target gate ``k`` is source gate
        ``gate_src[k]`` with its children swapped when ``gate_flip[k]`` (its logit,
        the log-odds of going right, changes sign); target expert ``j`` is source expert
        ``expert_src[j]`` (positions in ``gates`` / ``experts``).
    :raises ValueError: if the two topologies are not mirror images.
    """
    if _canonical_nested(source.to_nested()) != _canonical_nested(target.to_nested()):
        raise ValueError(f"{source} and {target} are not mirror images of each other")
    sg = {g: i for i, g in enumerate(source.gates)}
    se = {e: i for i, e in enumerate(source.experts)}
    tg = {g: i for i, g in enumerate(target.gates)}
    te = {e: i for i, e in enumerate(target.experts)}
    gate_src = [0] * target.num_gates
    gate_flip = [False] * target.num_gates
    expert_src = [0] * target.num_experts

    def shape(top, node):
        return _canonical_nested(top._nested(node))

    def walk(s_node, t_node):
        if t_node in te:
            expert_src[te[t_node]] = se[s_node]
            return
        k = tg[t_node]
        gate_src[k] = sg[s_node]
        sl, sr = left_child(s_node), right_child(s_node)
        tl, tr = left_child(t_node), right_child(t_node)
        if shape(source, sl) == shape(target, tl):
            walk(sl, tl)
            walk(sr, tr)
        else:
            gate_flip[k] = True
            walk(sr, tl)
            walk(sl, tr)

    walk(1, 1)
    return gate_src, gate_flip, expert_src


def sign_matrices(topologies, like: torch.Tensor) -> torch.Tensor:
    """The path signs (:meth:`Topology.sign_matrix`) of one topology or of a batch of
    topologies with the same number of experts, in the dtype and on the device of
    ``like``.

    :param topologies: a :class:`Topology`, a sequence of them, or sign matrices
        already (a tensor, converted to ``like``'s dtype and device).
    :param like: a tensor whose dtype and device the result takes.
    :returns: ``(num_gates, num_experts)`` for one topology, ``(K, num_gates,
        num_experts)`` for ``K`` of them.
    :raises ValueError: when the topologies of a batch differ in their number of experts.
    """
    if isinstance(topologies, torch.Tensor):
        return topologies.to(like)
    if isinstance(topologies, Topology):
        return topologies.sign_matrix(dtype=like.dtype, device=like.device)
    tops = list(topologies)
    if len({t.num_experts for t in tops}) != 1:
        raise ValueError("topologies batched together must have the same number of experts")
    return torch.stack([t.sign_matrix(dtype=like.dtype, device=like.device) for t in tops])


def num_topologies(num_experts: int) -> int:
    """Number of distinct topologies with exactly ``num_experts`` experts (Wedderburn-
    Etherington number)."""
    return len(_shapes(int(num_experts)))
