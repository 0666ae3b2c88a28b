"""One lock for Pyro's process-wide state, so that fits and draws from several threads
run one at a time instead of corrupting one another.

Pyro keeps its effect-handler stack (``pyro.poutine.runtime._PYRO_STACK``), its param
store and its settings (``pyro.settings``, validation) in module globals, and a seeded
draw reseeds the global random streams of Python, NumPy and torch. Two threads that run
Pyro code at once interleave on that state: ``"This Messenger is not on the bottom of
the stack"``, ``"duplicate plate"``, an in-place modification error in backward, or
seeded draws that differ from a sequential call. Everything in pyro_trees that uses that
state (:func:`~pyro_trees.infer.fit`, every estimator's ``fit`` and its seeded sampling)
holds :func:`exclusive` while it does: such calls from several threads are then
serialised and give the results of sequential calls. Predictions that only evaluate
fitted tensors (``predict``, ``predict_proba``, ``predict_interval``, ...) do not need
the lock and run concurrently.

A user's own Pyro code in other threads can share the same lock::

    with exclusive():
        svi.step(x, y)
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["exclusive"]

#: re-entrant: a fit holding it may call other code that takes it again
_LOCK = threading.RLock()


@contextlib.contextmanager
def exclusive():
    """Hold the process-wide lock of Pyro's global state for the block (re-entrant).

    .. rubric:: Examples

    >>> import threading
    >>> from pyro_trees.infer import exclusive
    >>> order = []
    >>> def work(name):
    ...     with exclusive():
    ...         order.extend([name, name])  # never interleaved with another thread's
    >>> threads = [threading.Thread(target=work, args=(n,)) for n in "ab"]
    >>> for t in threads:
    ...     t.start()
    >>> for t in threads:
    ...     t.join()
    >>> sorted(order) == ["a", "a", "b", "b"] and order[0] == order[1]
    True
    """
    with _LOCK:
        yield
