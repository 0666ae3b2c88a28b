"""A base for ELBOs that compute their loss in one differentiable function."""

from __future__ import annotations

import torch
from pyro.infer import ELBO

__all__ = ["DifferentiableLossELBO"]


class DifferentiableLossELBO(ELBO):
    """A :class:`pyro.infer.ELBO` whose subclass supplies only ``differentiable_loss``;
    ``loss`` and ``loss_and_grads`` (what :class:`pyro.infer.SVI` calls) derive from it.
    """

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO estimate as a float, without gradients."""
        with torch.no_grad():
            return float(self.differentiable_loss(model, guide, *args, **kwargs))

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """The negative ELBO estimate as a float; its gradients are accumulated (when
        some parameter requires them, as :class:`pyro.infer.Trace_ELBO`)."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward()
        return float(loss.detach())
