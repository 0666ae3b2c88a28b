"""What the stacked-loss tests of both VaRT ELBOs check (a helper, not a test module)."""

from __future__ import annotations

import torch

from pyro_trees.guides import StackedGuides


def check_stack_equals_fits(loss, elbo, model, guides, x, y, rows, seed: int = 0) -> None:
    """A :class:`StackedGuides` of ``guides``, fit ``j`` weighted to its rows ``rows[j]``:
    ``loss`` on the stack gives each fit's own ``elbo`` on its own rows, on the same draws,
    in value (``loss.fit_losses``) and in the gradients of its parameters."""
    stack = StackedGuides(guides)
    weight = torch.zeros(len(guides), x.shape[0], dtype=x.dtype)
    for j, r in enumerate(rows):
        weight[j, r] = 1.0
    torch.manual_seed(seed)
    total = loss.differentiable_loss(model, stack, x, y, weight=weight)
    total.backward()
    torch.manual_seed(seed)  # the same draws again
    q = stack.params(x)
    noise = {k: v.detach() for k, v in stack.noise(q).items()}
    for j, guide in enumerate(guides):
        qj = guide.params(x)
        values = guide.sites(qj, {k: v[j] for k, v in noise.items()}, stack.temperature)
        own = -elbo(model, guide, x[rows[j]], y[rows[j]], values=values, params=qj)
        assert torch.allclose(loss.fit_losses[j], own.detach(), rtol=1e-10)
        own.backward()
        for name in type(guide)._PARAMS:
            mine = getattr(guide, name + "_unconstrained").grad
            assert torch.allclose(getattr(stack, name).grad[j], mine, rtol=1e-8, atol=1e-12), name
    assert torch.allclose(total, loss.fit_losses.sum(), rtol=1e-12)
