"""GP maths of :class:`~pyro_trees.models.HeteroscedasticGP`, as plain functions of tensors.

The exact and the sparse (Titsias) collapsed evidence under a per-point noise :math:`R`,
the optimal whitened :math:`q(u)`, the exact posterior of ``f`` at new inputs, the
homoscedastic fit and the :math:`q(u)` mean that start the model, and the sparse model's
expected log-likelihood terms (its factor sites). The model's methods call these with its
kernel, constant mean and jitter; nothing here touches the param store.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch

from pyro_trees._interrupts import raise_if_interrupted
from pyro_trees.distributions.tree_balance import BalancedLeaf, expected_log_coupling
from pyro_trees.gp import (
    TensorKernel,
    cholesky,
    conditional,
    gaussian_log_evidence,
    kernel_matrix,
)


def exact_evidence(kernel, x, resid, log_prec, jitter: float, chol=cholesky) -> torch.Tensor:
    r""":math:`\log \mathcal{N}(r \mid 0, K + R)` with :math:`R_{nn} = e^{-\text{log\_prec}_n}`.

    :param x: ``(N, L)``; ``resid``: ``y`` minus the constant mean, ``(N,)``;
        ``log_prec``: :math:`\log R_{nn}^{-1}`, ``(N,)``.
    :param chol: the Cholesky factorisation ``chol(K, jitter)`` (a compiled loss passes
        one that does not read its outcome back). Returns a scalar.
    """
    r = torch.exp(-log_prec)
    K = kernel_matrix(kernel, x)[..., 0, :, :]
    return gaussian_log_evidence(K + torch.diag_embed(r), resid, jitter, chol)


def sparse_evidence(kernel, z, x, resid, log_prec, jitter: float, chol=cholesky):
    r"""Titsias' collapsed bound on :math:`\log \mathcal{N}(r \mid 0, K + R)` with the
    inducing inputs :math:`Z`, and the optimal whitened :math:`q(u)`.

    :math:`\log \mathcal{N}(r \mid 0, Q + R) - \tfrac12 \operatorname{tr}(R^{-1}(K - Q))`
    with :math:`Q = A^\top A`, :math:`A = L_{zz}^{-1} K_{zx}`; the optimal
    :math:`q(u) = \mathcal{N}(B^{-1} A R^{-1} r, B^{-1})`, :math:`B = I + A R^{-1} A^\top`.
    Cost :math:`O(N M^2)`.

    :param z: inducing inputs ``(M, L)``.
    :param x: ``(N, L)``.
    :param resid: ``y`` minus the constant mean, ``(N,)``.
    :param log_prec: :math:`\log R_{nn}^{-1}`, ``(N,)``.
    :param chol: the Cholesky factorisation ``chol(K, jitter)`` (see :func:`exact_evidence`).
    :returns: ``(bound, LB, c)``: a scalar, the Cholesky factor of :math:`B` ``(M, M)``
        and :math:`L_B^{-1} A R^{-1} r` ``(M,)``.
    """
    n = x.shape[0]
    Lzz = chol(kernel_matrix(kernel, z)[..., 0, :, :], jitter)
    Kzx = kernel_matrix(kernel, z, x)[..., 0, :, :]
    # L^-1 K_zx through the (M, M) triangular inverse: a matmul, forward and backward,
    # instead of a triangular solve with N right-hand sides (as gp.conditional)
    eye = torch.eye(Lzz.shape[-1], dtype=x.dtype, device=x.device)
    A = torch.linalg.solve_triangular(Lzz, eye, upper=False) @ Kzx  # (M, N)
    prec = torch.exp(log_prec)
    Ap = A * prec
    LB = chol(eye + Ap @ A.mT, 0.0)
    c = torch.linalg.solve_triangular(LB, (Ap @ resid).unsqueeze(-1), upper=False)
    c = c.squeeze(-1)
    logdet = -log_prec.sum() + 2 * LB.diagonal().log().sum()
    quad = (resid.pow(2) * prec).sum() - c.pow(2).sum()
    kdiag = kernel_matrix(kernel, x, diag=True)[..., 0, :]
    trace = (prec * (kdiag - A.pow(2).sum(-2))).sum()
    bound = -0.5 * (n * math.log(2 * math.pi) + logdet + quad + trace)
    return bound, LB, c


def optimal_whitened_q_u(LB, c):
    """The optimal whitened :math:`q(u)` from :func:`sparse_evidence`'s ``LB``, ``c``:
    ``(loc (M,), scale_tril (M, M))``."""
    eye = torch.eye(LB.shape[0], dtype=LB.dtype, device=LB.device)
    LBinv = torch.linalg.solve_triangular(LB, eye, upper=False)
    return (LBinv.mT @ c.unsqueeze(-1)).squeeze(-1), cholesky(LBinv.mT @ LBinv, 1e-10)


def exact_posterior(kernel, x, resid, r, x_new, jitter: float):
    r"""The exact posterior of ``f - c`` at ``x_new`` ``(N*, L)`` given the residuals
    ``resid`` ``(N,)`` at ``x`` ``(N, L)`` under noise variances ``r`` ``(N,)``.

    :returns: ``(loc, W)``: the mean ``(N*,)`` (without the constant mean) and
        :math:`W = L^{-1} K_{x x_*}` ``(N, N*)``, so that the covariance is
        :math:`K_{**} - W^\top W`.

    Each entry of ``loc`` and each column of ``W`` depend only on their row of
    ``x_new`` (and the training data), not on the other rows of the batch: the
    cross-covariance is evaluated with the training inputs first
    (:func:`~pyro_trees.gp.kernel_matrix`).
    """
    L = cholesky(kernel_matrix(kernel, x)[..., 0, :, :] + torch.diag_embed(r), jitter)
    Kxs = kernel_matrix(kernel, x, x_new)[..., 0, :, :]  # (N, N*): training inputs first
    alpha = torch.cholesky_solve(resid.unsqueeze(-1), L)
    W = torch.linalg.solve_triangular(L, Kxs, upper=False)
    return (alpha.mT @ Kxs).squeeze(-2), W


def fit_noise_level(kernel, xs, ys, *, jitter: float, num_steps: int, lr: float):
    """Fit ``kernel`` (in place) and one log noise scale by the exact GP evidence of
    ``ys - ys.mean()`` at ``xs``, with Adam; returns the log noise scale (a scalar)."""
    log_noise = torch.tensor(float(torch.log(ys.std() + 1e-6)) - 0.5, dtype=xs.dtype)
    log_noise.requires_grad_(True)
    params = [log_noise, *kernel.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    resid = ys - ys.mean()
    for _ in range(num_steps):
        opt.zero_grad()
        # an RBF or Matérn kernel as plain tensor code: the same values, fewer operations
        k = TensorKernel.of(kernel) or kernel
        log_prec = (-2 * log_noise).expand(resid.shape)
        loss = -exact_evidence(k, xs, resid, log_prec, jitter)
        loss.backward()
        opt.step()
        raise_if_interrupted()  # a safe point for Ctrl-C inside an estimator's fit
    return log_noise


@torch.no_grad()
def homoscedastic_residuals(kernel, x, y, sub, log_noise, *, jitter: float, loo: bool):
    """Residuals ``y - E[f(x) | y[sub]]`` at all ``x`` ``(N,)`` under the fitted homoscedastic
    GP (mean ``y[sub].mean()``); with ``loo``, the leave-one-out ones at the points ``sub``."""
    xs, ys = x[sub], y[sub]
    K = kernel_matrix(kernel, xs)[..., 0, :, :]
    eye = torch.eye(xs.shape[0], dtype=x.dtype, device=x.device)
    L = cholesky(K + torch.exp(2 * log_noise) * eye, jitter)
    alpha = torch.cholesky_solve((ys - ys.mean()).unsqueeze(-1), L)
    Kxs = kernel_matrix(kernel, x, xs)[..., 0, :, :]
    fmean = (Kxs @ alpha).squeeze(-1) + ys.mean()
    resid = y - fmean
    # at the fitted points, leave-one-out residuals alpha_i / [K_y^-1]_ii: the
    # in-sample ones are shrunk towards 0 and would start the noise too low
    if not loo:
        return resid.detach()
    resid[sub] = alpha.squeeze(-1) / torch.cholesky_inverse(L).diagonal()
    return resid.detach()


def whitened_mean_at(kernel, x, fmean, z, mean_constant, jitter: float):
    """The whitened :math:`q(u)` mean ``(M,)`` that puts the fitted mean ``fmean`` ``(N,)``
    at ``x`` ``(N, L)`` onto the inducing inputs ``z`` ``(M, L)``: kernel regression from
    at most 400 evenly spaced points (no :math:`O(N^3)`), then :math:`L_{zz}^{-1}`."""
    sub = torch.linspace(0, x.shape[0] - 1, min(400, x.shape[0])).round().long()
    xs, fs = x[sub], fmean[sub]
    K = kernel_matrix(kernel, xs)[..., 0, :, :]
    eye = torch.eye(xs.shape[0], dtype=xs.dtype, device=xs.device)
    L = cholesky(K + 1e-3 * K.diagonal().mean() * eye, jitter)
    alpha = torch.cholesky_solve((fs - mean_constant).unsqueeze(-1), L)
    fz = (kernel_matrix(kernel, z, xs)[..., 0, :, :] @ alpha).squeeze(-1) + mean_constant
    Lzz = cholesky(kernel_matrix(kernel, z)[..., 0, :, :], jitter)
    target = fz - mean_constant.to(x.dtype)
    return torch.linalg.solve_triangular(Lzz, target.unsqueeze(-1), upper=False).squeeze(-1)


def exact_f_joint(kernel, x, resid, r, x_new, jitter: float):
    """The joint of :func:`exact_posterior` at ``x_new``: ``(loc (N*,), cov (N*, N*))``."""
    loc, W = exact_posterior(kernel, x, resid, r, x_new, jitter)
    return loc, kernel_matrix(kernel, x_new)[..., 0, :, :] - W.mT @ W


def exact_f_marginals(kernel, x, resid, r, x_new, jitter: float):
    """Marginals of :func:`exact_posterior` at ``x_new``: ``(loc, var)``, each ``(N*,)``;
    each row's pair does not depend on the other rows of ``x_new``."""
    loc, W = exact_posterior(kernel, x, resid, r, x_new, jitter)
    kss = kernel_matrix(kernel, x_new, diag=True)[..., 0, :]
    return loc, (kss - W.pow(2).sum(-2)).clamp_min(0.0)


def sparse_f_marginals(kernel, x_new, z, u_loc, u_scale_tril, jitter: float):
    r"""Marginals of ``f - c`` at ``x_new`` ``(N*, L)`` under the whitened
    :math:`q(u) = \mathcal{N}(` ``u_loc`` ``(M,)``, ``u_scale_tril`` ``(M, M)`` :math:`)`
    at the inducing inputs ``z`` ``(M, L)``: ``(loc, var)``, each ``(N*,)``."""
    loc, var = conditional(
        kernel,
        x_new,
        z,
        u_loc.unsqueeze(-2),
        u_scale_tril.unsqueeze(-3),
        whiten=True,
        jitter=jitter,
    )
    return loc[0], var[0]


def collapsed_bound(
    kernel, x, resid, log_q, s, depth, *, z, jitter, balance_weight, entropy_weight, chol=cholesky
) -> torch.Tensor:
    r""":math:`\mathcal{L}_2(q(M))` of App. E (``z=None``), or its sparse collapsed form with
    the inducing inputs ``z`` ``(M, L)`` (Titsias' bound, :func:`sparse_evidence`).

    :param x: ``(N, L)``; ``resid``: ``y`` minus the constant mean, ``(N,)``.
    :param log_q: normalised leaf log-probabilities ``(N, 2**D)``.
    :param s: per-leaf log noise scales ``(2**D,)``.
    :param chol: the Cholesky factorisation (see :func:`exact_evidence`).
    :returns: a scalar.
    """
    q = log_q.exp()
    log_prec = torch.logsumexp(log_q - 2 * s, dim=-1)  # log R_nn^-1
    C = -0.5 * log_prec.sum() - (q * s).sum()
    if z is not None:
        log_evidence = sparse_evidence(kernel, z, x, resid, log_prec, jitter, chol)[0]
    else:
        log_evidence = exact_evidence(kernel, x, resid, log_prec, jitter, chol)
    per_point_kl = ((q * log_q).sum(-1) + depth * math.log(2.0)).sum()
    coupling = expected_log_coupling(log_q, depth)
    return log_evidence + C - entropy_weight * per_point_kl + balance_weight * coupling


def sparse_expected_log_lik(kernel, log_q, x, y, z, u, mean, s, depth, jitter, subsample_size):
    r"""The sparse model's ELBO terms given ``u``, with the routing summed out at the
    guide's leaf probabilities: per point
    :math:`\sum_\ell q_{n\ell}[\log\mathcal{N}(y_n \mid \mu_n, e^{2 s_\ell})
    - \tfrac12 v_n e^{-2 s_\ell}] - \mathrm{KL}(q_n \,\|\, \mathrm{Unif})`
    (factor ``"expected_log_lik"``), plus the tree-balance coupling (``"balance"``).

    ``log_q`` maps a batch of inputs ``(B, L)`` to normalised leaf log-probabilities
    ``(B, 2**D)``; the plate ``"data"`` subsamples ``subsample_size`` of the ``N`` points.
    Returns ``y``.
    """
    n = x.shape[0]
    with pyro.plate("data", n, subsample_size=subsample_size, dim=-1) as idx:
        log_q_b = log_q(x[idx])
        pyro.sample("leaf", BalancedLeaf(depth, n, dtype=x.dtype, device=x.device).mask(False))
        loc, var = conditional(kernel, x[idx], z, u.unsqueeze(-2), whiten=True, jitter=jitter)
        loc, var = loc[..., 0, :, None] + mean, var[..., 0, :, None]
        comp = dist.Normal(loc, torch.exp(s)).log_prob(y[idx, None]) - 0.5 * var * torch.exp(-2 * s)
        q = log_q_b.exp()
        kl = (q * log_q_b).sum(-1) + depth * math.log(2.0)
        pyro.factor("expected_log_lik", (q * comp).sum(-1) - kl)
    pyro.factor("balance", expected_log_coupling(log_q_b, depth, scale=n / log_q_b.shape[-2]))
    return y
