"""Lazy first-call initialisation of ``PyroModule`` s against Pyro's global param store.

A model or guide that initialises itself from the data at its first call must not
overwrite parameters that are already in the store under its names (loaded with
``pyro.get_param_store().load``, or trained by an earlier instance of the same name).
:func:`adopt_param_store` makes such a module use the stored tensors instead, and
refuses stored tensors of another shape with a message that names the fix.
"""

from __future__ import annotations

import pyro
import torch
from pyro.nn import PyroModule

__all__ = ["adopt_param_store", "follow_data", "store_name"]


def store_name(module: PyroModule, attr: str) -> str:
    """The param-store name of ``module``'s attribute ``attr`` (prefix included)."""
    prefix = module.__dict__["_pyro_name"]
    return f"{prefix}.{attr}" if prefix else attr


def _store_entries(module: PyroModule):
    """``{store name: (owner, key in owner._parameters)}`` for every parameter."""
    out = {}
    for sub in module.modules():
        if not isinstance(sub, PyroModule):
            continue
        for key in sub._parameters:
            attr = key
            if key.endswith("_unconstrained") and key[: -len("_unconstrained")] in sub._pyro_params:
                attr = key[: -len("_unconstrained")]
            out[store_name(sub, attr)] = (sub, key)
    return out


def adopt_param_store(module: PyroModule, *, buffers: dict | None = None) -> bool:
    """Make ``module`` use the tensors the param store already holds under its names.

    :param module: a root ``PyroModule`` (its ``name`` prefix is read now).
    :param buffers: ``{store name: (owner, buffer name)}`` of buffers mirrored in the
        store; stored values are copied into them.
    :returns: whether the store held any of the module's parameters.
    :raises ValueError: if a stored tensor's shape differs from the module's.
    """
    store = pyro.get_param_store()
    entries = _store_entries(module)
    found = [name for name in entries if name in store]
    if not found:
        return False
    for name in found:
        owner, key = entries[name]
        stored = store._params[name]
        own = owner._parameters[key]
        if stored.shape != own.shape:
            raise ValueError(
                f"the param store holds {name!r} of shape {tuple(stored.shape)}, but this "
                f"{type(module).__name__} needs {tuple(own.shape)}: another model or guide of "
                f"the same name was trained in this store. Give each instance its own "
                f"name=..., or call pyro.clear_param_store() first."
            )
        if not isinstance(stored, torch.nn.Parameter):
            stored = torch.nn.Parameter(stored.detach())
            store._params[name] = stored
            store._param_to_name[stored] = name
        owner._parameters[key] = stored
    for name, (owner, key) in (buffers or {}).items():
        if name in store:
            value = store[name].detach()
            if value.shape != getattr(owner, key).shape:
                raise ValueError(
                    f"the param store holds {name!r} of shape {tuple(value.shape)}, but "
                    f"this {type(module).__name__} needs {tuple(getattr(owner, key).shape)}"
                )
            setattr(owner, key, value.clone())
    return True


def follow_data(module: torch.nn.Module, x: torch.Tensor) -> None:
    """Move ``module`` to ``x``'s floating dtype and device if it is elsewhere."""
    for p in list(module.parameters()) + list(module.buffers()):
        if p.is_floating_point() and (p.dtype != x.dtype or p.device != x.device):
            module.to(dtype=x.dtype, device=x.device)
            return
