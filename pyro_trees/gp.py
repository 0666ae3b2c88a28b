"""GP conditionals on top of GPyTorch kernels, shared by the deep GP and the heteroscedastic GP.

Pure maths, no Pyro sites: map a Gaussian over inducing outputs :math:`q(u) = N(m, S)`
at inducing inputs :math:`Z` to the Gaussian of the function at new inputs :math:`X`,

.. math::

    q(f) = \\int p(f \\mid u) q(u) du
         = N\\big(K_{xz} K_{zz}^{-1} m,\\;
                  K_{xx} - K_{xz} K_{zz}^{-1} K_{zx}
                  + K_{xz} K_{zz}^{-1} S K_{zz}^{-1} K_{zx}\\big),

unwhitened (:math:`u = f(Z)`) or whitened (:math:`u = L_{zz}^{-1} f(Z)` with
:math:`K_{zz} = L_{zz} L_{zz}^\\top`, so that the prior on :math:`u` is :math:`N(0, I)`).
With ``u_scale_tril=None`` the inducing outputs are a point (a sample), which gives
the GP posterior :math:`p(f \\mid u)` used by the doubly stochastic sampler of
Salimbeni & Deisenroth: draw :math:`u`, then each layer's outputs from
:math:`p(f \\mid u)` with the reparameterisation trick.

Shapes: inputs ``x`` are ``batch_shape + (N, D)`` and inducing inputs ``z`` are
``batch_shape + (M, D)``; outputs are batched *before* the data dimension,
``u_loc`` is ``batch_shape + (P, M)`` and the results are ``batch_shape + (P, N)``
(diagonal) or ``batch_shape + (P, N, N)`` (full). Kernels are any
:class:`gpytorch.kernels.Kernel`, either shared by the ``P`` outputs
(``batch_shape=()``) or one per output (``batch_shape=(P,)``).

**References**

[1] H. Salimbeni, M. Deisenroth, *Doubly stochastic variational inference for deep
Gaussian processes*, NeurIPS 2017.

[2] J. Hensman, A. Matthews, Z. Ghahramani, *Scalable variational Gaussian process
classification*, AISTATS 2015.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = [
    "check_kernel_memory",
    "cholesky",
    "conditional",
    "gaussian_kl",
    "import_gpytorch",
    "kernel_matrix",
    "sample_gaussian",
]


def import_gpytorch():
    """GPyTorch, imported on first use.

    Nothing in pyro_trees imports GPyTorch at module level: it is slow to import, and
    its ``linear_operator`` calls the deprecated ``torch.jit.script`` while importing
    (a ``DeprecationWarning`` that is not ours, ignored here so that test suites run
    with warnings as errors still pass).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*torch.jit.script.*deprecated", category=DeprecationWarning
        )
        import gpytorch
    return gpytorch


def kernel_matrix(kernel, x1: torch.Tensor, x2: torch.Tensor | None = None, *, diag=False):
    """Dense kernel matrix of a GPyTorch kernel with an output-batch dimension.

    **Pass the fixed set first.** GPyTorch's stationary kernels (RBF, Matern, ...) shift
    both inputs by the mean of the rows of ``x1`` before the quadratic expansion
    :math:`\\|a\\|^2 + \\|b\\|^2 - 2 a^\\top b` of the squared distances, so every entry
    depends on all rows of ``x1``: one far-away row there (say at ``1e10``) moves the
    mean and cancels every other entry's digits. The rows of ``x2`` do not interact:
    column ``j`` of ``k(x1, x2)`` depends only on ``x2[j]`` and ``x1``. Callers therefore
    pass the training or inducing inputs as ``x1`` and new inputs as ``x2``, so that
    each new row's kernel values do not depend on the other rows of its batch (up to
    the last bits of the matrix product, which can vary with the batch size). The
    diagonal (``diag=True``) does not mix rows either (a row's distance to itself is
    zero). A full ``k(x, x)`` of new rows is
    joint by nature: its entries move with the batch's mean at rounding level while
    the inputs are bounded (the estimators clip new inputs to a band around the
    training range).

    :param kernel: a :class:`gpytorch.kernels.Kernel` (``batch_shape`` ``()`` or ``(P,)``).
    :param torch.Tensor x1: ``batch_shape + (N, D)``, the fixed (reference) set.
    :param torch.Tensor x2: ``batch_shape + (M, D)``; ``None`` means ``x1``.
    :param bool diag: return only the diagonal of ``k(x1, x1)``.
    :returns: ``batch_shape + (Pk, N, M)``, or ``batch_shape + (Pk, N)`` with ``diag``,
        where ``Pk`` is 1 or the kernel's batch size.
    """
    a = x1.unsqueeze(-3)
    if diag:
        out = kernel(a, a, diag=True)
        out = out.to_dense() if hasattr(out, "to_dense") else out
        return out.expand(*a.shape[:-2], a.shape[-2]) if out.dim() < a.dim() - 1 else out
    b = a if x2 is None else x2.unsqueeze(-3)
    out = kernel(a, b)
    return out.to_dense() if hasattr(out, "to_dense") else out


def cholesky(K: torch.Tensor, jitter: float = 1e-6, *, max_tries: int = 4) -> torch.Tensor:
    """Cholesky factor of ``K + jitter * I``, retrying with 10x the jitter when it fails.

    :raises ValueError: when ``K`` is not positive definite even with the largest jitter.
    """
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    for attempt in range(max_tries):
        L, info = torch.linalg.cholesky_ex(K + (jitter * 10**attempt) * eye)
        if not bool((info > 0).any()):
            return L
    raise ValueError(
        f"kernel matrix of size {K.shape[-1]} is not positive definite even with jitter "
        f"{jitter * 10 ** (max_tries - 1):g}; check for duplicated inducing inputs or "
        "non-finite kernel hyperparameters"
    )


def conditional(
    kernel,
    x: torch.Tensor,
    z: torch.Tensor,
    u_loc: torch.Tensor,
    u_scale_tril: torch.Tensor | None = None,
    *,
    whiten: bool = False,
    full_cov: bool = False,
    jitter: float = 1e-6,
    Lzz: torch.Tensor | None = None,
):
    """Gaussian of ``f(x)`` given a Gaussian (or a point) over inducing outputs at ``z``.

    :param kernel: a GPyTorch kernel, shared by the outputs or batched over them.
    :param torch.Tensor x: new inputs, ``batch_shape + (N, D)``.
    :param torch.Tensor z: inducing inputs, ``batch_shape + (M, D)``.
    :param torch.Tensor u_loc: mean of q(u) (or the inducing outputs themselves),
        ``batch_shape + (P, M)``.
    :param u_scale_tril: lower Cholesky factor of the covariance of q(u),
        ``batch_shape + (P, M, M)``; ``None`` for a point (gives ``p(f | u)``).
    :param bool whiten: ``u`` is whitened, ``f(Z) = L_zz u``.
    :param bool full_cov: return the full ``(N, N)`` covariance per output, else its
        diagonal.
    :param float jitter: added to the diagonal of ``K_zz``.
    :param Lzz: precomputed ``cholesky(K_zz + jitter I)`` of shape
        ``batch_shape + (Pk, M, M)``, to share it between calls.
    :returns: ``(loc, cov)``: ``loc`` is ``batch_shape + (P, N)``; ``cov`` is
        ``batch_shape + (P, N, N)`` if ``full_cov`` else the variances
        ``batch_shape + (P, N)``.

    Without ``full_cov``, each row's mean and variance do not depend on the other rows
    of ``x`` (the cross-covariances are evaluated with ``z`` first, see
    :func:`kernel_matrix`).
    """
    if Lzz is None:
        Lzz = cholesky(kernel_matrix(kernel, z), jitter)
    Kzx = kernel_matrix(kernel, z, x)  # (..., Pk, M, N)
    # L^-1 K_zx through the (M, M) triangular inverse: a matmul instead of a triangular
    # solve with N right-hand sides, forward and backward (about 3x faster on CPU for
    # N >> M); the inverse of a triangular factor is as accurate as the solve
    eye = torch.eye(Lzz.shape[-1], dtype=Lzz.dtype, device=Lzz.device)
    Linv = torch.linalg.solve_triangular(Lzz, eye, upper=False)
    W = Linv @ Kzx
    # projection of the inducing outputs, mean = A^T u: A = L^-1 K_zx when whitened,
    # K_zz^-1 K_zx otherwise
    A = W if whiten else Linv.mT @ W
    loc = _project(A, u_loc)
    # prior part: K_xx - K_xz K_zz^-1 K_zx = K_xx - W^T W
    if full_cov:
        cov = kernel_matrix(kernel, x) - W.mT @ W
        if u_scale_tril is not None:
            SA = u_scale_tril.mT @ A
            cov = cov + SA.mT @ SA
        cov = cov.expand(*loc.shape, loc.shape[-1])
    else:
        cov = kernel_matrix(kernel, x, diag=True) - W.pow(2).sum(-2)
        if u_scale_tril is not None:
            cov = cov + (u_scale_tril.mT @ A).pow(2).sum(-2)
        cov = cov.clamp_min(0.0).expand(loc.shape)
    return loc, cov


def _project(A: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``A^T u`` per output: ``A`` is ``batch_A + (Pa, M, N)``, ``u`` is ``batch_u + (P, M)``,
    the result ``batch + (P, N)``.

    Written as ``u^T A`` so that ``A`` is never transposed: ``A.mT @ u`` makes matmul copy
    the transposed ``(..., N, M)`` tensor, forward and backward (a large copy when ``N`` is
    large). When ``u`` carries batch dimensions (Monte Carlo particles) that ``A`` lacks,
    they are folded into the rows of one matmul per output, so ``A`` is not expanded
    (copied) over them either.
    """
    Pa, P = A.shape[-3], u.shape[-2]
    if A.dim() == 3 and u.dim() > 2 and Pa == P:
        M, N = A.shape[-2:]
        extra = u.shape[:-2]
        rows = u.reshape(-1, P, M).transpose(0, 1)  # (P, B, M)
        out = rows @ A  # (P, B, N)
        return out.transpose(0, 1).reshape(*extra, P, N)
    return (u.unsqueeze(-2) @ A).squeeze(-2)


def sample_gaussian(loc: torch.Tensor, cov: torch.Tensor, *, full_cov=False, jitter=1e-6):
    """A reparameterised draw from ``N(loc, cov)``.

    :param torch.Tensor loc: ``batch_shape + (N,)``.
    :param torch.Tensor cov: variances ``batch_shape + (N,)``, or with ``full_cov``
        covariances ``batch_shape + (N, N)``.
    """
    eps = torch.randn_like(loc)
    if full_cov:
        return loc + (cholesky(cov, jitter) @ eps.unsqueeze(-1)).squeeze(-1)
    return loc + cov.sqrt() * eps


def gaussian_kl(
    q_loc: torch.Tensor,
    q_scale_tril: torch.Tensor,
    p_loc: torch.Tensor | None = None,
    p_scale_tril: torch.Tensor | None = None,
) -> torch.Tensor:
    """Closed-form ``KL(N(q_loc, Sq) || N(p_loc, Sp))`` from lower Cholesky factors.

    ``p_loc=None`` means zero and ``p_scale_tril=None`` the identity (the whitened
    prior).

    .. math::

        \\mathrm{KL} = \\tfrac12\\big(\\operatorname{tr}(S_p^{-1} S_q)
            + (\\mu_p-\\mu_q)^\\top S_p^{-1}(\\mu_p-\\mu_q) - M
            + \\log|S_p| - \\log|S_q|\\big)

    :param q_loc: ``batch_shape + (M,)``.
    :param q_scale_tril: ``batch_shape + (M, M)``.
    :returns: ``batch_shape``.
    """
    M = q_loc.shape[-1]
    diff = q_loc if p_loc is None else q_loc - p_loc
    logdet_q = q_scale_tril.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
    if p_scale_tril is None:
        trace = q_scale_tril.pow(2).sum((-2, -1))
        maha = diff.pow(2).sum(-1)
        logdet_p = torch.zeros_like(logdet_q)
    else:
        p_scale_tril, q_b = torch.broadcast_tensors(p_scale_tril, q_scale_tril)
        trace = torch.linalg.solve_triangular(p_scale_tril, q_b, upper=False).pow(2).sum((-2, -1))
        maha = (
            torch.linalg.solve_triangular(p_scale_tril, diff.unsqueeze(-1), upper=False)
            .pow(2)
            .sum((-2, -1))
        )
        logdet_p = p_scale_tril.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
    return 0.5 * (trace + maha - M) + logdet_p - logdet_q


def check_kernel_memory(
    num_inducing: int,
    num_data: int = 0,
    *,
    num_outputs: int = 1,
    num_samples: int = 1,
    dtype=torch.float32,
    device=None,
    available: int | None = None,
) -> int:
    """Raise a :class:`ValueError` when the kernel matrices will not fit in memory.

    Counts the ``(M, M)`` inducing matrices (kernel, Cholesky, covariance of q(u)) and
    the ``(M, N)`` cross-covariances of each of ``num_samples`` draws, each a few times
    over for autograd.

    :param available: bytes available; default the free GPU memory on CUDA, else the
        physical memory of the machine.
    :returns: the estimated number of bytes.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    M, N, P, S = int(num_inducing), int(num_data), int(num_outputs), int(num_samples)
    need = 4 * itemsize * (3 * P * M * M + S * P * M * max(N, 1))
    if available is None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            available = torch.cuda.mem_get_info(dev)[0]
        else:
            try:
                available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):  # pragma: no cover
                available = 2**40
    if need > available:
        raise ValueError(
            f"{M} inducing points need about {need / 2**30:.2f} GiB for the kernel matrices "
            f"({P} outputs, {N} points in a batch, {S} samples) but only "
            f"{available / 2**30:.2f} GiB are available; use fewer inducing points or a "
            "smaller batch (subsample_size)"
        )
    return need
