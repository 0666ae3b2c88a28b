"""The memory a VaRT estimator's training and prediction need, checked before the
tensors are made: a ``ValueError`` that names the depth, the need and the budget instead
of an out-of-memory error deep inside a fit.

:func:`check_training_memory` and :func:`check_prediction_memory` are what
:class:`~pyro_trees.estimators.VaRTRegressor` and
:class:`~pyro_trees.estimators.VaRTClassifier` call in ``fit``; predictions run in
batches of rows within :data:`PREDICT_BYTES`. The budget is the free memory of the
device (CUDA) or the machine's physical memory (:func:`pyro_trees.trees.require_memory`).
"""

from __future__ import annotations

from pyro_trees import trees
from pyro_trees.guides import VaRTGuide

__all__ = [
    "PREDICT_BYTES",
    "ROW_BYTES_PER_NODE",
    "check_prediction_memory",
    "check_training_memory",
]

#: Bytes of one prediction batch: rows are predicted in batches that fit this budget.
PREDICT_BYTES = 256 * 2**20
#: Bytes per tree, row and node of the double-precision mixture tensors of a prediction.
ROW_BYTES_PER_NODE = 6 * 8


def _require_memory(depth: int, need: float, what: str, hint: str, device=None) -> None:
    """Raise a ``ValueError`` when ``need`` bytes exceed the memory of ``device`` (free
    CUDA memory, or the machine's physical memory), saying how much ``what`` needs.

    :param str what: what needs the memory (``"training on 256 rows at a time"``).
    :param str hint: how to need less (``"a smaller depth or batch_size"``).
    """
    trees.require_memory(
        need,
        what,
        f"Use {hint}.",
        head=f"depth {depth} means 2**{depth + 1} - 1 = {2 ** (depth + 1) - 1:,} nodes; ",
        device=device,
    )


def check_training_memory(depth, batch: int, in_features: int, device) -> int:
    """Check that training a VaRT tree of depth ``depth`` fits the memory of ``device``:
    ``(batch, 2**(D+1))`` routing and means with their gradients (about 12 float copies
    of ``(batch, 2**D, 2)``: :func:`~pyro_trees.trees.check_depth`, which also validates
    ``depth``), and the guide's parameters
    (:meth:`~pyro_trees.guides.VaRTGuide.num_parameters`) with their gradients,
    ClippedAdam's two moments and one draw (five copies).

    :param depth: the truncation depth ``D`` (an integer ``>= 1``).
    :param int batch: rows per training step.
    :param int in_features: inputs ``L``.
    :param device: where the fit runs (``None``: the CPU).
    :returns: ``depth`` as an ``int``.
    :raises ValueError: when ``depth`` is invalid or the need exceeds the memory.
    """
    depth = trees.check_depth(depth, batch, width=2, device=device, copies=12)
    params = VaRTGuide.num_parameters(depth, in_features)
    need = 4.0 * (12 * batch * 2 ** (depth + 1) + 5 * params)
    _require_memory(
        depth,
        need,
        f"training on {batch:,} rows at a time with {in_features:,} inputs",
        "a smaller depth or batch_size",
        device,
    )
    return depth


def check_prediction_memory(depth: int, num_samples: int, in_features: int, device) -> None:
    """Check that predicting with ``num_samples`` posterior trees of depth ``depth`` fits
    the memory of ``device``: the trees (split indicators, split and leaf weights and
    noise scales of every node, about ``2**D (3 (L + 1) + 4)`` floats each) held in about
    four copies while they are drawn and stacked, and the mixture tensors of one row
    (``num_samples * 2**(D+1) *`` :data:`ROW_BYTES_PER_NODE` bytes; more rows are
    predicted in batches within :data:`PREDICT_BYTES`).

    :param int depth: the truncation depth ``D``.
    :param int num_samples: posterior trees drawn.
    :param int in_features: inputs ``L``.
    :param device: where the prediction runs (``None``: the CPU).
    :raises ValueError: when the need exceeds the memory.
    """
    per_tree = 2**depth * (3 * (in_features + 1) + 4)
    need = num_samples * (4.0 * 4 * per_tree + ROW_BYTES_PER_NODE * 2 ** (depth + 1))
    _require_memory(
        depth,
        need,
        f"prediction with num_samples={num_samples:,} posterior trees of {in_features:,} inputs",
        "a smaller depth or num_samples",
        device,
    )
