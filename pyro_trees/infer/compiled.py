"""Compiled losses: a training step's loss as one tensor program under ``torch.compile``.

Pyro's ``Trace_ELBO`` runs a poutine stack, records every sample site and reads each
site's value back to the host; under ``torch.compile`` it breaks into many small graphs.
A loss of ours whose estimator is plain tensor code (:class:`~pyro_trees.infer.VaRTELBO`,
:class:`~pyro_trees.infer.VaRTForestELBO`, :class:`~pyro_trees.infer.TreeVIELBO`,
:class:`~pyro_trees.infer.DGPELBO`, :class:`~pyro_trees.infer.BayesianHMEELBO`; the
HME's and the heteroscedastic GP's losses need no draws) splits each step in two:

1. **the draws**, eager and cheap: the guide's constrained parameters, the standard
   random draws behind its reparameterised sample (uniforms, normals) and the
   minibatch's rows, taken from torch's global generator in the order the eager loss
   takes them; and
2. **the program**: everything else (the sites from the draws, the prior and guide log
   densities, the likelihood of the minibatch), a pure function of tensors that
   :class:`CompiledLoss` compiles once per process (see below).

So the compiled loss equals the eager one on the same draws (tested), a seeded fit
draws the same random numbers either way, and no random generator lives inside the
compiled program. Gradients flow through the program (AOTAutograd) into the eager
parameter transforms.

:class:`CompiledLoss` keeps one compiled function per program, backend and mode for the
whole process, so that a grid search or cross-validation compiles once: the first batch
shape compiles a program for that shape, a second shape (another fold's rows, a smaller
full batch) one program whose row count is symbolic, which every later shape reuses
(``torch.compile``'s automatic dynamic shapes). When compilation fails (no C++ compiler
for the CPU backend, an operation the compiler does not support), it warns once, says
why, and runs the program eagerly from then on.

:func:`should_compile` is the rule by which the estimators choose: compile where the
saving outweighs the compilation (see its docstring).
"""

from __future__ import annotations

import operator
import os
import sys
import warnings
import weakref
from collections.abc import Callable

import pyro
import torch

from pyro_trees.guides.stacked import StackedGuides

__all__ = ["CompiledLoss", "CompilesLoss", "CompilesVaRTLoss", "ScoresRows", "should_compile"]

#: the packages whose frames a warning skips: this one (two levels above this file),
#: Pyro's and torch's
_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep
    for path in (os.path.dirname(__file__), pyro.__file__, torch.__file__)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn``, called by the caller of this function, that
    points at the first frame outside pyro_trees, Pyro and torch: the user's line, whether
    a loss is called directly or through ``SVI`` or ``fit``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


#: compiled functions shared by every CompiledLoss of the process: (program, backend, mode)
_COMPILED: dict = {}

_NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
_FUNCTION_INSTANCE = ".*autograd.function.Function'> should not be instantiated"

#: gradient steps from which a CUDA fit compiles its loss
CUDA_MIN_STEPS = 1000

#: the most programs a CompiledLoss compiles for its program (shapes, depths, dtypes...)
RECOMPILE_LIMIT = 64


def xy_call(args: tuple, kwargs: dict, options: tuple = ()):
    """``(x, y, unexpected)`` of a call ``model(x, y, **options)``, with ``y`` or both
    as keywords: ``x`` and ``y`` are ``None`` for any other call, ``unexpected`` the
    keywords it has beyond ``x``, ``y`` and ``options``."""
    unexpected = set(kwargs) - {"x", "y", *options}
    if len(args) == 2 and not {"x", "y"} & set(kwargs):
        return args[0], args[1], unexpected
    if len(args) == 1 and "x" not in kwargs:
        return args[0], kwargs.get("y"), unexpected
    if not args and "x" in kwargs:
        return kwargs["x"], kwargs.get("y"), unexpected
    return None, None, unexpected or {"positional arguments"}


def plate_subsample(n: int, subsample_size, device=None) -> torch.Tensor | None:
    """The rows a ``pyro.plate`` over ``n`` rows draws for ``subsample_size``, as it draws
    them (``torch.randperm(n)[:B]`` from torch's generator), or ``None`` for all rows."""
    if subsample_size is None or int(subsample_size) >= n:
        return None
    return torch.randperm(n, device=device)[: int(subsample_size)]


def check_subsample_size(subsample_size, n: int) -> None:
    """Raise :class:`ValueError` unless ``subsample_size`` is ``None`` or an integer in
    ``[1, n]``, as a Pyro plate over ``n`` rows requires."""
    if subsample_size is None:
        return
    if isinstance(subsample_size, bool) or not hasattr(subsample_size, "__index__"):
        raise ValueError(f"subsample_size must be an integer in [1, {n}], got {subsample_size!r}")
    if not 1 <= operator.index(subsample_size) <= n:
        raise ValueError(
            f"subsample_size must lie in [1, {n}] (the rows of x), got {subsample_size!r}"
        )


def should_compile(device, num_steps: int, batch_rows: int | None = None) -> bool:
    """Whether an estimator's fit compiles its loss by default.

    On CUDA a VaRT step is bound by kernel launches, not arithmetic: on an H100 an
    eager step took 10-27 ms whatever the batch, the same loss compiled 1-2 ms, after
    3.5-13.5 s of compilation (issue 38's measurements). Compiling pays after about
    350-1,350 steps, and the program is reused by every later fit in the process,
    so fits of at least ``CUDA_MIN_STEPS`` steps compile (every VaRT estimator at its
    defaults); shorter ones stay eager. On CPU the saving is smaller (about a third of
    a depth-5 step of 2,048 rows; ``benchmarks/step_cost.py``) and compiling takes
    20-60 s per shape, more than most CPU fits last: CPU fits stay eager (pass
    ``compile=True`` to a loss to compile anyway). Provisional on CUDA until
    ``step_cost`` runs on a GPU.

    :param device: the fit's device (``torch.device``, a string or ``None``: the CPU).
    :param int num_steps: the fit's gradient steps.
    :param batch_rows: rows per step (not used by the rule at present; recorded so
        that a rule measured on a GPU can use it without changing the callers).
    """
    dev = torch.device("cpu" if device is None else device)
    return dev.type == "cuda" and int(num_steps) >= CUDA_MIN_STEPS


class CompiledLoss:
    """``program`` (a pure function of tensors and the model and guide objects it reads
    constants from) compiled with ``torch.compile``, shared across instances, with an
    eager fallback.

    A program is recompiled for each new combination of what it specialises on (shapes
    that are not yet symbolic, the number of layers or jumps, the dtype, the model and
    guide objects it reads), up to ``recompile_limit`` programs in all (torch's own
    default is 8, after which it would run the function eagerly with only a log line);
    past the limit the loss warns once, says so, and runs eagerly.

    :param program: the loss's tensor program.
    :param compile: ``True`` (the default backend, ``"inductor"``) or the name of a
        ``torch.compile`` backend (``"aot_eager"`` traces and differentiates without
        generating code: fast to build, used by the tests).
    :param mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).
    :param int recompile_limit: the most programs compiled for ``program``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import CompiledLoss
    >>> def sum_of_squares(x):
    ...     return (x * x).sum()
    >>> loss = CompiledLoss(sum_of_squares, compile="eager")  # dynamo's capture only
    >>> float(loss(torch.ones(3))), loss.failed
    (3.0, None)
    """

    def __init__(
        self,
        program: Callable,
        compile: bool | str = True,
        mode: str | None = None,
        recompile_limit: int = RECOMPILE_LIMIT,
    ):
        self.program = program
        self.backend = "inductor" if compile is True else str(compile)
        self.mode = mode
        self.recompile_limit = int(recompile_limit)
        self.failed: str | None = None

    def _compiled(self) -> Callable:
        key = (self.program, self.backend, self.mode)
        fn = _COMPILED.get(key)
        if fn is None:
            fn = torch.compile(self.program, backend=self.backend, mode=self.mode, dynamic=None)
            _COMPILED[key] = fn
        return fn

    def __call__(self, *args):
        """The program's value at ``args``: compiled, or eager after a failure."""
        if self.failed is None:
            validate = torch.distributions.Distribution._validate_args
            try:
                with warnings.catch_warnings():
                    # the compiler reads .grad of every input tensor while it traces; the
                    # guide's constrained parameters are not leaves, so torch warns
                    warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD, category=UserWarning)
                    # dynamo instantiates a custom autograd Function (gp's closed-form
                    # evidence gradient) while it traces it, and torch warns about that
                    warnings.filterwarnings(
                        "ignore", message=_FUNCTION_INSTANCE, category=DeprecationWarning
                    )
                    # torch's compiler calls its own deprecated helpers while it traces
                    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.")
                    limits = {
                        "recompile_limit": self.recompile_limit,
                        "fail_on_recompile_limit_hit": True,  # an error, caught below
                    }
                    with torch._dynamo.config.patch(**limits):
                        return self._compiled()(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back
                self.failed = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                warnings.warn(
                    f"torch.compile could not compile {self.program.__qualname__} "
                    f"({self.failed}); training runs eagerly",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
            finally:
                # torch.compile's first use turns off the validation of every
                # torch.distributions object in the process (Pyro's validation
                # included); the process keeps the setting it had
                torch.distributions.Distribution.set_default_validate_args(validate)
        return self.program(*args)

    def __getstate__(self):
        return {
            "program": self.program,
            "backend": self.backend,
            "mode": self.mode,
            "recompile_limit": self.recompile_limit,
        }

    def __setstate__(self, state):
        limit = state.get("recompile_limit", RECOMPILE_LIMIT)
        self.__init__(state["program"], state["backend"], state["mode"], limit)


class CompilesLoss:
    """What the compiled losses of the package share: ``compile`` and ``mode``, the
    :class:`CompiledLoss` of the class's ``_program`` (``None`` when eager), and a check
    that the inputs are complete (a program runs on complete inputs; missing ones take
    the eager path), cached for the tensor the fit passes at every step.

    :param compile: ``False`` (eager), ``True`` or a ``torch.compile`` backend name.
    :param mode: ``torch.compile``'s ``mode``.
    """

    _program: Callable = None

    def __init__(self, *args, compile: bool | str = False, mode: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.compile, self.mode = compile, mode
        self._compiled = CompiledLoss(type(self)._program, compile, mode) if compile else None
        self._checked = {}  # name -> (weak references, versions, the check's result)

    def _once(self, name: str, tensors: tuple, check: Callable, owner=None):
        """``check()``'s result, computed once per ``tensors`` (the same objects at the
        same versions) and ``owner`` (the model whose rules the check applies, if any)
        under ``name``: a fit passes the same tensors at every step, and a check of their
        values reads back from the device."""
        checked = self._checked if isinstance(self._checked, dict) else {}
        self._checked = checked
        versions = tuple(t._version for t in tensors)
        refs = tensors if owner is None else (*tensors, owner)
        hit = checked.get(name)
        if hit is not None and hit[1] == versions:
            if len(hit[0]) == len(refs) and all(
                ref() is t for ref, t in zip(hit[0], refs, strict=True)
            ):
                return hit[2]
        value = check()
        checked[name] = (tuple(weakref.ref(t) for t in refs), versions, value)
        return value

    #: why the latest call trained with Pyro's loss instead of the program (else ``None``)
    fallback: str | None = None

    def _fall_back(self, replacement: str, why: str) -> None:
        """Record that a call trains with ``replacement`` because ``why``, warning once per
        reason (at the user's line)."""
        seen = self.__dict__.setdefault("_fallbacks", set())
        if why not in seen:
            seen.add(why)
            warnings.warn(
                f"{type(self).__name__} trains with {replacement} instead: {why}",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        self.fallback = why

    def _complete(self, x: torch.Tensor) -> bool:
        """Whether ``x`` has no missing value (checked once per tensor and version)."""
        return self._once("complete", (x,), lambda: not bool(torch.isnan(x).any()))

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_checked"] = {}
        state.pop("_fallbacks", None)
        state.pop("fallback", None)
        return state


class ScoresRows:
    """``rows_loss`` for a loss whose eager ELBO function ``_elbo`` scores given rows
    (``subsample``, ``num_rows``) after its ``_check``: the VaRT losses and the HME's."""

    def rows_loss(self, model, guide, x, y, subsample, num_rows) -> torch.Tensor:
        """Negative ELBO estimate, eager, of the rows ``subsample`` of ``x``, their
        likelihood standing for ``num_rows`` rows: the step of a data-parallel fit
        whose rank scores its own share of the rows (checked as
        :meth:`differentiable_loss` checks).

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N,)``.
        :param subsample: indices of the batch's rows, a non-empty integer tensor
            ``(B,)``.
        :param num_rows: the rows the batch stands for (every rank's), an integer at
            least ``B``.
        :returns: a scalar; for a :class:`~pyro_trees.guides.StackedGuides`, the fits'
            losses ``(F,)`` (of the running fits).
        :raises ValueError: for another ``subsample`` or ``num_rows``, and for what
            :meth:`differentiable_loss` refuses.
        """
        name = f"{type(self).__name__}.rows_loss"
        if (
            not isinstance(subsample, torch.Tensor)
            or subsample.dim() != 1
            or subsample.numel() == 0
            or subsample.is_floating_point()
            or subsample.is_complex()
            or subsample.dtype == torch.bool
        ):
            got = tuple(subsample.shape) if isinstance(subsample, torch.Tensor) else subsample
            raise ValueError(
                f"{name}: subsample must be a non-empty 1-D integer tensor of row indices "
                f"(a boolean mask: mask.nonzero().flatten()); got {got!r}"
            )
        rows = float(num_rows)
        if isinstance(num_rows, bool) or not rows.is_integer() or rows < subsample.shape[0]:
            raise ValueError(
                f"{name}: num_rows must be an integer of at least the batch's "
                f"{subsample.shape[0]} rows; got {num_rows!r}"
            )
        self._check(model, guide, x, y)
        return -self._elbo(model, guide, x, y, subsample=subsample, num_rows=num_rows)


class CompilesVaRTLoss(ScoresRows, CompilesLoss):
    """What the VaRT losses (one tree, a forest) share: the checks of
    ``differentiable_loss`` and the step's draws. A loss sets ``_model_cls`` (the model
    class it scores, named ``_model_name`` in errors), ``_elbo`` (the eager ELBO
    function) and ``_program`` (its tensor program ``(model, guide, xb, yb, q, noise,
    temperature, num_rows) -> ELBO``: the batch, its draws and the rows it stands for,
    ``None`` for a full batch).

    :param compile: ``False`` (eager), ``True`` or a ``torch.compile`` backend name.
    :param mode: ``torch.compile``'s ``mode``.
    """

    _model_cls: type = object
    _model_name: str = ""
    _elbo: Callable = None

    def _compiled_elbo(self, model, guide, x, y, subsample_size):
        """The ELBO through the compiled program, or ``None`` where it does not apply
        (not compiling, missing inputs, hard splits at temperature 0)."""
        if self._compiled is None or getattr(guide, "missing", False):
            return None
        if not guide.temperature > 0 or not self._complete(x):
            return None
        q = guide.params(x)
        noise = guide.noise(q)
        n, num_rows = x.shape[0], None
        # the minibatch is gathered here, so that one program serves every data size
        subsample = plate_subsample(n, subsample_size, x.device)
        if subsample is not None:
            x, y = x[subsample], y[subsample]
            num_rows = torch.tensor(float(n), dtype=x.dtype, device=x.device)
        temperature = torch.tensor(float(guide.temperature), dtype=x.dtype, device=x.device)
        return self._compiled(model, guide, x, y, q, noise, temperature, num_rows)

    def _stacked_loss(self, model, guide, x, y, subsample_size, weight) -> torch.Tensor:
        """The summed loss of a stack of guides (or of row weights); the fits' losses in
        ``fit_losses``, ``(F,)``, NaN for the fits the stack no longer computes."""
        stacked = isinstance(guide, StackedGuides)
        if stacked and weight is not None:
            weight = guide.select(weight)
        value = type(self)._elbo(model, guide, x, y, subsample_size, weight=weight)
        losses = -value.detach() if value.dim() else None
        if stacked and guide.running is not None:
            full = losses.new_full((len(guide),), float("nan"))
            losses = full.index_copy_(0, guide.running_index(losses.device), losses)
        self.fit_losses = losses
        return -value.sum()

    def _check(self, model, guide, x, y) -> None:
        """The checks of every call: the model's class, the targets, ``x``'s shape."""
        name = type(self).__name__
        if not isinstance(model, self._model_cls):
            raise ValueError(
                f"{name} needs {self._model_name}, got {type(model).__name__}: it computes "
                "the family's ELBO from the model object itself, so a model inside a Pyro "
                "handler (poutine.scale, mask, condition) or a function of your own trains "
                "with Pyro's Trace_ELBO instead (the same value in expectation)"
            )
        if y is None:
            raise ValueError(f"{name} needs the targets y")
        # the missing-values check reads x back to the host: once per tensor, not per step
        complete = None if model.missing else self._complete(x)
        model.check(x, y, complete=complete)
        check_labels = getattr(model, "check_labels", None)  # a classification model's
        if complete is not None and check_labels is not None:  # check skipped its labels
            self._once("labels", (y,), lambda: check_labels(y), owner=model)

    #: the fits' negative ELBOs at the last call of a stack of guides (else ``None``)
    fit_losses = None

    def differentiable_loss(
        self, model, guide, x, y=None, subsample_size=None, weight=None
    ) -> torch.Tensor:
        """Negative ELBO estimate, differentiable in the guide's parameters (summed over
        the fits of a :class:`~pyro_trees.guides.StackedGuides`, whose values are kept in
        ``fit_losses``; ``weight``: row weights, see the loss's ELBO function)."""
        self._check(model, guide, x, y)
        if weight is not None or isinstance(guide, StackedGuides):
            return self._stacked_loss(model, guide, x, y, subsample_size, weight)
        value = self._compiled_elbo(model, guide, x, y, subsample_size)
        if value is None:
            value = type(self)._elbo(model, guide, x, y, subsample_size)
        return -value
