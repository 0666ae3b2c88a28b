"""Parent arrays of forests: validation, depths and the sampling plans of a tree.

A forest over ``N`` nodes is a parent array ``(N,)``: ``parents[i]`` is the parent of
node ``i``, or ``-1`` at a root. Everything here is vectorised (pointer jumping,
segmented scans): no Python loop over nodes. Shared by
:class:`~pyro_trees.distributions.TreeNormal` and the TreeVI guides.
"""

from __future__ import annotations

import math

import torch
from torch.distributions.utils import lazy_property

__all__ = [
    "TreePlan",
    "jump_solve",
    "parents_and_depths",
    "scale_noise",
    "scan",
    "tree_depths",
    "validate_parents",
]


def validate_parents(parents, num_nodes: int | None = None) -> torch.Tensor:
    """Check a parent array and return it as a ``torch.long`` tensor.

    ``parents[i]`` is the parent of node ``i``, or ``-1`` when ``i`` is a root. Several
    roots (a forest) are allowed. Raises :class:`ValueError` naming the cause when the
    array is not one-dimensional, not integer, out of range, has a self-loop or a cycle.
    The check costs :math:`O(N \\log \\text{height})` (pointer jumping), never a Python
    loop over nodes.

    :param parents: integer array-like of shape ``(N,)``.
    :param int num_nodes: the expected ``N`` (optional).
    :rtype: torch.LongTensor
    """
    return parents_and_depths(parents, num_nodes)[0]


def parents_and_depths(parents, num_nodes=None):
    """:func:`validate_parents` that also returns the depths it computes."""
    if not isinstance(parents, torch.Tensor):
        try:
            parents = torch.as_tensor(parents)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"parents must be an integer array of shape (N,): {e}") from None
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise ValueError(f"parents must have an integer dtype, got {parents.dtype}")
    if parents.dim() != 1:
        raise ValueError(f"parents must be one-dimensional (N,), got shape {tuple(parents.shape)}")
    parents = parents.long()
    n = parents.numel()
    if num_nodes is not None and n != num_nodes:
        raise ValueError(f"parents has {n} entries but there are {num_nodes} nodes")
    if n == 0:
        raise ValueError("parents must describe at least one node")
    bad = (parents < -1) | (parents >= n)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"parent index out of range: parents[{i}] = {int(parents[i])}, "
            f"expected -1 (root) or a node in [0, {n - 1}]"
        )
    idx = torch.arange(n, device=parents.device)
    selfloop = parents == idx
    if selfloop.any():
        i = int(selfloop.nonzero()[0])
        raise ValueError(f"parents has a self-loop at node {i} (use -1 for a root)")
    depth = _check_and_depths(parents)
    if depth is None:
        stuck = _pointer_jump(parents, math.ceil(math.log2(n + 1)) + 1) != n
        i = int(stuck.nonzero()[0])
        raise ValueError(f"parents contains a cycle (node {i} never reaches a root)")
    return parents, depth


def _index_dtype(n: int) -> torch.dtype:
    # int32 pointer arrays gather several times faster than int64 ones on CPU
    return torch.int32 if n < 2**31 - 1 else torch.long


def _sentinel_pointers(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` with roots (and an extra last entry) pointing at the sentinel ``n``."""
    n = parents.numel()
    ptr = torch.where(parents < 0, n, parents).to(_index_dtype(n))
    return torch.cat([ptr, ptr.new_tensor([n])])


def _pointer_jump(parents: torch.Tensor, rounds: int) -> torch.Tensor:
    """``2**rounds``-th ancestors of a range-checked parent array, ``n`` past a root."""
    ptr = _sentinel_pointers(parents)
    for _ in range(rounds):
        ptr = ptr.index_select(0, ptr)
    return ptr[:-1].long()


def _check_and_depths(parents: torch.Tensor) -> torch.Tensor | None:
    """Depths of a range-checked parent array by pointer jumping, ``None`` on a cycle.

    Each round doubles the stretch of ancestors every node has absorbed: after ``k``
    rounds ``ptr[i]`` is the ``2**k``-th ancestor of ``i`` (or the sentinel ``n`` past a
    root) and ``depth[i]`` the distance to it. A forest is done after
    ``ceil(log2(height + 1))`` rounds, so the cost is :math:`O(N \\log \\text{height})`;
    nodes on or below a cycle never reach the sentinel, so ``ceil(log2(N + 1)) + 1``
    rounds without finishing prove a cycle.
    """
    n = parents.numel()
    ptr = _sentinel_pointers(parents)
    depth = (ptr != n).to(ptr.dtype)  # the sentinel has depth 0
    for _ in range(math.ceil(math.log2(n + 1)) + 2):
        if bool((ptr[:n] == n).all()):
            return depth[:n].long()
        depth = depth + depth.index_select(0, ptr)
        ptr = ptr.index_select(0, ptr)
    return None


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (roots have depth 0) of a *valid* parent array, by pointer
    jumping in :math:`O(N \\log \\text{height})`."""
    depth = _check_and_depths(parents)
    if depth is None:
        raise ValueError("parents contains a cycle")
    return depth


def jump_solve(a: torch.Tensor, b: torch.Tensor, jumps) -> torch.Tensor:
    """Solve ``x[j] = a[j] x[p(j)] + b[j]`` along dim ``-2`` (``a = 0`` at roots) by
    pointer jumping over ``jumps``, the pointer arrays ``p, p∘p, ...``
    (:attr:`TreePlan.jumps`): each step substitutes the pointed-to equation, doubling
    the stretch of absorbed ancestors. Out of place, so autograd and ``torch.compile``
    follow it."""
    for k, ptr in enumerate(jumps):
        b = b + a * b.index_select(-2, ptr)
        if k + 1 < len(jumps):
            a = a * a.index_select(-2, ptr)
    return b


def scan(a: torch.Tensor, b: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Solve ``x[j] = a[j] x[j-1] + b[j]`` along dim ``-2`` with ``x[-1] = 0``.

    Odd-even reduction (a work-efficient parallel scan): pairing neighbours halves the
    system, so ``2 log2 n`` sequential steps of total work :math:`O(n)`; only products
    and sums of the recursion's own coefficients appear (no division), so it is as
    stable as the sequential loop. ``a`` broadcasts against ``b``; ``a[..., 0, :]`` is
    ignored. With ``inplace`` the result overwrites ``b`` (which must then have the
    full shape and no autograd history).
    """
    n = b.shape[-2]
    if n == 1:
        return b
    m = n // 2  # odd positions 1, 3, ...; even positions 0, 2, ... number n - m
    ao, ae = a[..., 1::2, :], a[..., 0::2, :]
    bo, be = b[..., 1::2, :], b[..., 0::2, :]
    # x[2k+1] = (a[2k+1] a[2k]) x[2k-1] + (a[2k+1] b[2k] + b[2k+1])
    x_odd = scan(ao * ae[..., :m, :], torch.addcmul(bo, ao, be[..., :m, :]), inplace)
    tail = n - m - 1  # even positions 2, 4, ... take a[2k] x[2k-1] + b[2k]
    if inplace:
        bo.copy_(x_odd)
        be[..., 1:, :].addcmul_(ae[..., 1:, :], x_odd[..., :tail, :])
        return b
    x_even = torch.cat(
        [be[..., :1, :], torch.addcmul(be[..., 1:, :], ae[..., 1:, :], x_odd[..., :tail, :])],
        dim=-2,
    )
    pairs = torch.stack([x_even[..., :m, :], x_odd], dim=-2)
    out = pairs.reshape(pairs.shape[:-3] + (2 * m, pairs.shape[-1]))
    return torch.cat([out, x_even[..., m:, :]], dim=-2) if n > 2 * m else out


class TreePlan:
    """Index bookkeeping of a parent array, computed once and shared by ``expand``.

    Three orders for the ancestral recursion ``u[j] = a[j] u[pa(j)] + b[j]``:

    * ``levels``: breadth-first order (nodes by depth, within a level by their parent's
      position), so every level is a contiguous slice and its parents a monotone
      gather from the previous slice; ``height`` sequential steps, :math:`O(N)` work.
    * ``paths``: heavy-path decomposition (every node continues the path of its child
      with the largest subtree), paths stored contiguously, grouped by their number of
      light edges above them (at most ``log2 N``). Round ``k`` injects the parents'
      values into the heads of its paths and solves all of them at once with one
      segmented parallel scan (:func:`scan`); :math:`O(\\log^2 N)` sequential steps,
      :math:`O(N)` work, whatever the height.
    * ``jumps``: pointer jumping ``P, P∘P, ...`` (``ceil(log2(height+1))`` steps of
      :math:`O(N)` work each), fully parallel.

    Every build costs :math:`O(N \\log \\text{height})` vectorised work (pointer
    jumping), never a Python loop over nodes.
    """

    def __init__(self, parents: torch.Tensor, depth: torch.Tensor | None = None):
        n = parents.numel()
        self.n = n
        self.parents = parents
        self.is_root = parents < 0
        self.safe_parents = torch.where(
            self.is_root, torch.arange(n, device=parents.device), parents
        )
        self.depth = tree_depths(parents) if depth is None else depth
        self.height = int(self.depth.max())

    @lazy_property
    def levels(self):
        """``(perm, inv, offsets, local_parent)``: nodes sorted by depth (by index within
        a level, so a level is a monotone gather or scatter of the original order),
        ``inv`` the inverse permutation, level ``d`` occupying
        ``offsets[d]:offsets[d + 1]`` and ``local_parent[d]`` each node's parent within
        level ``d - 1``."""
        perm = torch.argsort(self.depth, stable=True)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(self.n, device=perm.device)
        counts = torch.bincount(self.depth, minlength=self.height + 1).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        local_parent = [None]
        for d in range(1, self.height + 1):
            nodes = perm[offsets[d] : offsets[d + 1]]
            local_parent.append(inv[self.parents[nodes]] - offsets[d - 1])
        return perm, inv, offsets, local_parent

    @lazy_property
    def paths(self):
        """Heavy-path plan: ``perm``, ``inv``, round ``offsets``, ``root_pos`` and
        ``head_pos`` (sorted positions of roots and of all path heads) and per round
        ``k >= 1`` the sorted positions of its heads and of their parents."""
        n, dev = self.n, self.parents.device
        parents, root = self.parents, self.is_root
        ptr = _sentinel_pointers(parents)
        itype = ptr.dtype
        idx = torch.arange(n, device=dev, dtype=itype)
        # subtree sizes: after k rounds size[j] counts descendants at distance < 2**k
        size = torch.ones(n + 1, dtype=itype, device=dev)
        size[n] = 0
        while not bool((ptr[:n] == n).all()):
            size = size.index_add(0, ptr[:n], size[:n])
            size[n] = 0
            ptr = ptr.index_select(0, ptr)
        # heavy child: the child with the largest subtree (ties: the larger index)
        child = ~root
        key = size[:n].long() * (n + 1) + idx.long()
        best = torch.full((n,), -1, dtype=torch.long, device=dev)
        best.scatter_reduce_(0, self.safe_parents, torch.where(child, key, -1), "amax")
        heavy = torch.where(best >= 0, best % (n + 1), -1)
        is_heavy = child & (heavy.index_select(0, self.safe_parents) == idx)
        # head of each node's path and its position on it, by jumping up heavy edges
        head = torch.where(is_heavy, parents.to(itype), idx)
        pos = is_heavy.to(itype)
        while True:
            nxt = head.index_select(0, head)
            if torch.equal(nxt, head):
                break
            pos = pos + pos.index_select(0, head)
            head = nxt
        # light depth: number of light edges above a path (at most log2 N)
        head_parent = parents.to(itype).index_select(0, head)  # -1 for a root's path
        hp_safe = head_parent.clamp(min=0)
        light = torch.zeros(n, dtype=itype, device=dev)
        while True:
            new = torch.where(head_parent < 0, 0, light.index_select(0, hp_safe) + 1)
            if torch.equal(new, light):
                break
            light = new
        head, pos, light, idx = head.long(), pos.long(), light.long(), idx.long()
        # order the paths by (light depth, head) -- a sort of the heads only -- and lay
        # each out contiguously: a node's position is its path's start plus its own pos
        heads = (pos == 0).nonzero().squeeze(-1)
        heads = heads.index_select(0, torch.argsort(light.index_select(0, heads) * n + heads))
        length = torch.bincount(head, minlength=n).index_select(0, heads)
        head_pos = torch.cumsum(length, 0) - length  # sorted positions of the heads
        start = torch.empty(n, dtype=torch.long, device=dev)
        start[heads] = head_pos
        inv = start.index_select(0, head) + pos
        perm = torch.empty_like(inv)
        perm[inv] = idx
        counts = torch.bincount(light, minlength=1).tolist()
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        root_pos = head_pos[: int(root.sum())]  # light depth 0 comes first
        bounds = torch.tensor(offsets[1:-1], dtype=torch.long, device=dev)
        split = torch.searchsorted(head_pos, bounds).tolist()
        rounds = []
        pieces = zip(
            torch.tensor_split(head_pos, split), torch.tensor_split(heads, split), strict=True
        )
        for k, (hp, ids) in enumerate(pieces):
            if k > 0:
                rounds.append((hp, inv.index_select(0, parents.index_select(0, ids))))
        return perm, inv, offsets, root_pos, head_pos, rounds

    @lazy_property
    def jumps(self):
        ptrs = [self.safe_parents]
        steps = math.ceil(math.log2(self.height + 1)) if self.height > 0 else 0
        for _ in range(steps - 1):
            ptrs.append(ptrs[-1][ptrs[-1]])
        return ptrs if steps > 0 else []


def scale_noise(eps: torch.Tensor, r: torch.Tensor, chunk: int = 1 << 15) -> None:
    """``eps *= sqrt(1 - r**2)`` in place, in chunks of rows along dim ``-2`` so the
    temporaries stay small (``r`` broadcasts against ``eps``)."""
    n = eps.shape[-2]
    for lo in range(0, n, chunk):
        rc = r[..., lo : lo + chunk, :]
        eps[..., lo : lo + chunk, :].mul_(torch.mul(rc, rc).neg_().add_(1).sqrt_())
