r"""``CollapsedELBO``: the bound of a model whose latent function is integrated out exactly.

For a model with a method ``collapsed_bound(*args, leaf_logits, balance_weight,
entropy_weight)`` (e.g. :class:`~pyro_trees.models.HeteroscedasticGP` in exact mode,
App. E of Antorán et al.), the loss is minus that bound at the guide's routing
posterior: the guide is traced once and the logits of its ``"leaf"`` site are handed
to the model. No Monte Carlo over the GP function; the routing enters through its
probabilities.

For a :class:`~pyro_trees.models.HeteroscedasticGP` with a
:class:`~pyro_trees.guides.HeteroscedasticGPGuide` (an RBF or Matérn kernel, hard
feedback) the bound runs as one tensor program instead: the parameters are read once
(:meth:`~pyro_trees.models.HeteroscedasticGP.bound_params`), then the routing, the
kernel matrices (:class:`~pyro_trees.gp.TensorKernel`), the factorisations and the bound
are plain tensor code, without Pyro's trace or GPyTorch's lazy tensors: the same value
and gradients (tested), fewer operations per step, and with ``compile=True`` one program
under ``torch.compile`` (:mod:`pyro_trees.infer.compiled`). Its Cholesky factorisations
try the jitter once and report failure; a step whose factorisation fails is scored
again by the general path, which retries with more jitter (one host read per step).

For the sparse model the bound integrates the guide's :math:`q(u)` out, so training
leaves it where it started: call
:meth:`~pyro_trees.models.HeteroscedasticGP.set_optimal_inducing_posterior` on the
training data before predicting (the estimator does; ``predict`` and ``Predictive`` warn
until it is called).

Works with plain ``pyro.infer.SVI(model, guide, optim, loss=CollapsedELBO())``: the
parameters the guide and the model touch are registered in Pyro's param store as
usual. A model of your own must decorate its ``collapsed_bound`` with
:func:`pyro.nn.module.pyro_method` (a ``PyroModule`` registers its parameters only
inside such methods and ``forward``) and call ``pyro.module`` on plain ``nn.Module``
parts such as GPyTorch kernels.
"""

from __future__ import annotations

import torch
from pyro import poutine
from pyro.util import warn_if_nan

from pyro_trees.guides.heteroscedastic_gp import HeteroscedasticGPGuide
from pyro_trees.guides.rnn_tree import RNNTree
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesLoss
from pyro_trees.models.heteroscedastic_gp import HeteroscedasticGP

__all__ = ["CollapsedELBO"]


class _FirstTry:
    """:func:`~pyro_trees.gp.cholesky`'s first attempt without reading its outcome
    back: ``failed`` (a 0-dim tensor) says whether any factorisation failed, for the
    loss to check once the program has run."""

    def __init__(self):
        self.failed = None

    def __call__(self, K: torch.Tensor, jitter: float) -> torch.Tensor:
        eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
        L, info = torch.linalg.cholesky_ex(K + jitter * eye)
        failed = (info > 0).any()
        self.failed = failed if self.failed is None else self.failed | failed
        return L


def _hgp_program(tree_params, params, x, y, jitter, weights):
    """The collapsed bound of :class:`~pyro_trees.models.HeteroscedasticGP` at complete
    rows ``(x, y)`` from the routing's parameters
    (:meth:`~pyro_trees.guides.RNNTree.node_params`) and the model's
    (:meth:`~pyro_trees.models.HeteroscedasticGP.bound_params`), and whether a Cholesky
    factorisation failed: the part of a step that compiles."""
    log_q = RNNTree.leaf_log_probs_of(x, tree_params)
    chol = _FirstTry()
    bound = HeteroscedasticGP.bound_of(params, x, y, log_q, jitter=jitter, chol=chol, **weights)
    return bound, chol.failed


class CollapsedELBO(CompilesLoss, DifferentiableLossELBO):
    """Minus the model's ``collapsed_bound`` at the guide's leaf logits.

    :param str site: name of the guide's routing site (``"leaf"``).
    :param float balance_weight: weight of the tree-balance coupling (1: the bound).
    :param float entropy_weight: weight of the per-point KL to the uniform leaf
        (1: the bound; see :class:`~pyro_trees.infer.TreeELBO`).
    :param compile: ``False`` (default), ``True`` or a ``torch.compile`` backend name:
        the heteroscedastic GP's bound as one compiled program (module docs; other
        models, kernels and soft feedback run eagerly).
    :param str mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import HeteroscedasticGPGuide
    >>> from pyro_trees.infer import CollapsedELBO
    >>> from pyro_trees.models import HeteroscedasticGP
    >>> x, y = torch.randn(6, 1), torch.randn(6)
    >>> model = HeteroscedasticGP(1, depth=1)
    >>> guide = HeteroscedasticGPGuide(1, depth=1, hidden_size=4)
    >>> loss = CollapsedELBO().differentiable_loss(model, guide, x, y)
    >>> loss.shape, bool(torch.isfinite(loss))
    (torch.Size([]), True)
    """

    _program = staticmethod(_hgp_program)

    def __init__(
        self,
        *,
        site: str = "leaf",
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        compile: bool | str = False,
        mode: str | None = None,
    ):
        super().__init__(num_particles=1, compile=compile, mode=mode)
        self.site = site
        self.balance_weight = float(balance_weight)
        self.entropy_weight = float(entropy_weight)

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("CollapsedELBO evaluates the bound without model traces")

    def _check_data(self, model, x: torch.Tensor, y: torch.Tensor) -> None:
        """``model.check(x, y)`` (shapes, finite values: what ``collapsed_bound`` checks),
        once per pair of tensors and versions (:meth:`_once`)."""
        self._once("data", (x, y), lambda: model.check(x, y), owner=model)

    def _program_bound(self, model, guide, args, kwargs) -> torch.Tensor | None:
        """The bound through the tensor program (compiled where asked), or ``None`` where
        it does not apply (another model or guide, another kernel, soft feedback, other
        arguments) or a factorisation needs more jitter."""
        if not (
            isinstance(model, HeteroscedasticGP)
            and isinstance(guide, HeteroscedasticGPGuide)
            and self.site == "leaf"
            and len(args) == 2
            and not kwargs
        ):
            return None
        x, y = args
        self._check_data(model, x, y)
        if guide.tree.feedback != "hard" or guide.tree.depth != model.depth:
            return None
        guide.observe(x, y)
        params = model.bound_params(x.dtype)
        if params is None:
            return None
        weights = {"balance_weight": self.balance_weight, "entropy_weight": self.entropy_weight}
        if self._compiled is None:
            # eager: the routing by the tree's own blockwise function (normalised leaf
            # log-probabilities), and the factorisations that retry with more jitter
            log_q = guide.tree(x)
            return HeteroscedasticGP.bound_of(params, x, y, log_q, jitter=model.jitter, **weights)
        tree_params = guide.tree.node_params(x.dtype)
        bound, failed = self._compiled(tree_params, params, x, y, model.jitter, weights)
        return None if bool(failed) else bound

    def _traced_bound(self, model, guide, args, kwargs) -> torch.Tensor:
        """The bound of any model with ``collapsed_bound``, at the leaf logits of the
        guide's traced ``site``."""
        collapsed = getattr(model, "collapsed_bound", None)
        if collapsed is None:
            raise ValueError(
                f"CollapsedELBO needs a model with a collapsed_bound method; got {type(model)}"
            )
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        site = guide_trace.nodes.get(self.site)
        fn = None if site is None else site["fn"]
        while fn is not None and not hasattr(fn, "logits") and hasattr(fn, "base_dist"):
            fn = fn.base_dist  # a masked or reshaped Categorical
        if fn is None or not hasattr(fn, "logits"):
            raise ValueError(
                f"the guide has no site {self.site!r} with leaf logits (dist.Categorical)"
            )
        return collapsed(
            *args,
            leaf_logits=fn.logits,
            balance_weight=self.balance_weight,
            entropy_weight=self.entropy_weight,
            **kwargs,
        )

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Minus the collapsed bound, differentiable in model and guide parameters."""
        bound = self._program_bound(model, guide, args, kwargs)
        if bound is None:
            bound = self._traced_bound(model, guide, args, kwargs)
        loss = -bound
        warn_if_nan(loss, "loss")
        return loss
