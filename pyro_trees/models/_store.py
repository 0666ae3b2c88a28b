"""What the TreeVI models and guides do at the start of every call: follow the data's
dtype and device, take up parameters already in Pyro's store, and tell ``Predictive``
apart from inference."""

from __future__ import annotations

import pyro
import torch
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name
from pyro.poutine.mask_messenger import MaskMessenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import nn


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _store_names(module: nn.Module, prefix: str | None = None):
    """``(store name, parameter)`` of every ``nn.Parameter`` of ``module`` under the names
    ``PyroModule`` registers them with: its own as ``<name>.<attr>``, those of a plain
    ``nn.Module`` attribute as ``pyro.module`` does, ``<name>.<attr>$$$<path>``.
    ``PyroParam`` attributes are skipped (``PyroModule`` reads them from the store)."""
    if prefix is None:
        prefix = module._pyro_name
    for attr, p in module._parameters.items():
        if p is not None and not attr.endswith("_unconstrained"):
            yield _join(prefix, attr), p
    for attr, child in module._modules.items():
        if child is None:
            continue
        if isinstance(child, PyroModule):
            yield from _store_names(child, _join(prefix, attr))
        else:
            owner = _join(prefix, attr)
            for path, p in child.named_parameters():
                yield param_with_module_name(owner, path), p


def prepare(module: PyroModule, x) -> None:
    """Run at the start of ``forward``, before any parameter is read.

    * **dtype and device follow the data**: a floating ``x`` of another dtype or device
      moves the module's floating parameters and buffers to it (in place, so that the
      parameter store and an optimiser keep the same tensors).
    * **the store wins**: a parameter the store already holds under this module's name
      (e.g. after ``pyro.get_param_store().load(...)`` and fresh objects with the same
      ``name``) is copied into the module, and the store then holds the module's tensor,
      as for a ``PyroParam``. ``nn.Parameter`` attributes and plain ``nn.Module``
      submodules of a ``PyroModule`` otherwise ignore the stored value.

    :raises ValueError: if the store holds a parameter of this name with another shape
        (two different instances under one ``name``).
    """
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        ref = next(
            (t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()),
            None,
        )
        if ref is not None and (ref.dtype != x.dtype or ref.device != x.device):
            module.to(device=x.device, dtype=x.dtype)
    store = pyro.get_param_store()
    if not len(store._params):
        return
    for name, param in _store_names(module):
        stored = store._params.get(name)
        if stored is None or stored is param:
            continue
        if stored.shape != param.shape:
            raise ValueError(
                f"the parameter store holds {name!r} of shape {tuple(stored.shape)}, but this "
                f"{type(module).__name__} has shape {tuple(param.shape)}: give it another "
                f"name= or clear the store (pyro.clear_param_store())"
            )
        with torch.no_grad():
            param.copy_(stored)
        store._param_to_name.pop(stored, None)
        store._params[name] = param
        store._param_to_name[param] = name


def predicting() -> bool:
    """Whether every density is masked out (``poutine.mask(mask=False)``), as
    ``pyro.infer.Predictive`` runs the model: an observation then informs nothing, and
    the models draw their observed sites from the likelihood instead, so that
    ``Predictive`` returns posterior predictive draws."""
    return any(isinstance(m, MaskMessenger) and m.mask is False for m in _PYRO_STACK)
