"""Guide for :class:`~pyro_trees.models.HeteroscedasticGP`: an RNN-Tree over the noise leaves."""

from __future__ import annotations

import weakref

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam
from pyro.nn.module import pyro_method

from pyro_trees._param_store import adopt_param_store, shared_plate
from pyro_trees.guides.base import TreeGuide
from pyro_trees.guides.rnn_tree import RNNTree
from pyro_trees.models.heteroscedastic_gp import HeteroscedasticGP

__all__ = ["HeteroscedasticGPGuide"]


#: per guide, the data of its last ``_keep``: weak references to ``x`` and ``y``, their
#: versions and the stored copies (outside the guide, so that pickles do not carry it)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class HeteroscedasticGPGuide(TreeGuide, PyroModule):
    """The routing posterior of the noise tree, plus :math:`q(u)` for the sparse model.

    Build it from the model, ``HeteroscedasticGPGuide(model)``: depth, inputs and
    inducing points follow the model, the parameter-store prefix is the model's
    ``name``, and the pair trains with the plain SVI loop and ``Trace_ELBO``. At the
    first call on data the guide starts the fit with
    :meth:`HeteroscedasticGP.init_from_data
    <pyro_trees.models.HeteroscedasticGP.init_from_data>`, unless the param store
    already holds the model's parameters (a trained or loaded model).

    ``forward(x, y=None, subsample_size=None)`` has the model's signature. With
    ``num_inducing=M > 0`` it samples ``"u"`` from
    ``MultivariateNormal(u_loc, scale_tril=u_scale_tril)`` (whitened, ``(M,)``); then,
    inside the plate ``"data"``, the per-point site ``"leaf"`` from
    ``Categorical(logits=RNNTree(x))``: with ``y``, masked (the model's factor holds the
    routing's expectation at these logits); without, a draw from the routing posterior.
    A guide built without the model marks ``"leaf"`` for parallel enumeration instead
    (:class:`~pyro_trees.infer.TreeELBO`, :class:`~pyro_trees.infer.CollapsedELBO`).

    For the exact model built with it, the guide is the collapsed posterior: with ``y``
    it keeps the training data, as the param-store entries
    ``"<name>.data_x"`` ``(N, L)`` and ``"<name>.data_y"`` ``(N,)`` (never optimised);
    without ``y`` it samples ``"f"`` ``(N*,)`` from the function's posterior given those
    data (:meth:`HeteroscedasticGP.posterior_f
    <pyro_trees.models.HeteroscedasticGP.posterior_f>`), so that
    ``Predictive(model, guide=guide, ...)`` is the posterior predictive. It returns the
    dict of its samples.

    :param model: the :class:`~pyro_trees.models.HeteroscedasticGP` to serve, or (an
        unbound guide, for :class:`~pyro_trees.infer.CollapsedELBO` and explicit
        :meth:`~pyro_trees.models.HeteroscedasticGP.init_from_data`) the input
        dimension ``L``.
    :param int depth: tree depth (default the model's, or 2); must match the model's.
    :param int num_inducing: ``M`` of the sparse model (default the model's, or 0).
    :param str feedback: RNN-Tree feedback, ``"hard"`` (default: an exact soft tree,
        no sampling of the routing) or ``"soft"`` (the paper's noisy roll-out).
    :param float init_scale: initial scale of :math:`q(u)`.
    :param str name: parameter-store prefix (default the model's ``name``).
    :param kwargs: passed to :class:`~pyro_trees.guides.RNNTree` (``hidden_size``,
        ``noise``).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro import poutine
    >>> from pyro_trees.guides import HeteroscedasticGPGuide
    >>> guide = HeteroscedasticGPGuide(2, depth=2, hidden_size=4)
    >>> trace = poutine.trace(guide).get_trace(torch.randn(5, 2))
    >>> trace.nodes["leaf"]["value"].shape
    torch.Size([5])
    """

    def __init__(
        self,
        model,
        depth: int | None = None,
        *,
        num_inducing: int | None = None,
        feedback: str = "hard",
        init_scale: float = 0.1,
        name: str | None = None,
        **kwargs,
    ):
        bound = not isinstance(model, int)
        if bound:
            if not isinstance(model, HeteroscedasticGP):
                raise ValueError(
                    f"model must be a HeteroscedasticGP or an input dimension, got {type(model)}"
                )
            for what, given, own in (
                ("depth", depth, model.depth),
                ("num_inducing", num_inducing, model.num_inducing),
            ):
                if given is not None and given != own:
                    raise ValueError(f"{what}={given} differs from the model's {own}")
            in_features, depth, num_inducing = model.in_features, model.depth, model.num_inducing
            name = model.__dict__["_pyro_name"] if name is None else name
        else:
            in_features = model
            depth = 2 if depth is None else depth
            num_inducing = 0 if num_inducing is None else num_inducing
        super().__init__(name="" if name is None else name)
        if isinstance(num_inducing, bool) or not isinstance(num_inducing, int) or num_inducing < 0:
            raise ValueError(f"num_inducing must be an integer >= 0, got {num_inducing!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        kwargs.setdefault("hidden_size", 16)
        self.tree = RNNTree(in_features, depth, feedback=feedback, **kwargs)
        self.num_inducing = num_inducing
        if num_inducing:
            self.u_loc = PyroParam(torch.zeros(num_inducing))
            self.u_scale_tril = PyroParam(
                init_scale * torch.eye(num_inducing), constraint=constraints.lower_cholesky
            )
        self.__dict__["_model"] = model if bound else None
        if bound:
            model.bind(self)

    @property
    def depth(self) -> int:
        """Depth of the routing tree."""
        return self.tree.depth

    @property
    def model(self):
        """The model this guide was built from, or ``None`` (an unbound guide)."""
        return self.__dict__["_model"]

    def _fullname(self, name: str) -> str:
        prefix = self.__dict__["_pyro_name"]
        return f"{prefix}.{name}" if prefix else name

    def training_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training inputs ``(N, L)`` and targets ``(N,)`` kept for the exact model's
        posterior (from the param store).

        :raises ValueError: before the guide has seen data.
        """
        store = pyro.get_param_store()
        names = [self._fullname(k) for k in ("data_x", "data_y")]
        if not all(k in store for k in names):
            raise ValueError(
                "the guide of the exact HeteroscedasticGP has not seen training data: train "
                "it (svi.step(x, y)) or load its param store first; Predictive(model) "
                "without the guide gives prior draws"
            )
        return tuple(store[k].detach() for k in names)

    def _keep(self, x: torch.Tensor, y: torch.Tensor) -> None:
        store = pyro.get_param_store()
        names = [self._fullname(k) for k in ("data_x", "data_y")]
        kept = _KEPT.get(self)
        if kept is not None and kept[0]() is x and kept[1]() is y:
            # the tensors of the last call, unchanged, still in the store: a fit's every
            # step after the first (comparing the values would read them back each step)
            versions, stored = kept[2], kept[3]
            now = (x._version, y._version, *(t._version for t in stored))
            if versions == now and all(
                store._params.get(n) is t for n, t in zip(names, stored, strict=True)
            ):
                return
        for fullname, value in zip(names, (x, y), strict=True):
            old = store._params.get(fullname)
            if old is None or old.shape != value.shape or not torch.equal(old.detach(), value):
                store[fullname] = value.detach().clone()
        stored = tuple(store._params.get(n) for n in names)
        versions = (x._version, y._version, *(t._version for t in stored))
        _KEPT[self] = (weakref.ref(x), weakref.ref(y), versions, stored)

    @pyro_method
    def observe(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """What :meth:`forward` does with the data before its sites: the bound model's
        start at the first call on data, the parameters of a loaded param store, and for
        the exact model the training data its posterior needs. A loss that scores the
        bound without tracing the guide (:class:`~pyro_trees.infer.CollapsedELBO`) calls
        it instead.

        :param x: inputs ``(N, L)``; ``y``: targets ``(N,)`` or ``None``.
        """
        model = self.model
        if model is not None and y is not None:
            model.start_once(x, y)
        adopt_param_store(self)
        if model is not None and not model.sparse and y is not None:
            self._keep(x, y)

    def forward(self, x: torch.Tensor, y=None, subsample_size: int | None = None) -> dict:
        """Sample ``"u"`` (sparse model only), ``"f"`` (exact model, ``y=None``), then each
        point's ``"leaf"`` in ``"data"``.

        :param torch.Tensor x: inputs ``(N, L)``.
        :param y: targets ``(N,)`` or ``None`` (used by the lazy start and kept for the
            exact model's posterior).
        :param int subsample_size: minibatch size of the ``"data"`` plate; must match the
            model's.
        :returns: the dict of sampled values.
        """
        model = self.model
        self.observe(x, y)
        collapsed = model is not None and not model.sparse
        summed = model is not None and y is not None
        out = {}
        if self.num_inducing:
            if model is not None and y is None:  # drawing u to predict
                model.warn_if_q_u_stale()
            loc = self.u_loc.to(x.dtype)
            out["u"] = pyro.sample(
                "u", dist.MultivariateNormal(loc, scale_tril=self.u_scale_tril.to(x.dtype))
            )
        if collapsed:
            if y is None:
                x_train, y_train = self.training_data()
                out["f"] = pyro.sample("f", model.posterior_f(x, x_train, y_train, self))
        n = x.shape[0]
        with shared_plate("data", n, subsample_size=subsample_size) as idx:
            routing = dist.Categorical(logits=self.tree(x[idx]))
            if summed:
                out["leaf"] = pyro.sample("leaf", routing.mask(False))
            elif model is not None:
                out["leaf"] = pyro.sample("leaf", routing)
            else:
                out["leaf"] = pyro.sample("leaf", routing, infer={"enumerate": "parallel"})
        return out
