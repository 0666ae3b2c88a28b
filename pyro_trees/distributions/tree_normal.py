"""Tree-structured Gaussian over data instances (TreeVI, Xiao & Su 2024)."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

__all__ = ["TreeNormal", "open_interval", "tree_depths", "validate_parents"]


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
    The check costs :math:`O(N \\log N)` (pointer jumping), never a Python loop over
    nodes.

    :param parents: integer array-like of shape ``(N,)``.
    :param int num_nodes: the expected ``N`` (optional).
    :rtype: torch.LongTensor
    """
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
    # Pointer jumping: after ceil(log2 N) + 1 doublings every node of a forest points at
    # the sentinel n (beyond its root); nodes on or below a cycle never get there.
    ptr = torch.where(parents < 0, torch.full_like(parents, n), parents)
    ptr = torch.cat([ptr, ptr.new_tensor([n])])
    for _ in range(max(1, math.ceil(math.log2(n + 1))) + 1):
        ptr = ptr[ptr]
    cyc = ptr[:n] != n
    if cyc.any():
        i = int(cyc.nonzero()[0])
        raise ValueError(f"parents contains a cycle (node {i} never reaches a root)")
    return parents


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (roots have depth 0) of a *valid* parent array, by pointer
    jumping in :math:`O(N \\log \\text{height})`."""
    n = parents.numel()
    ptr = torch.where(parents < 0, torch.full_like(parents, n), parents)
    ptr = torch.cat([ptr, ptr.new_tensor([n])])
    depth = torch.cat([(parents >= 0).long(), parents.new_zeros(1)])
    while True:
        done = ptr == n
        if bool(done.all()):
            break
        depth = depth + torch.where(done, 0, depth[ptr])
        ptr = ptr[ptr]
    return depth[:n]


class _TreePlan:
    """Index bookkeeping of a parent array, computed once and shared by ``expand``.

    * ``levels``: nodes sorted by depth, per level the position of each node's parent
      within the previous level (ancestral recursion level by level, ``height`` steps
      of total work :math:`O(N)`).
    * ``jumps``: the pointer-jumping sequence ``P, P∘P, ...`` (``ceil(log2(height+1))``
      steps of work :math:`O(N)` each).
    """

    def __init__(self, parents: torch.Tensor):
        n = parents.numel()
        self.n = n
        self.parents = parents
        self.is_root = parents < 0
        self.safe_parents = torch.where(
            self.is_root, torch.arange(n, device=parents.device), parents
        )
        self.depth = tree_depths(parents)
        self.height = int(self.depth.max())

    @lazy_property
    def levels(self):
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
        return perm, inv, counts, local_parent

    @lazy_property
    def jumps(self):
        ptrs = [self.safe_parents]
        steps = math.ceil(math.log2(self.height + 1)) if self.height > 0 else 0
        for _ in range(steps - 1):
            ptrs.append(ptrs[-1][ptrs[-1]])
        return ptrs if steps > 0 else []


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
    fully parallel. ``rsample`` solves the linear recursion along the tree either level
    by level (``height`` sequential steps, :math:`O(N D)` work) or by pointer jumping
    (``ceil(log2(height + 1))`` sequential steps of :math:`O(N D)` work each; each node
    doubles the stretch of ancestors it has absorbed, as in a parallel prefix scan), so
    a chain of a million nodes needs 20 steps, not a million. ``method="auto"`` picks
    the cheaper from the tree's height and the tensor size.

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
    :param str method: ``"auto"``, ``"levels"`` or ``"jump"`` (sampling recursion).

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

    #: elements of work that one extra sequential step is worth (``method="auto"``).
    step_overhead = 20000

    def __init__(self, loc, scale, parents, rho, *, method="auto", validate_args=None):
        if method not in ("auto", "levels", "jump"):
            raise ValueError(f"method must be 'auto', 'levels' or 'jump', got {method!r}")
        for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 2:
                raise ValueError(
                    f"{name} must have shape batch_shape + (N, D), got {tuple(t.shape)}"
                )
        plan = parents if isinstance(parents, _TreePlan) else None
        if plan is None:
            parents = validate_parents(
                parents.to(loc.device) if isinstance(parents, torch.Tensor) else parents
            ).to(loc.device)
            n = parents.numel()
        else:
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
        if validate_args is not False and (
            validate_args or torch.distributions.Distribution._validate_args
        ):
            for name, t in (("loc", loc), ("scale", scale), ("rho", rho)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} contains NaN or infinite values")
            if not bool((rho.abs() < 1).all()):
                raise ValueError("rho must lie in the open interval (-1, 1); found |rho| >= 1")
        self.loc = loc.expand(shape)
        self.scale = scale.expand(shape)
        self.rho = rho
        self._plan = plan if plan is not None else _TreePlan(parents)
        self.method = method
        super().__init__(shape[:-2], shape[-2:], validate_args=validate_args)

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
    def _choose_method(self, numel: int) -> str:
        if self.method != "auto":
            return self.method
        h = self.height
        if h == 0:
            return "levels"
        steps = math.ceil(math.log2(h + 1))
        return "levels" if h * self.step_overhead < numel * steps else "jump"

    def whiten_inverse(self, eps: torch.Tensor, method: str | None = None) -> torch.Tensor:
        """Map standard noise ``eps`` (shape ``... + (N, D)``) to standardised correlated
        ``u`` (``z = loc + scale * u``) by the ancestral recursion; linear in ``eps``."""
        method = method or self._choose_method(eps.numel())
        if method == "jump":
            return self._jump(self._edge_rho.expand(eps.shape), eps)
        perm = self._plan.levels[0]
        return self._levels(eps.index_select(-2, perm), self._edge_rho.index_select(-2, perm))

    def _jump(self, rho, eps):
        # x_j = a_j x_{P_j} + b_j with a = 0 at roots; each step substitutes the
        # pointed-to equation, doubling the stretch of absorbed ancestors.
        b = (1 - rho.pow(2)).sqrt() * eps
        a = rho
        jumps = self._plan.jumps
        for k, ptr in enumerate(jumps):
            b = b + a * b.index_select(-2, ptr)
            if k + 1 < len(jumps):
                a = a * a.index_select(-2, ptr)
        return b

    def _levels(self, eps_sorted, rho_sorted):
        """Recursion level by level on nodes sorted by depth; returns the original order."""
        _, inv, counts, local_parent = self._plan.levels
        b = (1 - rho_sorted.pow(2)).sqrt() * eps_sorted
        out = [b[..., : counts[0], :]]
        start = counts[0]
        for d in range(1, len(counts)):
            stop = start + counts[d]
            prev = out[-1].index_select(-2, local_parent[d])
            out.append(rho_sorted[..., start:stop, :] * prev + b[..., start:stop, :])
            start = stop
        return torch.cat(out, dim=-2).index_select(-2, inv)

    def rsample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        if self._choose_method(eps.numel()) == "jump":
            u = self._jump(self._edge_rho, eps)
        else:  # i.i.d. noise may be drawn directly in depth order: one gather fewer
            u = self._levels(eps, self._edge_rho.index_select(-2, self._plan.levels[0]))
        return self.loc + self.scale * u

    # ----------------------------------------------------------------- densities
    def whiten(self, value: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`whiten_inverse` applied to ``(value - loc) / scale``: the
        independent standard noise behind ``value`` (one gather, fully parallel)."""
        u = (value - self.loc) / self.scale
        rho = self._edge_rho
        upar = u.index_select(-2, self._plan.safe_parents)
        return (u - rho * upar) / (1 - rho.pow(2)).sqrt()

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        e = self.whiten(value)
        rho = self._edge_rho
        log_det = self.scale.log() + 0.5 * torch.log1p(-rho.pow(2))
        lp = -0.5 * e.pow(2) - 0.5 * math.log(2 * math.pi) - log_det
        return lp.sum((-2, -1))

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
        lower = self.whiten_inverse(basis, method="levels")  # (a, *batch, j, d) = L_d[j, a]
        lower = lower.movedim(0, -1)  # (*batch, j, d, a)
        corr = torch.einsum("...ida,...jda->...idj", lower, lower)
        s = self.scale
        cov = corr * s.unsqueeze(-1) * s.transpose(-1, -2).unsqueeze(-3)  # (..., i, d, j)
        eye_d = torch.eye(d, dtype=cov.dtype, device=cov.device)
        full = cov.unsqueeze(-1) * eye_d.reshape(1, d, 1, d)  # (..., i, d, j, e)
        return full.reshape(self.batch_shape + (n * d, n * d))

    def __repr__(self):
        return (
            f"TreeNormal(batch_shape: {tuple(self.batch_shape)}, event_shape: "
            f"{tuple(self.event_shape)}, height: {self.height}, "
            f"roots: {int(self._plan.is_root.sum())})"
        )
