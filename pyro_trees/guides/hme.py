"""Guide for :class:`~pyro_trees.models.HME`: the RNN-Tree routing posterior (Sec. 4)."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from pyro.poutine.plate_messenger import PlateMessenger
from pyro.poutine.runtime import _PYRO_STACK

from pyro_trees import trees
from pyro_trees._param_store import adopt_param_store, follow_data, shared_plate, store_name
from pyro_trees._tree_start import check_init
from pyro_trees.guides.base import TreeGuide
from pyro_trees.guides.rnn_tree import RNNTree

__all__ = ["RNNTreeGuide"]


class RNNTreeGuide(TreeGuide, PyroModule):
    """Guide for :class:`~pyro_trees.models.HME`: the RNN-Tree routing posterior.

    ``forward(x, y=None, subsample_size=None)`` has the model's signature and samples
    the per-point site ``"leaf"`` ``(N,)`` inside the plate ``"data"`` from
    ``Categorical(logits=RNNTree(x))``, marked for parallel enumeration so that
    :class:`~pyro_trees.infer.TreeELBO` (or ``TraceEnum_ELBO``) sums it out exactly.
    Outside enumeration (``pyro.infer.Predictive``, ``poutine.trace``) the site is an
    ordinary draw from the routing posterior, so posterior predictive draws need nothing
    else.

    **Lazy initialisation.** At its first call with targets ``y`` (the first
    ``svi.step(x, y)``) the guide moves to ``x``'s dtype and device, sets the tree's
    input standardisation (:meth:`RNNTree.init_scaling`) and starts the tree at the
    balanced tree of ``(x, y)`` (:meth:`RNNTree.init_balanced`, the tree-balance
    prior's mode), which :class:`~pyro_trees.models.HME` with the same ``init`` starts
    its experts from. If the param store already holds the guide's parameters (loaded
    with ``pyro.get_param_store().load``, or trained by an instance of the same
    ``name``), it uses them and initialises nothing. The standardisation is mirrored in
    the store as ``"<name>.tree.x_loc"``, ``"<name>.tree.x_scale"``.

    :param int in_features: input dimension.
    :param int depth: tree depth; must match the model's.
    :param str init: ``"balanced"`` (median cuts; default), ``"greedy"`` (CART's cuts)
        or ``None`` (no data-dependent start: random splits on unscaled inputs).
    :param float sharpness: the start's sigmoid slopes, times each node's spread
        (:meth:`RNNTree.init_balanced`; default 40, formerly 20).
    :param str name: parameter-store prefix, e.g. ``"hme"`` gives ``"hme.tree.h0"``.
    :param kwargs: passed to :class:`RNNTree` (``hidden_size``, ``feedback``, ``noise``).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro import poutine
    >>> from pyro_trees.guides import RNNTreeGuide
    >>> x, y = torch.randn(6, 2), torch.randn(6)
    >>> guide = RNNTreeGuide(2, 2, hidden_size=8)
    >>> trace = poutine.trace(guide).get_trace(x, y)
    >>> trace.nodes["leaf"]["value"].shape
    torch.Size([6])
    >>> guide.initialised
    True
    """

    def __init__(
        self,
        in_features: int,
        depth: int,
        *,
        init: str | None = "balanced",
        sharpness: float = 40.0,
        name: str | None = None,
        **kwargs,
    ):
        super().__init__(name=name or "")
        check_init(init)
        if not sharpness > 0:
            raise ValueError(f"sharpness must be positive, got {sharpness}")
        self.init = init
        self.sharpness = float(sharpness)
        self.tree = RNNTree(in_features, depth, **kwargs)
        self._init_state = "fresh"

    @property
    def depth(self) -> int:
        """Depth ``D`` of the tree (``2**D`` leaves)."""
        return self.tree.depth

    @property
    def initialised(self) -> bool:
        """Whether the first-call initialisation has happened (or was adopted)."""
        return self._init_state == "done"

    def _scaling_names(self) -> dict:
        return {store_name(self.tree, key): (self.tree, key) for key in ("x_loc", "x_scale")}

    @torch.no_grad()
    def _lazy_init(self, x: torch.Tensor, y) -> None:
        if self._init_state == "fresh":
            self._init_state = "pending"
            if adopt_param_store(self, buffers=self._scaling_names()):
                self._init_state = "done"
                return
            follow_data(self, x)
        if self.init is None:
            self._init_state = "done"
            return
        if y is None:
            return  # initialised at the first call with targets
        self.tree.init_scaling(x)
        self.tree.init_balanced(x, y, cuts=self.init, sharpness=self.sharpness)
        store = pyro.get_param_store()
        for name, (owner, key) in self._scaling_names().items():
            store[name] = getattr(owner, key).clone()
        self._init_state = "done"

    def conditional_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        """Eq. 23 per point and node, ``(N, 2**D - 1)``: :meth:`RNNTree.conditional_posteriors`."""
        return self.tree.conditional_posteriors(x, noise=noise)

    def aggregate_posteriors(self, x: torch.Tensor, *, noise=None) -> torch.Tensor:
        """Eq. 24 per node over ``x``, ``(2**D - 1,)``: :meth:`RNNTree.aggregate_posteriors`."""
        return self.tree.aggregate_posteriors(x, noise=noise)

    def rules(self, leaf_values=None) -> trees.DecisionRules:
        """The single most likely tree, thresholds in the units of ``x``: :meth:`RNNTree.rules`."""
        return self.tree.rules(leaf_values)

    def _leaf_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Leaf logits ``(N, 2**D)``; under outer vectorised plates (``Predictive(...,
        parallel=True)``) and a noisy soft-feedback roll-out, one roll-out per element of
        those plates, ``batch + (N, 2**D)``, so that parallel draws are independent as
        sequential ones are."""
        tree = self.tree
        batch = _outer_plate_shape()
        if tree.feedback == "hard" or not (tree.training and tree.noise > 0) or not batch:
            return tree(x)
        copies = math.prod(batch)
        logits = tree(x.expand(copies, *x.shape).reshape(-1, x.shape[-1]))
        return logits.reshape(*batch, x.shape[0], -1)

    def forward(self, x: torch.Tensor, y=None, subsample_size: int | None = None):
        """Sample each point's ``"leaf"`` from :class:`RNNTree` inside the ``"data"`` plate.

        :param torch.Tensor x: inputs ``(N, L)``.
        :param y: targets as the model takes them; used only by the first-call
            initialisation.
        :param int subsample_size: minibatch size of the ``"data"`` plate; must match the
            model's.
        """
        if x.dim() != 2 or x.shape[-1] != self.tree.in_features:
            raise ValueError(
                f"x must have shape (N, {self.tree.in_features}); got {tuple(x.shape)}"
            )
        if self._init_state != "done":
            self._lazy_init(x, y)
        with shared_plate("data", x.shape[0], subsample_size=subsample_size) as idx:
            logits = self._leaf_logits(x[idx])
            pyro.sample("leaf", dist.Categorical(logits=logits), infer={"enumerate": "parallel"})


def _outer_plate_shape() -> tuple:
    """Sizes of the vectorised plates active outside the ``"data"`` plate (``dim=-1``),
    aligned on the dims left of it, e.g. ``(S,)`` inside ``Predictive(parallel=True)``;
    ``()`` when there are none."""
    sizes = {}
    for messenger in _PYRO_STACK:
        if isinstance(messenger, PlateMessenger) and messenger.dim is not None:
            if messenger.dim < -1:
                sizes[messenger.dim] = messenger.subsample_size
    if not sizes:
        return ()
    return tuple(sizes.get(d, 1) for d in range(min(sizes), -1))
