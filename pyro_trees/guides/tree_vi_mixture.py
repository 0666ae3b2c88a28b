"""MTreeVI: the amortised guide over a mixture of trees (Xiao & Su 2024, eqs. 14-15).

:class:`TreeVIMixtureGuide` trains with :class:`~pyro_trees.infer.MixtureTreeELBO`, which
runs it in its stratified mode (one draw per tree,
:meth:`TreeVIMixtureGuide.stratified`).
"""

from __future__ import annotations

import contextlib

import pyro
import torch
from pyro.distributions import TorchDistribution
from pyro.nn import PyroParam
from torch import nn
from torch.distributions import constraints

from pyro_trees._forest import validate_parents
from pyro_trees.distributions.tree_mixture import MixtureOfTreeNormals
from pyro_trees.distributions.tree_normal import TreeNormal
from pyro_trees.guides.tree_vi import TreeVIGuide, _batch_plan

__all__ = ["TreeVIMixtureGuide"]


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

    Train it with :class:`~pyro_trees.infer.MixtureTreeELBO`, which draws one sample
    from every tree and weights the ``M`` terms by the mixture weights (a stratified,
    reparameterised
    estimator). With ``entropy="bound"`` the objective is eq. 15,
    :math:`\\sum_m \\pi_m(\\mathbb E_{q_m}\\log p(x, z) + H[q_m])`, a lower bound of the
    mixture's ELBO that is linear in :math:`\\pi` (so it never beats the best single
    tree); with ``entropy="exact"`` (default) it is the mixture's own ELBO
    :math:`\\sum_m \\pi_m \\mathbb E_{q_m}[\\log p(x, z) - \\log q(z)]` with the exact
    mixture density :math:`q = \\sum_k \\pi_k q_k` (cost ``M`` times that of the bound).
    Called outside :class:`~pyro_trees.infer.MixtureTreeELBO` (e.g. by ``Predictive``) it
    draws from the mixture.

    :param parents: ``(M, N)`` parent arrays.
    :param pair_net: one module shared by the trees, or a list of ``M`` modules.
    :param edge_features: optional ``(M, N, E)`` features of each tree's parent edges
        (see :class:`~pyro_trees.guides.TreeVIGuide`); ``pair_inputs`` as there.
    :param str entropy: ``"exact"`` or ``"bound"``.
    :param int component_dim: the plate dim of the tree components (``-1`` for
        instance-level models without plates, ``-2`` below a group plate).
    :param str name: prefix of its names in Pyro's parameter store (see
        :class:`TreeVIGuide`).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import GroupEncoder, PairNet, TreeVIMixtureGuide
    >>> from pyro_trees.infer import MixtureTreeELBO
    >>> from pyro_trees.models import SyntheticGraphVAE
    >>> model = SyntheticGraphVAE()  # groups of 4 instances, 4 features, 4 latent dims
    >>> x = model.generate(6)
    >>> guide = TreeVIMixtureGuide(GroupEncoder(4, 4, 4), [[-1, 0, 0, 1], [-1, 0, 1, 0]],
    ...                            pair_net=PairNet(4, 4, num_nodes=4), plate="groups")
    >>> guide.num_trees, guide(x)["z"].shape
    (2, torch.Size([6, 4, 4]))
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), MixtureTreeELBO())
    >>> isinstance(svi.step(x), float)
    True
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

    @contextlib.contextmanager
    def stratified(self):
        """A context in which the guide draws one sample per tree, stacked on a leading
        batch dimension of size ``T`` (the mode :class:`~pyro_trees.infer.MixtureTreeELBO`
        runs it in, inside a plate of that size): the ``m``-th draw comes from tree ``m``,
        and its ``log_prob`` is the mixture density (``entropy="exact"``) or tree ``m``'s
        own density (``"bound"``)::

            with guide.stratified(), pyro.plate("tree_components", guide.num_trees, dim=-1):
                draws = guide(x)
        """
        self._stratify = True
        try:
            yield
        finally:
            self._stratify = False

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
        comps = self._components(x, idx)
        return MixtureOfTreeNormals(
            torch.stack([c.loc for c in comps], -3),
            torch.stack([c.scale for c in comps], -3),
            torch.stack([c.parents for c in comps]),
            torch.stack([c.rho for c in comps], -3),
            self.tree_logits,
        )

    def forward(self, x, *args, idx=None, subsample_size=None, **kwargs):
        """As :meth:`TreeVIGuide.forward`; under :class:`~pyro_trees.infer.MixtureTreeELBO`
        one draw per tree. Returns ``{site: z}``.

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
