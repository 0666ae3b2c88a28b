r"""``CollapsedELBO``: the bound of a model whose latent function is integrated out exactly.

For a model with a method ``collapsed_bound(*args, leaf_logits, balance_weight,
entropy_weight)`` (e.g. :class:`~pyro_trees.models.HeteroscedasticGP` in exact mode,
App. E of Antorán et al.), the loss is minus that bound at the guide's routing
posterior: the guide is traced once and the logits of its ``"leaf"`` site are handed
to the model. No Monte Carlo over the GP function; the routing enters through its
probabilities.

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

from pyro_trees.infer._loss_elbo import DifferentiableLossELBO

__all__ = ["CollapsedELBO"]


class CollapsedELBO(DifferentiableLossELBO):
    """Minus the model's ``collapsed_bound`` at the guide's leaf logits.

    :param str site: name of the guide's routing site (``"leaf"``).
    :param float balance_weight: weight of the tree-balance coupling (1: the bound).
    :param float entropy_weight: weight of the per-point KL to the uniform leaf
        (1: the bound; see :class:`~pyro_trees.infer.TreeELBO`).

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

    def __init__(
        self, *, site: str = "leaf", balance_weight: float = 1.0, entropy_weight: float = 1.0
    ):
        super().__init__(num_particles=1)
        self.site = site
        self.balance_weight = float(balance_weight)
        self.entropy_weight = float(entropy_weight)

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("CollapsedELBO evaluates the bound without model traces")

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Minus the collapsed bound, differentiable in model and guide parameters."""
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
        logits = fn.logits
        bound = collapsed(
            *args,
            leaf_logits=logits,
            balance_weight=self.balance_weight,
            entropy_weight=self.entropy_weight,
            **kwargs,
        )
        loss = -bound
        warn_if_nan(loss, "loss")
        return loss
