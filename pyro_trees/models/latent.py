"""Latent-variable models with instance-correlated Gaussian priors (TreeVI experiments).

:class:`SyntheticGraphVAE` and :class:`GraphPriorVAE` put a graph-correlated prior
:math:`\\mathcal N(0, (I + \\lambda A) \\otimes I_D)` on the latent codes of related
instances (Xiao & Su 2024, Secs. 4.1, 4.3, 4.4); :class:`ConstrainedClusteringVAE` couples
them through must-link and cannot-link constraints (Sec. 4.2, eq. 19). The exact
posterior couples instances, so a mean-field guide cannot represent it. All three work
with :class:`~pyro_trees.guides.TreeVIGuide` (and its mixture) and with the mean-field
guide ``TreeVIGuide(encoder, parents=None)``; see :mod:`pyro_trees.guides.tree_vi` for the
objective a minibatch step estimates with each.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import nn

from pyro_trees._param_store import predicting, prepare
from pyro_trees.distributions.kronecker_normal import KroneckerNormal
from pyro_trees.validation import as_tensor, check_finite, check_index

__all__ = ["ConstrainedClusteringVAE", "GraphPriorVAE", "SYNTHETIC_AFFINITY", "SyntheticGraphVAE"]

#: The loopy affinity matrix of eq. 18 (four instances).
SYNTHETIC_AFFINITY = torch.tensor(
    [
        [0.0, 1.0, 0.0, 0.3],
        [1.0, 0.0, 1.0, 0.3],
        [0.0, 1.0, 0.0, 0.4],
        [0.3, 0.3, 0.4, 0.0],
    ]
)


def _instance_rows(x, idx, num_nodes: int, obs_dim: int):
    """Checked ``(x_B, idx)`` of an instance-level model: ``x`` of shape ``(N, F)``,
    ``idx`` in ``[0, N)``, the batch's rows finite (only they are scanned, ``O(|B| F)``)."""
    x = as_tensor(x, "x")
    if x.dim() != 2 or x.shape[0] != num_nodes or x.shape[1] != obs_dim:
        raise ValueError(
            f"x must have shape (N, F) = ({num_nodes}, {obs_dim}) (one row per instance of "
            f"the model), got {tuple(x.shape)}"
        )
    if idx is not None:
        idx = check_index(idx, num_nodes, device=x.device)
        x = x.index_select(0, idx)
    return check_finite(x, "x"), idx


#: Graphs up to this size get the exact (dense Cholesky) positive-definiteness check.
DENSE_CHECK_MAX_NODES = 4096


def _csr_rows(ptr: torch.Tensor, idx: torch.Tensor):
    """The entries of the rows ``idx`` of a CSR layout with row pointers ``ptr``: their
    positions in the column array and the position in ``idx`` of each entry's row.
    ``O(|idx| + entries)``."""
    start = ptr[idx]
    counts = ptr[idx + 1] - start
    rows = torch.repeat_interleave(torch.arange(idx.numel(), device=idx.device), counts)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=idx.device) - first[rows] + start[rows]
    return pos, rows


def _sorted_batch(idx: torch.Tensor):
    """``idx`` sorted and the permutation; raises on repeated instances."""
    sorted_idx, order = idx.sort()
    if bool((sorted_idx[1:] == sorted_idx[:-1]).any()):
        raise ValueError("idx contains repeated instances")
    return sorted_idx, order


def _find(sorted_idx: torch.Tensor, order: torch.Tensor, values: torch.Tensor):
    """Position in ``idx`` of each of ``values`` and whether it is there at all
    (binary search, ``O(len(values) log |idx|)``)."""
    at = torch.searchsorted(sorted_idx, values).clamp_max(sorted_idx.numel() - 1)
    return order[at], sorted_idx[at] == values


def _check_sparse_pd(rows, cols, vals, n: int, strength: float, iters: int = 100):
    """Certify ``I + strength * A`` positive definite without forming it. Every eigenvalue
    of ``A`` is at most :math:`\\rho(|A|) = \\rho(|A|^2)^{1/2}` in modulus, and for any
    positive ``v`` the Collatz-Wielandt bound :math:`\\max_i (|A|^2 v)_i / v_i \\ge
    \\rho(|A|^2)`; ``v`` is refined by power iteration on :math:`|A|^2 + I` (squaring
    makes it converge on bipartite graphs, where :math:`\\pm\\rho` are both eigenvalues).
    Sufficient, not necessary (tight when :math:`\\lambda_{\\min}(A) = -\\rho(|A|)`, as for
    bipartite 0/1 graphs): raises when it cannot certify ``strength * rho(|A|) < 1``."""
    w = vals.abs().double()
    v = torch.ones(n, dtype=torch.float64, device=vals.device)

    def matvec(u):
        return torch.zeros_like(u).index_add_(0, rows, w * u[cols])

    bound = float("inf")
    for _ in range(iters):
        av = matvec(matvec(v))
        bound = min(bound, float((av / v).max()) ** 0.5)
        if abs(strength) * bound < 1:
            return
        v = av + v
        v = (v / v.max()).clamp_min(1e-100)  # any positive v gives a valid bound
    raise ValueError(
        f"I + {strength} * adjacency could not be certified positive definite: the "
        f"spectral radius of |adjacency| is bounded by {bound:.4g} only (a graph of {n} "
        f"> {DENSE_CHECK_MAX_NODES} nodes gets this sufficient check instead of a dense "
        f"Cholesky factorisation); lower the strength below {1 / bound:.4g}"
    )


class SyntheticGraphVAE(PyroModule):
    """The synthetic graph-structured latent-variable model of Sec. 4.1.

    Data come in ``G`` independent groups of ``N`` related instances (``N = 4`` with the
    affinity of eq. 18). Generative story, for every group ``g`` (plate ``"groups"``,
    dim -1)::

        Z_g ~ N(0, (I_N + strength * A) ⊗ I_D)          # site "z", event (N, D)
        X_g | Z_g ~ N(Z_g W^T + b, noise_var I)           # site "x", event (N, F)

    with a linear decoder ``W, b`` (identity and zero by default, frozen unless
    ``learn_decoder``), so :meth:`exact_log_likelihood` is available in closed form.

    :param torch.Tensor adjacency: ``(N, N)`` symmetric affinity (default eq. 18).
    :param float strength: :math:`\\lambda` (0.5 in the paper).
    :param int latent_dim: ``D``.
    :param int obs_dim: ``F`` (4 and 4 in the paper).
    :param float noise_var: :math:`\\sigma^2` (0.5 in the paper).
    :param bool learn_decoder: learn ``W, b`` (parameters ``"<name>.weight"``,
        ``"<name>.bias"``).
    :param str name: prefix of its names in Pyro's parameter store.

    Dtype and device follow the data (the buffers move to those of ``x`` at a call).
    Under ``Predictive`` the site ``"x"`` is drawn from the likelihood given the guide's
    ``z``: the posterior predictive of the groups (see :meth:`forward`).
    """

    def __init__(
        self,
        adjacency: torch.Tensor | None = None,
        strength: float = 0.5,
        latent_dim: int = 4,
        obs_dim: int = 4,
        noise_var: float = 0.5,
        learn_decoder: bool = False,
        *,
        name: str = "",
    ):
        super().__init__(name)
        adjacency = SYNTHETIC_AFFINITY if adjacency is None else torch.as_tensor(adjacency)
        prior = KroneckerNormal.from_affinity(adjacency.double(), strength, latent_dim)
        self.register_buffer("prior_tril", prior.scale_tril.float())
        if noise_var <= 0:
            raise ValueError(f"noise_var must be positive, got {noise_var}")
        self.noise_var = float(noise_var)
        self.latent_dim, self.obs_dim = latent_dim, obs_dim
        weight, bias = torch.eye(obs_dim, latent_dim), torch.zeros(obs_dim)
        if learn_decoder:
            self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)

    def decoder(self, z):
        """The linear decoder ``z W^T + b``."""
        return z @ self.weight.T + self.bias

    @property
    def num_instances(self) -> int:
        """Number of instances ``N`` per group (the size of the prior's covariance)."""
        return self.prior_tril.shape[-1]

    def forward(self, x=None, *, num_groups: int | None = None, subsample_size=None, **kwargs):
        """Run the generative story.

        ``x`` is observed, except under ``pyro.infer.Predictive`` (which masks every
        density out): there ``"x"`` is drawn from ``p(x | z)`` with ``z`` from the
        guide, so ``Predictive(model, guide=guide, num_samples=S)(x)`` returns
        reconstructions ``(S, G, N, F)`` of the data and the guide's ``z``
        ``(S, G, N, D)`` (without ``subsample_size``: ``Predictive`` does not pass the
        guide's subsample to the model; with it this raises).

        :param torch.Tensor x: observed data ``(G, N, F)``, or ``None`` to generate.
        :param int num_groups: ``G`` when generating (``x=None``).
        :param int subsample_size: minibatch size of the ``"groups"`` plate.
        :returns: ``x`` of the (subsampled) groups, ``(G', N, F)`` (with a leading batch
            shape under outer plates, e.g. ``Predictive(..., parallel=True)``).
        :raises ValueError: if ``x`` is not ``(G, N, F)``, the subsampled rows are not
            finite, or ``subsample_size`` is given under ``Predictive``.
        """
        if x is None and num_groups is None:
            raise ValueError("give the data x (G, N, F) or num_groups to generate")
        if x is not None:
            x = as_tensor(x, "x")
            shape = (self.num_instances, self.obs_dim)
            if x.dim() != 3 or tuple(x.shape[1:]) != shape:
                raise ValueError(
                    f"x must have shape (G, N, F) = (G, {shape[0]}, {shape[1]}), "
                    f"got {tuple(x.shape)}"
                )
        prepare(self, x)
        if predicting() and subsample_size is not None and x is not None:
            raise ValueError(
                "Predictive does not pass the guide's subsample of groups to the model, so "
                "with subsample_size the two would draw different groups: call Predictive "
                "without subsample_size (or on x[subset])"
            )
        g = x.shape[0] if x is not None else num_groups
        tril = self.prior_tril.to(self.weight.dtype)
        with pyro.plate("groups", g, subsample_size=subsample_size, dim=-1) as i:
            z = pyro.sample("z", KroneckerNormal(tril, self.latent_dim))
            obs = None if x is None else check_finite(x[i], "x")
            if predicting():
                obs = None
            scale = torch.tensor(self.noise_var, dtype=tril.dtype, device=tril.device).sqrt()
            return pyro.sample("x", dist.Normal(self.decoder(z), scale).to_event(2), obs=obs)

    @torch.no_grad()
    def marginal(self) -> torch.distributions.MultivariateNormal:
        """The exact marginal of one group, ``vec(X_g)`` of size ``N F``."""
        w = self.weight.double().cpu()
        tril = self.prior_tril.double().cpu()
        c = tril @ tril.T
        cov = torch.kron(c, w @ w.T) + self.noise_var * torch.eye(
            c.shape[0] * self.obs_dim, dtype=torch.float64
        )
        loc = self.bias.double().cpu().repeat(c.shape[0])
        return torch.distributions.MultivariateNormal(loc, cov)

    @torch.no_grad()
    def exact_log_likelihood(self, x) -> torch.Tensor:
        """:math:`\\log p(X_g)` per group, shape ``(G,)`` (float64)."""
        return self.marginal().log_prob(x.double().cpu().reshape(x.shape[0], -1))

    @torch.no_grad()
    def generate(self, num_groups: int, generator: torch.Generator | None = None):
        """Draw ``(G, N, F)`` data from the model."""
        m = self.marginal()
        eps = torch.randn(num_groups, m.loc.numel(), generator=generator, dtype=torch.float64)
        x = m.loc + eps @ m.scale_tril.T
        shape = (num_groups, self.num_instances, self.obs_dim)
        return x.reshape(shape).to(self.weight.dtype).to(self.weight.device)


class GraphPriorVAE(PyroModule):
    """VAE with a graph-correlated Gaussian prior over instances (Secs. 4.3, 4.4).

    Generative story for the instances ``B`` of a step (all ``N`` when ``idx=None``)::

        Z_B ~ N(0, (I + strength * A)_{BB} ⊗ I_D)    # site "z", event (|B|, D): the exact
                                                    # marginal of the prior over B
        X_B | Z_B ~ Bernoulli(logits = decoder(Z_B))  # site "x", event (|B|, F)

    ``A`` is the (symmetric, 0/1) affinity of a correlation graph: the two halves of a
    user's history for user matching, the friendship graph for link prediction. It is
    stored sparse (rows sorted, CSR-like), never as an ``N x N`` matrix; the prior over a
    batch takes the induced subgraph of ``B`` in ``O(|B| log |B| + d_B log |B|)`` (``d_B``
    the number of edges incident to ``B``: each is looked up in the sorted batch) and
    costs one ``|B| x |B|`` Cholesky factorisation.

    Positive definiteness of ``I + strength * A`` is checked at construction: exactly
    (dense Cholesky) for graphs of at most :data:`~pyro_trees.models.latent.DENSE_CHECK_MAX_NODES`
    nodes or given as a dense matrix; for larger edge lists, by the sufficient condition
    ``strength * rho(|A|) < 1`` (a Collatz-Wielandt bound on the spectral radius, ``O(edges)`` per
    iteration), which may reject a strength that the exact check would accept.

    :param adjacency: dense ``(N, N)`` tensor, or ``(E, 2)`` integer edge list with
        ``num_nodes`` (duplicates and self-loops are ignored).
    :param float strength: :math:`\\lambda`; ``I + \\lambda A`` must be positive definite.
    :param int latent_dim: ``D``.
    :param int obs_dim: ``F``.
    :param hidden: hidden sizes of the decoder MLP.
    :param str likelihood: ``"bernoulli"`` (bag-of-words) or ``"normal"``.
    :param str name: prefix of its names in Pyro's parameter store
        (``"<name>.decoder$$$0.weight"``, ...).

    Dtype and device follow the data. Under ``Predictive`` the site ``"x"`` is drawn
    from the likelihood (see :meth:`forward`).
    """

    def __init__(
        self,
        adjacency,
        obs_dim: int,
        *,
        num_nodes: int | None = None,
        strength: float = 0.5,
        latent_dim: int = 16,
        hidden=(128,),
        likelihood: str = "bernoulli",
        name: str = "",
    ):
        super().__init__(name)
        adjacency = torch.as_tensor(adjacency)
        is_edge_list = adjacency.dim() == 2 and adjacency.shape[1] == 2
        if is_edge_list and num_nodes is None and adjacency.shape[0] != 2:
            raise ValueError(
                f"num_nodes is required with an edge list: got adjacency of shape "
                f"{tuple(adjacency.shape)} (an (E, 2) edge list) and num_nodes=None"
            )
        if is_edge_list and num_nodes is not None:
            if adjacency.is_floating_point() or adjacency.dtype == torch.bool:
                raise ValueError(f"edge list must hold integer indices, got {adjacency.dtype}")
            if int(num_nodes) < 1:
                raise ValueError(f"num_nodes must be a positive int, got {num_nodes}")
            adjacency = adjacency.long()
            if adjacency.numel() and (adjacency.min() < 0 or adjacency.max() >= num_nodes):
                raise ValueError(
                    f"edge index out of range: the edge list holds nodes "
                    f"{int(adjacency.min())}..{int(adjacency.max())}, "
                    f"outside [0, num_nodes={num_nodes})"
                )
            n = int(num_nodes)
            e = adjacency[adjacency[:, 0] != adjacency[:, 1]]  # no self-loops
            keys = torch.cat([e[:, 0] * n + e[:, 1], e[:, 1] * n + e[:, 0]]).unique()
            rows, cols = keys // n, keys % n  # both directions, sorted by row then column
            vals = torch.ones(rows.numel())
            dense = None
        else:
            if adjacency.dim() != 2 or adjacency.shape[0] != adjacency.shape[1]:
                raise ValueError("adjacency must be a square (N, N) matrix or an (E, 2) edge list")
            if num_nodes is not None and adjacency.shape[0] != num_nodes:
                raise ValueError(f"adjacency is {tuple(adjacency.shape)} but num_nodes={num_nodes}")
            n, dense = adjacency.shape[0], adjacency
            a = adjacency.float()
            rows, cols = a.nonzero(as_tuple=True)  # row-major: sorted by row then column
            vals = a[rows, cols]
        if likelihood not in ("bernoulli", "normal"):
            raise ValueError(f"likelihood must be 'bernoulli' or 'normal', got {likelihood!r}")
        if dense is None and n <= DENSE_CHECK_MAX_NODES:
            dense = torch.zeros(n, n, dtype=torch.float64).index_put_((rows, cols), vals.double())
        if dense is not None:  # symmetric, and positive definite exactly
            KroneckerNormal.from_affinity(dense.double(), strength, latent_dim)
        else:
            _check_sparse_pd(rows, cols, vals, n, float(strength))
        ptr = torch.zeros(n + 1, dtype=torch.long)
        ptr[1:] = torch.bincount(rows, minlength=n).cumsum(0)
        self.register_buffer("adj_ptr", ptr)
        self.register_buffer("adj_cols", cols.long())
        self.register_buffer("adj_vals", vals.float())
        self.strength = float(strength)
        self.latent_dim, self.obs_dim = latent_dim, obs_dim
        self.likelihood = likelihood
        layers, sizes = [], [latent_dim, *hidden, obs_dim]
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(a, b), nn.Softplus()]
        self.decoder = nn.Sequential(*layers[:-1])
        if likelihood == "normal":
            self.log_noise = nn.Parameter(torch.zeros(()))

    def adjacency_matrix(self, idx=None) -> torch.Tensor:
        """The dense adjacency of the subgraph induced by ``idx`` (``(B,)`` distinct
        indices, in their order), ``(B, B)``; the whole ``(N, N)`` matrix if ``None``.
        ``O(B^2 + d_B log B)`` with ``d_B`` the edges incident to the batch."""
        ptr, cols, vals = self.adj_ptr, self.adj_cols, self.adj_vals
        n = ptr.numel() - 1
        if idx is None:
            rows = torch.repeat_interleave(torch.arange(n, device=ptr.device), ptr.diff())
            return vals.new_zeros(n, n).index_put_((rows, cols), vals)
        idx = check_index(idx, n, device=ptr.device)
        sorted_idx, order = _sorted_batch(idx)
        pos, rows = _csr_rows(ptr, idx)
        local, inside = _find(sorted_idx, order, cols[pos])
        a = vals.new_zeros(idx.numel(), idx.numel())
        return a.index_put_((rows[inside], local[inside]), vals[pos[inside]])

    def prior(self, idx=None) -> KroneckerNormal:
        """The exact marginal prior of the instances ``idx`` (``(B,)`` distinct indices,
        or ``None`` for all): event shape ``(B, D)``."""
        a = self.adjacency_matrix(idx)
        eye = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
        tril = torch.linalg.cholesky(eye + self.strength * a.double()).to(a.dtype)
        return KroneckerNormal(tril, self.latent_dim)

    @property
    def num_nodes(self) -> int:
        """Number of nodes of the graph (rows of ``x``)."""
        return self.adj_ptr.numel() - 1

    def forward(self, x, *args, idx=None, **kwargs):
        """Score the instances of a step; under ``Predictive``, draw them.

        ``x`` is observed, except under ``pyro.infer.Predictive`` (which masks every
        density out): there ``"x"`` is drawn from ``p(x | z)`` with ``z`` from the
        guide, so ``Predictive(model, guide=guide, num_samples=S)(x)`` returns
        posterior predictive draws ``(S, B, F)`` of the batch and ``z`` ``(S, B, D)``.

        :param torch.Tensor x: ``(N, F)``, one row per node of the graph.
        :param idx: ``(B,)`` integer indices of the batch's instances, or ``None`` for all
            (``B = N``); the prior of site ``"z"`` is then the exact marginal over ``B``.
        :returns: the observations (or draws) of the batch, site ``"x"``, ``(B, F)``
            (with a leading batch shape under outer plates); the latent site ``"z"``
            has event shape ``(B, D)``.
        :raises ValueError: if ``x`` is not ``(N, F)``, ``idx`` is out of range, or a row
            of the batch is not finite (only the batch's rows are scanned).
        """
        xb, idx = _instance_rows(x, idx, self.num_nodes, self.obs_dim)
        prepare(self, xb)
        z = pyro.sample("z", self.prior(idx))
        out = self.decoder(z)
        if self.likelihood == "bernoulli":
            likelihood = dist.Bernoulli(logits=out)
        else:
            likelihood = dist.Normal(out, self.log_noise.exp())
        return pyro.sample("x", likelihood.to_event(2), obs=None if predicting() else xb)


class ConstrainedClusteringVAE(PyroModule):
    """Constrained clustering in the DC-GMM / VaDE style (Sec. 4.2, eq. 19).

    Generative story for the instances ``B`` of a step (all when ``idx=None``)::

        c_i ~ Categorical(pi)           (marginalised exactly)
        z_i | c_i ~ N(mu_c, diag sigma_c^2)   # site "z", event (|B|, D): a Gaussian mixture
        factor  sum_{i<j in B} W_ij [c_i = c_j]  # pairwise prior of eq. 19
        x_i | z_i ~ Bernoulli(decoder(z_i))     # site "x", event (|B|, F)

    The pairwise prior ``p(c | W) ∝ prod_i pi_{c_i} h_i(c, W)`` with
    ``h_i = prod_{j != i} exp(W_ij [c_i = c_j])`` (must-link ``W_ij > 0``, cannot-link
    ``W_ij < 0``) enters, as in DC-GMM, through its expectation under the cluster
    posterior ``q(c_i | z_i) = p(c_i | z_i)`` (Bayes' rule under the mixture):
    ``sum_ij W_ij sum_k q_ik q_jk`` (a ``pyro.factor``); its normaliser ``Omega(pi)`` is
    dropped, as DC-GMM does. Only constraints with both ends in the batch count (those
    leaving it are dropped); they are found in ``O(|B| log |B| + c_B log |B|)``, with
    ``c_B`` the constraints whose first instance is in the batch, not ``O(#constraints)``.

    :param int obs_dim: ``F``.
    :param int num_clusters: ``K``.
    :param int latent_dim: ``D``.
    :param constraints: ``(C, 2)`` integer pairs.
    :param weights: ``(C,)`` values
        ``W_ij`` (positive must-link, negative cannot-link; the paper uses ``±1e4``).
    :param int num_nodes: ``N``, the number of instances (checked against the
        constraints); default: the rows of ``x``.
    :param str name: prefix of its names in Pyro's parameter store
        (``"<name>.cluster_loc"``, ...).

    Dtype and device follow the data. Under ``Predictive`` the site ``"x"`` is drawn
    from the likelihood (see :meth:`forward`).
    """

    def __init__(
        self,
        obs_dim: int,
        num_clusters: int,
        *,
        latent_dim: int = 10,
        hidden=(256,),
        constraints=None,
        weights=None,
        num_nodes: int | None = None,
        name: str = "",
    ):
        super().__init__(name)
        if num_clusters < 2:
            raise ValueError(f"num_clusters must be >= 2, got {num_clusters}")
        pairs = torch.zeros(0, 2, dtype=torch.long) if constraints is None else constraints
        pairs = torch.as_tensor(pairs).long().reshape(-1, 2)
        w = torch.zeros(0) if weights is None else torch.as_tensor(weights).float()
        if w.shape != (pairs.shape[0],):
            raise ValueError(f"weights must have shape ({pairs.shape[0]},), got {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("constraint weights contain NaN or infinite values")
        if num_nodes is not None and int(num_nodes) < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes}")
        if pairs.numel() and (
            pairs.min() < 0 or (num_nodes is not None and pairs.max() >= num_nodes)
        ):
            raise ValueError(
                f"constraint index out of range: the constraints hold instances "
                f"{int(pairs.min())}..{int(pairs.max())}, outside [0, num_nodes={num_nodes})"
            )
        # the largest constrained instance: without num_nodes, checked against x's rows
        self.max_constrained = int(pairs.max()) if pairs.numel() else -1
        self.num_nodes = None if num_nodes is None else int(num_nodes)
        self.register_buffer("pairs", pairs)
        self.register_buffer("weights", w)
        # the constraints listed by their first instance (CSR-like), so that a batch finds
        # its own in O(|B| log |B| + c_B log |B|); row max_constrained + 1 is empty, for
        # every instance beyond the last constrained one
        k = self.max_constrained + 1
        ptr = torch.zeros(k + 2, dtype=torch.long)
        ptr[1 : k + 1] = torch.bincount(pairs[:, 0], minlength=k).cumsum(0)
        ptr[k + 1] = ptr[k]
        self.register_buffer("_by_first_ptr", ptr)
        self.register_buffer("_by_first", torch.argsort(pairs[:, 0], stable=True))
        self.num_clusters, self.latent_dim, self.obs_dim = num_clusters, latent_dim, obs_dim
        self.cluster_logits = nn.Parameter(torch.zeros(num_clusters))
        self.cluster_loc = nn.Parameter(torch.randn(num_clusters, latent_dim))
        self.cluster_log_scale = nn.Parameter(torch.zeros(num_clusters, latent_dim))
        layers, sizes = [], [latent_dim, *hidden, obs_dim]
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(a, b), nn.Softplus()]
        self.decoder = nn.Sequential(*layers[:-1])

    def _components(self):
        return dist.Normal(self.cluster_loc, self.cluster_log_scale.exp()).to_event(1)

    def responsibilities(self, z):
        """``q(c | z) = p(c | z)`` under the mixture, ``(..., N, K)``; the model follows
        ``z``'s dtype and device."""
        prepare(self, z)
        lp = self._components().log_prob(z.unsqueeze(-2)) + self.cluster_logits.log_softmax(-1)
        return lp.softmax(-1)

    @torch.no_grad()
    def predict(self, z):
        """Hard cluster assignments ``(..., N)``."""
        return self.responsibilities(z).argmax(-1)

    def _batch_constraints(self, idx):
        """The constraints with both ends in the batch, as positions in ``idx``
        (``(C_B, 2)``), in their original order, and their weights ``(C_B,)``.

        The constraints are listed by their first instance, so only the ``c_B``
        constraints whose first instance is in ``B`` are visited, each with a binary
        search of its second instance in the sorted batch: ``O(|B| log |B| + c_B log
        |B|)``, never ``O(C)``."""
        if self.pairs.numel() == 0 or idx is None:
            return self.pairs, self.weights
        idx = torch.as_tensor(idx, device=self.pairs.device).long()
        sorted_idx, order = _sorted_batch(idx)
        last = self._by_first_ptr.numel() - 2  # the empty row
        pos, rows = _csr_rows(self._by_first_ptr, idx.clamp(0, last))
        ids = self._by_first[pos]
        second, inside = _find(sorted_idx, order, self.pairs[ids, 1])
        ids, keep = ids[inside].sort()  # the original order of the constraints
        first, second = rows[inside][keep], second[inside][keep]
        return torch.stack([first, second], -1), self.weights[ids]

    def pairwise_log_factor(self, z, idx=None):
        """The pairwise term of eq. 19, ``sum_ij W_ij sum_k q(c_i = k | z_i) q(c_j = k |
        z_j)`` over the constraints inside the batch ``idx``: ``z`` of shape
        ``(..., |B|, D)`` gives ``(...)``. It is the model's only term that couples
        instances (the site ``"constraints"``; see :class:`~pyro_trees.infer.PairwiseELBO`).
        ``idx`` must hold distinct instances."""
        if idx is None:
            self._check_constraints(z.shape[-2], "z")
        pairs, w = self._batch_constraints(idx)
        if not pairs.numel():
            return z.new_zeros(z.shape[:-2])
        r = self.responsibilities(z)
        same = (r.index_select(-2, pairs[:, 0]) * r.index_select(-2, pairs[:, 1])).sum(-1)
        return (w * same).sum(-1)

    def _check_constraints(self, n: int, name: str):
        if self.max_constrained >= n:
            raise ValueError(
                f"constraint index out of range: a constraint names instance "
                f"{self.max_constrained} but {name} has {n} instances (rows on dim -2)"
            )

    def forward(self, x, *args, idx=None, **kwargs):
        """Score the instances of a step; under ``Predictive``, draw them.

        ``x`` is observed, except under ``pyro.infer.Predictive`` (which masks every
        density out): there ``"x"`` is drawn from ``p(x | z)`` with ``z`` from the
        guide, so ``Predictive(model, guide=guide, num_samples=S)(x)`` returns
        posterior predictive draws ``(S, B, F)`` of the batch and ``z`` ``(S, B, D)``.

        :param torch.Tensor x: ``(N, F)``, one row per instance (``N`` as ``num_nodes``
            when given).
        :param idx: ``(B,)`` integer indices of the batch's instances, or ``None`` for all
            (``B = N``); only the constraints with both ends in the batch enter the
            factor ``"constraints"`` (a scalar, or ``(M,)`` under a component plate).
        :returns: the observations of the batch, site ``"x"``, ``(B, F)``; the latent site
            ``"z"`` has event shape ``(B, D)``.
        :raises ValueError: if ``x`` is not ``(N, F)``, ``idx`` is out of range, a
            constraint names an instance beyond the ``N`` rows, or a row of the batch is
            not finite (only the batch's rows are scanned).
        """
        x = as_tensor(x, "x")
        n_all = self.num_nodes if self.num_nodes is not None else x.shape[-2]
        xb, idx = _instance_rows(x, idx, n_all, self.obs_dim)
        self._check_constraints(n_all, "x")
        prepare(self, xb)
        n = xb.shape[-2]
        mix = dist.MixtureSameFamily(
            dist.Categorical(logits=self.cluster_logits), self._components()
        )
        z = pyro.sample("z", mix.expand(torch.Size([n])).to_event(1))
        if self.pairs.numel():
            pyro.factor("constraints", self.pairwise_log_factor(z, idx=idx))
        logits = self.decoder(z)
        obs = None if predicting() else xb
        return pyro.sample("x", dist.Bernoulli(logits=logits).to_event(2), obs=obs)
