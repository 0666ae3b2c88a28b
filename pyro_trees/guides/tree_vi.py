"""TreeVI guides: amortised tree-structured Gaussian posteriors over data instances.

:class:`TreeVIGuide` maps each instance ``x_i`` to a mean and a standard deviation
(an encoder) and each tree edge ``(i, j)`` to a correlation :math:`\\rho_{ij} = f(x_i,
x_j)` (a pair network, eq. 12 of Xiao & Su 2024), and samples the latent site from a
:class:`~pyro_trees.distributions.TreeNormal`; its networks live in
:mod:`pyro_trees.guides.tree_vi_nets`. :class:`~pyro_trees.guides.TreeVIMixtureGuide`
(:mod:`pyro_trees.guides.tree_vi_mixture`) does the same for a mixture of trees (MTreeVI)
and trains with :class:`~pyro_trees.infer.MixtureTreeELBO`. Both train with plain
``pyro.infer.SVI``. The tree is given, initialised (e.g.
:func:`~pyro_trees.infer.similarity_dfs_tree`), or learnt jointly with the guide's
networks by the acyclicity-constrained optimisation of eqs. 16-17
(:func:`~pyro_trees.infer.learn_guide_tree`), after which SVI continues on the learnt tree.

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
import math
import weakref

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import nn

from pyro_trees._forest import TreePlan, jump_solve, parents_and_depths, validate_parents
from pyro_trees._param_store import prepare, read_params, shared_plate
from pyro_trees.distributions.soft_tree_normal import SoftTreeNormal
from pyro_trees.distributions.tree_normal import TreeNormal
from pyro_trees.guides.base import TreeGuide
from pyro_trees.guides.tree_vi_nets import PairNet
from pyro_trees.validation import as_tensor, check_finite, check_index

__all__ = ["TreeVIGuide", "induced_forest", "tree_batches"]

# Per guide: the validated parent array and sampling plan of the forest each batch
# induces, so that repeated batches (every epoch) skip validation and planning. Kept
# outside the modules so that pickled guides stay small.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_PLANS = 4096
_LOG_2PI = math.log(2 * math.pi)


def _batch_plan(owner, parents: torch.Tensor, m: int, idx) -> TreePlan:
    """Plan of the forest ``parents`` (tree ``m`` of ``owner``) induces on ``idx``
    (``None``: the whole tree), cached per batch and per version of ``parents``."""
    cache = _PLANS.setdefault(owner, {})
    key = (m, None if idx is None else idx.detach().cpu().numpy().tobytes())
    version = (parents.data_ptr(), parents._version, parents.device)
    hit = cache.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    par = parents if idx is None else induced_forest(parents, idx)
    plan = TreePlan(*parents_and_depths(par))
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    cache[key] = (version, plan)
    return plan


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


def _edge_inputs(parents: torch.Tensor, pair_net, edges=None, idx=None) -> dict:
    """What the pair network needs of a batch's forest ``parents`` ``(B,)`` besides the
    inputs: each node's parent (itself at a root), the roots, the edges' features of the
    batch and, for offsets by node, the node ids of each edge."""
    device = parents.device
    safe = torch.where(parents < 0, torch.arange(parents.numel(), device=device), parents)
    out = {"safe": safe, "root": (parents < 0).unsqueeze(-1), "edges": None, "nodes": None}
    if edges is not None:
        if idx is not None:
            edges = edges.index_select(0, torch.as_tensor(idx, device=edges.device).long())
        out["edges"] = edges.to(device)
    if getattr(pair_net, "offsets", None) == "pair":  # offsets looked up by node ids
        child = torch.arange(parents.numel(), device=device) if idx is None else idx
        out["nodes"] = (child, child[safe])
    return out


def _edge_correlations(pair_net, feats: torch.Tensor, edge: dict) -> torch.Tensor:
    """``rho`` ``(..., B, D)`` of every node's parent edge (0 at roots) from the pair
    network on ``feats`` ``(..., B, F')`` and :func:`_edge_inputs`: plain tensor code."""
    args = (feats, feats.index_select(-2, edge["safe"]))
    if edge["edges"] is not None:
        args += (edge["edges"].to(feats.device),)
    kwargs = {} if edge["nodes"] is None else {"nodes": edge["nodes"]}
    rho = pair_net(*args, **kwargs)
    return torch.where(edge["root"], torch.zeros_like(rho), rho)


class TreeVIGuide(TreeGuide, PyroModule):
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

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide
    >>> from pyro_trees.models import GraphPriorVAE
    >>> adjacency = torch.tensor([[0, 1], [1, 2], [2, 3]])  # a path over 4 instances
    >>> model = GraphPriorVAE(adjacency, 3, num_nodes=4, latent_dim=2, hidden_sizes=(8,),
    ...                       likelihood="normal")
    >>> guide = TreeVIGuide(GaussianEncoder(3, 2, hidden_sizes=(8,)), [-1, 0, 1, 2],
    ...                     pair_net=PairNet(3, 2, hidden_sizes=(8,)))
    >>> x = torch.randn(4, 3)
    >>> guide(x)["z"].shape
    torch.Size([4, 2])
    >>> type(guide.distribution(x, idx=torch.tensor([1, 2]))).__name__
    'TreeNormal'
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), pyro.infer.Trace_ELBO())
    >>> isinstance(svi.step(x), float)
    True
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

    def _inputs(self, x, idx, tree: bool = True, finite: bool = True):
        """The checked rows of a step: ``(x_B, idx)`` with ``x_B`` of shape ``(..., |B|, F)``
        and ``idx`` a long tensor (or ``None``). Raises :class:`ValueError` if ``x`` does
        not have the tree's ``N`` rows on dim -2 (unless ``tree=False``: the encoder alone
        takes any number of instances), if ``idx`` is out of range, or if a row of the
        batch is not finite (unless ``finite=False``: the caller has checked every row).
        Only the batch's rows are scanned (``O(|B| F)``). The guide follows ``x``'s dtype
        and device."""
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
        return (check_finite(x, "x") if finite else x), idx

    def _select(self, x, idx):
        """The batch's inputs and its tree as a cached plan (``None`` for mean-field)."""
        x, idx = self._inputs(x, idx)
        plan = None if self.parents is None else _batch_plan(self, self.parents, 0, idx)
        return x, plan, idx

    def _rho(self, xb, parents, pair_net, edges=None, idx=None):
        return _edge_correlations(pair_net, xb, _edge_inputs(parents, pair_net, edges, idx))

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

    # -- the draw as plain tensor code, for a loss that compiles it (TreeVIELBO) ----------
    def step_inputs(self, x, idx=None, *, check: bool = True) -> dict:
        """What a draw of the batch ``idx`` needs besides the guide's networks, computed
        eagerly: the batch's rows and, for a tree, its forest (cached per batch, see
        :meth:`distribution`), the order in which :class:`TreeNormal`'s ``rsample``
        reads its noise, and the pair network's edge inputs. With :meth:`program_parts`
        and :meth:`draw_of` it makes the draw of :meth:`forward` (no group ``plate``).

        :param torch.Tensor x: ``(N, F)``.
        :param idx: ``(B,)`` indices of the batch, or ``None`` (all ``N``).
        :param bool check: scan the batch's rows for NaN and infinite values (``False``
            where the caller has checked every row of ``x``).
        :returns: ``{"x": (B, F), "forest": None (mean-field) or {"jumps": the pointer
            arrays ``(B,)`` of pointer jumping (``ceil(log2 B)`` of them for a
            minibatch, whatever its forest's height), "noise_order":
            (B,), "safe", "root", "edges", "nodes"}}``.
        :raises ValueError: as :meth:`distribution`.
        """
        xb, idx = self._inputs(x, idx, finite=check)
        if self.parents is None:
            return {"x": xb, "forest": None}
        plan = _batch_plan(self, self.parents, 0, idx)
        if self.pair_net is None:
            with torch.no_grad():
                loc, scale = self.encoder(xb)
                self._default_pair_net(self._pair_features(xb, loc, scale), loc.shape[-1])
        forest = _edge_inputs(plan.parents, self.pair_net, self.edge_features, idx)
        # TreeNormal.rsample reads i.i.d. noise in the order of its recursion's plan
        sorted_by = plan.levels if plan.height <= TreeNormal.max_levels_height else plan.paths
        forest["noise_order"] = sorted_by[1]
        # a minibatch: ceil(log2 B) jumps whatever its forest's height (enough for any
        # forest of B nodes; the extra ones add exact zeros), so that every batch of B
        # rows shares one compiled program
        jumps = list(plan.jumps)
        while idx is not None and len(jumps) < math.ceil(math.log2(max(plan.n, 1))):
            jumps.append(jumps[-1].index_select(0, jumps[-1]) if jumps else plan.safe_parents)
        forest["jumps"] = tuple(jumps)
        return {"x": xb, "forest": forest}

    def program_parts(self) -> dict:
        """The guide's networks, read through Pyro's store (so that plain ``SVI`` trains
        them; :func:`~pyro_trees._param_store.read_params`), for :meth:`draw_of`."""
        read_params(self)
        return {"encoder": self.encoder, "pair_net": self.pair_net, "pair_inputs": self.pair_inputs}

    @staticmethod
    def draw_of(parts: dict, inputs: dict, eps: torch.Tensor):
        """The reparameterised draw of :meth:`forward` from standard normal noise, as
        plain tensor code, and its log-density: ``(z, log q(z))``.

        ``z = loc + scale * u`` with ``u`` the tree's ancestral recursion of ``eps`` (by
        pointer jumping, whose program does not depend on the forest's shape), and
        ``log q(z) = log N(eps; 0, I) - sum log scale - sum log sqrt(1 - rho^2)`` (the
        change of variables): :class:`TreeNormal`'s value and gradients at the same
        noise, to rounding.

        :param dict parts: :meth:`program_parts`.
        :param dict inputs: :meth:`step_inputs`.
        :param torch.Tensor eps: ``(B, D)`` standard normal noise in the order
            ``rsample`` reads it (the forest's plan order; the rows' order for the
            mean-field guide).
        :returns: ``z`` ``(B, D)`` and ``log q(z)``, a scalar.
        """
        xb = inputs["x"]
        loc, scale = parts["encoder"](xb)
        if loc.shape != eps.shape:
            raise ValueError(
                f"the guide's encoder gives codes of shape {tuple(loc.shape)} but the model's "
                f"latent site has shape {tuple(eps.shape)}: the encoder's latent_dim must be "
                "the model's"
            )
        log_noise = -0.5 * eps.pow(2).sum() - 0.5 * eps.numel() * _LOG_2PI
        forest = inputs["forest"]
        if forest is None:
            return loc + scale * eps, log_noise - scale.log().expand_as(loc).sum()
        eps = eps.index_select(-2, forest["noise_order"])
        if parts["pair_inputs"] == "data":
            feats = xb
        else:
            feats = torch.cat([loc, scale.log()], -1).detach()
        rho = _edge_correlations(parts["pair_net"], feats, forest)
        sd = (1 - rho.pow(2)).sqrt()
        u = jump_solve(rho, sd * eps, forest["jumps"])  # u_j = rho_j u_pa(j) + sd_j eps_j
        log_q = log_noise - scale.log().expand_as(loc).sum() - sd.log().expand_as(loc).sum()
        return loc + scale * u, log_q

    def _default_pair_net(self, feats, latent_dim):
        if self.edge_features is not None:
            raise ValueError("a guide with edge_features needs its pair_net (edge_features=E)")
        grouped = feats.dim() >= 3
        num_nodes = self.parents.numel() if grouped else None
        with torch.random.fork_rng(devices=[]):  # the draws after it do not move
            net = PairNet(feats.shape[-1], latent_dim, num_nodes=num_nodes)
        self.pair_net = net.to(device=feats.device, dtype=feats.dtype)
        prepare(self, feats)  # a loaded store's values for it

    def checked_rows(self, x) -> torch.Tensor:
        """``x`` as a tensor checked against the guide (the guide follows its dtype and
        device).

        :param x: ``(..., N, F)``, the tree's ``N`` instances on dim -2.
        :returns: the rows, ``(..., N, F)``.
        :raises ValueError: for another number of instances than the tree's, or a row
            that is not finite.
        """
        return self._inputs(x, None)[0]

    def pair_rho(self, x: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The pair network's correlations on every ordered pair of the rows of ``x``:
        ``rho[..., i, j, :]`` for child ``i`` and parent ``j``.

        :param x: checked rows ``(..., N, F)`` (:meth:`checked_rows`).
        :param loc: the encoder's means at ``x``, ``(..., N, D)``.
        :param scale: the encoder's standard deviations at ``x``, ``(..., N, D)``.
        :returns: ``(..., N, N, D)``.
        :raises ValueError: for a guide whose pair network cannot score all pairs.
        """
        return self._all_pair_rho(self._pair_features(x, loc, scale), loc.shape[-1])

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
        xb = self.checked_rows(x)
        loc, scale = self.encoder(xb)
        return SoftTreeNormal(loc, scale, probs.to(loc), self.pair_rho(xb, loc, scale))

    def set_tree(self, parents) -> None:
        """Install the tree ``parents`` (``(N,)``, ``-1`` at roots; validated) on the
        guide's device and drop the cached batch plans of the old one. Used by
        :func:`~pyro_trees.infer.learn_guide_tree`; the guide's networks are kept."""
        device = next((q.device for q in self.parameters()), None)
        n = None if self.parents is None else self.parents.numel()
        parents = validate_parents(parents, n)
        self.parents = parents if device is None else parents.to(device)
        _PLANS.pop(self, None)  # plans of the old tree

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
            group plate (``G'`` the subsample size); under
            :class:`~pyro_trees.infer.MixtureTreeELBO` with a leading component axis ``M``.
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
