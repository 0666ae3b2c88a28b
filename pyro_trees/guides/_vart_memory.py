"""Memory checks of VaRT's training and prediction, raised before the tensors are made."""

from __future__ import annotations

from pyro_trees import trees

PREDICT_BYTES = 256 * 2**20  # memory for one prediction batch
ROW_BYTES_PER_NODE = 6 * 8  # per tree and row: the double mixture tensors of one row


def _guide_param_count(depth: int, in_features: int) -> int:
    """Entries of the parameters of :class:`~pyro_trees.guides.VaRTGuide` at depth ``depth`` with
    ``in_features`` inputs: split logits and the split weights' locations and scales on
    the :math:`2^D - 1` internal positions, the leaf weights' and log noise scales'
    locations and scales on all :math:`2^{D+1} - 1` nodes."""
    width = in_features + 1
    n_int, n_all = trees.num_internal(depth), trees.num_internal(depth + 1)
    return n_int * (1 + 2 * width) + n_all * (2 * width + 2)


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


def _check_training_memory(depth, batch: int, in_features: int, device) -> int:
    """Training: ``(batch, 2**(D+1))`` routing and means with their gradients (about 12
    float copies of ``(batch, 2**D, 2)``: :func:`~pyro_trees.trees.check_depth`, which
    also validates ``depth``), and the guide's parameters with their gradients,
    ClippedAdam's two moments and one draw (five copies).

    :returns: ``depth`` as an ``int``.
    """
    depth = trees.check_depth(depth, batch, width=2, device=device, copies=12)
    need = 4.0 * (12 * batch * 2 ** (depth + 1) + 5 * _guide_param_count(depth, in_features))
    _require_memory(
        depth,
        need,
        f"training on {batch:,} rows at a time with {in_features:,} inputs",
        "a smaller depth or batch_size",
        device,
    )
    return depth


def _check_prediction_memory(depth: int, num_samples: int, in_features: int, device) -> None:
    """Prediction: the ``num_samples`` posterior trees (split indicators, split and leaf
    weights and noise scales of every node, about ``2**D (3 (L + 1) + 4)`` floats
    each) held in about four copies while they are drawn and stacked, and the mixture
    tensors of one row (``num_samples * 2**(D+1) * 48`` bytes; larger inputs are
    processed in batches within a fixed budget)."""
    per_tree = 2**depth * (3 * (in_features + 1) + 4)
    need = num_samples * (4.0 * 4 * per_tree + ROW_BYTES_PER_NODE * 2 ** (depth + 1))
    _require_memory(
        depth,
        need,
        f"prediction with num_samples={num_samples:,} posterior trees of {in_features:,} inputs",
        "a smaller depth or num_samples",
        device,
    )
