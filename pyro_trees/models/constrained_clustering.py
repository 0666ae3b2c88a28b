"""Constrained clustering with a VAE (Xiao & Su 2024, Sec. 4.2, eq. 19; DC-GMM).

:class:`ConstrainedClusteringVAE` is a Gaussian-mixture VAE whose instances are coupled
by must-link and cannot-link constraints through one pairwise factor; see
:mod:`pyro_trees.guides.tree_vi` for the surrogate objective a minibatch step estimates
and :class:`~pyro_trees.infer.PairwiseELBO` for its Rao-Blackwellised estimator.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import nn

from pyro_trees._param_store import predicting, prepare, read_params
from pyro_trees.models._instances import csr_rows, find, instance_rows, sorted_batch
from pyro_trees.validation import as_tensor

__all__ = ["ConstrainedClusteringVAE"]

_ACTIVATIONS = {"softplus": nn.Softplus, "relu": nn.ReLU}
_LOG_2PI = math.log(2 * math.pi)


def _check_unit_interval(x: torch.Tensor) -> None:
    if bool(((x < 0) | (x > 1)).any()):
        raise ValueError("x must lie in [0, 1] (bits or grey levels)")


class ConstrainedClusteringVAE(PyroModule):
    """Constrained clustering in the DC-GMM / VaDE style (Sec. 4.2, eq. 19).

    Generative story for the instances ``B`` of a step (all when ``idx=None``)::

        c_i ~ Categorical(pi)           (marginalised exactly)
        z_i | c_i ~ N(mu_c, diag sigma_c^2)   # site "z", event (|B|, D): a Gaussian mixture
        factor  sum_{(i,j) listed, in B} W_ij [c_i = c_j]  # pairwise prior of eq. 19
        x_i | z_i ~ Bernoulli(decoder(z_i))     # site "x", event (|B|, F)

    The pairwise prior ``p(c | W) ∝ prod_i pi_{c_i} h_i(c, W)`` with
    ``h_i = prod_{j != i} exp(W_ij [c_i = c_j])`` (must-link ``W_ij > 0``, cannot-link
    ``W_ij < 0``) enters, as in DC-GMM, through its expectation under the cluster
    posterior ``q(c_i | z_i) = p(c_i | z_i)`` (Bayes' rule under the mixture):
    ``sum_ij W_ij sum_k q_ik q_jk`` (a ``pyro.factor``); its normaliser ``Omega(pi)`` is
    dropped, as DC-GMM does. Each listed pair counts once: eq. 19's sum runs over
    ordered pairs (``h_i`` and ``h_j`` both hold ``W_ij``), so a symmetric ``W`` of
    entries ``±w`` is ``weights=±2w`` on unordered pairs (DC-GMM's code sums both
    orders). Only constraints with both ends in the batch count (those
    leaving it are dropped); they are found in ``O(|B| log |B| + c_B log |B|)``, with
    ``c_B`` the constraints whose first instance is in the batch, not ``O(#constraints)``.

    ``x`` may hold grey levels in ``[0, 1]`` rather than bits: the log-likelihood is
    then the negative binary cross-entropy of the decoder's logits, as VaDE and DC-GMM
    train on MNIST's pixel intensities (not a normalised density for such ``x``).

    :param int in_features: ``F``.
    :param int num_clusters: ``K``.
    :param int latent_dim: ``D``.
    :param hidden_sizes: the decoder's hidden layers, from ``z`` to ``x`` (DC-GMM's
        ``(2000, 500, 500)``).
    :param str activation: ``"softplus"`` or ``"relu"`` (VaDE, DC-GMM) between the
        decoder's layers.
    :param bool learn_cluster_weights: learn the mixture weights ``pi`` (VaDE); ``False``
        keeps them uniform, a buffer ``cluster_logits`` of zeros (DC-GMM).
    :param constraints: ``(C, 2)`` integer pairs.
    :param weights: ``(C,)`` values
        ``W_ij`` (positive must-link, negative cannot-link; the paper uses ``±1e4``).
    :param int num_nodes: ``N``, the number of instances (checked against the
        constraints); default: the rows of ``x``.
    :param str name: prefix of its names in Pyro's parameter store
        (``"<name>.cluster_loc"``, ...).

    Dtype and device follow the data. Under ``Predictive`` the site ``"x"`` is drawn
    from the likelihood (see :meth:`forward`).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.models import ConstrainedClusteringVAE
    >>> model = ConstrainedClusteringVAE(3, 2, latent_dim=2, hidden_sizes=(8,),
    ...                                  constraints=[[0, 1], [2, 3]], weights=[1.0, -1.0])
    >>> x = torch.rand(4, 3).round()
    >>> trace = pyro.poutine.trace(model).get_trace(x)
    >>> z = trace.nodes["z"]["value"]
    >>> z.shape, model.responsibilities(z).shape, model.predict(z).shape
    (torch.Size([4, 2]), torch.Size([4, 2]), torch.Size([4]))
    >>> model.pairwise_log_factor(z).shape
    torch.Size([])
    """

    def __init__(
        self,
        in_features: int,
        num_clusters: int,
        *,
        latent_dim: int = 10,
        hidden_sizes=(256,),
        activation: str = "softplus",
        learn_cluster_weights: bool = True,
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
        self.num_clusters, self.latent_dim, self.in_features = num_clusters, latent_dim, in_features
        if learn_cluster_weights:
            self.cluster_logits = nn.Parameter(torch.zeros(num_clusters))
        else:
            self.register_buffer("cluster_logits", torch.zeros(num_clusters))
        self.cluster_loc = nn.Parameter(torch.randn(num_clusters, latent_dim))
        self.cluster_log_scale = nn.Parameter(torch.zeros(num_clusters, latent_dim))
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(_ACTIVATIONS)}; got {activation!r}"
            )
        layers, sizes = [], [latent_dim, *hidden_sizes, in_features]
        for a, b in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(a, b), _ACTIVATIONS[activation]()]
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
        sorted_idx, order = sorted_batch(idx)
        last = self._by_first_ptr.numel() - 2  # the empty row
        pos, rows = csr_rows(self._by_first_ptr, idx.clamp(0, last))
        ids = self._by_first[pos]
        second, inside = find(sorted_idx, order, self.pairs[ids, 1])
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

    def _rows(self, x, idx, check: bool = True):
        """The batch's checked rows ``(x_B, idx)`` (see :meth:`forward`'s errors)."""
        x = as_tensor(x, "x")
        n_all = self.num_nodes if self.num_nodes is not None else x.shape[-2]
        xb, idx = instance_rows(x, idx, n_all, self.in_features, finite=check)
        if check:
            _check_unit_interval(xb)
        self._check_constraints(n_all, "x")
        return xb, idx

    def check(self, x) -> None:
        """Raise :class:`ValueError` if a row of ``x`` ``(N, F)`` is not finite or leaves
        ``[0, 1]``, or ``x`` has the wrong shape: :meth:`forward`'s checks of a batch, on
        every row at once (one read back from the device)."""
        self._rows(x, None)

    # -- the log-joint as plain tensor code, for a loss that compiles it (TreeVIELBO) ----
    def program_parts(self, x) -> dict:
        """The model's tensors and decoder for data ``x``, read through Pyro's store (so
        that plain ``SVI`` trains them), for :meth:`log_joint_of`. The model follows
        ``x``'s dtype and device first, as :meth:`forward` does."""
        prepare(self, as_tensor(x, "x"))
        read_params(self)
        return {
            "decoder": self.decoder,
            "cluster_loc": self.cluster_loc,
            "cluster_log_scale": self.cluster_log_scale,
            "cluster_logits": self.cluster_logits,
        }

    def step_inputs(self, x, idx=None, *, check: bool = True) -> dict:
        """What :meth:`log_joint_of` needs of the batch ``idx``, computed eagerly: its
        rows and the constraints inside it.

        :param torch.Tensor x: ``(N, F)``.
        :param idx: ``(B,)`` indices of the batch, or ``None`` (all ``N``).
        :param bool check: scan the batch's rows (``False`` where the caller has run
            :meth:`check` on ``x``).
        :returns: ``{"x": (B, F), "pairs": (C_B, 2) positions in the batch, "weights":
            (C_B,)}``.
        :raises ValueError: as :meth:`forward`.
        """
        xb, idx = self._rows(x, idx, check)
        pairs, weights = self._batch_constraints(idx)
        return {"x": xb, "pairs": pairs, "weights": weights.to(xb.dtype)}

    @staticmethod
    def log_joint_of(parts: dict, inputs: dict, z: torch.Tensor) -> torch.Tensor:
        """:meth:`forward`'s log-joint at the batch's ``z`` ``(B, D)`` as plain tensor code
        (the mixture prior, the constraints' factor and the likelihood, summed): the
        value of its trace's densities, from :meth:`program_parts` and
        :meth:`step_inputs`. Returns a scalar."""
        scale = parts["cluster_log_scale"].exp()
        lp = -0.5 * ((z.unsqueeze(-2) - parts["cluster_loc"]) / scale).pow(2)
        lp = (lp - parts["cluster_log_scale"] - 0.5 * _LOG_2PI).sum(-1)  # (B, K)
        lp = lp + parts["cluster_logits"].log_softmax(-1)
        total = lp.logsumexp(-1).sum()
        pairs = inputs["pairs"]
        if pairs.numel():
            r = lp.softmax(-1)
            same = (r.index_select(-2, pairs[:, 0]) * r.index_select(-2, pairs[:, 1])).sum(-1)
            total = total + (inputs["weights"] * same).sum()
        logits = parts["decoder"](z)
        return total - F.binary_cross_entropy_with_logits(logits, inputs["x"], reduction="sum")

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
            not finite or leaves ``[0, 1]`` (only the batch's rows are scanned).
        """
        xb, idx = self._rows(x, idx)
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
        # grey levels are scored by their binary cross-entropy: no support check
        like = dist.Bernoulli(logits=logits, validate_args=False)
        return pyro.sample("x", like.to_event(2), obs=obs)
