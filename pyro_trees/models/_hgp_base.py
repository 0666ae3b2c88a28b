"""The plumbing under :class:`~pyro_trees.models.HeteroscedasticGP`: input checks,
parameter-store names, the binding to the guide built from the model, and the lazy start
(which calls the model's ``init_from_data``)."""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name

from pyro_trees._param_store import adopt_param_store


class _HGPBase(PyroModule):
    """Private methods of :class:`~pyro_trees.models.HeteroscedasticGP`; the subclass sets
    ``in_features``, ``kernel``, ``num_leaves``, ``_started`` and the ``_guide`` slot."""

    # -- checks ------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        if not torch.is_tensor(x) or x.dim() != 2 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (N, {self.in_features}); got {shape}")
        if x.shape[0] < 1:
            raise ValueError("x has no rows")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or infinite values")
        if y is not None:
            if not torch.is_tensor(y) or y.dim() != 1 or y.shape[0] != x.shape[0]:
                shape = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
                raise ValueError(f"y must be a tensor of shape ({x.shape[0]},); got {shape}")
            if not bool(torch.isfinite(y).all()):
                raise ValueError("y contains NaN or infinite values")

    def _check_logits(self, x: torch.Tensor, leaf_logits: torch.Tensor) -> torch.Tensor:
        if leaf_logits.shape != (x.shape[0], self.num_leaves):
            raise ValueError(
                f"leaf_logits must have shape ({x.shape[0]}, {self.num_leaves}); "
                f"got {tuple(leaf_logits.shape)}"
            )
        return leaf_logits - leaf_logits.logsumexp(-1, keepdim=True)

    # -- names, the guide and the lazy start --------------------------------------------
    def _fullname(self, name: str) -> str:
        prefix = self.__dict__["_pyro_name"]
        return f"{prefix}.{name}" if prefix else name

    def _kernel(self):
        """The kernel, registered as ``"<name>.kernel"`` with its values from the param store."""
        return pyro.module(self._fullname("kernel"), self.kernel, update_module_params=True)

    def _bind(self, guide) -> None:
        if self.__dict__["_guide"] is not None and self.__dict__["_guide"] is not guide:
            raise ValueError(
                "this HeteroscedasticGP already has a guide; build one guide per model"
            )
        self.__dict__["_guide"] = guide

    def _adopt(self, guide) -> None:
        """Model, kernel and guide use the tensors the param store holds under their names
        (a loaded store), registering nothing new."""
        adopt_param_store(self)
        adopt_param_store(guide)
        store = pyro.get_param_store()
        prefix = self._fullname("kernel")
        for name, own in list(self.kernel.named_parameters()):
            stored = store._params.get(param_with_module_name(prefix, name))
            if stored is not None and stored is not own and stored.shape == own.shape:
                owner, _, leaf = name.rpartition(".")
                self.kernel.get_submodule(owner)._parameters[leaf] = stored

    def _require_guide(self):
        guide = self.__dict__["_guide"]
        if guide is None:
            raise ValueError(
                "the exact HeteroscedasticGP conditioned on y scores the collapsed bound at "
                "its guide's routing: build the guide as HeteroscedasticGPGuide(model), or "
                "train with CollapsedELBO"
            )
        return guide

    def _maybe_start(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """:meth:`init_from_data` at the first call on data, when the model has a guide and
        the param store does not hold its parameters yet (trained or loaded ones stay)."""
        guide = self.__dict__["_guide"]
        if guide is None or self._started:
            return
        self._started = True
        if self._fullname("leaf_log_scale") in pyro.get_param_store():
            return
        self.to(device=x.device, dtype=x.dtype)
        guide.to(device=x.device, dtype=x.dtype)
        with poutine.block():
            self.init_from_data(x, y, guide)
