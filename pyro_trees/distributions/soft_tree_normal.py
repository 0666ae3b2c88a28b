"""Gaussian with soft parents: the continuous relaxation of :class:`TreeNormal` (eq. 17)."""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import lazy_property

from pyro_trees._forest import validate_parents
from pyro_trees.distributions.constraints import open_interval
from pyro_trees.distributions.tree_normal import TreeNormal

__all__ = ["SoftTreeNormal"]


class SoftTreeNormal(TorchDistribution):
    r"""Gaussian over ``N`` instances × ``D`` dimensions with *soft* parents.

    The relaxation of :class:`~pyro_trees.distributions.TreeNormal` in which node ``i``
    takes each other node ``j`` as parent with weight ``P[i, j]`` (and is a root with
    the remaining weight), used to learn the tree by the acyclicity-constrained
    optimisation of eqs. 16-17 of Xiao & Su (2024) (see
    :func:`~pyro_trees.infer.learn_tree_structure` and
    :func:`~pyro_trees.infer.soft_tree_elbo`). Each latent dimension ``d`` is a linear
    Gaussian structural equation model on standardised values ``w``:

    .. math::

        w = B w + \operatorname{diag}(c)\, \varepsilon, \qquad
        B_{ij} = P_{ij} \rho_{ij}, \qquad
        c_i = \sqrt{1 - \textstyle\sum_j P_{ij} \rho_{ij}^2}, \qquad
        z = \mathrm{loc} + \mathrm{scale} \odot w,

    with :math:`\varepsilon \sim \mathcal N(0, I)`, so
    :math:`w = (I - B)^{-1} \operatorname{diag}(c)\, \varepsilon` and

    .. math::

        \log q(z) = \log \mathcal N(\varepsilon; 0, I) + \log\det(I - B)
        - \textstyle\sum_i \log c_i - \sum_i \log \mathrm{scale}_i .

    **Exact at hard parents.** When every row of ``P`` is one-hot (a parent, or the
    root column), ``B`` is the parent-pointer matrix of a forest scaled by the edge
    correlations, ``det(I - B) = 1``, ``c_i = sqrt(1 - rho_i^2)`` (1 at roots), and the
    equation is the ancestral recursion of :class:`TreeNormal`: samples (for the same
    noise), ``log_prob`` and ``entropy`` coincide with those of the tree
    (:meth:`to_tree_normal`).

    **A proper Gaussian for every soft** ``P``. Rows of ``P`` sum to at most 1 and
    :math:`|\rho| < 1`, so :math:`\sum_j |B_{ij}| < 1`: ``I - B`` is strictly
    diagonally dominant with a positive diagonal, hence invertible with a positive
    determinant, and :math:`\sum_j P_{ij}\rho_{ij}^2 < 1` keeps ``c`` positive (clamped
    at :attr:`min_c` against rounding). The ELBO of this family is therefore a true
    lower bound at every point of the relaxation, not only at hard trees.

    **Why per-edge correlations** ``rho`` of shape ``(..., N, N, D)``: in TreeVI the
    correlation of an edge is a function of its two end points, ``rho_ij = f(x_i, x_j)``
    (eq. 12, :class:`~pyro_trees.guides.PairNet`), and eq. 17 reads the learned
    tree's correlations off that function at the selected edges. Evaluating the pair
    network on all pairs of a minibatch, ``pair_net(x[:, None], x[None, :])``, gives
    exactly this tensor (``N^2`` evaluations), so the relaxation and the hard tree share
    one parameterisation. (``PairNet(num_nodes=N)``'s per-child offsets are indexed for
    a fixed tree and do not apply to all pairs; ``PairNet(num_nodes=N, offsets="pair")``
    has one offset per ordered pair and does, see
    :func:`~pyro_trees.infer.learn_guide_tree`.)
    A per-child correlation ``(..., N, D)`` (as in :class:`TreeNormal`) is the special
    case ``rho.unsqueeze(-2).expand(..., N, N, D)``.

    Cost: ``rsample`` and ``entropy`` factorise ``D`` dense ``N × N`` matrices per batch
    element, :math:`O(D N^3)`; ``log_prob`` is :math:`O(D N^2)` plus that determinant.
    Meant for one minibatch of up to a few hundred instances, like
    :func:`~pyro_trees.infer.acyclicity`.

    :param torch.Tensor loc: means, shape ``batch_shape + (N, D)``.
    :param torch.Tensor scale: standard deviations (positive), broadcastable with
        ``loc``.
    :param torch.Tensor probs: soft parents, shape ``(..., N, N + 1)`` with rows on the
        simplex, the last column the probability of being a root (the ``probs`` of
        :func:`~pyro_trees.infer.learn_tree_structure`), or ``(..., N, N)`` with row sums
        at most 1 (the rest is the root's). The diagonal (self-parent) must be zero.
    :param torch.Tensor rho: edge correlations in ``(-1, 1)``, shape
        ``(..., N, N, D)``: ``rho[..., i, j, :]`` is the correlation of child ``i`` with
        parent ``j`` (the diagonal is ignored). The last dimension may be 1.

    **References**

    [1] J. Xiao, Q. Su. *TreeVI: Reparameterizable Tree-structured Variational
    Inference for Instance-level Correlation Capturing.* NeurIPS 2024, Sec. 2.3.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import SoftTreeNormal, TreeNormal
    >>> probs = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.9, 0.0, 0.1, 0.0], [0.2, 0.8, 0.0, 0.0]])
    >>> q = SoftTreeNormal(torch.zeros(3, 2), torch.ones(3, 2), probs, torch.full((3, 3, 2), 0.5))
    >>> q.rsample((4,)).shape
    torch.Size([4, 3, 2])
    >>> q.hard_parents()
    tensor([-1,  0,  1])
    >>> isinstance(q.to_tree_normal(), TreeNormal)
    True
    """

    arg_constraints = {
        "loc": constraints.real,
        "scale": constraints.positive,
        "probs": constraints.unit_interval,
        "rho": open_interval(-1.0, 1.0),
    }
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    #: lower bound of the noise scale ``c`` (guards rounding, not a modelling choice).
    min_c = 1e-6
    #: tolerance of the row-sum check of ``probs`` (at least ``(N + 1)`` machine epsilons).
    row_tol = 1e-5

    def __init__(self, loc, scale, probs, rho, *, validate_args=None):
        for name, t in (("loc", loc), ("scale", scale), ("probs", probs), ("rho", rho)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if loc.dim() < 2 or scale.dim() < 2:
            raise ValueError(
                f"loc and scale must have shape batch_shape + (N, D), got {tuple(loc.shape)} "
                f"and {tuple(scale.shape)}"
            )
        try:
            loc_shape = torch.broadcast_shapes(loc.shape, scale.shape)
        except RuntimeError:
            raise ValueError(
                f"shape mismatch: loc {tuple(loc.shape)} and scale {tuple(scale.shape)} do "
                "not broadcast"
            ) from None
        n, d = loc_shape[-2:]
        if probs.dim() < 2 or probs.shape[-2] != n or probs.shape[-1] not in (n, n + 1):
            raise ValueError(
                f"probs must have shape (..., N, N + 1) or (..., N, N) with N = {n}, got "
                f"{tuple(probs.shape)}"
            )
        if rho.dim() < 3 or rho.shape[-3:-1] != (n, n) or rho.shape[-1] not in (1, d):
            raise ValueError(
                f"rho must have shape (..., N, N, D) (per edge: child, parent, dimension) "
                f"with N = {n}, D = {d} (or 1), got {tuple(rho.shape)}"
            )
        try:
            batch_shape = torch.broadcast_shapes(loc_shape[:-2], probs.shape[:-2], rho.shape[:-3])
        except RuntimeError:
            raise ValueError(
                f"batch shapes do not broadcast: loc/scale {tuple(loc_shape[:-2])}, probs "
                f"{tuple(probs.shape[:-2])}, rho {tuple(rho.shape[:-3])}"
            ) from None
        validate = validate_args is not False and (
            validate_args or torch.distributions.Distribution._validate_args
        )
        if validate:
            self._check_values(loc, scale, probs, rho)
        self.loc = loc.expand(batch_shape + (n, d))
        self.scale = scale.expand(batch_shape + (n, d))
        self.probs = probs
        self.rho = rho
        super().__init__(batch_shape, torch.Size((n, d)), validate_args=False)
        self._validate_args = validate

    @staticmethod
    def _check_values(loc, scale, probs, rho):
        """One reduction per tensor; :class:`ValueError` naming the culprit."""
        with torch.no_grad():
            for name, t in (("loc", loc), ("scale", scale), ("probs", probs), ("rho", rho)):
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name} contains NaN or infinite values")
            if bool((scale <= 0).any()):
                raise ValueError(f"scale must be positive; found {float(scale.min())}")
            if bool((rho.abs() >= 1).any()):
                raise ValueError("rho must lie in the open interval (-1, 1); found |rho| >= 1")
            if bool((probs < 0).any()):
                raise ValueError(f"probs must be non-negative; found {float(probs.min())}")
            n = probs.shape[-2]
            diag = probs[..., :n].diagonal(dim1=-2, dim2=-1)
            if bool((diag != 0).any()):
                i = int((diag != 0).nonzero()[0, -1])
                raise ValueError(
                    f"probs has a self-parent weight at node {i} (the diagonal must be 0; "
                    "the root is the last column)"
                )
            rows = probs.sum(-1)
            # rounding of a sum of N + 1 terms grows with N (float32 softmax rows)
            tol = max(SoftTreeNormal.row_tol, (n + 1) * torch.finfo(probs.dtype).eps)
            if probs.shape[-1] == n + 1:
                bad = (rows - 1).abs() > tol
                what = "sum to 1 (last column = root)"
            else:
                bad = rows > 1 + tol
                what = "sum to at most 1 (the rest is the root's)"
            if bool(bad.any()):
                i = int(bad.nonzero()[0, -1])
                got = float(rows[bad][0])
                raise ValueError(f"rows of probs must {what}; row {i} sums to {got}")

    # ----------------------------------------------------------------- structure
    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` (the event size)."""
        return self.event_shape[0]

    @lazy_property
    def parent_probs(self) -> torch.Tensor:
        """``P[..., :, :N]``: the soft parent weights without the root column."""
        return self.probs[..., : self.num_nodes]

    @lazy_property
    def _b(self) -> torch.Tensor:
        """``B`` per dimension, shape ``(..., D, N, N)``."""
        d = self.event_shape[1]
        rho = self.rho.movedim(-1, -3)  # (..., D|1, N, N)
        b = self.parent_probs.unsqueeze(-3) * rho
        return b.expand(b.shape[:-3] + (d,) + b.shape[-2:])

    @lazy_property
    def _i_minus_b(self) -> torch.Tensor:
        n = self.num_nodes
        eye = torch.eye(n, dtype=self._b.dtype, device=self._b.device)
        return eye - self._b

    @lazy_property
    def noise_scale(self) -> torch.Tensor:
        """``c``, shape ``(..., N, D)``: :math:`\\sqrt{1 - \\sum_j P_{ij}\\rho_{ij}^2}`."""
        var = (self.parent_probs.unsqueeze(-1) * self.rho.pow(2)).sum(-2)
        c = (1 - var).clamp_min(self.min_c**2).sqrt()
        return c.expand(c.shape[:-1] + (self.event_shape[1],))

    @lazy_property
    def log_det(self) -> torch.Tensor:
        """:math:`\\log\\det(I - B)` per dimension, shape ``(..., D)`` (0 for a forest)."""
        # positive determinant (strict diagonal dominance), so logabsdet is the log det
        return torch.linalg.slogdet(self._i_minus_b).logabsdet

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(SoftTreeNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        shape = batch_shape + self.event_shape
        new.loc = self.loc.expand(shape)
        new.scale = self.scale.expand(shape)
        new.probs = self.probs
        new.rho = self.rho
        super(SoftTreeNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    # ----------------------------------------------------------------- sampling
    def whiten_inverse(self, eps: torch.Tensor) -> torch.Tensor:
        """Map standard noise ``eps`` (``sample_shape + batch_shape + (N, D)``) to the
        standardised ``w = (I - B)^{-1} diag(c) eps`` (``z = loc + scale * w``); one
        factorisation per batch element and dimension, the sample dimensions solved as
        columns of one right-hand side."""
        full = self.batch_shape + self.event_shape
        try:
            shape = torch.broadcast_shapes(eps.shape, full)
        except RuntimeError:
            raise ValueError(
                f"eps of shape {tuple(eps.shape)} does not broadcast with "
                f"batch_shape + event_shape = {tuple(full)}"
            ) from None
        x = (self.noise_scale * eps).expand(shape)
        lead = shape[: len(shape) - len(full)]
        s = math.prod(lead)
        x = x.reshape((s,) + full)  # (S, *batch, N, D)
        rhs = x.movedim(0, -1).movedim(-2, -3)  # (*batch, D, N, S)
        a = self._i_minus_b.expand(self.batch_shape + self._i_minus_b.shape[-3:])
        w = torch.linalg.solve(a, rhs)
        return w.movedim(-3, -2).movedim(-1, 0).reshape(shape)

    def rsample(self, sample_shape=()):
        shape = self._extended_shape(sample_shape)
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + self.scale * self.whiten_inverse(eps)

    # ----------------------------------------------------------------- densities
    def whiten(self, value: torch.Tensor) -> torch.Tensor:
        """The noise behind ``value``: :math:`\\operatorname{diag}(c)^{-1}(I - B) w` with
        ``w = (value - loc) / scale``; shape of ``value``."""
        w = (value - self.loc) / self.scale
        bw = torch.einsum("...dij,...jd->...id", self._b, w)
        return (w - bw) / self.noise_scale

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        e = self.whiten(value)
        n, d = self.event_shape
        log_norm = (
            self.log_det.sum(-1)
            - self.noise_scale.log().sum((-2, -1))
            - self.scale.log().sum((-2, -1))
        )
        return -0.5 * e.pow(2).sum((-2, -1)) - 0.5 * n * d * math.log(2 * math.pi) + log_norm

    def entropy(self):
        r"""Exact Gaussian entropy :math:`\tfrac{ND}{2}(1 + \log 2\pi) + \sum \log
        \mathrm{scale} + \sum \log c - \sum_d \log\det(I - B_d)`, shape ``batch_shape``."""
        n, d = self.event_shape
        h = (
            self.scale.log().sum((-2, -1))
            + self.noise_scale.log().sum((-2, -1))
            - self.log_det.sum(-1)
            + 0.5 * n * d * (1 + math.log(2 * math.pi))
        )
        return h.expand(self.batch_shape)

    # ----------------------------------------------------------------- moments
    @property
    def mean(self):
        return self.loc

    @lazy_property
    def _inverse(self) -> torch.Tensor:
        """:math:`(I - B)^{-1} \\operatorname{diag}(c)` per dimension, ``(..., D, N, N)``."""
        c = self.noise_scale.transpose(-1, -2).unsqueeze(-2)  # (..., D, 1, N)
        return torch.linalg.inv(self._i_minus_b) * c

    @property
    def variance(self):
        var_w = self._inverse.pow(2).sum(-1).transpose(-1, -2)  # (..., N, D)
        return self.scale.pow(2) * var_w

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """Dense covariance, shape ``batch_shape + (N D, N D)``, rows ordered as
        ``value.reshape(batch_shape + (N * D,))`` (dimensions are independent)."""
        n, d = self.event_shape
        m = self._inverse
        corr = m @ m.transpose(-1, -2)  # (..., D, N, N)
        s = self.scale.transpose(-1, -2)  # (..., D, N)
        cov = corr * s.unsqueeze(-1) * s.unsqueeze(-2)
        cov = cov.expand(self.batch_shape + cov.shape[-3:])
        eye_d = torch.eye(d, dtype=cov.dtype, device=cov.device)
        full = cov.permute(*range(cov.dim() - 3), -2, -3, -1).unsqueeze(-1) * eye_d.reshape(
            d, 1, d
        )  # (..., i, d, j, e)
        return full.reshape(self.batch_shape + (n * d, n * d))

    # ----------------------------------------------------------------- hard tree
    def hard_parents(self) -> torch.Tensor:
        """Row-wise argmax of ``probs`` (``-1`` where the root weight wins), shape
        ``(N,)``; only for unbatched ``probs``. May contain cycles: see
        :func:`~pyro_trees.infer.learn_tree_structure`, which cuts them."""
        if self.probs.dim() != 2:
            raise ValueError("hard_parents needs unbatched probs of shape (N, N + 1) or (N, N)")
        n = self.num_nodes
        p = self.probs.detach()
        if p.shape[-1] == n:
            p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp_min(0)], -1)
        best = p.argmax(-1)
        return torch.where(best == n, torch.full_like(best, -1), best)

    def to_tree_normal(self, parents=None, **kwargs) -> TreeNormal:
        """The :class:`TreeNormal` of a hard forest with this distribution's ``loc``,
        ``scale`` and the correlations ``rho[i, parents[i]]`` of its edges.

        :param parents: parent array ``(N,)``; default :meth:`hard_parents`.
        :param kwargs: passed to :class:`TreeNormal` (e.g. ``method``).
        """
        n = self.num_nodes
        parents = validate_parents(self.hard_parents() if parents is None else parents, n)
        parents = parents.to(self.rho.device)
        safe = parents.clamp_min(0)
        idx = safe.view(n, 1, 1).expand(self.rho.shape[:-3] + (n, 1, self.rho.shape[-1]))
        rho = self.rho.gather(-2, idx).squeeze(-2)  # (..., N, D|1)
        rho = torch.where((parents < 0).unsqueeze(-1), torch.zeros_like(rho), rho)
        return TreeNormal(self.loc, self.scale, parents, rho, **kwargs)

    def __repr__(self):
        return (
            f"SoftTreeNormal(batch_shape: {tuple(self.batch_shape)}, event_shape: "
            f"{tuple(self.event_shape)})"
        )
