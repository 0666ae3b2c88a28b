"""What models and guides do at their first call on data, against Pyro's global param store.

A model or guide that initialises itself from the data at its first call must not
overwrite parameters that are already in the store under its names (loaded with
``pyro.get_param_store().load``, or trained by an earlier instance of the same name).
:func:`adopt_param_store` makes such a module use the stored tensors instead, and
refuses stored tensors of another shape with a message that names the fix.
"""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule
from pyro.params.param_store import param_with_module_name
from pyro.poutine.mask_messenger import MaskMessenger
from pyro.poutine.runtime import _PYRO_STACK
from pyro.poutine.subsample_messenger import _Subsample
from pyro.poutine.trace_messenger import TraceMessenger
from torch import nn

__all__ = [
    "adopt_param_store",
    "follow_data",
    "predicting",
    "prepare",
    "read_params",
    "recorded_subsample",
    "shared_plate",
    "store_name",
]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def store_name(module: PyroModule, attr: str) -> str:
    """The param-store name of ``module``'s attribute ``attr`` (prefix included)."""
    return _join(module.__dict__["_pyro_name"], attr)


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


def follow_data(module: torch.nn.Module, x) -> None:
    """Move ``module`` to ``x``'s floating dtype and device if it is elsewhere (in place,
    so that the parameter store and an optimiser keep the same tensors); a non-floating
    ``x`` (indices, ``None``) moves nothing."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return
    for p in list(module.parameters()) + list(module.buffers()):
        if p.is_floating_point() and (p.dtype != x.dtype or p.device != x.device):
            module.to(dtype=x.dtype, device=x.device)
            return


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
    follow_data(module, x)
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


def read_params(module: PyroModule) -> None:
    """Read every parameter of ``module`` through Pyro's store, as its ``forward`` does:
    under a trace (``SVI``'s step) each becomes a ``param`` site, so that ``SVI`` and
    :func:`~pyro_trees.infer.fit` train it. For a loss that then scores the module's
    tensors as plain code, outside ``forward`` (a compiled program reads no store)."""
    with module._pyro_context:
        _read(module)


def _read(module: PyroModule) -> None:
    for key in module._parameters:
        attr = key
        if key.endswith("_unconstrained") and key[: -len("_unconstrained")] in module._pyro_params:
            attr = key[: -len("_unconstrained")]
        getattr(module, attr)  # a pyro.param statement
    for attr in list(module._modules):
        child = getattr(module, attr)  # a plain nn.Module: a pyro.module statement
        if isinstance(child, PyroModule):
            _read(child)


def predicting() -> bool:
    """Whether every density is masked out (``poutine.mask(mask=False)``), as
    ``pyro.infer.Predictive`` runs the model: an observation then informs nothing, and
    the models draw their observed sites from the likelihood instead, so that
    ``Predictive`` returns posterior predictive draws."""
    return any(isinstance(m, MaskMessenger) and m.mask is False for m in _PYRO_STACK)


def recorded_subsample(name: str):
    """The indices of a plate ``name`` that an enclosing trace already recorded (as
    :class:`~pyro.infer.autoguide.AutoGuideList` does for every plate of its model
    before it runs its parts), or ``None``."""
    for messenger in _PYRO_STACK:
        if isinstance(messenger, TraceMessenger):
            site = messenger.trace.nodes.get(name)
            if site is not None and isinstance(site.get("fn"), _Subsample):
                return site["value"]
    return None


def shared_plate(name: str, size: int, subsample_size=None, subsample=None, dim: int = -1):
    """``pyro.plate(name, size, ...)`` for a guide that may run inside an ``AutoGuideList``.

    Inside a trace that already recorded the plate, the plate runs over the recorded
    indices and is not recorded a second time, which Pyro would refuse. When the recorded
    indices have another length than this call asks for (an ``AutoGuideList`` set up on
    minibatches, then asked to predict on all points), the call's own request wins.
    """
    recorded = recorded_subsample(name)
    if recorded is None:
        return pyro.plate(name, size, subsample_size=subsample_size, subsample=subsample, dim=dim)
    if subsample is not None:
        if recorded.shape[0] != subsample.shape[0]:
            recorded = subsample
    elif subsample_size is None and recorded.shape[0] != size:
        recorded = torch.arange(size, device=recorded.device)
    elif subsample_size is not None and recorded.shape[0] != subsample_size:
        recorded = torch.randperm(size, device=recorded.device)[:subsample_size]
    with poutine.block(hide=[name]):
        return pyro.plate(name, size, subsample=recorded, dim=dim)
