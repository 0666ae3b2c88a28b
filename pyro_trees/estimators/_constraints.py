"""Declared parameter checks: each estimator lists, once, what every constructor
parameter may be (``_parameter_constraints``, in the spirit of scikit-learn's), and
:func:`validate_params` checks them all at the top of ``fit`` with one message per kind
of constraint, ``"<name> must be <what>, got <value>"``.

Checks that tie several parameters together (``patience`` needs a validation split,
``num_fits`` at most ``num_samples``...) stay with the estimator that has them
(``_check_params_together``): they are few, and each says why.

.. rubric:: Examples

>>> from pyro_trees.estimators._constraints import Integer, OneOf, Real
>>> Integer(1).check("depth", 3)
>>> Real(0, 1, high_open=True).describe()
'a number in [0, 1)'
>>> OneOf("hard", "posterior").describe()
"one of 'hard', 'posterior'"
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import numpy as np

from pyro_trees.validation import resolve_device

__all__ = [
    "EARLY_STOPPING",
    "SEED_AND_DEVICE",
    "Anything",
    "Boolean",
    "Checked",
    "Integer",
    "OneOf",
    "Real",
    "validate_params",
]


class Constraint:
    """What one parameter may be: :meth:`describe` says it, :meth:`check` enforces it."""

    #: whether ``None`` is allowed too
    none: bool = False

    def allows(self, value) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, name: str, value) -> None:
        """:raises ValueError: ``"<name> must be <describe()>, got <value!r>"``."""
        if value is None and self.none:
            return
        if not self.allows(value):
            tail = " or None" if self.none else ""
            raise ValueError(f"{name} must be {self.describe()}{tail}, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


class Integer(Constraint):
    """An integer (not a bool) ``>= low`` (and ``<= high``); ``low=None``: any integer."""

    def __init__(self, low: int | None = None, high: int | None = None, *, none: bool = False):
        self.low, self.high, self.none = low, high, none

    def allows(self, value) -> bool:
        if not _is_int(value):
            return False
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"an integer in [{self.low}, {self.high}]"
        if self.low is not None:
            return f"an integer >= {self.low}"
        return "an integer"


class Real(Constraint):
    """A finite real number (not a bool) within ``[low, high]``, each end open or
    closed; ``None`` ends are unbounded."""

    def __init__(
        self,
        low: float | None = None,
        high: float | None = None,
        *,
        low_open: bool = False,
        high_open: bool = False,
        none: bool = False,
    ):
        self.low, self.high, self.none = low, high, none
        self.low_open, self.high_open = low_open, high_open

    def allows(self, value) -> bool:
        if not _is_real(value) or not math.isfinite(float(value)):
            return False
        v = float(value)
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        return self.high is None or (v < self.high if self.high_open else v <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"a number in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"a number {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"a number {'<' if self.high_open else '<='} {_num(self.high)}"
        return "a finite number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class OneOf(Constraint):
    """One of the listed values, compared by type as well (``1`` is not ``True``)."""

    def __init__(self, *values):
        self.values = values

    def allows(self, value) -> bool:
        return any(value is v or (type(value) is type(v) and value == v) for v in self.values)

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)


class Boolean(OneOf):
    """``True`` or ``False`` (NumPy's bools too)."""

    def __init__(self, *, none: bool = False):
        super().__init__(True, False)
        self.none = none

    def allows(self, value) -> bool:
        return isinstance(value, bool | np.bool_)

    def describe(self) -> str:
        return "True or False"


class Checked(Constraint):
    """A parameter checked by a function that gives its own message (e.g.
    :func:`~pyro_trees.validation.resolve_device`), called as ``check(value, name)``;
    ``None`` passes when ``none``."""

    def __init__(self, check: Callable, *, none: bool = False):
        self._check, self.none = check, none

    def check(self, name: str, value) -> None:
        if value is None and self.none:
            return
        self._check(value, name)

    def describe(self) -> str:
        return getattr(self._check, "__name__", "checked")


class Anything(Constraint):
    """Any value: a parameter checked where it is used, which says where (``by``)."""

    def __init__(self, by: str):
        self.by = by

    def allows(self, value) -> bool:
        return True

    def describe(self) -> str:
        return f"anything {self.by} accepts"


def validate_params(estimator, constraints: Mapping[str, Constraint] | None = None) -> None:
    """Check every constructor parameter of ``estimator`` against its declared
    constraint (``estimator._parameter_constraints`` by default).

    :raises ValueError: naming the first parameter that breaks its constraint.
    :raises TypeError: a constructor parameter without a declared constraint (a
        programming error of the estimator, not the user's).
    """
    constraints = type(estimator)._parameter_constraints if constraints is None else constraints
    for name, value in estimator.get_params(deep=False).items():
        if name not in constraints:
            raise TypeError(f"{type(estimator).__name__} declares no constraint for {name!r}")
        constraints[name].check(name, value)


#: the parameters every estimator has: its seed, its device and its progress bar
SEED_AND_DEVICE = {
    "random_state": Integer(none=True),
    "device": Checked(resolve_device, none=True),
    "progress": Boolean(),
}

#: early stopping on held-out rows (the SVI estimators)
EARLY_STOPPING = {
    "validation_fraction": Real(0, 1, high_open=True),
    "patience": Integer(1, none=True),
    "eval_every": Integer(1),
}
