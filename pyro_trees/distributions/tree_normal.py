"""Tree-structured Gaussian over data instances (TreeVI, Xiao & Su 2024)."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

__all__ = ["TreeNormal", "TreeNormalInstances", "open_interval", "tree_depths", "validate_parents"]


class _OpenInterval(constraints.Constraint):
    """The open interval ``(lower_bound, upper_bound)``."""

    def __init__(self, lower_bound, upper_bound):
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        super().__init__()

    def check(self, value):
        return (self.lower_bound < value) & (value < self.upper_bound)

    def __repr__(self):
        return f"OpenInterval(lower_bound={self.lower_bound}, upper_bound={self.upper_bound})"


#: Constraint factory for an open interval (torch has only the closed one).
open_interval = _OpenInterval


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
    return _validate_parents(parents, num_nodes)[0]


def _validate_parents(parents, num_nodes=None):
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


def _scan(a: torch.Tensor, b: torch.Tensor, inplace: bool) -> torch.Tensor:
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
    x_odd = _scan(ao * ae[..., :m, :], torch.addcmul(bo, ao, be[..., :m, :]), inplace)
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


class _TreePlan:
    """Index bookkeeping of a parent array, computed once and shared by ``expand``.

    Three orders for the ancestral recursion ``u[j] = a[j] u[pa(j)] + b[j]``:

    * ``levels``: breadth-first order (nodes by depth, within a level by their parent's
      position), so every level is a contiguous slice and its parents a monotone
      gather from the previous slice; ``height`` sequential steps, :math:`O(N)` work.
    * ``paths``: heavy-path decomposition (every node continues the path of its child
      with the largest subtree), paths stored contiguously, grouped by their number of
      light edges above them (at most ``log2 N``). Round ``k`` injects the parents'
      values into the heads of its paths and solves all of them at once with one
      segmented parallel scan (:func:`_scan`); :math:`O(\\log^2 N)` sequential steps,
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


def _scale_noise(eps: torch.Tensor, r: torch.Tensor, chunk: int = 1 << 15) -> None:
    """``eps *= sqrt(1 - r**2)`` in place, in chunks of rows along dim ``-2`` so the
    temporaries stay small (``r`` broadcasts against ``eps``)."""
    n = eps.shape[-2]
    for lo in range(0, n, chunk):
        rc = r[..., lo : lo + chunk, :]
        eps[..., lo : lo + chunk, :].mul_(torch.mul(rc, rc).neg_().add_(1).sqrt_())


def _check_params(loc, scale, rho):
    """Finite ``loc``, finite positive ``scale``, ``rho`` in ``(-1, 1)``: one reduction
    pass per tensor (``aminmax`` propagates NaN), :class:`ValueError` naming the culprit."""
    with torch.no_grad():
        for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
            if t.numel() == 0:
                continue
            lo, hi = (float(v) for v in torch.aminmax(t.detach()))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(f"{name} contains NaN or infinite values")
            if name == "scale" and lo <= 0:
                raise ValueError(f"scale must be positive; found {lo}")
            if name == "rho" and not (-1 < lo and hi < 1):
                raise ValueError("rho must lie in the open interval (-1, 1); found |rho| >= 1")


class TreeNormal(TorchDistribution):
    r"""Gaussian over ``N`` instances × ``D`` dimensions whose correlation follows a tree.

    Each dimension ``d`` is an independent Gaussian Markov random field on the tree
    given by ``parents``; every instance has mean ``loc[i]`` and standard deviation
    ``scale[i]``, and the correlation of instances ``i`` and ``j`` is the product of the
    edge correlations on the path between them (eq. 3 of Xiao & Su):

    .. math::

        \operatorname{corr}(z_{id}, z_{jd}) = \prod_{(s, t) \in \mathrm{path}(i, j)}
        \rho_{t d},

    where the edge ``(parent(t), t)`` carries the correlation ``rho[t]``. Samples are
    drawn by ancestral recursion (eq. 8): with standardised ``u = (z - loc) / scale`` and
    independent noise ``eps ~ N(0, I)``,

    .. math::

        u_r = \varepsilon_r \ \text{(roots)}, \qquad
        u_j = \rho_j u_{\mathrm{pa}(j)} + \sqrt{1 - \rho_j^2}\, \varepsilon_j .

    Structure: the distribution is **sparse in precision** (the precision of each
    dimension has non-zeros only on the diagonal and on tree edges, and the inverse of
    the sampling factor is unit-sparse: one parent per row, as in Pyro's
    ``AutoStructured`` shear) and **dense in covariance** (every pair of nodes in one
    tree is correlated). The ``N D × N D`` matrices are never formed, except by
    :attr:`covariance_matrix` for small ``N``.

    Cost: ``log_prob`` and ``entropy`` are one gather, :math:`O(N D)` time and memory,
    fully parallel. ``rsample`` solves the linear recursion along the tree with
    :math:`O(N D)` work in one of three orders (see the private ``_TreePlan``): level by level
    (``height`` sequential steps), along heavy paths (a segmented parallel scan per
    round, at most ``log2 N`` rounds, so :math:`O(\log^2 N)` sequential steps whatever
    the height: a chain of a million nodes takes about 40 steps, not a million), or by
    pointer jumping (``ceil(log2(height + 1))`` fully parallel steps of :math:`O(N D)`
    work each). ``method="auto"`` samples level by level up to
    :attr:`max_levels_height` and along heavy paths beyond. Without autograd the
    recursion runs in place, streaming one level at a time, so an ``rsample`` allocates
    little more than its output.

    The root entries of ``rho`` are ignored. A forest (several ``-1`` entries) is a
    product of independent trees. The parent array is always validated (once per
    tree); parameter values (finite, ``scale > 0``, ``|rho| < 1``) are checked when
    argument validation is on, as for every torch distribution, and raise
    :class:`ValueError` naming the parameter.

    :param torch.Tensor loc: means, shape ``batch_shape + (N, D)``.
    :param torch.Tensor scale: standard deviations (positive), broadcastable with
        ``loc``.
    :param parents: integer array ``(N,)``; ``parents[i]`` is the parent of ``i`` or
        ``-1`` at a root (see :func:`validate_parents`).
    :param torch.Tensor rho: edge correlations in ``(-1, 1)``, shape
        ``(N, D)`` or broadcastable ``batch_shape + (N, D)``; ``rho[j]`` is the
        correlation between ``j`` and its parent.
    :param str method: ``"auto"``, ``"levels"``, ``"paths"`` or ``"jump"`` (sampling
        recursion; all give the same samples up to rounding for the same noise).

    **References**

    [1] J. Xiao, Q. Su. *TreeVI: Reparameterizable Tree-structured Variational
    Inference for Instance-level Correlation Capturing.* NeurIPS 2024.
    """

    arg_constraints = {
        "loc": constraints.real,
        "scale": constraints.positive,
        "rho": open_interval(-1.0, 1.0),
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    #: largest height that ``method="auto"`` samples level by level (else by paths).
    max_levels_height = 64

    def __init__(self, loc, scale, parents, rho, *, method="auto", validate_args=None):
        if method not in ("auto", "levels", "paths", "jump"):
            raise ValueError(f"method must be 'auto', 'levels', 'paths' or 'jump', got {method!r}")
        for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 2:
                raise ValueError(
                    f"{name} must have shape batch_shape + (N, D), got {tuple(t.shape)}"
                )
        plan = parents if isinstance(parents, _TreePlan) else None
        if plan is None:
            parents, depth = _validate_parents(
                parents.to(loc.device) if isinstance(parents, torch.Tensor) else parents
            )
            plan = _TreePlan(parents.to(loc.device), depth.to(loc.device))
        n = plan.n
        for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
            if t.shape[-2] != n:
                raise ValueError(
                    f"{name} has {t.shape[-2]} instances (shape {tuple(t.shape)}) but parents "
                    f"has {n}"
                )
        try:
            shape = torch.broadcast_shapes(loc.shape, scale.shape, rho.shape)
        except RuntimeError:
            raise ValueError(
                f"shape mismatch: loc {tuple(loc.shape)}, scale {tuple(scale.shape)} and rho "
                f"{tuple(rho.shape)} do not broadcast"
            ) from None
        validate = validate_args is not False and (
            validate_args or torch.distributions.Distribution._validate_args
        )
        if validate:
            _check_params(loc, scale, rho)
        self.loc = loc.expand(shape)
        self.scale = scale.expand(shape)
        self.rho = rho
        self._plan = plan
        self.method = method
        # the parameters were checked above, in one pass each (torch's generic check of
        # arg_constraints would repeat it at several passes per tensor)
        super().__init__(shape[:-2], shape[-2:], validate_args=False)
        self._validate_args = validate

    # ----------------------------------------------------------------- structure
    @property
    def parents(self) -> torch.Tensor:
        """The parent array ``(N,)`` (``-1`` at roots)."""
        return self._plan.parents

    @property
    def height(self) -> int:
        """Length of the longest root-to-leaf path (0 for isolated nodes)."""
        return self._plan.height

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` (the event size)."""
        return self._plan.n

    @lazy_property
    def _edge_rho(self):
        """``rho`` with the (ignored) root entries set to zero."""
        return torch.where(self._plan.is_root.unsqueeze(-1), torch.zeros_like(self.rho), self.rho)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(TreeNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        shape = batch_shape + self.event_shape
        new.loc = self.loc.expand(shape)
        new.scale = self.scale.expand(shape)
        new.rho = self.rho.expand(shape)
        new._plan = self._plan
        new.method = self.method
        super(TreeNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    # ----------------------------------------------------------------- moments
    @property
    def mean(self):
        return self.loc

    @property
    def variance(self):
        return self.scale.pow(2)

    @property
    def stddev(self):
        return self.scale

    # ----------------------------------------------------------------- sampling
    def _choose_method(self, numel: int | None = None) -> str:
        """``levels`` for shallow trees, ``paths`` once ``height`` sequential steps cost
        more than the heavy-path plan's extra passes over the data."""
        if self.method != "auto":
            return self.method
        return "levels" if self.height <= self.max_levels_height else "paths"

    def whiten_inverse(self, eps: torch.Tensor, method: str | None = None) -> torch.Tensor:
        """Map standard noise ``eps`` (shape ``... + (N, D)``) to standardised correlated
        ``u`` (``z = loc + scale * u``) by the ancestral recursion; linear in ``eps``."""
        return self._solve(eps, method or self._choose_method(), presorted=False)

    def _solve(self, eps, method, presorted):
        """Ancestral recursion ``u = L eps`` in the order of ``method``; ``presorted``
        means ``eps`` is fresh i.i.d. noise that may be read in the plan's order and
        overwritten. Without autograd the kernels write in place and allocate as few
        ``N × D`` buffers as possible: each fresh one costs page faults comparable to a
        pass over it."""
        inplace = not (torch.is_grad_enabled() and (self.rho.requires_grad or eps.requires_grad))
        if method == "levels" and inplace:
            return self._stream_levels(eps.shape, eps, presorted)
        if method == "jump":
            return self._jump(eps, inplace, presorted)
        plan = self._plan.levels if method == "levels" else self._plan.paths
        perm, inv = plan[0], plan[1]
        e = eps if presorted else eps.index_select(-2, perm)
        if not inplace:
            r = self._edge_rho.index_select(-2, perm)
            b = (1 - r.pow(2)).sqrt() * e
            x = self._run_levels(r, b) if method == "levels" else self._run_paths(r, b, False)
            return x.index_select(-2, inv)
        r = self.rho.index_select(-2, perm)
        r.index_fill_(-2, plan[3], 0.0)  # root entries are ignored
        _scale_noise(e, r)
        x = self._run_paths(r, e, True)
        if r.shape == x.shape:  # r is spent: reuse its (already mapped) memory
            return torch.index_select(x, -2, inv, out=r)
        return x.index_select(-2, inv)

    def _stream_levels(self, shape, eps=None, presorted=False):
        """Level by level without autograd: per level draw (or gather, monotone) the
        noise, gather the level's ``rho`` (monotone), combine with the parents' values
        from the previous level and scatter (monotone) into the single output buffer;
        every temporary has the size of one level."""
        perm, _, offsets, local_parent = self._plan.levels
        lead, d_ = shape[:-2], shape[-1]
        dtype, device = self.loc.dtype, self.loc.device
        out = torch.empty(shape, dtype=dtype, device=device)
        prev = None
        for d in range(len(offsets) - 1):
            nodes = perm[offsets[d] : offsets[d + 1]]
            if eps is None:
                x = torch.empty(lead + (nodes.numel(), d_), dtype=dtype, device=device).normal_()
            elif presorted:
                x = eps[..., offsets[d] : offsets[d + 1], :]
            else:
                x = eps.index_select(-2, nodes)
            if d:
                r = self.rho.index_select(-2, nodes)
                _scale_noise(x, r)
                x.addcmul_(r, prev.index_select(-2, local_parent[d]))
            out.index_copy_(-2, nodes, x)
            prev = x
        return out

    def _run_levels(self, r, b):
        _, _, offsets, local_parent = self._plan.levels
        out = [b[..., : offsets[1], :]]
        for d in range(1, len(offsets) - 1):
            mid, hi = offsets[d], offsets[d + 1]
            par = out[-1].index_select(-2, local_parent[d])
            out.append(torch.addcmul(b[..., mid:hi, :], r[..., mid:hi, :], par))
        return torch.cat(out, dim=-2)

    def _run_paths(self, r, b, inplace):
        _, _, offsets, _, head_pos, rounds = self._plan.paths
        head_rho = [r.index_select(-2, hp) for hp, _ in rounds]
        # a head starts its path afresh: its parent's value arrives by injection
        r = r.index_fill_(-2, head_pos, 0.0) if inplace else r.index_fill(-2, head_pos, 0.0)
        if inplace:
            for k in range(len(offsets) - 1):
                lo, hi = offsets[k], offsets[k + 1]
                if k:
                    hp, pp = rounds[k - 1]
                    b.index_add_(-2, hp, b.index_select(-2, pp).mul_(head_rho[k - 1]))
                _scan(r[..., lo:hi, :], b[..., lo:hi, :], True)
            return b
        outs = []
        for k in range(len(offsets) - 1):
            lo, hi = offsets[k], offsets[k + 1]
            bk = b[..., lo:hi, :]
            if k:
                hp, pp = rounds[k - 1]
                par = torch.cat(outs, dim=-2).index_select(-2, pp)
                bk = bk.index_add(-2, hp - lo, par * head_rho[k - 1])
            outs.append(_scan(r[..., lo:hi, :], bk, False))
        return torch.cat(outs, dim=-2)

    def _jump(self, eps, inplace, own_eps=False):
        # x_j = a_j x_{P_j} + b_j with a = 0 at roots; each step substitutes the
        # pointed-to equation, doubling the stretch of absorbed ancestors.
        rho = self._edge_rho
        jumps = self._plan.jumps
        if not inplace:
            b = (1 - rho.pow(2)).sqrt() * eps
            a = rho
            for k, ptr in enumerate(jumps):
                b = b + a * b.index_select(-2, ptr)
                if k + 1 < len(jumps):
                    a = a * a.index_select(-2, ptr)
            return b
        s = torch.mul(rho, rho).neg_().add_(1).sqrt_()
        b = eps.mul_(s) if own_eps else eps * s
        a = rho.clone()
        for k, ptr in enumerate(jumps):
            b.addcmul_(a, b.index_select(-2, ptr))
            if k + 1 < len(jumps):
                a.mul_(a.index_select(-2, ptr))
        return b

    def rsample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        if torch.is_grad_enabled() and self.rho.requires_grad:
            eps = torch.empty(shape, dtype=self.loc.dtype, device=self.loc.device).normal_()
            u = self._solve(eps, self._choose_method(), presorted=True)
        else:  # i.i.d. noise is drawn inside, directly in the plan's order
            u = self._solve_shape(shape)
        if torch.is_grad_enabled() and (
            self.loc.requires_grad or self.scale.requires_grad or u.requires_grad
        ):
            return torch.addcmul(self.loc, self.scale, u)
        return torch.addcmul(self.loc, self.scale, u, out=u)

    def _solve_shape(self, shape):
        method = self._choose_method()
        if method == "levels":
            return self._stream_levels(shape)
        eps = torch.empty(shape, dtype=self.loc.dtype, device=self.loc.device).normal_()
        return self._solve(eps, method, presorted=True)

    # ----------------------------------------------------------------- densities
    @lazy_property
    def _edge_sd(self):
        """``sqrt(1 - rho**2)`` on edges, ``1`` at roots."""
        return (1 - self._edge_rho.pow(2)).sqrt()

    def _tracks_grad(self, *tensors) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.loc, self.scale, self.rho, *tensors)
        )

    def whiten(self, value: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`whiten_inverse` applied to ``(value - loc) / scale``: the
        independent standard noise behind ``value`` (one gather, fully parallel)."""
        rho, safe = self._edge_rho, self._plan.safe_parents
        if self._tracks_grad(value):
            u = (value - self.loc) / self.scale
            return (u - rho * u.index_select(-2, safe)) / self._edge_sd
        u = torch.sub(value, self.loc).div_(self.scale)  # in place: few N x D buffers
        return u.index_select(-2, safe).mul_(rho).neg_().add_(u).div_(self._edge_sd)

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        e = self.whiten(value)
        sq = e.pow(2).sum((-2, -1)) if self._tracks_grad(value) else e.mul_(e).sum((-2, -1))
        n, d = self.event_shape
        log_det = self.scale.log().sum((-2, -1)) + self._edge_sd.log().sum((-2, -1))
        return -0.5 * sq - 0.5 * n * d * math.log(2 * math.pi) - log_det

    def entropy(self):
        r"""Exact entropy: singleton terms :math:`\sum_i H[q(z_i)]` plus, per edge,
        :math:`H[q(z_i, z_j)] - H[q(z_i)] - H[q(z_j)] = \tfrac12 \log(1 - \rho_{ij}^2)`."""
        rho = self._edge_rho
        h = 0.5 * (1 + math.log(2 * math.pi)) + self.scale.log() + 0.5 * torch.log1p(-rho.pow(2))
        return h.expand(self.batch_shape + self.event_shape).sum((-2, -1))

    # ----------------------------------------------------------------- dense views
    max_dense = 8192

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """Dense covariance, shape ``batch_shape + (N D, N D)``, rows ordered as
        ``value.reshape(batch_shape + (N * D,))``; only for ``N * D <= max_dense``."""
        n, d = self.event_shape
        if n * d > self.max_dense:
            raise ValueError(
                f"covariance_matrix of {n} x {d} = {n * d} variables exceeds max_dense = "
                f"{self.max_dense}; it is meant for small N"
            )
        eye = torch.eye(n, dtype=self.loc.dtype, device=self.loc.device)
        basis = eye.reshape((n,) + (1,) * len(self.batch_shape) + (n, 1))
        basis = basis.expand((n,) + self.batch_shape + (n, d))
        lower = self.whiten_inverse(basis)  # (a, *batch, j, d) = L_d[j, a]
        lower = lower.movedim(0, -1)  # (*batch, j, d, a)
        corr = torch.einsum("...ida,...jda->...idj", lower, lower)
        s = self.scale
        cov = corr * s.unsqueeze(-1) * s.transpose(-1, -2).unsqueeze(-3)  # (..., i, d, j)
        eye_d = torch.eye(d, dtype=cov.dtype, device=cov.device)
        full = cov.unsqueeze(-1) * eye_d.reshape(1, d, 1, d)  # (..., i, d, j, e)
        return full.reshape(self.batch_shape + (n * d, n * d))

    def per_instance(self) -> TreeNormalInstances:
        """The same distribution in the plate form of a latent: batch shape
        ``batch_shape + (N,)``, event shape ``(D,)`` (see :class:`TreeNormalInstances`)."""
        return TreeNormalInstances(self)

    def __repr__(self):
        return (
            f"TreeNormal(batch_shape: {tuple(self.batch_shape)}, event_shape: "
            f"{tuple(self.event_shape)}, height: {self.height}, "
            f"roots: {int(self._plan.is_root.sum())})"
        )


class TreeNormalInstances(TorchDistribution):
    r"""A :class:`TreeNormal` in the plate form of a latent: the instances on the last
    batch dim, each with event shape ``(D,)``, as a model samples ``z_i`` inside
    ``pyro.plate("data", N)`` with ``.to_event(1)``.

    Draws are the tree's (correlated across the instances). ``log_prob`` returns the
    tree's factorisation along its edges, one term per instance,

    .. math::

        \log q(z) = \sum_i \log q(z_i \mid z_{\mathrm{pa}(i)})

    (the marginal at roots), shape ``batch_shape + (N,)``, whose sum over the instances
    is :meth:`TreeNormal.log_prob`; :meth:`entropy` splits the same way. A plate then
    sums (and, when it subsamples, scales) them as it does any per-instance density.

    :param TreeNormal tree: batch shape ``B``, event shape ``(N, D)``.
    """

    arg_constraints = {}
    support = constraints.independent(constraints.real, 1)
    has_rsample = True

    def __init__(self, tree: TreeNormal, *, validate_args=None):
        if not isinstance(tree, TreeNormal):
            raise ValueError(f"tree must be a TreeNormal, got {type(tree).__name__}")
        self.tree = tree
        n, d = tree.event_shape
        super().__init__(tree.batch_shape + (n,), torch.Size([d]), validate_args=False)

    @property
    def mean(self):
        return self.tree.mean

    @property
    def variance(self):
        return self.tree.variance

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        if not batch_shape or batch_shape[-1] != self.batch_shape[-1]:
            raise ValueError(
                f"a tree over {self.batch_shape[-1]} instances cannot expand to batch shape "
                f"{tuple(batch_shape)}: the last dim is the instances'"
            )
        return TreeNormalInstances(self.tree.expand(batch_shape[:-1]))

    def rsample(self, sample_shape=()):
        return self.tree.rsample(sample_shape)

    def log_prob(self, value):
        q = self.tree
        e = q.whiten(value)
        log_det = q.scale.log() + q._edge_sd.log()
        return (-0.5 * e.pow(2) - 0.5 * math.log(2 * math.pi) - log_det).sum(-1)

    def entropy(self):
        rho, scale = self.tree._edge_rho, self.tree.scale
        h = 0.5 * (1 + math.log(2 * math.pi)) + scale.log() + 0.5 * torch.log1p(-rho.pow(2))
        return h.expand(self.batch_shape + self.event_shape).sum(-1)
