"""VaRT: the nonparametric stochastic-tree prior and the mixture-of-leaves likelihood.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023 (Secs. 2.2-3).
"""

from __future__ import annotations

import contextlib
import math

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule

from pyro_trees import trees
from pyro_trees.distributions.split_indicator import SplitIndicator
from pyro_trees.models.vart_mixture import gaussian, tree_likelihood, tree_mean

__all__ = ["VaRT", "log_existence", "node_weights", "weighted"]


@contextlib.contextmanager
def weighted(weight: torch.Tensor):
    """Multiply the log-densities of the enclosed sites by a non-negative ``weight``.

    ``poutine.scale`` needs strictly positive factors, so entries that are exactly zero
    (nodes absent from a hard tree) are masked out and the others scaled.
    """
    positive = weight > 0
    if bool(positive.all()):  # relaxed indicators during training: no mask needed
        with poutine.scale(scale=weight):
            yield
        return
    with poutine.mask(mask=positive), poutine.scale(scale=torch.where(positive, weight, 1.0)):
        yield


def node_weights(exist: torch.Tensor, split: torch.Tensor):
    """The indicator weights of eqs. 28-29 for one level of the tree.

    :param exist: :math:`A_i = \\prod_{k \\ge 1} s_{pa^k(i)}`, the (soft) indicator that
        node ``i`` belongs to the tree; shape broadcastable with ``split``.
    :param split: :math:`s_i`, shape ``batch_shape + (2**d,)``.
    :returns: ``(psi, kappa, child_exist)``: :math:`\\psi_i = A_i s_i` (node ``i`` is
        internal), :math:`\\kappa_i = A_i (1 - s_i)` (node ``i`` is a leaf) and the
        existence of the ``2**(d+1)`` children (heap order).
    """
    psi = exist * split
    kappa = exist * (1 - split)
    return psi, kappa, psi.repeat_interleave(2, dim=-1)


def log_existence(split: torch.Tensor) -> torch.Tensor:
    """:math:`\\log A_i` of every node of a truncated tree (or of each tree of a forest):
    the sum of the log split indicators of its proper ancestors (0 at the root), top-down
    level by level.

    :param split: ``batch_shape + (2**D - 1,)`` split indicators of the internal nodes, in
        heap order (a hard 0 gives ``-inf`` below it).
    :returns: ``batch_shape + (2**(D+1) - 1,)`` in heap order.
    """
    log_split = split.log()
    levels = [split.new_zeros(split.shape[:-1] + (1,))]
    for d in range((split.shape[-1] + 1).bit_length() - 1):
        parent = levels[-1] + log_split[..., (1 << d) - 1 : (2 << d) - 1]
        levels.append(parent.repeat_interleave(2, dim=-1))
    return torch.cat(levels, -1)


def _check_prior_options(
    kl_weight,
    split_alpha,
    split_beta,
    split_scale,
    leaf_scale,
    noise_prior_scale,
    missing,
    missing_concentration,
) -> None:
    """The checks of the prior options :class:`VaRT` and
    :class:`~pyro_trees.models.VaRTForest` share (a ``ValueError`` naming the first bad
    one)."""
    if not kl_weight > 0:
        raise ValueError(f"kl_weight must be > 0, got {kl_weight}")
    if not 0 < split_alpha < 1:
        raise ValueError(f"split_alpha must lie in (0, 1), got {split_alpha}")
    if split_beta < 0:
        raise ValueError(f"split_beta must be >= 0, got {split_beta}")
    for name, v in (
        ("split_scale", split_scale),
        ("leaf_scale", leaf_scale),
        ("noise_prior_scale", noise_prior_scale),
    ):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")
    if not isinstance(missing, bool):
        raise ValueError(f"missing must be True or False, got {missing!r}")
    if not missing_concentration > 0:
        raise ValueError(f"missing_concentration must be > 0, got {missing_concentration}")


class VaRT(PyroModule):
    r"""Variational regression tree model: a stochastic tree of unbounded depth.

    **Prior** (Sec. 2.3, eqs. 13-14). Nodes are heap-numbered (root 1, children
    :math:`2i, 2i+1`, see :mod:`pyro_trees.trees`). For every node :math:`i` of depth
    :math:`d`

    .. math::
        s_i \sim \mathrm{Bernoulli}(\gamma_d), \quad
        \gamma_d = \alpha (1 + d)^{-\beta}, \quad
        \beta_i \sim \mathcal N(0, S), \quad
        \theta_i \sim \mathcal N(0, \Psi), \quad
        \log\sigma_i \sim \mathcal N(m_\sigma, v_\sigma),

    a node exists when all its ancestors split; an existing node with :math:`s_i = 1` is
    internal and routes :math:`x` left with probability :math:`\sigma(\beta_i^\top x)`
    (``x`` with an intercept column appended); one with :math:`s_i = 0` is a leaf.
    :math:`S = s_\beta^2 I`, :math:`\Psi = s_\theta^2 I`. The paper leaves the leaf noise
    :math:`\sigma_i` unspecified; here each node's log noise scale is part of its leaf
    parameters, with the Gaussian prior above.

    **Missing inputs** (``missing=True``; beyond the paper). Every node also draws
    :math:`\rho_i \sim \mathrm{Beta}(c, c)`, the probability that a missing input
    goes right there (the soft-tree analogue of a learnt default direction, as XGBoost's).
    A row :math:`x` with missing inputs :math:`M(x)` goes right at node :math:`i` with
    probability :math:`(1 - m_i)\,\sigma(-\beta_i^\top x_0) + m_i \rho_i`, with
    :math:`x_0` the row with its missing inputs at 0 and :math:`m_i = \sum_{j \in M(x)}
    \beta_{ij}^2 / \sum_{j \le L} \beta_{ij}^2` the share of the split's weight on
    them (:func:`pyro_trees.trees.split_log_probs`); the leaves read :math:`x_0`. The
    sites ``rho_d`` (:math:`d <` ``site_depth``, in ``nodes_d``, weighted by
    :math:`\psi_i` as ``beta_d``) follow the ``beta_d`` sites; the tree's ``rho`` is
    ``B + (2**D - 1,)``. Posterior trees differ in :math:`\rho`, so a row whose route
    depends on a missing input gets the spread of the routes. Without ``missing`` the
    model has no ``rho`` sites and refuses inputs with NaN.

    **Likelihood** (Secs. 2.2, 3, eq. 27): with :math:`\kappa_i` the leaf indicator
    and :math:`P(x \to i)` the soft routing probability of reaching node :math:`i`,

    .. math:: p(y \mid x, T, \Theta) = \sum_i \kappa_i\, P(x \to i)\,
              \mathcal N(y;\ \theta_i^\top x,\ \sigma_i^2).

    The weights :math:`\kappa_i P(x \to i)` sum to one for hard *and* relaxed split
    indicators, so the likelihood is a proper mixture at every temperature.

    **Unbounded depth, static sites.** The model is not truncated: a prior draw goes on
    level by level until no node splits. Since :math:`\gamma_d \to 0`, the expected
    number of nodes at depth :math:`d`, :math:`2^d \prod_{k<d} \gamma_k`, vanishes
    super-exponentially for :math:`\beta > 0`, so a prior draw is finite almost surely
    (with the defaults the expected number of nodes at depth 7 is :math:`3.5 \cdot
    10^{-6}`); a pathologically deep one raises the memory ``ValueError`` of
    :func:`pyro_trees.trees.check_depth`. The levels :math:`d \le` ``site_depth`` are
    Pyro sample sites in every draw, whether or not their nodes exist: ``split_d``,
    ``theta_d``, ``log_sigma_d`` for :math:`d \le` ``site_depth`` and ``beta_d`` for
    :math:`d <` ``site_depth``, inside the plate ``nodes_d`` of size ``2**d`` at
    ``dim=-1`` (absent nodes weigh zero). Deeper levels, which only a prior draw that
    splits at level ``site_depth`` reaches, are drawn without sites. Every draw thus has
    the same sites, as :class:`pyro.infer.Predictive` and autoguides need.
    :class:`~pyro_trees.guides.VaRTGuide` raises ``site_depth`` to its truncation depth
    :math:`D`; under it every node of level :math:`D` is a leaf.

    **Weighting** (eqs. 4, 23-24). Each node's prior terms are weighted by its indicator
    (:math:`A_i` for ``split``, :math:`\psi_i` for ``beta``, :math:`\kappa_i` for the leaf
    parameters, see :func:`weighted`) and every tree site by ``kl_weight``: both happen inside
    :meth:`sample_tree`, the piece to compose into one's own model, so plain
    :class:`pyro.infer.Trace_ELBO` estimates the :math:`\lambda`-weighted ELBO
    :math:`E_q \log p(Y|X,T,\Theta) - \lambda\, KL(q\|p)` of any model that draws its
    tree with :meth:`sample_tree` (the guide scales its sites by the same ``kl_weight``).

    Observations live in the plate ``data`` (``dim=-1``, ``subsample_size`` for
    minibatches, rescaled by Pyro); the site ``obs`` follows
    :func:`~pyro_trees.models.tree_likelihood` and the site ``mean`` records
    :func:`~pyro_trees.models.tree_mean`, the conditional mean
    :math:`\sum_i \kappa_i P(x \to i)\theta_i^\top x` of each point. With ``name`` every
    site and plate is prefixed ``"<name>."``.

    :param int in_features: number of inputs :math:`L`.
    :param float kl_weight: :math:`\lambda` of eq. 4 (``1e-3`` in the paper's regression runs).
    :param float split_alpha: :math:`\alpha`, the base of Chipman et al.'s split
        probabilities :math:`\alpha (1 + d)^{-\beta}` at depth ``d`` (default 0.95).
    :param float split_beta: :math:`\beta`, their depth decay (default 2).
    :param float split_scale: :math:`s_\beta`.
    :param float leaf_scale: :math:`s_\theta`.
    :param float noise_prior_loc: :math:`m_\sigma`.
    :param float noise_prior_scale: :math:`v_\sigma`.
    :param int site_depth: the deepest level recorded as sample sites (default 0;
        :class:`~pyro_trees.guides.VaRTGuide` raises it to its depth).
    :param bool missing: inputs may be missing (NaN): the ``rho`` sites above (default
        ``False``).
    :param float missing_concentration: :math:`c > 0` of the ``rho`` prior (default 1,
        uniform).
    :param str name: prefix of the sample sites (default none).

    **Per-node priors** (the general form of Sec. 2.3, :math:`s_i \sim
    \mathrm{Bernoulli}(\gamma_i)`, :math:`\beta_i \sim \mathcal N(\mu_i, S_i)`,
    :math:`\theta_i \sim \mathcal N(\zeta_i, \Psi_i)`). Each of the following optional
    tensors gives its value for the first ``K`` heap nodes :math:`i = 1, \dots, K`
    (row ``i - 1``; each tensor its own ``K``); every other node keeps the rule above
    (:math:`\gamma_d`, mean zero, :math:`s_\beta^2 I` or :math:`s_\theta^2 I`). Left at
    ``None`` (the default) the model is exactly the one above.

    :param node_split_prob: :math:`\gamma_i`, ``(K,)`` in ``(0, 1)``.
    :param node_split_loc: :math:`\mu_i`, ``(K, L + 1)`` (the last entry the intercept's).
    :param node_split_scale: :math:`S_i`, as standard deviations ``(K, L + 1)``
        (:math:`S_i` diagonal) or lower Cholesky factors ``(K, L + 1, L + 1)`` with a
        positive diagonal (:math:`S_i = C_i C_i^\top`).
    :param node_leaf_loc: :math:`\zeta_i`, ``(K, L + 1)``.
    :param node_leaf_scale: :math:`\Psi_i`, like ``node_split_scale``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models import VaRT
    >>> model = VaRT(2)
    >>> sorted(model.sample_tree())
    ['beta', 'log_exist', 'log_sigma', 'split', 'theta']
    >>> model(torch.randn(5, 2)).shape  # one draw of y per row
    torch.Size([5])
    """

    missing = False  # models pickled before missing inputs existed
    missing_concentration = 1.0

    def __init__(
        self,
        in_features: int,
        *,
        kl_weight: float = 1e-3,
        split_alpha: float = 0.95,
        split_beta: float = 2.0,
        split_scale: float = 1.0,
        leaf_scale: float = 1.0,
        noise_prior_loc: float = -1.0,
        noise_prior_scale: float = 1.0,
        node_split_prob: torch.Tensor | None = None,
        node_split_loc: torch.Tensor | None = None,
        node_split_scale: torch.Tensor | None = None,
        node_leaf_loc: torch.Tensor | None = None,
        node_leaf_scale: torch.Tensor | None = None,
        site_depth: int = 0,
        missing: bool = False,
        missing_concentration: float = 1.0,
        name: str | None = None,
    ):
        super().__init__(name="" if name is None else str(name))
        if int(in_features) < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
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
        self.kl_weight = float(kl_weight)
        self.missing = missing
        self.missing_concentration = float(missing_concentration)
        if isinstance(site_depth, bool) or int(site_depth) != site_depth or site_depth < 0:
            raise ValueError(f"site_depth must be an integer >= 0, got {site_depth!r}")
        self.site_depth = int(site_depth)
        self.split_alpha = float(split_alpha)
        self.split_beta = float(split_beta)
        self.split_scale = float(split_scale)
        self.leaf_scale = float(leaf_scale)
        self.noise_prior_loc = float(noise_prior_loc)
        self.noise_prior_scale = float(noise_prior_scale)
        width = self.in_features + 1
        self.node_split_prob = _check_node_tensor("node_split_prob", node_split_prob, ())
        if (
            self.node_split_prob is not None
            and not ((self.node_split_prob > 0) & (self.node_split_prob < 1)).all()
        ):
            raise ValueError("node_split_prob must lie in (0, 1)")
        self.node_split_loc = _check_node_tensor("node_split_loc", node_split_loc, (width,))
        self.node_split_scale = _check_node_scale("node_split_scale", node_split_scale, width)
        self.node_leaf_loc = _check_node_tensor("node_leaf_loc", node_leaf_loc, (width,))
        self.node_leaf_scale = _check_node_scale("node_leaf_scale", node_leaf_scale, width)

    @property
    def leaf_width(self) -> int:
        """Entries of each node's leaf weights :math:`\\theta_i`: ``in_features + 1``
        (a subclass with several outputs per leaf, such as
        :class:`~pyro_trees.models.VaRTClassification`, has more)."""
        return self.in_features + 1

    def obs_log_lik(self, mix_logits, x1, theta, log_sigma, y) -> torch.Tensor:
        """The log-likelihood of each row of ``y`` ``(B,)`` given the log weights
        :math:`\\log \\kappa_i + \\log P(x \\to i)` of the nodes ``mix_logits``
        ``T + (B, M)``, inputs with intercept ``x1`` ``(B, L + 1)`` and the trees'
        ``theta`` ``T + (M, leaf_width)`` and ``log_sigma`` ``T + (M,)`` (``T``: a batch
        of trees, ``()`` for one), ``T + (B,)``: eq. 27 here
        (:func:`~pyro_trees.infer.vart_elbo.vart_elbo` sums it, so a subclass with
        another likelihood trains with it too). The weights of a row sum to one over the
        nodes (a node's own weight and its subtree's add up to :math:`A_i P(x \\to i)`,
        down to the truncation depth, whose nodes do not split), so the mixture needs no
        normalising."""
        means = x1 @ theta.transpose(-1, -2)
        log_sigma = log_sigma.unsqueeze(-2)
        z = (y.unsqueeze(-1) - means) / log_sigma.exp()
        comp = -0.5 * z * z - log_sigma - 0.5 * math.log(2 * math.pi)
        return (mix_logits + comp).logsumexp(-1)

    def split_prob(self, depth: int) -> float:
        """Prior split probability :math:`\\gamma_d = \\alpha (1 + d)^{-\\beta}`."""
        return self.split_alpha * (1.0 + depth) ** (-self.split_beta)

    def node_prior(self, start: int, stop: int, *, dtype=None, device=None) -> dict | None:
        """The prior of heap nodes ``start + 1, ..., stop`` (rows ``start:stop``) where
        per-node values apply there, else ``None`` (the depth rule and the scalar scales).

        :returns: ``None``, or a dict of ``split_prob`` ``(n,)``, ``split_loc`` and
            ``leaf_loc`` ``(n, L + 1)``, ``split_scale`` and ``leaf_scale`` (standard
            deviations ``(n, L + 1)`` or Cholesky factors ``(n, L + 1, L + 1)``),
            ``n = stop - start``, with the defaults filled in where not given.
        """
        given = [
            getattr(self, k, None)
            for k in (
                "node_split_prob",
                "node_split_loc",
                "node_split_scale",
                "node_leaf_loc",
                "node_leaf_scale",
            )
        ]
        if not any(t is not None and start < t.shape[0] for t in given):
            return None
        opts = {"dtype": torch.get_default_dtype() if dtype is None else dtype, "device": device}
        n, width = stop - start, self.in_features + 1
        depths = torch.arange(start + 1, stop + 1, dtype=torch.float64).log2().floor().long()
        probs = torch.tensor(
            [self.split_prob(d) for d in range(int(depths.max()) + 1)], dtype=torch.float64
        )
        zeros = torch.zeros(n, width, **opts)
        p_given, sl, ss, ll, ls = given
        return {
            "split_prob": _fill(p_given, probs[depths].to(**opts), start),
            "split_loc": _fill(sl, zeros, start),
            "split_scale": _fill_scale(ss, self.split_scale, n, width, start, opts),
            "leaf_loc": _fill(ll, zeros, start),
            "leaf_scale": _fill_scale(ls, self.leaf_scale, n, width, start, opts),
        }

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

    def rho_prior(self, shape, *, dtype=None, device=None) -> dist.Beta:
        """The prior :math:`\\mathrm{Beta}(c, c)` of the ``rho`` sites, batch ``shape``."""
        c = torch.full(shape, self.missing_concentration, dtype=dtype, device=device)
        return dist.Beta(c, c)

    def site(self, name: str) -> str:
        """The full name of the sample site or plate ``name`` (``"<name>." + name``
        for a named model)."""
        return f"{self._pyro_name}.{name}" if self._pyro_name else name

    def sample_tree(self, num_points: int = 1, like: torch.Tensor | None = None) -> dict:
        r"""Draw a tree from the prior (or, under a guide, replay the guide's), with its
        ELBO weighting: every site is scaled by ``kl_weight`` and each node's terms by its
        indicator (see the class docstring). This is the piece to use VaRT as a part of
        one's own model, e.g. as a mean function::

            tree = vart.sample_tree(like=x)
            f = tree_mean(tree, x)  # (N,), or batch_shape + (N,)

        :param int num_points: points the caller will route through the tree (only for
            the memory check of deep prior draws).
        :param like: a tensor whose dtype and device the tree takes (e.g. the inputs).
        :returns: dict of per-node tensors in heap order, with batch shape ``B`` (empty,
            or the outer plates' shape such as ``Predictive(parallel=True)``'s): ``split``
            ``B + (M,)``, ``log_exist`` (:math:`\log A_i`) ``B + (M,)``, ``beta``
            ``B + (2**D - 1, L + 1)`` (``None`` for a single leaf), ``theta``
            ``B + (M, L + 1)``, ``log_sigma`` ``B + (M,)`` and, with ``missing`` and
            some split, ``rho`` ``B + (2**D - 1,)``, with
            ``M = 2**(D + 1) - 1`` nodes and ``D`` the deepest level drawn.
        """
        like = torch.zeros(()) if like is None else like
        opts = {"dtype": like.dtype, "device": like.device}
        exist = torch.ones(1, **opts)
        log_exist = torch.zeros(1, **opts)
        out = {"split": [], "log_exist": [], "beta": [], "theta": [], "log_sigma": [], "rho": []}
        depth = 0
        with poutine.scale(scale=self.kl_weight):
            while True:
                if depth > 0:
                    trees.check_depth(depth, num_points, dtype=like.dtype, device=like.device)
                split, beta, theta, log_sigma, rho = self._level(depth, exist, opts)
                psi, _, child_exist = node_weights(exist, split)
                out["split"].append(split)
                out["log_exist"].append(log_exist.expand(split.shape))
                out["theta"].append(theta)
                out["log_sigma"].append(log_sigma)
                internal = bool((psi > 0).any())
                if depth >= self.site_depth and not internal:
                    break
                if beta is None:  # the last recorded level splits: a prior draw goes on
                    beta = self._prior(depth, opts)[1].expand(psi.shape).sample()
                    if self.missing:
                        rho = self.rho_prior(psi.shape, **opts).sample()
                out["beta"].append(beta)
                if rho is not None:
                    out["rho"].append(rho)
                log_exist = (log_exist + split.log()).repeat_interleave(2, dim=-1)
                exist = child_exist
                depth += 1
        tree = {
            "split": _bcat(out["split"]),
            "log_exist": _bcat(out["log_exist"]),
            "beta": _bcat_event(out["beta"]) if out["beta"] else None,
            "theta": _bcat_event(out["theta"]),
            "log_sigma": _bcat(out["log_sigma"]),
        }
        if out["rho"]:
            tree["rho"] = _bcat(out["rho"])
        return tree

    def _prior(self, depth: int, opts: dict):
        """The priors of level ``depth``: split probabilities ``(n,)`` and the
        distributions of ``beta``, ``theta`` (batch ``(n,)``, event ``(L + 1,)``) and
        ``log_sigma`` (batch ``(n,)``)."""
        n, width = 1 << depth, self.in_features + 1
        prior = self.node_prior(n - 1, 2 * n - 1, **opts)
        if prior is None:
            gamma = torch.full((n,), self.split_prob(depth), **opts)
            beta = dist.Normal(torch.zeros(n, width, **opts), self.split_scale).to_event(1)
            theta = dist.Normal(torch.zeros(n, self.leaf_width, **opts), self.leaf_scale)
            theta = theta.to_event(1)
        else:
            gamma = prior["split_prob"]
            beta = gaussian(prior["split_loc"], prior["split_scale"])
            theta = gaussian(prior["leaf_loc"], prior["leaf_scale"])
        log_sigma = dist.Normal(
            torch.full((n,), self.noise_prior_loc, **opts), self.noise_prior_scale
        )
        return gamma, beta, theta, log_sigma

    def _level(self, depth: int, exist: torch.Tensor, opts: dict):
        """Draw level ``depth`` given its nodes' existence ``exist``: as weighted sample
        sites up to ``site_depth`` (``beta`` and ``rho`` below it only), without sites
        beyond. Returns ``(split, beta or None, theta, log_sigma, rho or None)``."""
        gamma, beta_prior, theta_prior, ls_prior = self._prior(depth, opts)
        if depth > self.site_depth:
            shape = exist.shape
            split = SplitIndicator(gamma).expand(shape).sample()
            theta, log_sigma = theta_prior.expand(shape).sample(), ls_prior.expand(shape).sample()
            return split, None, theta, log_sigma, None
        beta = rho = None
        with pyro.plate(self.site(f"nodes_{depth}"), 1 << depth, dim=-1):
            with weighted(exist):
                split = pyro.sample(self.site(f"split_{depth}"), SplitIndicator(gamma))
            psi, kappa, _ = node_weights(exist, split)
            if depth < self.site_depth:
                with weighted(psi):
                    beta = pyro.sample(self.site(f"beta_{depth}"), beta_prior)
                    if self.missing:
                        rho_prior = self.rho_prior((1 << depth,), **opts)
                        rho = pyro.sample(self.site(f"rho_{depth}"), rho_prior)
            with weighted(kappa):
                theta = pyro.sample(self.site(f"theta_{depth}"), theta_prior)
                log_sigma = pyro.sample(self.site(f"log_sigma_{depth}"), ls_prior)
        return split, beta, theta, log_sigma, rho

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Draw a tree (:meth:`sample_tree`), then ``obs`` for each point in ``data``.

        :param x: inputs ``(N, L)`` (NaN where missing, with ``missing=True``).
        :param y: targets ``(N,)`` or ``None``.
        :param int subsample_size: minibatch size of the plate ``data`` (default all).
        :returns: the ``obs`` values of the (sub)sampled points, ``B + (N_b,)``.
        """
        self.check(x, y)
        batch = x.shape[0] if subsample_size is None else min(int(subsample_size), x.shape[0])
        tree = self.sample_tree(batch, like=x)
        with pyro.plate(
            self.site("data"), x.shape[0], subsample_size=subsample_size, dim=-1
        ) as idx:
            xb = x[idx]
            yb = None if y is None else y[idx]
            pyro.deterministic(self.site("mean"), tree_mean(tree, xb))
            return pyro.sample(self.site("obs"), tree_likelihood(tree, xb), obs=yb)


def _check_node_tensor(name: str, value, event: tuple) -> torch.Tensor | None:
    if value is None:
        return None
    value = torch.as_tensor(value)
    if not value.is_floating_point():
        value = value.to(torch.get_default_dtype())
    if value.dim() != 1 + len(event) or tuple(value.shape[1:]) != event or value.shape[0] < 1:
        shape = "(K" + "".join(f", {e}" for e in event) + ("" if event else ",") + ")"
        raise ValueError(f"{name} must have shape {shape} with K >= 1; got {tuple(value.shape)}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return value.detach().clone()


def _check_node_scale(name: str, value, width: int) -> torch.Tensor | None:
    if value is None:
        return None
    value = torch.as_tensor(value)
    if value.dim() == 3:
        value = _check_node_tensor(name, value, (width, width))
        diag = value.diagonal(dim1=-2, dim2=-1)
        if not (diag > 0).all() or (value.triu(1) != 0).any():
            raise ValueError(
                f"{name} as Cholesky factors must be lower triangular with a positive diagonal"
            )
        return value
    value = _check_node_tensor(name, value, (width,))
    if not (value > 0).all():
        raise ValueError(f"{name} as standard deviations must be > 0")
    return value


def _fill(given: torch.Tensor | None, default: torch.Tensor, start: int) -> torch.Tensor:
    """``default`` (rows ``start:start + n`` of all nodes) with the rows ``given`` has."""
    if given is None or start >= given.shape[0]:
        return default
    head = given[start : start + default.shape[0]].to(default)
    return torch.cat([head, default[head.shape[0] :]])


def _fill_scale(given, scale: float, n: int, width: int, start: int, opts: dict):
    default = torch.full((n, width), scale, **opts)
    if given is not None and given.dim() == 3:
        default = torch.diag_embed(default)
    return _fill(given, default, start)


def _bcat(tensors):
    shape = torch.broadcast_shapes(*(t.shape[:-1] for t in tensors))
    return torch.cat([t.expand(shape + t.shape[-1:]) for t in tensors], dim=-1)


def _bcat_event(tensors):
    shape = torch.broadcast_shapes(*(t.shape[:-2] for t in tensors))
    return torch.cat([t.expand(shape + t.shape[-2:]) for t in tensors], dim=-2)
