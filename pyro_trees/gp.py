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

import math
import os
import warnings

import torch

__all__ = [
    "TensorKernel",
    "check_kernel_memory",
    "cholesky",
    "conditional",
    "gaussian_kl",
    "gaussian_log_evidence",
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

    :param kernel: a :class:`gpytorch.kernels.Kernel` (``batch_shape`` ``()`` or ``(P,)``),
        or a :class:`TensorKernel` (``Pk`` is then 1).
    :param torch.Tensor x1: ``batch_shape + (N, D)``, the fixed (reference) set.
    :param torch.Tensor x2: ``batch_shape + (M, D)``; ``None`` means ``x1``.
    :param bool diag: return only the diagonal of ``k(x1, x1)``.
    :returns: ``batch_shape + (Pk, N, M)``, or ``batch_shape + (Pk, N)`` with ``diag``,
        where ``Pk`` is 1 or the kernel's batch size.
    """
    if isinstance(kernel, TensorKernel):
        out = kernel(x1, x2, diag=diag)
        return out if kernel.batch_shape else out.unsqueeze(-2 if diag else -3)
    a = x1.unsqueeze(-3)
    if diag:
        out = kernel(a, a, diag=True)
        out = out.to_dense() if hasattr(out, "to_dense") else out
        return out.expand(*a.shape[:-2], a.shape[-2]) if out.dim() < a.dim() - 1 else out
    b = a if x2 is None else x2.unsqueeze(-3)
    out = kernel(a, b)
    return out.to_dense() if hasattr(out, "to_dense") else out


#: the Matérn smoothness values GPyTorch's ``MaternKernel`` takes
_MATERN_NU = (0.5, 1.5, 2.5)


class TensorKernel:
    r"""A GPyTorch RBF or Matérn kernel, optionally inside a ``ScaleKernel``, as plain
    tensor code: its hyperparameters read once (:meth:`of`, through the kernel's own
    constraints, so that gradients reach its raw parameters), then every matrix computed
    from them without GPyTorch's lazy tensors and settings, which ``torch.compile``
    cannot trace in one graph. The values are GPyTorch's up to rounding: the inputs are
    divided by the lengthscales and centred on the mean of the rows of ``x1`` before the
    quadratic expansion of the squared distances, as GPyTorch does (see
    :func:`kernel_matrix` on why ``x1`` is the fixed set). The diagonal of ``k(x1)`` has
    distance 0 exactly (GPyTorch keeps the expansion's rounding there, which Matérn 1/2's
    kink at 0 turns into up to 1e-2 in float32).

    .. math::

        k(a, b) = s \cdot \begin{cases}
            \exp(-r^2 / 2) & \text{RBF} \\
            p_\nu(r) \exp(-\sqrt{2 \nu}\, r) & \text{Matérn } \nu
        \end{cases}, \qquad r = \lVert (a - b) / \ell \rVert,

    with :math:`p_{1/2} = 1`, :math:`p_{3/2} = 1 + \sqrt3 r`,
    :math:`p_{5/2} = 1 + \sqrt5 r + \tfrac53 r^2`.

    A kernel batched over outputs (GPyTorch's ``batch_shape=(P,)``, as a deep GP's layer
    uses) has lengthscales ``(P, 1, L)`` and output scales ``(P,)``; it then maps inputs
    ``(..., N, L)`` to ``(..., P, N, M)`` (:attr:`batch_shape` is ``(P,)``).

    :param torch.Tensor lengthscale: ``(L,)`` (one per input, ARD) or ``(1,)``; batched,
        ``(P, 1, L)`` or ``(P, 1, 1)``.
    :param outputscale: the ``ScaleKernel``'s :math:`s`, a 0-dim tensor (batched:
        ``(P,)``), or ``None``.
    :param nu: ``None`` for the RBF kernel, else the Matérn smoothness (0.5, 1.5, 2.5).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.gp import TensorKernel, import_gpytorch
    >>> gpytorch = import_gpytorch()
    >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=2))
    >>> x = torch.randn(5, 2)
    >>> K = TensorKernel.of(kernel)(x)
    >>> torch.allclose(K, kernel(x, x).to_dense(), atol=1e-6)
    True
    """

    def __init__(self, lengthscale: torch.Tensor, outputscale=None, nu: float | None = None):
        if nu is not None and float(nu) not in _MATERN_NU:
            raise ValueError(f"nu must be None (RBF) or one of {_MATERN_NU}, got {nu!r}")
        self.lengthscale = lengthscale
        self.outputscale = outputscale
        self.nu = None if nu is None else float(nu)
        self.batch_shape = lengthscale.shape[:-2] if lengthscale.dim() > 1 else torch.Size()

    @classmethod
    def of(cls, kernel, *, batched: bool = False) -> TensorKernel | None:
        """The tensors of ``kernel`` read now, or ``None`` for a kernel this class does
        not cover (another family, ``active_dims``, a batch shape unless ``batched``).

        :param bool batched: also take a kernel batched over outputs (one batch
            dimension, the same for a ``ScaleKernel`` and its base kernel)."""
        gpytorch = import_gpytorch()
        kernels = gpytorch.kernels
        outputscale, base = None, kernel
        if type(kernel) is kernels.ScaleKernel:
            outputscale, base = kernel.outputscale, kernel.base_kernel
        batch = base.batch_shape
        for part in (kernel, base):
            if part.active_dims is not None or part.batch_shape != batch:
                return None
        if len(batch) > (1 if batched else 0):
            return None
        if type(base) is kernels.RBFKernel:
            nu = None
        elif type(base) is kernels.MaternKernel and float(base.nu) in _MATERN_NU:
            nu = float(base.nu)
        else:
            return None
        lengthscale = base.lengthscale if len(batch) else base.lengthscale.reshape(-1)
        return cls(lengthscale, outputscale, nu)

    def __call__(self, x1: torch.Tensor, x2: torch.Tensor | None = None, *, diag: bool = False):
        """``k(x1, x2)`` ``(N, M)`` for ``x1`` ``(N, L)`` and ``x2`` ``(M, L)`` (``None``:
        ``x1``); with ``diag``, the diagonal of ``k(x1, x1)``, ``(N,)``. A batched
        kernel puts its batch before the rows: ``(..., P, N, M)``, ``(..., P, N)``."""
        if self.batch_shape:
            x1 = x1.unsqueeze(-3)
            x2 = None if x2 is None else x2.unsqueeze(-3)
        if diag:
            k = x1.new_ones(())  # r = 0 on the diagonal
            k = k.expand(torch.broadcast_shapes(x1.shape[:-1], self.lengthscale.shape[:-1]))
        else:
            a = x1 / self.lengthscale
            b = a if x2 is None else x2 / self.lengthscale
            centre = a.mean(-2, keepdim=True)
            a, b = a - centre, b - centre
            # |a|^2 + |b|^2 - 2 a.b as one product of padded rows (no pass over the
            # (N, M) result but the product's)
            a_sq, b_sq = a.pow(2).sum(-1, keepdim=True), b.pow(2).sum(-1, keepdim=True)
            right = torch.cat([b, torch.ones_like(b_sq), b_sq], -1)
            if self.nu is None:
                # -r^2 / 2 straight from the product, each summand scaled by -1/2 (exact),
                # and the clamp and the exponential in place, as GPyTorch does
                left = torch.cat([a, -0.5 * a_sq, torch.full_like(a_sq, -0.5)], -1)
                half = (left @ right.mT).clamp_max_(0)
                if x2 is None:  # r = 0 on the diagonal exactly, not the product's rounding
                    half = half - torch.diag_embed(half.diagonal(dim1=-2, dim2=-1))
                k = half.exp_()
            else:
                left = torch.cat([-2.0 * a, a_sq, torch.ones_like(a_sq)], -1)
                sq = (left @ right.mT).clamp_min(0)
                if x2 is None:  # r = 0 on the diagonal exactly, not the product's rounding
                    sq = sq - torch.diag_embed(sq.diagonal(dim1=-2, dim2=-1))
                r = sq.clamp_min(1e-30).sqrt()
                k = torch.exp(-math.sqrt(2 * self.nu) * r)
                if self.nu == 1.5:
                    k = k * (1 + math.sqrt(3) * r)
                elif self.nu == 2.5:
                    k = k * (1 + math.sqrt(5) * r + (5.0 / 3.0) * sq)
        if self.outputscale is None:
            return k
        scale = self.outputscale
        if self.batch_shape:  # (P,) -> (P, 1, 1), or (P, 1) for the diagonal
            scale = scale.reshape(scale.shape + (1,) * (1 if diag else 2))
        return scale * k


def cholesky(K: torch.Tensor, jitter: float = 1e-6, *, max_tries: int = 4) -> torch.Tensor:
    """Cholesky factor of ``K + jitter * I``, retrying with 10x the jitter when it fails.

    :raises ValueError: when ``K`` is not positive definite even with the largest jitter.
    """
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    for attempt in range(max_tries):
        L, info = torch.linalg.cholesky_ex(K + (jitter * 10**attempt) * eye)
        if not bool((info > 0).any()):
            return L
    if not bool(torch.isfinite(K).all()):  # checked only once the factorisation failed
        raise ValueError(
            f"the matrix of size {K.shape[-1]} to factorise has NaN or infinite entries: "
            "non-finite inputs, kernel hyperparameters or noise levels (a diverged fit?)"
        )
    raise ValueError(
        f"kernel matrix of size {K.shape[-1]} is not positive definite even with jitter "
        f"{jitter * 10 ** (max_tries - 1):g}; check for duplicated inducing inputs or "
        "non-finite kernel hyperparameters"
    )


class _GaussianEvidence(torch.autograd.Function):
    r""":math:`\log \mathcal{N}(r \mid 0, C)` from the Cholesky factor ``L`` of ``C``,
    with the gradient in ``C`` in closed form (see :func:`gaussian_log_evidence`)."""

    @staticmethod
    def forward(ctx, C, L, r):
        alpha = torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)  # C^-1 r
        ctx.save_for_backward(L, alpha)
        quad = (r * alpha).sum(-1)
        logdet = L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (r.shape[-1] * math.log(2 * math.pi) + quad) - logdet

    @staticmethod
    def backward(ctx, grad):
        L, alpha = ctx.saved_tensors
        grad_c = grad_r = None
        if ctx.needs_input_grad[0]:
            outer = alpha.unsqueeze(-1) * alpha.unsqueeze(-2)
            grad_c = 0.5 * grad[..., None, None] * (outer - torch.cholesky_inverse(L))
        if ctx.needs_input_grad[2]:
            grad_r = -grad.unsqueeze(-1) * alpha
        return grad_c, None, grad_r


def gaussian_log_evidence(C: torch.Tensor, r: torch.Tensor, jitter: float = 1e-6, chol=None):
    r""":math:`\log \mathcal{N}(r \mid 0, C + \epsilon I)`, the log evidence of an exact
    GP (``C`` its kernel matrix plus the noise), differentiable in ``C`` and ``r``.

    The gradient in ``C`` is written in closed form,
    :math:`\tfrac12 (\alpha \alpha^\top - C^{-1})` with :math:`\alpha = C^{-1} r`,
    from the factor of the forward pass: about a third of the time of differentiating
    through the Cholesky factorisation (two triangular solves and a product of
    :math:`N \times N` matrices), the cost that dominates an exact GP's step. The
    gradient is not differentiable again.

    :param torch.Tensor C: ``batch_shape + (N, N)``, symmetric positive definite.
    :param torch.Tensor r: ``batch_shape + (N,)``.
    :param float jitter: :math:`\epsilon`, added before the factorisation.
    :param chol: the factorisation ``chol(C, jitter)`` (default :func:`cholesky`, which
        retries with more jitter; the gradient is that of the matrix factorised).
    :returns: ``batch_shape``.
    """
    L = (cholesky if chol is None else chol)(C.detach(), jitter)
    return _GaussianEvidence.apply(C, L, r)


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
