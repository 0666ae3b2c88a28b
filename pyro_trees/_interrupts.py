"""Ctrl-C at a safe point: inside :func:`deferred_interrupts`, an interrupt ends the
work between two training steps instead of in the middle of one.

A ``KeyboardInterrupt`` raised at an arbitrary bytecode can leave a training run half
updated: some parameters stepped and others not, a random stream advanced by the draws
of a step that never finished, a lazily imported module half initialised. Within the
block, the first SIGINT (Ctrl-C, or :func:`_thread.interrupt_main`) is only recorded;
:func:`raise_if_interrupted` raises it at the next safe point (:func:`~pyro_trees.infer.fit`
calls it after every finished step), and the end of the block raises it if no safe point
came. A second SIGINT raises at once.

Only the main thread receives signals, so the block changes nothing in other threads,
nor where a SIGINT handler other than Python's default one is installed (the caller's
own handler then keeps deciding).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

__all__ = ["deferred_interrupts", "raise_if_interrupted"]


class _Pending:
    """Whether a SIGINT arrived inside the block and has not been raised yet."""

    requested = False


def _hold(signum, frame) -> None:
    """The block's SIGINT handler: record the first interrupt, raise on the second."""
    if _Pending.requested:
        _Pending.requested = False
        raise KeyboardInterrupt
    _Pending.requested = True
    print(
        "Interrupted: stopping after the current step (Ctrl-C again to stop at once).",
        file=sys.stderr,
        flush=True,
    )


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if a SIGINT arrived since the block began (or since
    it was last raised); a safe point of :func:`deferred_interrupts`. Does nothing
    outside the main thread, which alone receives signals."""
    if _Pending.requested and _main_thread():
        _Pending.requested = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def deferred_interrupts():
    """A block in which Ctrl-C takes effect at safe points only.

    Blocks nest: an inner one uses the outer one's handler, and each block's end is a
    safe point. On exit the previous SIGINT handler is restored.

    .. rubric:: Examples

    >>> import _thread
    >>> from pyro_trees.infer import deferred_interrupts, raise_if_interrupted
    >>> done = []
    >>> try:
    ...     with deferred_interrupts():
    ...         for step in range(3):
    ...             if step == 1:
    ...                 _thread.interrupt_main()  # as if Ctrl-C were pressed mid-step
    ...             done.append(step)  # the step still finishes
    ...             raise_if_interrupted()
    ... except KeyboardInterrupt:
    ...     pass
    >>> done
    [0, 1]
    """
    if not _main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        # nested (our handler is already in place), another thread, or a handler of
        # the caller's own: leave the signal alone; a nested block's end is a safe point
        yield
        if signal.getsignal(signal.SIGINT) is _hold:
            raise_if_interrupted()
        return
    previous = signal.signal(signal.SIGINT, _hold)
    _Pending.requested = False
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        pending, _Pending.requested = _Pending.requested, False
    if pending:
        raise KeyboardInterrupt
