"""Several started VaRT guides as one set of parameters with a leading dimension of fits,
so that one training step draws and scores all of them (the pooled fits of the VaRT
estimators, trained as one program).

A step's cost at a few hundred rows is set by the number of operations it dispatches,
not by their arithmetic: ``F`` guides stacked take about the operations of one, so ``F``
fits trained together take about one fit's time where the rows are few
(``benchmarks/results/stacked_fits.md``).
"""

from __future__ import annotations

import pyro
import torch
from torch.distributions import transform_to

from pyro_trees.guides.vart import RelaxedSplitGuide

__all__ = ["StackedGuides"]


class StackedGuides(torch.nn.Module):
    r"""``F`` guides of one VaRT family and shape (the same model, started each in its own
    way) held as one: each parameter of ``_PARAMS`` becomes one trainable tensor
    ``(F,) + shape`` on the guides' unconstrained scale, whose slice ``j`` starts as guide
    ``j``'s value. :meth:`params`, :meth:`noise` and :meth:`relaxed` are the guides' with
    that leading dimension, so a loss that reads a guide through them (as
    :class:`~pyro_trees.infer.VaRTForestELBO` does) scores the ``F`` fits at once; the
    fits share no parameter, so the gradient of the sum of their ELBOs with respect to
    fit ``j``'s slice is that of fit ``j``'s own ELBO. :meth:`unstack` writes the current
    values back into the guides, which then predict, pickle and calibrate as ever.

    The guides are kept as a plain list (not submodules): an optimiser over
    ``parameters()`` trains the stack only. ``temperature`` is the stack's own (set it
    with :class:`~pyro_trees.guides.TemperatureSchedule`'s callback as for one guide).

    **Fits that have stopped.** :meth:`keep` names the fits still training: from then
    on :meth:`params` returns theirs only (``(F',) + shape``), so a step computes
    ``F'`` fits, and the others' slices receive zero gradients (an optimiser may still
    move them by its momentum: keep their states elsewhere, as
    :class:`~pyro_trees.infer.StackedEarlyStopping` does). :meth:`select` takes the
    same fits from a tensor of all of them (the row weights).

    Guides keep their parameters themselves only with Pyro's module-local parameters
    (``pyro.settings.context(module_local_params=True)``, as the estimators train):
    outside it guides of the same name share Pyro's global store, and a stack could
    neither tell them apart nor write them back, so it refuses to be built there.

    :param guides: the started guides (:class:`~pyro_trees.guides.VaRTForestGuide` or
        :class:`~pyro_trees.guides.VaRTGuide`), of one class, one model shape, without
        missing inputs, their parameters already created (after
        :meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.init_splits_from_data` or a
        first call).
    :raises ValueError: for no guide, guides of different classes or shapes, a guide
        of a model with missing inputs, or outside module-local parameters.

    .. rubric:: Examples

    >>> import pyro
    >>> import torch
    >>> from pyro_trees.guides import StackedGuides, VaRTForestGuide
    >>> from pyro_trees.models import VaRTForest
    >>> model = VaRTForest(2, num_trees=4, depth=2)
    >>> with pyro.settings.context(module_local_params=True):
    ...     guides = [VaRTForestGuide(model, init="random") for _ in range(3)]
    ...     stack = StackedGuides(guides)
    ...     shape = stack.params(torch.randn(5, 2))["beta_loc"].shape
    >>> shape  # (F, K, 2**D - 1, L + 1)
    torch.Size([3, 4, 3, 3])
    >>> stack.unstack()[0] is guides[0]
    True
    """

    def __init__(self, guides):
        super().__init__()
        guides = list(guides)
        if not pyro.settings.get("module_local_params"):
            raise ValueError(
                "StackedGuides needs Pyro's module-local parameters: build and train it "
                "inside pyro.settings.context(module_local_params=True)"
            )
        if not guides:
            raise ValueError("StackedGuides needs at least one guide")
        family = type(guides[0])
        if not issubclass(family, RelaxedSplitGuide):
            raise ValueError(f"StackedGuides stacks VaRT guides, got {family.__name__}")
        for g in guides:
            if type(g) is not family:
                raise ValueError(
                    f"StackedGuides needs guides of one class, got {family.__name__} "
                    f"and {type(g).__name__}"
                )
            if getattr(g, "missing", False):
                raise ValueError(
                    "StackedGuides does not stack guides of models with missing inputs"
                )
        self.guides = guides
        self.running: list[int] | None = None  # None: every fit
        self._index: torch.Tensor | None = None
        self.family = family
        self.temperature = float(guides[0].temperature)
        self._constraints = {}
        for name in family._PARAMS:
            values = [self._unconstrained(g, name) for g in guides]
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"the guides' {name!r} differ in shape: {sorted(shapes)}")
            self._constraints[name] = guides[0]._pyro_params[name][0]
            self.register_parameter(name, torch.nn.Parameter(torch.stack(values).detach().clone()))

    @staticmethod
    def _unconstrained(guide, name: str) -> torch.Tensor:
        return getattr(guide, name + "_unconstrained").detach()

    def __len__(self) -> int:
        return len(self.guides)

    @property
    def missing(self) -> bool:
        """``False``: stacked guides have no missing-input parameters."""
        return False

    def keep(self, running) -> None:
        """Compute only the fits ``running`` (indices; ``None``: all) from now on."""
        if running is not None:
            given = [int(j) for j in running]
            running = sorted(set(given))
            num = len(self.guides)
            if not running or running[0] < 0 or running[-1] >= num or len(running) != len(given):
                raise ValueError(
                    f"running must name some of the {num} fits, each once, got {given}"
                )
            if len(running) == num:
                running = None
        self.running = running
        self._index = None

    def select(self, values: torch.Tensor) -> torch.Tensor:
        """The running fits' entries of ``values`` ``(F, ...)`` (all of it when every
        fit runs)."""
        if self.running is None:
            return values
        return values[self.running_index(values.device)]

    def running_index(self, device) -> torch.Tensor:
        """The indices of the running fits (:meth:`keep`), ``(R,)`` int64 on ``device``
        (kept between calls; every fit's while all run)."""
        if self._index is None or self._index.device != torch.device(device):
            running = range(len(self.guides)) if self.running is None else self.running
            self._index = torch.tensor(list(running), dtype=torch.long, device=device)
        return self._index

    def params(self, x: torch.Tensor) -> dict:
        """Every constrained parameter of every running fit (:meth:`keep`; by default
        all), ``(F,) + `` the guide's shape, in ``x``'s dtype and device, as the guides'
        own ``params`` returns them."""
        opts = {"dtype": x.dtype, "device": x.device}
        q = {}
        for name in self.family._PARAMS:
            value = self.select(getattr(self, name))
            q[name] = transform_to(self._constraints[name])(value).to(**opts)
        return self.guides[0]._read_params(q)

    def noise(self, params: dict) -> dict:
        """The random draws behind one draw of every fit (the guides' ``noise``, with the
        leading dimension of fits)."""
        return self.family.noise(self, params)

    relaxed = staticmethod(RelaxedSplitGuide.relaxed)

    @torch.no_grad()
    def unstack(self) -> list:
        """Write each fit's current values into its guide; returns the guides."""
        for name in self.family._PARAMS:
            values = getattr(self, name)
            for j, g in enumerate(self.guides):
                self._unconstrained(g, name).copy_(values[j])
        return self.guides

    def extra_repr(self) -> str:
        """Fits and the guides' class, for ``repr``."""
        return f"num_fits={len(self.guides)}, family={self.family.__name__}"
