"""A VAE with a graph-correlated Gaussian prior over its instances (Xiao & Su 2024,
Secs. 4.3-4.4).

:class:`GraphPriorVAE` puts :math:`\\mathcal N(0, (I + \\lambda A) \\otimes I_D)` on the
latent codes of all ``N`` instances of a (sparse) graph ``A``; a minibatch ``idx`` samples
the exact marginal prior of its instances. See :mod:`pyro_trees.guides.tree_vi` for the
objective a minibatch step estimates with :class:`~pyro_trees.guides.TreeVIGuide`.
"""

from __future__ import annotations

import math
import weakref

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import nn

from pyro_trees._param_store import predicting, prepare, read_params
from pyro_trees.distributions.kronecker_normal import KroneckerNormal
from pyro_trees.models._instances import csr_rows, find, instance_rows, sorted_batch
from pyro_trees.validation import as_tensor, check_index

__all__ = ["DENSE_CHECK_MAX_NODES", "GraphPriorVAE"]

#: Graphs up to this size get the exact (dense Cholesky) positive-definiteness check.
DENSE_CHECK_MAX_NODES = 4096
_LOG_2PI = math.log(2 * math.pi)
# per model: the Cholesky factor of the whole graph's prior, with what it was made from
_FULL_TRIL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    (dense Cholesky) for graphs of at most
    :data:`~pyro_trees.models.graph_prior.DENSE_CHECK_MAX_NODES` nodes or given as a dense
    matrix; for larger edge lists, by the sufficient condition ``strength * rho(|A|) < 1``
    (a Collatz-Wielandt bound on the spectral radius, ``O(edges)`` per iteration), which
    may reject a strength that the exact check would accept.

    :param adjacency: dense ``(N, N)`` tensor, or ``(E, 2)`` integer edge list with
        ``num_nodes`` (duplicates and self-loops are ignored).
    :param float strength: :math:`\\lambda`; ``I + \\lambda A`` must be positive definite.
    :param int latent_dim: ``D``.
    :param int in_features: ``F``.
    :param hidden_sizes: hidden sizes of the decoder MLP.
    :param str likelihood: ``"bernoulli"`` (bag-of-words) or ``"normal"``.
    :param str name: prefix of its names in Pyro's parameter store
        (``"<name>.decoder$$$0.weight"``, ...).

    Dtype and device follow the data. Under ``Predictive`` the site ``"x"`` is drawn
    from the likelihood (see :meth:`forward`).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.models import GraphPriorVAE
    >>> adjacency = torch.tensor([[0, 1], [1, 2], [2, 3]])  # edge list over 4 instances
    >>> model = GraphPriorVAE(adjacency, 3, num_nodes=4, latent_dim=2, hidden_sizes=(8,))
    >>> model.prior(idx=torch.tensor([1, 2])).event_shape  # exact marginal of the batch
    torch.Size([2, 2])
    >>> x = torch.rand(4, 3).round()
    >>> trace = pyro.poutine.trace(model).get_trace(x)
    >>> trace.nodes["z"]["value"].shape
    torch.Size([4, 2])
    """

    def __init__(
        self,
        adjacency,
        in_features: int,
        *,
        num_nodes: int | None = None,
        strength: float = 0.5,
        latent_dim: int = 16,
        hidden_sizes=(128,),
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
        self.latent_dim, self.in_features = latent_dim, in_features
        self.likelihood = likelihood
        layers, sizes = [], [latent_dim, *hidden_sizes, in_features]
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
        sorted_idx, order = sorted_batch(idx)
        pos, rows = csr_rows(ptr, idx)
        local, inside = find(sorted_idx, order, cols[pos])
        a = vals.new_zeros(idx.numel(), idx.numel())
        return a.index_put_((rows[inside], local[inside]), vals[pos[inside]])

    def prior(self, idx=None) -> KroneckerNormal:
        """The exact marginal prior of the instances ``idx`` (``(B,)`` distinct indices,
        or ``None`` for all): event shape ``(B, D)``."""
        return KroneckerNormal(self._prior_tril(idx), self.latent_dim)

    def _prior_tril(self, idx=None) -> torch.Tensor:
        """The Cholesky factor of ``(I + strength A)_BB``; the whole graph's is kept
        (per strength, graph and dtype), since a full-batch fit asks for it every step."""
        if idx is None:
            key = (
                self.strength,
                self.adj_vals.dtype,
                self.adj_vals.device,
                *((t.data_ptr(), t._version) for t in (self.adj_ptr, self.adj_cols, self.adj_vals)),
            )
            hit = _FULL_TRIL.get(self)
            if hit is not None and hit[0] == key:
                return hit[1]
        a = self.adjacency_matrix(idx)
        eye = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
        tril = torch.linalg.cholesky(eye + self.strength * a.double()).to(a.dtype)
        if idx is None:
            _FULL_TRIL[self] = (key, tril)
        return tril

    @property
    def num_nodes(self) -> int:
        """Number of nodes of the graph (rows of ``x``)."""
        return self.adj_ptr.numel() - 1

    def check(self, x) -> None:
        """Raise :class:`ValueError` if ``x`` is not ``(N, F)`` or a row is not finite, or,
        with the Bernoulli likelihood while Pyro's validation is on, holds a value other
        than 0 and 1: :meth:`forward`'s checks of a batch (Pyro's for the likelihood), on
        every row at once (one read back from the device)."""
        self._rows(x, None)

    def _rows(self, x, idx, check: bool = True):
        xb, idx = instance_rows(x, idx, self.num_nodes, self.in_features, finite=check)
        validating = torch.distributions.Distribution._validate_args  # as the likelihood
        if check and self.likelihood == "bernoulli" and validating:
            if bool(((xb != 0) & (xb != 1)).any()):
                raise ValueError(
                    "x must hold 0 or 1 for the Bernoulli likelihood (Pyro's validation "
                    "rejects other values; use likelihood='normal' for real values)"
                )
        return xb, idx

    # -- the log-joint as plain tensor code, for a loss that compiles it (TreeVIELBO) ----
    def program_parts(self, x) -> dict:
        """The model's tensors and decoder for data ``x``, read through Pyro's store (so
        that plain ``SVI`` trains them), for :meth:`log_joint_of`. The model follows
        ``x``'s dtype and device first, as :meth:`forward` does."""
        prepare(self, as_tensor(x, "x"))
        read_params(self)
        parts = {"decoder": self.decoder, "likelihood": self.likelihood}
        parts["log_noise"] = self.log_noise if self.likelihood == "normal" else None
        return parts

    def step_inputs(self, x, idx=None, *, check: bool = True) -> dict:
        """What :meth:`log_joint_of` needs of the batch ``idx``, computed eagerly: its
        rows and the Cholesky factor of its prior's row covariance (:meth:`prior`).

        :param torch.Tensor x: ``(N, F)``.
        :param idx: ``(B,)`` indices of the batch, or ``None`` (all ``N``).
        :param bool check: scan the batch's rows (``False`` where the caller has run
            :meth:`check` on ``x``).
        :returns: ``{"x": (B, F), "tril": (B, B)}``.
        :raises ValueError: as :meth:`forward`.
        """
        xb, idx = self._rows(x, idx, check)
        return {"x": xb, "tril": self._prior_tril(idx).to(xb)}

    @staticmethod
    def log_joint_of(parts: dict, inputs: dict, z: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`'s log-joint at the batch's ``z`` ``(B, D)`` as plain tensor code
        (the graph prior and the likelihood, summed): the value of its trace's densities,
        from :meth:`program_parts` and :meth:`step_inputs`. Returns a scalar."""
        tril = inputs["tril"]
        w = torch.linalg.solve_triangular(tril, z, upper=False)
        n, d = z.shape[-2], z.shape[-1]
        log_diag = tril.diagonal(dim1=-2, dim2=-1).log().sum()
        total = -0.5 * w.pow(2).sum() - d * log_diag - 0.5 * n * d * _LOG_2PI
        out, xb = parts["decoder"](z), inputs["x"]
        if parts["likelihood"] == "bernoulli":
            return total - F.binary_cross_entropy_with_logits(out, xb, reduction="sum")
        log_noise = parts["log_noise"]
        lp = -0.5 * ((xb - out) / log_noise.exp()).pow(2) - log_noise - 0.5 * _LOG_2PI
        return total + lp.sum()

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
        xb, idx = instance_rows(x, idx, self.num_nodes, self.in_features)
        prepare(self, xb)
        z = pyro.sample("z", self.prior(idx))
        out = self.decoder(z)
        if self.likelihood == "bernoulli":
            likelihood = dist.Bernoulli(logits=out)
        else:
            likelihood = dist.Normal(out, self.log_noise.exp())
        return pyro.sample("x", likelihood.to_event(2), obs=None if predicting() else xb)
