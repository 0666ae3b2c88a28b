"""Seeded randomness that leaves the caller's global random state alone.

scikit-learn estimators take ``random_state`` and never reseed the process-wide
generators; :func:`pyro.set_rng_seed` reseeds Python's ``random``, NumPy's legacy
global generator and torch's. :func:`local_seed` seeds all three as
``pyro.set_rng_seed`` does for the duration of a ``with`` block and puts back what was
there before on exit.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from pyro_trees.infer import exclusive

__all__ = ["local_seed"]

MEMBER_SEED = 7919  # VaRT ``num_fits``: offset between the seeds of successive fits


def _cuda_index(device) -> int | None:
    """The index of ``device`` when it is a CUDA device, else ``None``."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def local_seed(seed: int | None, device=None):
    """Seed the global random streams inside the block and restore them after it.

    With an integer ``seed``, saves the states of Python's ``random``, NumPy's global
    generator, torch's CPU generator and, when ``device`` is a CUDA device, that
    device's generator; seeds them as :func:`pyro.set_rng_seed` does (``random.seed``,
    ``numpy.random.seed`` of ``seed mod 2**32``, and the torch generators with
    ``seed``), so draws inside the block are those after ``pyro.set_rng_seed(seed)``;
    and restores the saved states on exit, also on an exception. Other CUDA devices
    are neither seeded nor touched.

    With ``seed=None`` the block draws from the global streams as usual (and advances
    them), so repeated unseeded runs differ.

    Either way the block holds :func:`~pyro_trees.infer.exclusive`: the streams (and
    Pyro's handler stack, which the seeded work uses) are process-wide, so seeded
    blocks in several threads run one at a time and draw what sequential calls draw.

    :param seed: an integer seed or ``None``.
    :param device: the torch device the block computes on (default CPU).
    """
    with exclusive():
        if seed is None:
            yield
        else:
            with _seeded(int(seed), device):
                yield


@contextlib.contextmanager
def _seeded(seed: int, device):
    index = _cuda_index(device)
    devices = [] if index is None else [index]
    py_state = random.getstate()
    np_state = np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            torch.default_generator.manual_seed(seed)
            if index is not None:
                with torch.cuda.device(index):
                    torch.cuda.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
