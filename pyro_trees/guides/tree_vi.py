"""TreeVI guides: amortised tree-structured Gaussian posteriors over data instances.

:class:`TreeVIGuide` maps each instance ``x_i`` to a mean and a standard deviation
(an encoder) and each tree edge ``(i, j)`` to a correlation :math:`\\rho_{ij} = f(x_i,
x_j)` (a pair network, eq. 12 of Xiao & Su 2024), and samples the latent site from a
:class:`~pyro_trees.distributions.TreeNormal`. :class:`TreeVIMixtureGuide` does the same
for a mixture of trees (MTreeVI) and trains with :class:`MixtureTreeELBO`. Both train with
plain ``pyro.infer.SVI``. The tree is given, initialised (e.g.
:func:`~pyro_trees.infer.similarity_dfs_tree`), or learnt jointly with the guide's
networks by the acyclicity-constrained optimisation of eqs. 16-17
(:meth:`TreeVIGuide.learn_tree`), after which SVI continues on the learnt tree.

**Minibatches.** A guide called with ``idx`` (indices of a batch ``B`` of instances)
samples ``z_B`` from the tree *restricted to B*: a node whose parent is outside ``B``
becomes a root, so the edges leaving the batch are dropped and the cost of a step is
:math:`O(|B| \\log |B|)`, independent of ``N``. With a model whose prior over the batch
is the exact marginal ``p(z_B)`` (as :class:`~pyro_trees.models.GraphPriorVAE`; the
groups of :class:`~pyro_trees.models.SyntheticGraphVAE` are independent, so subsampling
them with the group plate instead gives an unbiased estimate of the full ELBO), one step
estimates

.. math::

    \\mathcal L_B = \\mathbb E_{q_B(z_B)}\\big[\\log p(x_B \\mid z_B) + \\log p(z_B)
    - \\log q_B(z_B)\\big] \\le \\log p(x_B),

the evidence lower bound of the *marginal model of the batch* (instances outside ``B``
integrated out), with :math:`q_B` the forest induced by ``B``. It is not an unbiased
estimate of the full-data ELBO (the correlated prior does not factorise over batches);
with ``idx=None`` or ``B`` = all instances it is exactly the full ELBO of eq. 13. Batches
that are connected pieces of the tree (:func:`tree_batches`) keep most edges.

**The exception: constrained clustering.** :class:`~pyro_trees.models.ConstrainedClusteringVAE`
has no normalised prior over a batch. Its pairwise factor (eq. 19) keeps only the
constraints with both ends in ``B`` (those leaving the batch are dropped, not integrated
out) and, as in DC-GMM, omits the normaliser :math:`\\Omega(\\pi)`. A step then estimates

.. math::

    \\mathbb E_{q_B}\\Big[\\sum_{i \\in B} \\log p(x_i, z_i) + \\sum_{(i, j) \\in C_B}
    W_{ij} \\sum_k q_{ik} q_{jk} - \\log q_B(z_B)\\Big],

with :math:`C_B` the constraints inside ``B``, :math:`q_{ik} = p(c_i = k \\mid z_i)` the
responsibilities and :math:`p(x_i, z_i)` the Gaussian-mixture VAE: DC-GMM's surrogate
objective restricted to the batch. It is not a lower bound on :math:`\\log p(x_B)` (the
factor is unnormalised: it is at least 1 on every must-link), and with ``idx=None`` it is the
full-data surrogate, still without :math:`\\Omega`.
"""

from __future__ import annotations

import contextlib
import weakref

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.distributions import TorchDistribution
from pyro.infer import Trace_ELBO
from pyro.nn import PyroModule, PyroParam
from torch import nn
from torch.distributions import constraints

from pyro_trees._param_store import prepare, shared_plate
from pyro_trees.distributions.tree_normal import (
    TreeNormal,
    _TreePlan,
    _validate_parents,
    validate_parents,
)
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.validation import as_tensor, check_finite, check_index

# Per guide: the validated parent array and sampling plan of the forest each batch
# induces, so that repeated batches (every epoch) skip validation and planning. Kept
# outside the modules so that pickled guides stay small.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_PLANS = 4096


def _batch_plan(owner, parents: torch.Tensor, m: int, idx) -> _TreePlan:
    """Plan of the forest ``parents`` (tree ``m`` of ``owner``) induces on ``idx``
    (``None``: the whole tree), cached per batch and per version of ``parents``."""
    cache = _PLANS.setdefault(owner, {})
    key = (m, None if idx is None else idx.detach().cpu().numpy().tobytes())
    version = (parents.data_ptr(), parents._version, parents.device)
    hit = cache.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    par = parents if idx is None else induced_forest(parents, idx)
    plan = _TreePlan(*_validate_parents(par))
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    cache[key] = (version, plan)
    return plan


__all__ = [
    "GaussianEncoder",
    "GroupEncoder",
    "MixtureTreeELBO",
    "PairNet",
    "PairwiseELBO",
    "TreeVIGuide",
    "TreeVIMixtureGuide",
    "induced_forest",
    "tree_batches",
]


def _mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.Softplus()]
    return nn.Sequential(*layers[:-1])


class GaussianEncoder(nn.Module):
    """Per-instance encoder ``x -> (loc, scale)``; ``(..., F) -> (..., D), (..., D)``.

    :param int in_features: ``F``.
    :param int latent_dim: ``D``.
    :param hidden: sizes of the hidden layers (``()`` for an affine encoder).
    """

    def __init__(self, in_features: int, latent_dim: int, hidden=(64,)):
        super().__init__()
        self.net = _mlp([in_features, *hidden, 2 * latent_dim])
        self.latent_dim = latent_dim

    def forward(self, x):
        """``(loc, scale)`` of ``q(z | x)``: ``(..., F) -> (..., D), (..., D)``."""
        out = self.net(x)
        loc, s = out.split(self.latent_dim, dim=-1)
        return loc, nn.functional.softplus(s) + 1e-4


class GroupEncoder(nn.Module):
    """Encoder of a whole group of instances: ``(..., N, F) -> (..., N, D), (..., N, D)``.

    The means are an affine map of the group's flattened data (the exact posterior mean
    of a linear-Gaussian group model, such as Sec. 4.1's, is affine in it); the scales
    are free per-node, per-dimension parameters that do not depend on ``x``.

    :param int num_nodes: ``N``, instances per group.
    :param int in_features: ``F``.
    :param int latent_dim: ``D``.
    """

    def __init__(self, num_nodes: int, in_features: int, latent_dim: int):
        super().__init__()
        self.n, self.d = num_nodes, latent_dim
        self.lin = nn.Linear(num_nodes * in_features, num_nodes * latent_dim)
        self.log_scale = nn.Parameter(torch.full((num_nodes, latent_dim), -0.5))

    def forward(self, x):
        """``(loc, scale)`` of each instance: ``(..., N, F) -> (..., N, D), (..., N, D)``."""
        loc = self.lin(x.flatten(-2)).unflatten(-1, (self.n, self.d))
        return loc, self.log_scale.exp().expand_as(loc)


class PairNet(nn.Module):
    """Edge correlation network :math:`\\rho_{ij} = f(x_i, x_j)` (eq. 12), symmetric in
    its arguments: an MLP of ``[x_i + x_j, x_i * x_j]`` followed by ``max_rho * tanh``.
    ``(..., F), (..., F) -> (..., D)``.

    With ``edge_features=E`` it also takes per-edge side information ``e_ij`` of shape
    ``(..., E)`` (for instance whether the edge is a must-link constraint), appended to
    the MLP's input: :math:`\\rho_{ij} = f(x_i, x_j, e_{ij})`. The data of two instances
    rarely tell which edges the model's prior couples; the edge's own features do.

    With ``num_nodes=N`` it adds a learnt per-edge offset before the ``tanh``,
    :math:`\\rho_{ij} = \\rho_{\\max}\\tanh(f(x_i, x_j) + b_i)`, indexed by the child
    ``i`` of the edge (in a tree each non-root node has exactly one parent edge), ``b`` of
    shape ``(N, D)``. Use it when the inputs carry no clue to which edge they sit on
    (e.g. groups of ``N`` exchangeable-looking instances with a fixed tree, the synthetic
    model of Sec. 4.1): without it every edge of a tree gets the same function of
    ``(x_i, x_j)``, hence nearly the same correlation. It needs every call to see all
    ``N`` nodes in order on dim -2 (a plate over groups; not ``idx`` minibatches), and
    cannot score all pairs (structure learning): ``offsets="pair"`` can.

    With ``num_nodes=N`` and ``offsets="pair"`` the learnt offset belongs to the ordered
    pair instead, :math:`\\rho_{ij} = \\rho_{\\max}\\tanh(f(x_i, x_j) + b_{ij})` with ``b``
    of shape ``(N, N, D)`` (child, parent, dimension; the diagonal is never used), so the
    same network scores any pair: the edges of a fixed tree (``b[i, parents[i]]``), the
    edges a minibatch keeps, and all ``N^2`` candidate edges of the structure learning of
    eq. 17 (:meth:`TreeVIGuide.learn_tree`). The caller then says which nodes each pair
    joins with ``nodes=(child, parent)``, integer tensors broadcastable to the output's
    batch shape (:class:`TreeVIGuide` does). The offset of ``(i, j)`` is not that of
    ``(j, i)``: ``rho`` is symmetric in ``(x_i, x_j)`` but not in the node identities.

    With ``zero_init=True`` the last layer starts at zero, so every :math:`\\rho` starts
    at 0: the guide starts as the mean-field guide and moves away from it only where
    the ELBO's gradient asks (random initial correlations otherwise perturb the early
    steps, which matters when a large pairwise prior weight amplifies them).

    :param int edge_features: ``E``, size of the per-edge features (0: none).
    :param int num_nodes: ``N`` for per-edge offsets, or ``None`` (default).
    :param str offsets: with ``num_nodes``, ``"child"`` (default: one offset per child,
        ``(N, D)``, for a fixed tree) or ``"pair"`` (one per ordered pair, ``(N, N, D)``).
    :param bool zero_init: start with :math:`\\rho = 0` on every edge.
    """

    def __init__(
        self,
        in_features: int,
        latent_dim: int,
        hidden=(64,),
        max_rho: float = 0.999,
        num_nodes: int | None = None,
        edge_features: int = 0,
        zero_init: bool = False,
        offsets: str = "child",
    ):
        super().__init__()
        if not 0 < max_rho < 1:
            raise ValueError(f"max_rho must lie in (0, 1), got {max_rho}")
        if num_nodes is not None and num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes}")
        if offsets not in ("child", "pair"):
            raise ValueError(f"offsets must be 'child' or 'pair', got {offsets!r}")
        if offsets == "pair" and num_nodes is None:
            raise ValueError("offsets='pair' needs num_nodes (the size of the offset table)")
        if edge_features < 0:
            raise ValueError(f"edge_features must be >= 0, got {edge_features}")
        self.net = _mlp([2 * in_features + edge_features, *hidden, latent_dim])
        if zero_init:
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)
        self.max_rho = max_rho
        self.edge_features = edge_features
        pair = offsets == "pair"
        self.edge_bias = (
            None if num_nodes is None or pair else nn.Parameter(torch.zeros(num_nodes, latent_dim))
        )
        self.pair_bias = (
            nn.Parameter(torch.zeros(num_nodes, num_nodes, latent_dim)) if pair else None
        )

    @property
    def offsets(self) -> str | None:
        """``"child"``, ``"pair"`` or ``None``: which learnt offsets the network adds."""
        if getattr(self, "pair_bias", None) is not None:
            return "pair"
        return "child" if self.edge_bias is not None else None

    def forward(self, xi, xj, edge=None, *, nodes=None):
        """Correlations of the pairs ``(x_i, x_j)``.

        :param torch.Tensor xi: child inputs ``(..., F)``.
        :param torch.Tensor xj: parent inputs ``(..., F)``, broadcast together with ``xi``
            (e.g. ``x[:, None]`` and ``x[None, :]`` for all pairs).
        :param edge: per-edge features ``(..., E)`` with ``edge_features=E``.
        :param nodes: ``(child, parent)`` integer node indices of each pair, broadcastable
            to the output's batch shape; required with ``offsets="pair"`` (ignored
            otherwise).
        :returns: ``rho`` of shape ``broadcast(xi, xj).shape[:-1] + (D,)``.
        """
        h = torch.cat([xi + xj, xi * xj], dim=-1)
        if self.edge_features:
            if edge is None or edge.shape[-1] != self.edge_features:
                got = None if edge is None else tuple(edge.shape)
                raise ValueError(
                    f"PairNet(edge_features={self.edge_features}) needs edge features of "
                    f"last size {self.edge_features}, got {got}"
                )
            h = torch.cat([h, edge.to(h.dtype).expand(h.shape[:-1] + edge.shape[-1:])], -1)
        elif edge is not None:
            raise ValueError("edge features given to a PairNet built with edge_features=0")
        h = self.net(h)
        if self.edge_bias is not None:
            if xi.dim() < 2 or xi.shape[-2] != self.edge_bias.shape[0]:
                raise ValueError(
                    f"PairNet(num_nodes={self.edge_bias.shape[0]}) needs all "
                    f"{self.edge_bias.shape[0]} nodes on dim -2, got input {tuple(xi.shape)}"
                )
            h = h + self.edge_bias
        elif self.offsets == "pair":
            h = h + self._pair_offsets(nodes, h.shape[:-1])
        return self.max_rho * torch.tanh(h)

    def _pair_offsets(self, nodes, batch_shape):
        n = self.pair_bias.shape[0]
        if nodes is None or len(nodes) != 2:
            raise ValueError(
                "PairNet(offsets='pair') needs nodes=(child, parent): the node indices of "
                "each pair, to look up its offset"
            )
        child, parent = (torch.as_tensor(t, device=self.pair_bias.device) for t in nodes)
        if child.is_floating_point() or parent.is_floating_point():
            raise ValueError("nodes must be integer tensors (child, parent)")
        try:
            shape = torch.broadcast_shapes(child.shape, parent.shape)
            torch.broadcast_shapes(shape, batch_shape)
        except RuntimeError:
            raise ValueError(
                f"nodes of shapes {tuple(child.shape)} and {tuple(parent.shape)} do not "
                f"broadcast with the pairs' batch shape {tuple(batch_shape)}"
            ) from None
        for name, t in (("child", child), ("parent", parent)):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
                raise ValueError(f"{name} node index out of range [0, {n - 1}]")
        return self.pair_bias[child.long(), parent.long()]


def induced_forest(parents: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Parent array of the forest that the tree ``parents`` induces on the nodes ``idx``:
    ``out[k]`` is the position in ``idx`` of the parent of ``idx[k]``, or ``-1`` if that
    parent is not in ``idx`` (edges leaving the batch are dropped). ``O(B log B)``."""
    idx = idx.to(parents.device).long()
    sorted_idx, order = idx.sort()
    if bool((sorted_idx[1:] == sorted_idx[:-1]).any()):
        raise ValueError("idx contains repeated instances")
    par = parents[idx]
    pos = torch.searchsorted(sorted_idx, par.clamp_min(0)).clamp_max(idx.numel() - 1)
    found = (par >= 0) & (sorted_idx[pos] == par)
    return torch.where(found, order[pos], torch.full_like(par, -1))


def tree_batches(parents, batch_size: int, *, generator: torch.Generator | None = None):
    """Split the nodes into batches that are mostly connected pieces of the tree:
    a depth-first (pre-order) listing cut into chunks of ``batch_size``, with the roots
    visited in random order. Returns a list of index tensors covering every node once."""
    parents = validate_parents(parents).cpu()
    n = parents.numel()
    children = [[] for _ in range(n)]
    for c, p in enumerate(parents.tolist()):
        if p >= 0:
            children[p].append(c)
    roots = (parents < 0).nonzero().squeeze(-1)
    roots = roots[torch.randperm(roots.numel(), generator=generator)].tolist()
    order = []
    for r in roots:
        stack = [r]
        while stack:
            v = stack.pop()
            order.append(v)
            stack.extend(reversed(children[v]))
    order = torch.tensor(order)
    return list(order.split(batch_size))


@contextlib.contextmanager
def _stratified(guide):
    guide._stratify = True
    try:
        yield
    finally:
        guide._stratify = False


class TreeVIGuide(PyroModule):
    """Amortised TreeVI guide for a latent site of shape ``batch + (N, D)``.

    ``x`` holds one row per instance on its second-to-last axis: ``(N, F)`` for
    instance-level models (one tree over all instances), or ``(G, N, F)`` with a plate
    of ``G`` independent groups on dim -1 (``plate="groups"``), each with the same tree
    over its ``N`` members (the synthetic model of Sec. 4.1).

    The site's form follows the model's:

    * no ``plate``: one event ``(N, D)`` (``(B, D)`` with ``idx``), as
      :class:`~pyro_trees.models.GraphPriorVAE` samples it;
    * ``plate`` with ``x`` of shape ``(G, N, F)``: the groups plate (dim -1), each
      group's event ``(N, D)`` (:class:`~pyro_trees.models.SyntheticGraphVAE`);
    * ``plate`` with ``x`` of shape ``(N, F)``: the usual plate form of a VAE's latent,
      ``z_i`` inside ``pyro.plate(plate, N)`` (dim -1) with event ``(D,)``; the plate's
      subsample (its ``subsample_size``, or ``idx``) picks the instances, and the draw is
      a :class:`~pyro_trees.distributions.TreeNormalInstances` of the forest the tree
      induces on them (correlated; per-instance conditional densities).

    Called, it returns ``{site: draw}`` like Pyro's autoguides, so it composes in
    ``AutoGuideList``. Dtype and device follow ``x``; parameters already in Pyro's
    store under its ``name`` (e.g. after ``pyro.get_param_store().load``) are taken up
    at the first call.

    :param encoder: module ``x -> (loc, scale)``, ``(..., N, F) -> (..., N, D)``
        (e.g. :class:`GaussianEncoder`).
    :param parents: parent array ``(N,)`` of the tree (``-1`` at roots); ``None`` for
        the mean-field guide (no correlation, ``Normal(loc, scale)``).
    :param pair_net: module ``(x_child, x_parent) -> rho`` (e.g. :class:`PairNet`), or
        ``(x_child, x_parent, e) -> rho`` with ``edge_features``. Default (with a tree):
        built at the first call, ``PairNet(F', D)`` on the pair inputs (``F' = F``, or
        ``2 D`` for ``"codes"``), with a learnt offset per edge (``num_nodes=N``) when
        ``x`` holds groups ``(G, N, F)``, whose members carry no clue to their edge.
    :param edge_features: optional ``(N, E)`` side information on each node's parent
        edge (row ``i``: the edge ``(i, parents[i])``; roots' rows are ignored), passed
        to ``pair_net`` as its third argument, e.g. a must-link indicator.
    :param str pair_inputs: what ``pair_net`` sees of the two instances: ``"data"``
        (their rows of ``x``, eq. 12) or ``"codes"`` (the encoder's outputs
        ``[loc, log scale]``, ``2 D`` features, detached so that the correlations do not
        steer the encoder): where the two posteriors sit in latent space, which decides
        how much the model's pairwise terms couple them.
    :param str site: name of the latent site of the model.
    :param str plate: name of the model's plate (dim -1) over groups or instances, if any.
    :param subsample_size: minibatch size of that plate.
    :param str name: prefix of the guide's names in Pyro's parameter store (default
        none: ``encoder$$$...``; with a name, ``<name>.encoder$$$...``); give two guides
        that share the store different names (e.g. a mean-field and a tree guide trained
        side by side).
    """

    def __init__(
        self,
        encoder: nn.Module,
        parents=None,
        *,
        pair_net: nn.Module | None = None,
        site: str = "z",
        plate: str | None = None,
        subsample_size: int | None = None,
        edge_features=None,
        pair_inputs: str = "data",
        name: str = "",
    ):
        super().__init__(name)
        if pair_inputs not in ("data", "codes"):
            raise ValueError(f"pair_inputs must be 'data' or 'codes', got {pair_inputs!r}")
        self.pair_inputs = pair_inputs
        self.encoder = encoder
        if parents is not None:
            parents = validate_parents(parents)
            table = getattr(pair_net, "pair_bias", None)
            if table is not None and table.shape[0] != parents.numel():
                raise ValueError(
                    f"the pair network's offset table is for {table.shape[0]} nodes but the "
                    f"tree has {parents.numel()}"
                )
        self.register_buffer("parents", parents)
        self.register_buffer("edge_features", self._check_edges(edge_features, parents))
        self.pair_net = pair_net
        self.site = site
        self.plate = plate
        self.subsample_size = subsample_size

    @staticmethod
    def _check_edges(edge_features, parents):
        if edge_features is None:
            return None
        if parents is None:
            raise ValueError("edge_features need a tree (parents)")
        e = torch.as_tensor(edge_features)
        if not e.is_floating_point():
            e = e.float()
        if e.dim() != parents.dim() + 1 or e.shape[:-1] != parents.shape:
            raise ValueError(
                f"edge_features must have shape {tuple(parents.shape)} + (E,), got {tuple(e.shape)}"
            )
        if not torch.isfinite(e).all():
            raise ValueError("edge_features contain NaN or infinite values")
        return e

    def _pair_features(self, xb, loc, scale):
        if self.pair_inputs == "data":
            return xb
        return torch.cat([loc, scale.log()], -1).detach()

    def _inputs(self, x, idx, tree: bool = True):
        """The checked rows of a step: ``(x_B, idx)`` with ``x_B`` of shape ``(..., |B|, F)``
        and ``idx`` a long tensor (or ``None``). Raises :class:`ValueError` if ``x`` does
        not have the tree's ``N`` rows on dim -2 (unless ``tree=False``: the encoder alone
        takes any number of instances), if ``idx`` is out of range, or if a row of the
        batch is not finite. Only the batch's rows are scanned (``O(|B| F)``). The guide
        follows ``x``'s dtype and device."""
        x = as_tensor(x, "x")
        prepare(self, x)
        if x.dim() < 2:
            raise ValueError(f"x must have shape (..., N, F), got {tuple(x.shape)}")
        if tree and self.parents is not None and x.shape[-2] != self.parents.shape[-1]:
            raise ValueError(
                f"x has {x.shape[-2]} instances (rows on dim -2) but the guide's tree has "
                f"{self.parents.shape[-1]} nodes"
            )
        if idx is not None:
            idx = check_index(idx, x.shape[-2], device=x.device)
            x = x.index_select(-2, idx)
        return check_finite(x, "x"), idx

    def _select(self, x, idx):
        """The batch's inputs and its tree as a cached plan (``None`` for mean-field)."""
        x, idx = self._inputs(x, idx)
        plan = None if self.parents is None else _batch_plan(self, self.parents, 0, idx)
        return x, plan, idx

    def _rho(self, xb, parents, pair_net, edges=None, idx=None):
        safe = torch.where(parents < 0, torch.arange(parents.numel(), device=xb.device), parents)
        args = (xb, xb.index_select(-2, safe))
        if edges is not None:
            if idx is not None:
                edges = edges.index_select(0, torch.as_tensor(idx, device=edges.device).long())
            args += (edges.to(xb.device),)
        kwargs = {}
        if getattr(pair_net, "offsets", None) == "pair":  # offsets looked up by node ids
            child = torch.arange(parents.numel(), device=xb.device) if idx is None else idx
            kwargs["nodes"] = (child, child[safe])
        rho = pair_net(*args, **kwargs)
        return torch.where((parents < 0).unsqueeze(-1), torch.zeros_like(rho), rho)

    def distribution(self, x, idx=None):
        """The posterior ``q(z | x)`` over the batch ``idx`` (all instances if ``None``).

        :param torch.Tensor x: ``(N, F)``, or ``(G, N, F)`` for ``G`` groups (any leading
            batch shape); ``N`` must equal the tree's size.
        :param idx: ``(B,)`` integer indices into the ``N`` instances, or ``None``
            (``B = N``). Only the rows of the batch are encoded and checked for NaN/inf.
        :returns: a :class:`~pyro_trees.distributions.TreeNormal` (over the forest the tree
            induces on ``idx``), or for the mean-field guide a ``Normal(...).to_event(2)``,
            with batch shape ``x.shape[:-2]`` and event shape ``(B, D)``.
        :raises ValueError: if ``x`` does not have ``N`` rows on dim -2, ``idx`` is out of
            range, or a row of the batch is not finite.
        """
        xb, plan, idx = self._select(x, idx)
        loc, scale = self.encoder(xb)
        if plan is None:
            return dist.Normal(loc, scale).to_event(2)
        feats = self._pair_features(xb, loc, scale)
        if self.pair_net is None:
            self._default_pair_net(feats, loc.shape[-1])
        rho = self._rho(feats, plan.parents, self.pair_net, self.edge_features, idx)
        return TreeNormal(loc, scale, plan, rho)

    def _default_pair_net(self, feats, latent_dim):
        if self.edge_features is not None:
            raise ValueError("a guide with edge_features needs its pair_net (edge_features=E)")
        grouped = feats.dim() >= 3
        num_nodes = self.parents.numel() if grouped else None
        with torch.random.fork_rng(devices=[]):  # the draws after it do not move
            net = PairNet(feats.shape[-1], latent_dim, num_nodes=num_nodes)
        self.pair_net = net.to(device=feats.device, dtype=feats.dtype)
        prepare(self, feats)  # a loaded store's values for it

    def _all_pair_rho(self, feats: torch.Tensor, latent_dim: int) -> torch.Tensor:
        """The pair network on every ordered pair of the ``N`` rows of ``feats``
        ``(..., N, F')``: ``rho[..., i, j, :] = f(x_i, x_j)`` (child ``i``, parent ``j``),
        shape ``(..., N, N, D)``. Raises :class:`ValueError` for a pair network that
        cannot score all pairs."""
        net = self.pair_net
        n = feats.shape[-2]
        if net is None:
            raise ValueError(
                "the guide has no pair_net: build it with pair_net=PairNet(...) to score "
                "candidate edges"
            )
        if self.edge_features is not None:
            raise ValueError(
                "the guide has edge_features, which exist only for the edges of its fixed "
                "tree; its pair network cannot score all N^2 candidate edges"
            )
        offsets = getattr(net, "offsets", None)
        if offsets == "child":
            raise ValueError(
                "PairNet(num_nodes=N) adds one offset per child of a fixed tree, which "
                "cannot score all pairs; use PairNet(..., num_nodes=N, offsets='pair') "
                "(one offset per ordered pair) or no offsets"
            )
        kwargs = {}
        if offsets == "pair":
            if net.pair_bias.shape[0] != n:
                raise ValueError(
                    f"the pair network's offset table is for {net.pair_bias.shape[0]} "
                    f"nodes but x has {n} instances on dim -2"
                )
            ar = torch.arange(n, device=feats.device)
            kwargs["nodes"] = (ar[:, None], ar[None, :])
        try:
            rho = net(feats.unsqueeze(-2), feats.unsqueeze(-3), **kwargs)
        except (RuntimeError, IndexError) as e:
            raise ValueError(
                "the pair network cannot score all pairs: calling it on the broadcast "
                f"inputs {tuple(feats.unsqueeze(-2).shape)} and "
                f"{tuple(feats.unsqueeze(-3).shape)} failed ({e})"
            ) from None
        want = feats.shape[:-2] + (n, n)
        if (
            not isinstance(rho, torch.Tensor)
            or rho.shape[:-1] != want
            or (rho.shape[-1] not in (1, latent_dim))
        ):
            got = tuple(rho.shape) if isinstance(rho, torch.Tensor) else type(rho).__name__
            raise ValueError(
                f"the pair network scored all pairs with shape {got}; expected "
                f"{tuple(want) + (latent_dim,)} (child, parent, dimension)"
            )
        return rho

    def soft_distribution(self, x, probs):
        """The relaxed posterior of eq. 17 for soft parents ``probs``: a
        :class:`~pyro_trees.distributions.SoftTreeNormal` with the encoder's ``loc`` and
        ``scale`` and the pair network's correlations on all ``N^2`` ordered pairs.
        At one-hot ``probs`` it equals :meth:`distribution` of that tree (the pair
        network is the same; a ``PairNet(offsets="pair")`` looks its offsets up by node).

        :param torch.Tensor x: ``(..., N, F)`` (all ``N`` instances).
        :param torch.Tensor probs: soft parents ``(N, N + 1)`` (last column: root).
        :returns: ``SoftTreeNormal`` with batch shape ``x.shape[:-2]``, event ``(N, D)``.
        :raises ValueError: for a guide whose pair network cannot score all pairs, or
            inputs of the wrong shape.
        """
        from pyro_trees.distributions.soft_tree_normal import SoftTreeNormal

        xb, _ = self._inputs(x, None)
        loc, scale = self.encoder(xb)
        rho = self._all_pair_rho(self._pair_features(xb, loc, scale), loc.shape[-1])
        return SoftTreeNormal(loc, scale, probs.to(loc), rho)

    def learn_tree(
        self,
        model,
        x,
        *args,
        subsample_size: int | None = None,
        num_particles: int = 2,
        restarts: int = 1,
        init_parents=None,
        init_strength: float = 2.0,
        temperature: float = 0.3,
        max_outer: int = 15,
        inner_steps: int = 100,
        lr: float = 0.1,
        param_lr: float = 0.01,
        eval_particles: int = 16,
        refine_steps: int = 100,
        single_root: bool = True,
        generator: torch.Generator | None = None,
        **kwargs,
    ):
        r"""Learn the guide's tree jointly with its parameters (eq. 17) and install it.

        The relaxed family of :meth:`soft_distribution` (the encoder's means and scales,
        the pair network on all ordered pairs, soft parents ``P``) is trained by
        :func:`~pyro_trees.infer.learn_tree_structure` on its ELBO
        (:func:`~pyro_trees.infer.soft_tree_elbo` with
        :func:`~pyro_trees.infer.model_log_joint`), jointly over ``P`` and every
        parameter of the guide (encoder and pair network), under the acyclicity
        constraint :math:`h(A) = 0` (augmented Lagrangian). The hard tree (the most
        probable root and every other node's most probable parent, cycles cut) then
        becomes the guide's ``parents`` (cached batch plans are dropped) and the guide
        keeps the jointly learnt parameters, so plain ``SVI`` continues from there on the
        learned tree. The model's own parameters are held
        fixed. With ``restarts > 1`` each restart starts from the guide's parameters as
        they were and from fresh random logits; its hard tree's parameters are refined
        (``refine_steps``) and the hard tree with the best Monte Carlo ELBO
        (``eval_particles`` draws over every group) wins, with its parameters.

        **The objective.** For ``x`` of shape ``(N, F)`` (one tree over all instances)
        it is the ELBO of the whole data. With a group plate (``x`` of shape
        ``(G, N, F)``, ``plate`` set) each inner step draws ``B`` groups
        (``subsample_size``, else the guide's, else all ``G``) and the model runs with its
        plate conditioned on those groups, as ``SVI`` replays a guide's subsample; the
        log joint keeps the plate's scale :math:`G / B` and the entropy gets the same
        scale, so the estimate is unbiased for the full-data ELBO of the relaxed guide.
        The solver sees it divided by the number of trees (:math:`G`, or 1): the ELBO
        *per tree*, whose size does not grow with the data, so that the Lagrangian's
        penalty schedule behaves alike on any data size.

        **Why a method.** The guide owns the pieces this needs (its encoder, the pair
        network's all-pairs evaluation, its plate and site) and the state it changes
        (the tree buffer and the cached batch plans); the solver and the relaxed ELBO
        stay generic functions in :mod:`pyro_trees.infer.tree_structure`.

        Cost per inner step: ``num_particles`` model calls and a dense ``N x N`` solve
        per tree and latent dimension, :math:`O(B D N^3)`: meant for trees of up to a few
        hundred nodes (a memory check raises before an oversized problem starts). The
        oriented relaxation has local optima (see
        :func:`~pyro_trees.infer.learn_tree_structure`): use a few ``restarts``.

        :param model: the Pyro model; its only latent site must be the guide's ``site``,
            of the shape the guide draws (``(N, D)``, or ``(B, N, D)`` under the plate).
        :param torch.Tensor x: the data, ``(N, F)`` or ``(G, N, F)`` with a group plate.
        :param args: further model arguments (the model is called as
            ``model(x, *args, **kwargs)``, like ``SVI`` calls it).
        :param int subsample_size: groups per inner step (group plate only).
        :param int num_particles: draws of the relaxed guide per inner step.
        :param int restarts: independent runs; the best hard tree is kept.
        :param init_parents: parent array ``(N,)`` to start from (default: near-uniform
            logits); ``init_strength``, ``temperature``, ``max_outer``, ``inner_steps``,
            ``lr`` (logits) and ``param_lr`` (guide parameters) are passed to
            :func:`~pyro_trees.infer.learn_tree_structure`.
        :param int refine_steps: Adam steps (``param_lr``) on the guide's parameters
            with the hard tree fixed, after each restart and before its ELBO is taken:
            the parameters learnt at soft parents are not yet those of the hard tree, and
            ranking restarts by unrefitted ELBOs picked wrong trees (0 to skip).
        :param int eval_particles: draws for the ELBO that ranks the restarts.
        :param bool single_root: learn a spanning tree (one unit of root mass, see
            :func:`~pyro_trees.infer.learn_tree_structure`; default) rather than a
            forest: with free root options the solver tends to the empty forest when the
            posterior's correlations are weak, and a spanning tree loses nothing since
            its correlations are learnt (an edge with ``rho = 0`` is a missing edge).
        :param torch.Generator generator: seeds the restarts' logits and the groups drawn.
        :param kwargs: further keyword arguments of the model (not ``idx``: the tree is
            learnt over all ``N`` instances).
        :returns: the winning :class:`~pyro_trees.infer.LearnedTree`, with ``elbo`` its
            per-tree Monte Carlo ELBO on the hard tree.
        :raises ValueError: for a mixture guide, a guide whose pair network cannot score
            all pairs, a model with other latent sites or a site of another shape, a
            missing plate, or data of the wrong shape.
        """
        from pyro_trees.infer.tree_structure import (
            learn_tree_structure,
            model_log_joint,
            parents_to_probs,
            soft_tree_elbo,
        )
        from pyro_trees.trees import require_memory

        if isinstance(self, TreeVIMixtureGuide):
            raise ValueError(
                "learn_tree learns a single tree; for a mixture learn each tree with a "
                "TreeVIGuide and pass the parent arrays to TreeVIMixtureGuide"
            )
        if kwargs.get("idx") is not None:
            raise ValueError(
                "learn_tree learns the tree over all N instances; idx minibatches are not "
                "supported (the tree of a minibatch is not the tree of the data)"
            )
        for name, v in (("num_particles", num_particles), ("restarts", restarts)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(eval_particles, int) or eval_particles < 1:
            raise ValueError(f"eval_particles must be a positive int, got {eval_particles!r}")
        if not isinstance(refine_steps, int) or refine_steps < 0:
            raise ValueError(f"refine_steps must be a non-negative int, got {refine_steps!r}")
        x = as_tensor(x, "x")
        if self.plate is not None and x.dim() != 3:
            raise ValueError(
                f"with the group plate {self.plate!r}, x must have shape (G, N, F), got "
                f"{tuple(x.shape)}"
            )
        xall, _ = self._inputs(x, None)  # shape and finiteness of all rows, once
        table = getattr(self.pair_net, "pair_bias", None)
        if table is not None and table.shape[0] != xall.shape[-2]:
            raise ValueError(
                f"the pair network's offset table is for {table.shape[0]} nodes but x has "
                f"{xall.shape[-2]} instances on dim -2"
            )
        n = xall.shape[-2]
        with torch.no_grad():
            x1 = xall[:1] if self.plate is not None else xall
            loc0, scale0 = self.encoder(x1)
        d = loc0.shape[-1]
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        if self.plate is not None:
            num_groups = x.shape[0]
            size = subsample_size if subsample_size is not None else self.subsample_size
            size = num_groups if size is None else min(int(size), num_groups)
            if size < 1:
                raise ValueError(f"subsample_size must be positive, got {size}")
        else:
            if subsample_size is not None:
                raise ValueError("subsample_size needs a guide with a group plate")
            num_groups = size = 1
        # rho (N, N, D), B = I - P * rho, its inverse and their gradients, per tree
        need = 12.0 * size * n * n * d * xall.element_size() * max(num_particles, 2)
        require_memory(
            need,
            f"learning a {n}-node tree on {size} tree(s) at a time",
            "Use a smaller subsample_size or fewer instances per tree.",
            device=xall.device,
        )
        with torch.no_grad():  # fails early for a pair network that cannot score all pairs
            self._all_pair_rho(self._pair_features(x1, loc0, scale0), d)

        def draw():
            if self.plate is None:
                return None
            if size >= num_groups:
                return torch.arange(num_groups, device=x.device)
            return torch.randperm(num_groups, generator=gen)[:size].to(x.device)

        def conditioned(sel):
            if sel is None:
                return model
            return poutine.condition(model, data={self.plate: sel})

        def site_scale(sel, z):
            cond = poutine.condition(conditioned(sel), data={self.site: z})
            tr = poutine.trace(cond).get_trace(x, *args, **kwargs)
            node = tr.nodes.get(self.site)
            if node is None or node["type"] != "sample":
                raise ValueError(f"the model has no sample site named {self.site!r}")
            if self.plate is not None and self.plate not in tr.nodes:
                raise ValueError(
                    f"the model has no plate named {self.plate!r} (the guide's group plate)"
                )
            shape = node["fn"].shape()
            if tuple(shape) != tuple(z.shape):
                raise ValueError(
                    f"the model's site {self.site!r} has shape {tuple(shape)} but the guide "
                    f"draws {tuple(z.shape)}"
                )
            s = node["scale"]
            return float(s) if not isinstance(s, torch.Tensor) else float(s.reshape(-1)[0])

        def elbo_per_tree(p, sel, particles, scale_):
            xb = xall if sel is None else xall.index_select(0, sel)
            loc, scale = self.encoder(xb)
            rho = self._all_pair_rho(self._pair_features(xb, loc, scale), d)
            log_joint = model_log_joint(conditioned(sel), self.site, x, *args, **kwargs)
            elbo = soft_tree_elbo(
                lambda z: log_joint(z) / scale_, loc, scale, rho, p.to(loc), particles
            )
            return elbo / max(1, loc.shape[:-2].numel())

        probe = None if self.plate is None else torch.arange(size, device=x.device)
        with torch.no_grad():
            z0 = self.encoder(xall if probe is None else xall.index_select(0, probe))[0]
            site_scale_ = site_scale(probe, z0)
            # the other latent sites are named by model_log_joint's check
            model_log_joint(conditioned(probe), self.site, x, *args, **kwargs)(z0.unsqueeze(0))

        def objective(p):
            return elbo_per_tree(p, draw(), num_particles, site_scale_)

        def evaluate(p):
            """Per-tree ELBO over every group (in chunks of the step's size)."""
            if self.plate is None:
                return float(elbo_per_tree(p, None, eval_particles, site_scale_))
            total = 0.0
            for sel in torch.arange(num_groups, device=x.device).split(size):
                chunk_scale = site_scale_ * size / sel.numel()
                total += sel.numel() * float(elbo_per_tree(p, sel, eval_particles, chunk_scale))
            return total / num_groups

        params = [q for q in self.parameters() if q.requires_grad]
        start = [q.detach().clone() for q in params]
        best, best_state = None, None
        for _ in range(restarts):
            with torch.no_grad():
                for q, q0 in zip(params, start, strict=True):
                    q.copy_(q0)
            seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
            res = learn_tree_structure(
                objective,
                n,
                init_parents=init_parents,
                init_strength=init_strength,
                temperature=temperature,
                max_outer=max_outer,
                inner_steps=inner_steps,
                lr=lr,
                params=params,
                param_lr=param_lr,
                single_root=single_root,
                generator=torch.Generator().manual_seed(seed),
            )
            hard = parents_to_probs(res.parents, n)
            if refine_steps and params:  # fit the hard tree's parameters before ranking
                opt = torch.optim.Adam(params, lr=param_lr)
                for _ in range(refine_steps):
                    opt.zero_grad()
                    (-objective(hard)).backward()
                    opt.step()
            with torch.no_grad():
                res.elbo = evaluate(hard)
            if best is None or res.elbo > best.elbo:
                best, best_state = res, [q.detach().clone() for q in params]
        with torch.no_grad():
            for q, q1 in zip(params, best_state, strict=True):
                q.copy_(q1)
        self._clear_grads(model, params)
        device = params[0].device if params else x.device
        self.parents = validate_parents(best.parents, n).to(device)
        _PLANS.pop(self, None)  # plans of the old tree
        return best

    @staticmethod
    def _clear_grads(model, params):
        """Drop the gradients the solver left (SVI accumulates onto existing ones)."""
        for q in params:
            q.grad = None
        if isinstance(model, nn.Module):
            for q in model.parameters():
                q.grad = None
        for _, q in pyro.get_param_store().named_parameters():
            q.grad = None

    @contextlib.contextmanager
    def _plate(self, x, subsample_size=None):
        if self.plate is None:
            yield x
            return
        size = subsample_size if subsample_size is not None else self.subsample_size
        with shared_plate(self.plate, x.shape[0], subsample_size=size, dim=-1) as i:
            yield x[i]

    def _start(self, x):
        x = as_tensor(x, "x")
        prepare(self, x)
        return x

    def _instance_plate(self, x, idx, subsample_size):
        """The draw in the plate form: ``z_B`` inside the plate over the ``N`` rows."""
        size = subsample_size if subsample_size is not None else self.subsample_size
        n = x.shape[-2]
        if idx is not None:
            idx, size = check_index(idx, n, device=x.device), None
        with shared_plate(self.plate, n, subsample_size=size, subsample=idx, dim=-1) as i:
            whole = i.numel() == n and bool((i == torch.arange(n, device=i.device)).all())
            sub = None if whole else i
            q = self.distribution(x, sub)
            q = q.per_instance() if isinstance(q, TreeNormal) else q.base_dist.to_event(1)
            return pyro.sample(self.site, q)

    def forward(self, x, *args, idx=None, subsample_size=None, **kwargs):
        """Sample the model's latent site from :meth:`distribution` (the guide has the
        model's signature; extra arguments, such as ``y``, are ignored).

        :param torch.Tensor x: ``(N, F)``; with a group ``plate``, ``(G, N, F)`` with the
            groups on dim 0 (the plate subsamples them).
        :param idx: ``(B,)`` integer indices of the instances of a minibatch, or ``None``
            (with a plate over instances, the plate's subsample).
        :param int subsample_size: the plate's minibatch size (overrides the one given at
            construction).
        :returns: ``{site: z}`` with ``z`` of shape ``(B, D)``, or ``(G', N, D)`` with a
            group plate (``G'`` the subsample size); under :class:`MixtureTreeELBO` with a
            leading component axis ``M``.
        """
        x = self._start(x)
        if self.plate is not None and x.dim() == 2:
            return {self.site: self._instance_plate(x, idx, subsample_size)}
        with self._plate(x, subsample_size) as xb:
            return {self.site: pyro.sample(self.site, self.distribution(xb, idx))}

    @torch.no_grad()
    def median(self, x, idx=None):
        """Posterior means ``(..., B, D)`` of the rows ``idx`` of ``x`` (all if ``None``),
        from the encoder alone: ``x`` may hold instances outside the tree (e.g. held-out
        ones), ``(..., N', F)`` with any ``N'``."""
        return self.encoder(self._inputs(x, idx, tree=False)[0])[0]


class _StratifiedTreeMixture(TorchDistribution):
    """One draw per component, stacked on a leading batch axis of size ``M``.

    ``log_prob`` of the ``m``-th draw is the exact mixture density (``entropy="exact"``)
    or the density of component ``m`` (``"bound"``, the paper's eq. 15)."""

    arg_constraints = {}
    support = constraints.independent(constraints.real, 2)
    has_rsample = True

    def __init__(self, components, logits, exact: bool):
        self.components = components
        self.logits = logits - logits.logsumexp(-1, keepdim=True)
        self.exact = exact
        bs = torch.broadcast_shapes(*(c.batch_shape for c in components))
        self.components = [c.expand(bs) for c in components]
        super().__init__((len(components),) + bs, components[0].event_shape, False)

    def rsample(self, sample_shape=()):
        if len(sample_shape):
            raise NotImplementedError("one stratified draw at a time")
        return torch.stack([c.rsample() for c in self.components], 0)

    def log_prob(self, value):
        if not self.exact:
            return torch.stack([c.log_prob(v) for c, v in zip(self.components, value, strict=True)])
        lp = torch.stack([c.log_prob(value) for c in self.components], -1)  # (M, ..., K)
        return (lp + self.logits).logsumexp(-1)


class TreeVIMixtureGuide(TreeVIGuide):
    """MTreeVI guide (eqs. 14-15): ``M`` trees sharing the encoder's means and scales,
    each with its own edge correlations, and learnable mixture weights.

    Train it with :class:`MixtureTreeELBO`, which draws one sample from every tree and
    weights the ``M`` terms by the mixture weights (a stratified, reparameterised
    estimator). With ``entropy="bound"`` the objective is eq. 15,
    :math:`\\sum_m \\pi_m(\\mathbb E_{q_m}\\log p(x, z) + H[q_m])`, a lower bound of the
    mixture's ELBO that is linear in :math:`\\pi` (so it never beats the best single
    tree); with ``entropy="exact"`` (default) it is the mixture's own ELBO
    :math:`\\sum_m \\pi_m \\mathbb E_{q_m}[\\log p(x, z) - \\log q(z)]` with the exact
    mixture density :math:`q = \\sum_k \\pi_k q_k` (cost ``M`` times that of the bound).
    Called outside :class:`MixtureTreeELBO` (e.g. by ``Predictive``) it draws from the
    mixture.

    :param parents: ``(M, N)`` parent arrays.
    :param pair_net: one module shared by the trees, or a list of ``M`` modules.
    :param edge_features: optional ``(M, N, E)`` features of each tree's parent edges
        (see :class:`TreeVIGuide`); ``pair_inputs`` as there.
    :param str entropy: ``"exact"`` or ``"bound"``.
    :param int component_dim: the plate dim of the tree components (``-1`` for
        instance-level models without plates, ``-2`` below a group plate).
    :param str name: prefix of its names in Pyro's parameter store (see
        :class:`TreeVIGuide`).
    """

    def __init__(
        self,
        encoder,
        parents,
        *,
        pair_net,
        site="z",
        plate=None,
        subsample_size=None,
        entropy: str = "exact",
        component_dim: int | None = None,
        edge_features=None,
        pair_inputs: str = "data",
        name: str = "",
    ):
        parents = torch.as_tensor(parents)
        if parents.dim() != 2:
            raise ValueError(f"parents must have shape (M, N), got {tuple(parents.shape)}")
        if entropy not in ("exact", "bound"):
            raise ValueError(f"entropy must be 'exact' or 'bound', got {entropy!r}")
        super().__init__(
            encoder,
            None,
            site=site,
            plate=plate,
            subsample_size=subsample_size,
            pair_inputs=pair_inputs,
            name=name,
        )
        self.register_buffer("parents", torch.stack([validate_parents(p) for p in parents]))
        self.register_buffer("edge_features", self._check_edges(edge_features, self.parents))
        nets = list(pair_net) if isinstance(pair_net, list | tuple | nn.ModuleList) else None
        if nets is not None and len(nets) != parents.shape[0]:
            raise ValueError(f"got {len(nets)} pair networks for {parents.shape[0]} trees")
        self.pair_nets = nn.ModuleList(nets) if nets is not None else None
        self.pair_net = None if nets is not None else pair_net
        self.tree_logits = PyroParam(torch.zeros(parents.shape[0]))
        self.entropy = entropy
        self.component_dim = (
            component_dim if component_dim is not None else (-2 if plate is not None else -1)
        )
        self._stratify = False

    @property
    def num_trees(self) -> int:
        """Number of trees ``T`` in the mixture."""
        return self.parents.shape[0]

    def tree_probs(self):
        """The mixture weights over the trees, ``(T,)``."""
        return torch.softmax(self.tree_logits, -1)

    def _components(self, x, idx):
        xb, idx = self._inputs(x, idx)
        loc, scale = self.encoder(xb)
        feats = self._pair_features(xb, loc, scale)
        comps = []
        for m in range(self.num_trees):
            plan = _batch_plan(self, self.parents[m], m, idx)
            net = self.pair_nets[m] if self.pair_nets is not None else self.pair_net
            edges = None if self.edge_features is None else self.edge_features[m]
            rho = self._rho(feats, plan.parents, net, edges, idx)
            comps.append(TreeNormal(loc, scale, plan, rho))
        return comps

    def distribution(self, x, idx=None):
        """The mixture ``q(z | x)`` as a :class:`~pyro_trees.distributions.MixtureOfTreeNormals`
        with batch shape ``x.shape[:-2]`` and event shape ``(B, D)``; ``x`` and ``idx``
        as in :meth:`TreeVIGuide.distribution`."""
        from pyro_trees.distributions.tree_mixture import MixtureOfTreeNormals

        comps = self._components(x, idx)
        return MixtureOfTreeNormals(
            torch.stack([c.loc for c in comps], -3),
            torch.stack([c.scale for c in comps], -3),
            torch.stack([c.parents for c in comps]),
            torch.stack([c.rho for c in comps], -3),
            self.tree_logits,
        )

    def forward(self, x, *args, idx=None, subsample_size=None, **kwargs):
        """As :meth:`TreeVIGuide.forward`; under :class:`MixtureTreeELBO` one draw per
        tree. Returns ``{site: z}``.

        :raises ValueError: for a plate over instances (``x`` of shape ``(N, F)`` with
            ``plate``): a mixture has no per-instance factorisation; use a group plate or
            none."""
        x = self._start(x)
        if self.plate is not None and x.dim() == 2:
            raise ValueError(
                "TreeVIMixtureGuide takes a plate over groups (x of shape (G, N, F)) or no "
                "plate; a plate over instances needs per-instance densities, which a "
                "mixture of trees has not (use TreeVIGuide)"
            )
        with self._plate(x, subsample_size) as xb:
            if self._stratify:
                q = _StratifiedTreeMixture(
                    self._components(xb, idx), self.tree_logits, self.entropy == "exact"
                )
                return {self.site: pyro.sample(self.site, q)}
            return {self.site: pyro.sample(self.site, self.distribution(xb, idx))}


class MixtureTreeELBO(Trace_ELBO):
    """Trace ELBO for :class:`TreeVIMixtureGuide`: model and guide run inside a plate
    ``"tree_components"`` of size ``M`` (at the guide's ``component_dim``) scaled by the
    mixture weights, so the loss is :math:`-\\sum_m \\pi_m (\\log p(x, z^{(m)}) - \\log
    q(z^{(m)}))` with one reparameterised draw :math:`z^{(m)}` per tree.

    The model must broadcast over that extra batch dim (models whose likelihood is a
    single site without plates, or a site inside a plate at dim -1, do). The guide may
    be an ``AutoGuideList`` holding the mixture guide: its other parts then draw once
    per component as well (an unbiased, stratified estimate of the same ELBO)."""

    @staticmethod
    def _mixture(guide):
        if isinstance(guide, TreeVIMixtureGuide):
            return guide
        for part in guide if isinstance(guide, nn.ModuleList) else ():
            inner = getattr(part, "_guide", part)
            if isinstance(inner, TreeVIMixtureGuide):
                return inner
        raise ValueError(
            "MixtureTreeELBO needs a TreeVIMixtureGuide (alone or in an AutoGuideList)"
        )

    def _wrap(self, fn, guide):
        guide = self._mixture(guide)

        def wrapped(*args, **kwargs):
            m = guide.num_trees
            shape = (m,) + (1,) * (-guide.component_dim - 1)
            with (
                _stratified(guide),
                pyro.plate("tree_components", m, dim=guide.component_dim),
                poutine.scale(scale=guide.tree_probs().reshape(shape)),
            ):
                return fn(*args, **kwargs)

        return wrapped

    def _check(self, guide):
        self._mixture(guide)

    def loss(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().loss(self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().differentiable_loss(
            self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs
        )

    def loss_and_grads(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().loss_and_grads(
            self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs
        )


class PairwiseELBO(DifferentiableLossELBO):
    """Rao-Blackwellised ELBO estimator for models whose instances interact only through
    one pairwise factor (e.g. the constraints of
    :class:`~pyro_trees.models.ConstrainedClusteringVAE`), for :class:`TreeVIGuide`
    (tree or mean-field). With ``q`` the guide's posterior over the latent site and
    ``q_i`` its marginals,

    .. math::

        \\mathcal L = \\mathbb E_{\\prod_i q_i}\\Big[\\sum_i \\log p(x_i, z_i)\\Big]
        + \\mathbb E_q\\big[\\log f(z)\\big] + H[q],

    which is the ELBO of ``q`` exactly: the per-instance terms only see the marginals,
    which a tree shares with its mean-field counterpart, so they are estimated with
    *independent* draws ``z_i = loc_i + scale_i eps_i`` (one draw, as for mean-field);
    the pairwise log-factor ``log f`` (the model's ``pairwise_log_factor(z, idx=None)``,
    site ``pair_site``) is averaged over ``num_pair_particles`` draws of ``q``; the
    entropy is exact. The edge correlations then receive gradient only from the terms
    they change in expectation (the pairwise factor and the entropy): with
    :class:`~pyro.infer.Trace_ELBO`, every per-instance term (e.g. a 784-pixel
    likelihood) adds zero-mean noise to it through ``dz / drho``. For a mean-field guide
    the estimator differs from ``Trace_ELBO`` only by the exact entropy and the
    ``num_pair_particles`` draws of the pairwise term.

    :param int num_pair_particles: draws of ``q`` for the pairwise term.
    :param str site: the latent site.
    :param str pair_site: the model's pairwise factor.
    """

    def __init__(self, num_pair_particles: int = 8, *, site: str = "z", pair_site="constraints"):
        if int(num_pair_particles) < 1:
            raise ValueError(f"num_pair_particles must be >= 1, got {num_pair_particles}")
        super().__init__()
        self.num_pair_particles = int(num_pair_particles)
        self.site, self.pair_site = site, pair_site

    def _posterior(self, guide, *args, **kwargs):
        if isinstance(guide, TreeVIMixtureGuide) or not isinstance(guide, TreeVIGuide):
            raise ValueError("PairwiseELBO needs a TreeVIGuide (tree or mean-field)")
        if guide.plate is not None:
            raise ValueError("PairwiseELBO does not support a guide with a group plate")
        # run the guide under a trace so that its parameters register with SVI
        return poutine.trace(guide).get_trace(*args, **kwargs).nodes[self.site]["fn"]

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """``-L`` (one estimate), differentiable in the parameters of both."""
        if not callable(getattr(model, "pairwise_log_factor", None)):
            raise ValueError("PairwiseELBO needs a model with a pairwise_log_factor(z, idx)")
        q = self._posterior(guide, *args, **kwargs)
        loc, scale = q.mean, q.stddev
        z = loc + scale * torch.randn_like(loc)  # independent draws of the marginals
        unary = poutine.block(poutine.condition(model, data={self.site: z}), hide=[self.pair_site])
        log_unary = poutine.trace(unary).get_trace(*args, **kwargs).log_prob_sum()
        zk = q.rsample((self.num_pair_particles,))
        log_pair = model.pairwise_log_factor(zk, idx=kwargs.get("idx")).mean(0)
        return -(log_unary + log_pair + q.entropy())

    def _get_trace(self, model, guide, args, kwargs):  # abstract in ELBO; not used
        raise NotImplementedError
