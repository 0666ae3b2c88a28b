"""What wraps every estimator's ``fit``: one fit at a time, Ctrl-C only between
training steps, and no half-fitted estimator after a failure.

:class:`~pyro_trees.estimators._base.TabularEstimator` applies :func:`guarded_fit` to
the ``fit`` of each of its subclasses; an estimator outside that base (the causal
estimator) decorates its ``fit`` with it.
"""

from __future__ import annotations

import functools

from sklearn.base import BaseEstimator

from pyro_trees.infer import deferred_interrupts, exclusive, keep_freed_memory

__all__ = ["forget_fit", "guarded_fit"]


def forget_fit(estimator: BaseEstimator) -> None:
    """Return ``estimator`` to its unfitted state: remove every attribute but its
    constructor parameters (and scikit-learn's own configuration, such as
    ``set_output``'s)."""
    keep = set(estimator.get_params(deep=False))
    for name in list(vars(estimator)):
        if name not in keep and not name.startswith(("_sklearn", "_metadata")):
            delattr(estimator, name)


def guarded_fit(fit):
    """Wrap an estimator's ``fit``: under :func:`~pyro_trees.infer.exclusive` and
    :func:`~pyro_trees.infer.deferred_interrupts`, after
    :func:`~pyro_trees.infer.keep_freed_memory`, and unfitted (:func:`forget_fit`)
    when it raises, ``KeyboardInterrupt`` included."""
    if getattr(fit, "_guarded", False):
        return fit

    @functools.wraps(fit)
    def guarded(self, *args, **kwargs):
        keep_freed_memory()
        with exclusive():
            try:
                with deferred_interrupts():
                    return fit(self, *args, **kwargs)
            except BaseException:
                forget_fit(self)
                raise

    guarded._guarded = True
    return guarded
