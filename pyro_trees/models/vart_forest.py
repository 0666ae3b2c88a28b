"""VaRT forests: a sum of ``K`` VaRT trees under one prior, with one Gaussian noise.

The VaRT paper (Salazar, 2023, Sec. 6) names sums of trees as future work; this is the
construction of BART (Chipman, George and McCulloch, 2010) with VaRT's soft, oblique
trees and linear leaves: the leaves' prior scale shrinks as :math:`1/\\sqrt K`, so the
prior variance of the sum does not grow with the number of trees.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* H. A. Chipman, E. I. George, R. E. McCulloch, *BART: Bayesian additive regression
  trees*, Ann. Appl. Stat. 2010.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule

from pyro_trees import trees
from pyro_trees.distributions.split_indicator import SplitIndicator
from pyro_trees.models.vart import (
    VaRT,
    _check_prior_options,
    log_existence,
    node_weights,
    weighted,
)
from pyro_trees.models.vart_mixture import forest_mean

__all__ = ["VaRTForest", "forest_mean", "forest_of_nodes", "forest_tree"]


def forest_tree(split: list, beta: list, theta: list, rho: list | None = None) -> dict:
    """The per-tree tensors of :meth:`~pyro_trees.models.VaRT.sample_tree` from the
    levels of a forest of depth ``D``: ``split`` the ``D`` internal levels ``B + (K, 2**d)``,
    ``beta`` the same levels ``B + (K, 2**d, L + 1)``, ``theta`` the ``D + 1`` levels,
    ``rho`` (optional, where a missing input goes) the internal levels ``B + (K, 2**d)``.
    The nodes of level ``D`` are leaves. The levels may differ in batch shape
    (broadcast); :func:`forest_of_nodes` takes the nodes already in one tensor."""
    shape = torch.broadcast_shapes(*(t.shape[:-2] for t in theta), *(s.shape[:-1] for s in split))

    def nodes(levels: list, event: int) -> torch.Tensor:
        dims = -event - 1  # the node dimension
        return torch.cat([t.expand(shape + t.shape[dims:]) for t in levels], dims)

    return forest_of_nodes(
        nodes(split, 0), nodes(beta, 1), nodes(theta, 1), nodes(rho, 0) if rho else None
    )


def forest_of_nodes(
    split: torch.Tensor, beta: torch.Tensor, theta: torch.Tensor, rho: torch.Tensor | None = None
) -> dict:
    """The per-tree tensors of :meth:`~pyro_trees.models.VaRT.sample_tree` from a forest's
    nodes in heap order: ``split`` ``B + (K, 2**D - 1)`` and ``beta``
    ``B + (K, 2**D - 1, L + 1)`` at the internal positions, ``theta``
    ``B + (K, 2**(D+1) - 1, L + 1)`` at every node, ``rho`` (optional) as ``split``; the
    nodes of level ``D`` are leaves. Adds ``log_exist`` (the log of each node's
    existence, the sum of its ancestors' log split indicators), the leaves' zero split
    indicators and zero ``log_sigma`` (unused by a forest)."""
    n_int = split.shape[-1]
    log_exist = log_existence(split)
    leaves = split.new_zeros(split.shape[:-1] + (n_int + 1,))
    out = {
        "split": torch.cat([split, leaves], -1),
        "log_exist": log_exist,
        "beta": beta,
        "theta": theta,
        "log_sigma": split.new_zeros(split.shape[:-1] + (2 * n_int + 1,)),
    }
    if rho is not None:
        out["rho"] = rho
    return out


class VaRTForest(PyroModule):
    r"""A sum of ``num_trees`` VaRT trees under one prior: Bayesian additive VaRT.

    Each tree :math:`k` is a :class:`~pyro_trees.models.VaRT` tree truncated at depth
    ``depth`` (its nodes at that depth are leaves; with the default split decay the
    prior splits there with probability :math:`\alpha(1+D)^{-\beta}`, 0.059 at
    :math:`D = 3`): for node :math:`i` at depth :math:`d < D`,
    :math:`s_{ki} \sim \mathrm{Bernoulli}(\alpha(1+d)^{-\beta})` and
    :math:`\beta_{ki} \sim \mathcal N(0, s_\beta^2 I)`; for every node,
    :math:`\theta_{ki} \sim \mathcal N(0, s_\theta^2 I / K)`. Tree :math:`k` gives the
    soft regression function :math:`f_k(x) = \sum_i \kappa_{ki} P_k(x \to i)\,
    \theta_{ki}^\top x` (:func:`~pyro_trees.models.tree_mean`), and

    .. math:: y \mid x \sim \mathcal N\Bigl(\sum_{k=1}^K f_k(x),\ \sigma^2\Bigr), \qquad
              \log\sigma \sim \mathcal N(m_\sigma, v_\sigma^2).

    **Prior variance constant in K.** Given the routing weights, :math:`f_k(x)` is a
    linear combination of its leaves' :math:`\theta` with weights summing to one, and the
    trees are independent, so :math:`\mathrm{Var}\,f(x) = s_\theta^2 \lVert x_1\rVert^2
    E[\sum_i w_i^2]` (:math:`x_1` the input with its intercept): the leaf scale
    :math:`s_\theta / \sqrt K` makes it independent of :math:`K`, as BART's leaf prior does.

    **Sites.** In the plate ``trees`` (size ``K``, ``dim=-2``) and the plates ``nodes_d``
    (``2**d``, ``dim=-1``): ``split_d`` and ``beta_d`` for :math:`d < D`, ``theta_d`` for
    :math:`d \le D`, weighted by :math:`A`, :math:`\psi` and :math:`\kappa` and by ``kl_weight``
    as in :meth:`~pyro_trees.models.VaRT.sample_tree`; ``log_sigma`` (scaled by ``kl_weight``)
    outside them; ``mean`` and ``obs`` in the plate ``data`` (``dim=-1``), of shape
    ``(1, N)`` (the summed trees dimension is kept so that outer plates such as
    ``Predictive(parallel=True)``'s line up). With ``missing=True`` every internal node of
    every tree also has ``rho_d`` :math:`\sim \mathrm{Beta}(c, c)`, after ``beta_d`` and
    weighted as it is: the probability that a missing input (NaN) goes right there, as in
    :class:`~pyro_trees.models.VaRT`. With ``name`` every site and plate is
    prefixed ``"<name>."``. :class:`~pyro_trees.guides.VaRTForestGuide` is its guide and
    :class:`~pyro_trees.infer.VaRTForestELBO` its vectorised ELBO.

    :param int in_features: number of inputs :math:`L`.
    :param int num_trees: :math:`K` (default 50).
    :param int depth: :math:`D \\ge 1`, the depth of every tree (default 3).
    :param float kl_weight: :math:`\lambda`, the weight of the KL term (default 1: the ELBO).
    :param float split_alpha: :math:`\alpha` (default 0.95).
    :param float split_beta: :math:`\beta` (default 2).
    :param float split_scale: :math:`s_\beta` (default 1).
    :param float leaf_scale: :math:`s_\theta`, the prior scale of the *sum* (default 1).
    :param float noise_prior_loc: :math:`m_\sigma` (default -1).
    :param float noise_prior_scale: :math:`v_\sigma` (default 1).
    :param bool missing: inputs may be missing (NaN): the ``rho`` sites (default ``False``).
    :param float missing_concentration: :math:`c` of their prior (default 1).
    :param str name: prefix of the sample sites (default none).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models import VaRTForest
    >>> model = VaRTForest(2, num_trees=10, depth=2)
    >>> model.sample_forest()["theta"].shape  # (K, nodes, L + 1)
    torch.Size([10, 7, 3])
    >>> model(torch.randn(5, 2)).shape
    torch.Size([5])
    """

    missing = False  # models pickled before missing inputs existed
    missing_concentration = 1.0

    def __init__(
        self,
        in_features: int,
        *,
        num_trees: int = 50,
        depth: int = 3,
        kl_weight: float = 1.0,
        split_alpha: float = 0.95,
        split_beta: float = 2.0,
        split_scale: float = 1.0,
        leaf_scale: float = 1.0,
        noise_prior_loc: float = -1.0,
        noise_prior_scale: float = 1.0,
        missing: bool = False,
        missing_concentration: float = 1.0,
        name: str | None = None,
    ):
        super().__init__(name="" if name is None else str(name))
        if int(in_features) < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        if isinstance(num_trees, bool) or int(num_trees) != num_trees or num_trees < 1:
            raise ValueError(f"num_trees must be an integer >= 1, got {num_trees!r}")
        if isinstance(depth, bool) or int(depth) != depth or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        _check_prior_options(
            kl_weight,
            split_alpha,
            split_beta,
            split_scale,
            leaf_scale,
            noise_prior_scale,
            missing,
            missing_concentration,
        )
        self.in_features = int(in_features)
        self.num_trees = int(num_trees)
        self.depth = trees.check_depth(int(depth))
        self.kl_weight = float(kl_weight)
        self.split_alpha = float(split_alpha)
        self.split_beta = float(split_beta)
        self.split_scale = float(split_scale)
        self.leaf_scale = float(leaf_scale)
        self.noise_prior_loc = float(noise_prior_loc)
        self.noise_prior_scale = float(noise_prior_scale)
        self.missing = missing
        self.missing_concentration = float(missing_concentration)

    rho_prior = VaRT.rho_prior

    @property
    def tree_leaf_scale(self) -> float:
        """The prior scale of one tree's leaf weights, :math:`s_\\theta / \\sqrt K`."""
        return self.leaf_scale / math.sqrt(self.num_trees)

    def split_prob(self, depth: int) -> float:
        """Prior split probability :math:`\\gamma_d = \\alpha (1 + d)^{-\\beta}` (``d < D``)."""
        return self.split_alpha * (1.0 + depth) ** (-self.split_beta)

    def site(self, name: str) -> str:
        """The full name of the site or plate ``name`` (``"<name>." + name`` if named)."""
        return f"{self._pyro_name}.{name}" if self._pyro_name else name

    def check(self, x: torch.Tensor, y=None, complete: bool | None = None) -> None:
        """Raise :class:`ValueError` for ``x`` ``(N, L)`` and ``y`` ``(N,)`` (or ``None``)
        of the wrong shape, and for missing values (NaN) in ``x`` unless the model routes
        them: :meth:`forward`'s checks, which the guide's data start and the vectorised
        losses run too; ``complete`` is whether ``x`` is already known to have none (a
        loss that caches the check across steps passes it)."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (N, {self.in_features}); got {tuple(x.shape)}")
        if y is not None and y.shape != x.shape[:1]:
            raise ValueError(f"y must have shape ({x.shape[0]},) to match x; got {tuple(y.shape)}")
        if complete is None and not self.missing:
            complete = not bool(torch.isnan(x).any())
        if not self.missing and not complete:
            raise ValueError(
                "x has missing values (NaN); build the model with missing=True to route "
                "them (each split learns where a missing value goes)"
            )

    def sample_forest(self, like: torch.Tensor | None = None) -> dict:
        """Draw the ``K`` trees (from the prior, or replayed from a guide) with their
        weighting, in the plate ``trees``.

        :param like: a tensor whose dtype and device the trees take.
        :returns: per-tree tensors of :meth:`~pyro_trees.models.VaRT.sample_tree`'s format
            with batch shape ``B + (K,)`` (:func:`forest_tree`; ``log_sigma`` is unused).
        """
        like = torch.zeros(()) if like is None else like
        opts = {"dtype": like.dtype, "device": like.device}
        width = self.in_features + 1
        split, beta, theta, rho = [], [], [], []
        exist = torch.ones(1, **opts)
        with (
            poutine.scale(scale=self.kl_weight),
            pyro.plate(self.site("trees"), self.num_trees, dim=-2),
        ):
            for d in range(self.depth + 1):
                n = 1 << d
                with pyro.plate(self.site(f"nodes_{d}"), n, dim=-1):
                    if d < self.depth:
                        gamma = torch.full((n,), self.split_prob(d), **opts)
                        with weighted(exist):
                            s = pyro.sample(self.site(f"split_{d}"), SplitIndicator(gamma))
                        psi, kappa, child = node_weights(exist, s)
                        with weighted(psi):
                            b = pyro.sample(
                                self.site(f"beta_{d}"),
                                dist.Normal(
                                    torch.zeros(n, width, **opts), self.split_scale
                                ).to_event(1),
                            )
                            if self.missing:
                                r = pyro.sample(self.site(f"rho_{d}"), self.rho_prior((n,), **opts))
                                rho.append(r)
                        split.append(s)
                        beta.append(b)
                    else:
                        kappa = exist
                    with weighted(kappa):
                        t = pyro.sample(
                            self.site(f"theta_{d}"),
                            dist.Normal(
                                torch.zeros(n, width, **opts), self.tree_leaf_scale
                            ).to_event(1),
                        )
                    theta.append(t)
                if d < self.depth:
                    exist = child
        return forest_tree(split, beta, theta, rho)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Draw the forest and the noise, then ``obs`` for each point in ``data``.

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N,)`` or ``None``.
        :param int subsample_size: minibatch size of the plate ``data`` (default all).
        :returns: the ``obs`` values of the (sub)sampled points, ``B + (N_b,)``.
        """
        self.check(x, y)
        forest = self.sample_forest(like=x)
        loc = torch.tensor(self.noise_prior_loc, dtype=x.dtype, device=x.device)
        with poutine.scale(scale=self.kl_weight):
            log_sigma = pyro.sample(
                self.site("log_sigma"), dist.Normal(loc, self.noise_prior_scale)
            )
        with pyro.plate(
            self.site("data"), x.shape[0], subsample_size=subsample_size, dim=-1
        ) as idx:
            xb = x[idx]
            yb = None if y is None else y[idx].unsqueeze(0)
            f = forest_mean(forest, xb, keepdim=True)
            # batch-shaped like "obs" (the summed trees dim, then the rows): Predictive
            # returns both as (S, 1, N)
            pyro.deterministic(self.site("mean"), f, event_dim=0)
            sigma = log_sigma.exp()
            if sigma.dim():  # outer plates: (..., 1, 1) lines up with (..., 1, N)
                sigma = sigma.reshape(sigma.shape + (1,) * max(0, 2 - sigma.dim()))
            obs = pyro.sample(self.site("obs"), dist.Normal(f, sigma), obs=yb)
        return obs.squeeze(-2)
