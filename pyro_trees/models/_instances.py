"""Batches of instances for the instance-level latent models: checked rows of ``x`` and
the entries of a sparse (CSR) pair structure that a batch ``idx`` keeps."""

from __future__ import annotations

import torch

from pyro_trees.validation import as_tensor, check_finite, check_index

__all__ = ["csr_rows", "find", "instance_rows", "sorted_batch"]


def instance_rows(x, idx, num_nodes: int, in_features: int, finite: bool = True):
    """Checked ``(x_B, idx)`` of an instance-level model: ``x`` of shape ``(N, F)``,
    ``idx`` in ``[0, N)``, the batch's rows finite (only they are scanned, ``O(|B| F)``;
    not with ``finite=False``, where the caller has checked every row)."""
    x = as_tensor(x, "x")
    if x.dim() != 2 or x.shape[0] != num_nodes or x.shape[1] != in_features:
        raise ValueError(
            f"x must have shape (N, F) = ({num_nodes}, {in_features}) (one row per instance of "
            f"the model), got {tuple(x.shape)}"
        )
    if idx is not None:
        idx = check_index(idx, num_nodes, device=x.device)
        x = x.index_select(0, idx)
    return (check_finite(x, "x") if finite else x), idx


def csr_rows(ptr: torch.Tensor, idx: torch.Tensor):
    """The entries of the rows ``idx`` of a CSR layout with row pointers ``ptr``: their
    positions in the column array and the position in ``idx`` of each entry's row.
    ``O(|idx| + entries)``."""
    start = ptr[idx]
    counts = ptr[idx + 1] - start
    rows = torch.repeat_interleave(torch.arange(idx.numel(), device=idx.device), counts)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=idx.device) - first[rows] + start[rows]
    return pos, rows


def sorted_batch(idx: torch.Tensor):
    """``idx`` sorted and the permutation; raises on repeated instances."""
    sorted_idx, order = idx.sort()
    if bool((sorted_idx[1:] == sorted_idx[:-1]).any()):
        raise ValueError("idx contains repeated instances")
    return sorted_idx, order


def find(sorted_idx: torch.Tensor, order: torch.Tensor, values: torch.Tensor):
    """Position in ``idx`` of each of ``values`` and whether it is there at all
    (binary search, ``O(len(values) log |idx|)``)."""
    at = torch.searchsorted(sorted_idx, values).clamp_max(sorted_idx.numel() - 1)
    return order[at], sorted_idx[at] == values
