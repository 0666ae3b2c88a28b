"""Constraints that ``torch.distributions.constraints`` lacks."""

from __future__ import annotations

from torch.distributions import constraints

__all__ = ["open_interval"]


class _OpenInterval(constraints.Constraint):
    """The open interval ``(lower_bound, upper_bound)``."""

    def __init__(self, lower_bound, upper_bound):
        self.lower_bound = lower_bound
        self.upper_bound = upper_bound
        super().__init__()

    def check(self, value):
        return (self.lower_bound < value) & (value < self.upper_bound)

    def __repr__(self):
        return f"OpenInterval(lower_bound={self.lower_bound}, upper_bound={self.upper_bound})"


#: Constraint factory for an open interval (torch has only the closed one).
open_interval = _OpenInterval
