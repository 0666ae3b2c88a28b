"""Eq. 13 of the RNN-Tree at every node for every input, as one blockwise autograd function.

:class:`_NodeSplitLogProbs` serves :meth:`pyro_trees.guides.RNNTree.node_logits` under hard
feedback; :func:`_log_right_left` is the soft-feedback roll-out's formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one ``(rows, nodes, features)`` block of :class:`_NodeSplitLogProbs`:
# on CPU about a megabyte in float32, so each block's passes run from cache; on an
# accelerator, blocks large enough to fill it (64 MB in float32).
_BLOCK_ELEMENTS = 2**18
_BLOCK_ELEMENTS_ACCELERATOR = 2**24


def _sigmoid_pair(z: torch.Tensor):
    """``sigmoid(z)`` and ``sigmoid(-z)``, each accurate to relative precision (neither
    is formed as ``1 - sigmoid``)."""
    return torch.sigmoid(z), torch.sigmoid(-z)


def _log_right_left(x, log_dim, w0, w1, missing=None, missing_logits=None):
    """``log q(m=1)``, ``log q(m=0)`` of eq. 13 through log-sum-exps over the last dim,
    broadcasting over ``x``: the soft-feedback roll-out's formula, and the reference
    where :class:`_NodeSplitLogProbs`' probability-space sums underflow.

    With ``missing`` (bool, like ``x``, whose missing entries must be finite, e.g. 0)
    a missing dimension's split :math:`\\sigma(w_0 + w_1 x)` is replaced by
    :math:`\\sigma(a)`, ``a`` the ``missing_logits`` (broadcasting like ``w0``): the
    probability that the node sends a point missing that dimension right."""
    z = w0 + w1 * x
    if missing is None:
        log_right = torch.logsumexp(log_dim + F.logsigmoid(z), dim=-1)
        log_left = torch.logsumexp(log_dim + F.logsigmoid(-z), dim=-1)
        return log_right, log_left
    right = torch.where(missing, F.logsigmoid(missing_logits), F.logsigmoid(z))
    left = torch.where(missing, F.logsigmoid(-missing_logits), F.logsigmoid(-z))
    return torch.logsumexp(log_dim + right, dim=-1), torch.logsumexp(log_dim + left, dim=-1)


def _log_space_pairs(x, log_dim, w0, w1, rows, nodes):
    """:func:`_log_right_left` for the ``(row, node)`` pairs given, ``(P,)`` each."""
    return _log_right_left(x[rows], log_dim[nodes], w0[nodes], w1[nodes])


class _NodeSplitLogProbs(torch.autograd.Function):
    r"""Eq. 13 at every node for every input: ``log q(m=1)``, ``log q(m=0)``, ``(N, K)``.

    ``x`` is ``(N, L)``; ``log_dim``, ``w0``, ``w1`` are ``(K, L)``. The same values as
    ``logsumexp(log_dim + logsigmoid(+-(w0 + w1 x)), -1)``, computed blockwise over the
    rows (the ``(N, K, L)`` intermediates never exist whole; backward recomputes each
    block) and in probability space, :math:`q_R = \sum_l \pi_l \sigma(z_l)`, one
    pair of sigmoids per element. A ``(row, node)`` pair whose :math:`q_R` or
    :math:`q_L` falls below ``finfo.tiny * 2**(3 * finfo.bits / 4)`` (its terms
    underflowing, as with sharp splits far from every threshold) is redone in log
    space, forward and backward.
    Gradients: :math:`\partial \log q_R / \partial z_l =
    \pi_l \sigma(z_l) \sigma(-z_l) / q_R`, :math:`\partial \log q_L / \partial z_l =
    -\pi_l \sigma(z_l) \sigma(-z_l) / q_L`, :math:`\partial \log q_R / \partial
    \log \pi_l = \pi_l \sigma(z_l) / q_R`.
    """

    @staticmethod
    def forward(ctx, x, log_dim, w0, w1):
        n = x.shape[0]
        block = _BLOCK_ELEMENTS if x.device.type == "cpu" else _BLOCK_ELEMENTS_ACCELERATOR
        rows = max(1, block // max(1, w0.numel()))
        finfo = torch.finfo(x.dtype)
        floor = finfo.tiny * 2.0 ** (finfo.bits - finfo.bits // 4)  # 2**24 / 2**48 over tiny
        pi = log_dim.exp()
        log_right = x.new_empty(n, w0.shape[0])
        log_left = torch.empty_like(log_right)
        underflow = torch.empty(n, w0.shape[0], dtype=torch.bool, device=x.device)
        for s in range(0, n, rows):
            z = torch.addcmul(w0, w1, x[s : s + rows].unsqueeze(-2))  # (B, K, L)
            sig, sig_neg = _sigmoid_pair(z)
            right, left = sig.mul_(pi).sum(-1), sig_neg.mul_(pi).sum(-1)
            underflow[s : s + rows] = (right < floor) | (left < floor)
            log_right[s : s + rows] = right.clamp_min_(floor).log_()
            log_left[s : s + rows] = left.clamp_min_(floor).log_()
        bad_rows, bad_nodes = underflow.nonzero(as_tuple=True)  # redo these in log space
        if bad_rows.numel():
            log_right[bad_rows, bad_nodes], log_left[bad_rows, bad_nodes] = _log_space_pairs(
                x, log_dim, w0, w1, bad_rows, bad_nodes
            )
        ctx.save_for_backward(x, log_dim, w0, w1, log_right, log_left, bad_rows, bad_nodes)
        ctx.rows = rows
        return log_right, log_left

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_right, grad_left):
        x, log_dim, w0, w1, log_right, log_left, bad_rows, bad_nodes = ctx.saved_tensors
        rows = ctx.rows
        pi = log_dim.exp()
        grad_log_dim = torch.zeros_like(log_dim)
        grad_w0 = torch.zeros_like(w0)
        grad_w1 = torch.zeros_like(w1)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # d/dq of log q: grad / q; zero on the log-space rows, which are added below
        c_right = grad_right * log_right.neg().exp_()
        c_left = grad_left * log_left.neg().exp_()
        if bad_rows.numel():
            c_right[bad_rows, bad_nodes] = 0.0
            c_left[bad_rows, bad_nodes] = 0.0
        for s in range(0, x.shape[0], rows):
            xs = x[s : s + rows]
            cr, cl = c_right[s : s + rows], c_left[s : s + rows]
            z = torch.addcmul(w0, w1, xs.unsqueeze(-2))
            sig, sig_neg = _sigmoid_pair(z)
            cr, cl = cr.unsqueeze(-1), cl.unsqueeze(-1)
            grad_log_dim += (sig * cr).add_(sig_neg * cl).sum(0)
            dz = sig.mul_(sig_neg).mul_(cr - cl)  # (B, K, L), without pi
            grad_w0 += dz.sum(0)
            grad_w1 += (dz * xs.unsqueeze(-2)).sum(0)
            if grad_x is not None:
                grad_x[s : s + rows] = (dz * (w1 * pi)).sum(-2)
        grad_log_dim *= pi
        grad_w0 *= pi
        grad_w1 *= pi
        if bad_rows.numel():  # autograd through the log-space formula on those pairs
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (x, log_dim, w0, w1)]
                out_r, out_l = _log_space_pairs(*inputs, bad_rows, bad_nodes)
                total = (out_r * grad_right[bad_rows, bad_nodes]).sum()
                total = total + (out_l * grad_left[bad_rows, bad_nodes]).sum()
                g_x, g_ld, g_w0, g_w1 = torch.autograd.grad(total, inputs)
            grad_log_dim += g_ld
            grad_w0 += g_w0
            grad_w1 += g_w1
            if grad_x is not None:
                grad_x += g_x
        return grad_x, grad_log_dim, grad_w0, grad_w1
