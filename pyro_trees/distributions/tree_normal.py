"""Tree-structured Gaussian over data instances (TreeVI, Xiao & Su 2024)."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

from pyro_trees._forest import TreePlan, jump_solve, parents_and_depths, scale_noise, scan
from pyro_trees.distributions.constraints import open_interval

__all__ = ["TreeNormal", "TreeNormalInstances"]


def _check_params(loc, scale, rho):
    """Finite ``loc``, finite positive ``scale``, ``rho`` in ``(-1, 1)``: one reduction
    pass per tensor (``aminmax`` propagates NaN) and one read back to the host for all
    three (a GPU waits once), :class:`ValueError` naming the culprit."""
    named = [(n, t) for n, t in (("loc", loc), ("scale", scale), ("rho", rho)) if t.numel()]
    if not named:
        return
    with torch.no_grad():
        bounds = torch.stack([torch.stack(torch.aminmax(t.detach())).double() for _, t in named])
        bounds = bounds.tolist()
    for (name, _), (lo, hi) in zip(named, bounds, strict=True):
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
    :math:`O(N D)` work in one of three orders (``pyro_trees._forest.TreePlan``): level by level
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
        ``-1`` at a root (see :func:`~pyro_trees.distributions.validate_parents`).
    :param torch.Tensor rho: edge correlations in ``(-1, 1)``, shape
        ``(N, D)`` or broadcastable ``batch_shape + (N, D)``; ``rho[j]`` is the
        correlation between ``j`` and its parent.
    :param str method: ``"auto"``, ``"levels"``, ``"paths"`` or ``"jump"`` (sampling
        recursion; all give the same samples up to rounding for the same noise).

    **References**

    [1] J. Xiao, Q. Su. *TreeVI: Reparameterizable Tree-structured Variational
    Inference for Instance-level Correlation Capturing.* NeurIPS 2024.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import TreeNormal
    >>> loc, scale = torch.zeros(3, 2), torch.ones(3, 2)
    >>> q = TreeNormal(loc, scale, parents=[-1, 0, 1], rho=torch.full((3, 2), 0.5))
    >>> z = q.rsample((4,))
    >>> z.shape, q.log_prob(z).shape
    (torch.Size([4, 3, 2]), torch.Size([4]))
    >>> round(q.covariance_matrix[0, 4].item(), 4)  # instances 0 and 2 (dim 0): rho * rho
    0.25
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
        plan = parents if isinstance(parents, TreePlan) else None
        if plan is None:
            parents, depth = parents_and_depths(
                parents.to(loc.device) if isinstance(parents, torch.Tensor) else parents
            )
            plan = TreePlan(parents.to(loc.device), depth.to(loc.device))
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
        scale_noise(e, r)
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
                scale_noise(x, r)
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
                scan(r[..., lo:hi, :], b[..., lo:hi, :], True)
            return b
        outs = []
        for k in range(len(offsets) - 1):
            lo, hi = offsets[k], offsets[k + 1]
            bk = b[..., lo:hi, :]
            if k:
                hp, pp = rounds[k - 1]
                par = torch.cat(outs, dim=-2).index_select(-2, pp)
                bk = bk.index_add(-2, hp - lo, par * head_rho[k - 1])
            outs.append(scan(r[..., lo:hi, :], bk, False))
        return torch.cat(outs, dim=-2)

    def _jump(self, eps, inplace, own_eps=False):
        # x_j = a_j x_{P_j} + b_j with a = 0 at roots; each step substitutes the
        # pointed-to equation, doubling the stretch of absorbed ancestors.
        rho = self._edge_rho
        jumps = self._plan.jumps
        if not inplace:
            return jump_solve(rho, (1 - rho.pow(2)).sqrt() * eps, jumps)
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
        # rho may broadcast along the D dimensions ((N, 1)): each dimension counts
        log_sd = self._edge_sd.log()
        log_sd = log_sd.expand(log_sd.shape[:-2] + self.event_shape)
        log_det = self.scale.log().sum((-2, -1)) + log_sd.sum((-2, -1))
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

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import TreeNormal
    >>> tree = TreeNormal(torch.zeros(3, 2), torch.ones(3, 2), [-1, 0, 0], torch.full((3, 2), 0.3))
    >>> q = tree.per_instance()
    >>> q.batch_shape, q.event_shape
    (torch.Size([3]), torch.Size([2]))
    >>> z = q.rsample()
    >>> torch.allclose(q.log_prob(z).sum(), tree.log_prob(z))
    True
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
