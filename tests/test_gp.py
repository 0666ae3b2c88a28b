"""GP conditionals: exact GP regression, whitening, KLs against torch's closed form."""

import warnings

import pytest
import torch

with warnings.catch_warnings():
    # linear_operator (imported by GPyTorch) decorates with torch.jit.script, deprecated
    # in torch 2.13; the pyproject filter names linear_operator but torch issues it.
    warnings.simplefilter("ignore", DeprecationWarning)
    import gpytorch
from torch.distributions import MultivariateNormal, kl_divergence

from pyro_trees.gp import (
    TensorKernel,
    check_kernel_memory,
    cholesky,
    conditional,
    gaussian_kl,
    gaussian_log_evidence,
    kernel_matrix,
    sample_gaussian,
)


def _kernel(batch_shape=()):
    k = gpytorch.kernels.ScaleKernel(
        gpytorch.kernels.RBFKernel(batch_shape=batch_shape), batch_shape=batch_shape
    ).double()
    k.base_kernel.lengthscale = 0.7
    k.outputscale = 1.3
    return k


def _exact_gp(kernel, X, y, Xs, noise):
    K = kernel(X, X).to_dense() + noise * torch.eye(len(X), dtype=X.dtype)
    Ks = kernel(Xs, X).to_dense()
    Kss = kernel(Xs, Xs).to_dense()
    mean = Ks @ torch.linalg.solve(K, y)
    cov = Kss - Ks @ torch.linalg.solve(K, Ks.T)
    return mean, cov


@pytest.mark.parametrize("whiten", [False, True])
@pytest.mark.parametrize("noise", [1e-1, 1e-6])
def test_conditional_equals_exact_gp_when_z_is_x(whiten, noise):
    torch.manual_seed(0)
    X = torch.rand(12, 2, dtype=torch.float64) * 3
    y = torch.sin(X.sum(-1))
    Xs = torch.rand(7, 2, dtype=torch.float64) * 3
    k = _kernel()
    # the exact posterior of u = f(X) given y ...
    K = k(X, X).to_dense()
    Ky = K + noise * torch.eye(12, dtype=X.dtype)
    m = K @ torch.linalg.solve(Ky, y)
    S = K - K @ torch.linalg.solve(Ky, K)
    S = 0.5 * (S + S.T) + 1e-10 * torch.eye(12, dtype=X.dtype)
    jitter = 1e-10
    Lzz = torch.linalg.cholesky(K + jitter * torch.eye(12, dtype=X.dtype))
    if whiten:  # u = L^-1 f(Z)
        m = torch.linalg.solve_triangular(Lzz, m.unsqueeze(-1), upper=False).squeeze(-1)
        S = torch.linalg.solve_triangular(
            Lzz, torch.linalg.solve_triangular(Lzz, S, upper=False).T, upper=False
        )
        S = 0.5 * (S + S.T) + 1e-10 * torch.eye(12, dtype=X.dtype)
    LS = torch.linalg.cholesky(S)
    # ... mapped through the conditional equals exact GP regression at new inputs
    mean, cov = conditional(
        k, Xs, X, m.unsqueeze(0), LS.unsqueeze(0), whiten=whiten, full_cov=True, jitter=jitter
    )
    emean, ecov = _exact_gp(k, X, y, Xs, noise)
    torch.testing.assert_close(mean[0], emean, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cov[0], ecov, atol=1e-6, rtol=1e-6)
    _, var = conditional(k, Xs, X, m.unsqueeze(0), LS.unsqueeze(0), whiten=whiten, jitter=jitter)
    torch.testing.assert_close(var[0], ecov.diagonal(), atol=1e-6, rtol=1e-6)


def test_point_conditional_interpolates_as_noise_goes_to_zero():
    torch.manual_seed(1)
    X = torch.linspace(0, 2, 8, dtype=torch.float64).unsqueeze(-1)
    y = torch.cos(3 * X[:, 0])
    k = _kernel()
    Xs = torch.rand(5, 1, dtype=torch.float64) * 2
    mean, cov = conditional(k, Xs, X, y.unsqueeze(0), full_cov=True, jitter=1e-12)
    emean, ecov = _exact_gp(k, X, y, Xs, 1e-12)
    torch.testing.assert_close(mean[0], emean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cov[0], ecov, atol=1e-6, rtol=1e-5)
    # at the inducing inputs themselves the posterior is the data, with no variance
    mean, var = conditional(k, X, X, y.unsqueeze(0), jitter=1e-12)
    torch.testing.assert_close(mean[0], y, atol=1e-6, rtol=1e-6)
    assert var.abs().max() < 1e-6


def test_whitened_equals_unwhitened_under_the_change_of_variables():
    torch.manual_seed(2)
    Z = torch.randn(6, 3, dtype=torch.float64)
    X = torch.randn(4, 3, dtype=torch.float64)
    k = _kernel(batch_shape=(2,))
    Lzz = cholesky(kernel_matrix(k, Z), 1e-6)  # (2, 6, 6)
    v = torch.randn(2, 6, dtype=torch.float64)
    Lv = torch.tril(torch.randn(2, 6, 6, dtype=torch.float64)) + 3 * torch.eye(6)
    u = (Lzz @ v.unsqueeze(-1)).squeeze(-1)
    Lu = Lzz @ Lv
    a = conditional(k, X, Z, v, Lv, whiten=True, full_cov=True)
    b = conditional(k, X, Z, u, Lu, whiten=False, full_cov=True)
    for s, t in zip(a, b, strict=True):
        assert s.shape == (2, 4, 4)[: s.dim()]
        torch.testing.assert_close(s, t)


def test_conditional_broadcasts_sample_batches_and_shared_kernels():
    Z = torch.randn(5, 2)
    X = torch.randn(10, 3, 2)  # a batch of 10 sample inputs
    u = torch.randn(10, 4, 5)
    k = gpytorch.kernels.RBFKernel()
    loc, var = conditional(k, X, Z.expand(10, 5, 2), u)
    assert loc.shape == var.shape == (10, 4, 3)
    loc, cov = conditional(k, X, Z.expand(10, 5, 2), u, full_cov=True)
    assert cov.shape == (10, 4, 3, 3)
    f = sample_gaussian(loc, cov, full_cov=True)
    assert f.shape == (10, 4, 3)


def test_gaussian_kl_equals_torch_closed_form():
    torch.manual_seed(3)
    B, M = (3, 2), 5
    q_loc = torch.randn(*B, M, dtype=torch.float64)
    p_loc = torch.randn(*B, M, dtype=torch.float64)
    q_L = torch.tril(torch.randn(*B, M, M, dtype=torch.float64), -1) + torch.diag_embed(
        torch.rand(*B, M, dtype=torch.float64) + 0.5
    )
    p_L = torch.tril(torch.randn(M, M, dtype=torch.float64), -1) + torch.diag(
        torch.rand(M, dtype=torch.float64) + 0.5
    )
    q = MultivariateNormal(q_loc, scale_tril=q_L)
    expect = kl_divergence(q, MultivariateNormal(p_loc, scale_tril=p_L.expand(*B, M, M)))
    torch.testing.assert_close(gaussian_kl(q_loc, q_L, p_loc, p_L), expect)
    eye = torch.eye(M, dtype=torch.float64).expand(*B, M, M)
    expect = kl_divergence(q, MultivariateNormal(torch.zeros_like(q_loc), scale_tril=eye))
    torch.testing.assert_close(gaussian_kl(q_loc, q_L), expect)


def test_gradients_reach_kernel_hyperparameters():
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    Z = torch.randn(4, 1, requires_grad=True)
    u = torch.randn(1, 4, requires_grad=True)
    loc, var = conditional(k, torch.randn(6, 1), Z, u, torch.eye(4).unsqueeze(0) * 0.3)
    (loc.sum() + var.sum()).backward()
    for p in [*k.parameters(), Z, u]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def test_cholesky_raises_on_indefinite():
    with pytest.raises(ValueError, match="not positive definite"):
        cholesky(-torch.eye(3))


def test_memory_check_says_how_much():
    assert check_kernel_memory(10, 100, available=10**9) > 0
    with pytest.raises(ValueError, match=r"100000 inducing points need about \d+\.\d+ GiB"):
        check_kernel_memory(100_000, 1000, available=2**30)


@pytest.mark.parametrize(
    "a_shape, u_shape",
    [
        ((3, 5, 7), (3, 5)),  # one draw
        ((3, 5, 7), (4, 3, 5)),  # particles that A lacks: folded into rows
        ((2, 1, 3, 5, 7), (2, 4, 3, 5)),  # broadcast batch dims
        ((4, 3, 5, 7), (4, 3, 5)),  # A per particle (inputs of an inner layer)
        ((1, 5, 7), (4, 3, 5)),  # a kernel shared by the outputs
    ],
)
def test_projection_equals_transposed_matvec(a_shape, u_shape):
    from pyro_trees.gp import _project

    g = torch.Generator().manual_seed(0)
    A = torch.randn(a_shape, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(u_shape, generator=g, dtype=torch.float64, requires_grad=True)
    out = _project(A, u)
    ref = (A.mT @ u.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, ref)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ga, gu = torch.autograd.grad((out * w).sum(), (A, u))
    ra, ru = torch.autograd.grad((ref * w).sum(), (A, u))
    torch.testing.assert_close(ga, ra)
    torch.testing.assert_close(gu, ru)


@pytest.mark.parametrize("base", [gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel])
def test_kernel_columns_do_not_depend_on_the_other_new_rows(base):
    # GPyTorch centres both inputs at the mean of its first argument's rows: with the
    # fixed set first, a far-away new row must not move the other rows' kernel values
    torch.manual_seed(0)
    k = gpytorch.kernels.ScaleKernel(base()).double()
    z = torch.randn(9, 2, dtype=torch.float64)
    x = torch.randn(4, 2, dtype=torch.float64)
    far = torch.tensor([[1e10, 0.0]], dtype=torch.float64)
    alone = kernel_matrix(k, z, x)
    batch = kernel_matrix(k, z, torch.cat([x, far]))
    torch.testing.assert_close(batch[..., :4], alone, rtol=1e-12, atol=1e-15)
    assert float(batch[..., 4].detach().abs().max()) == 0.0  # a far row is uncorrelated


def test_conditional_marginals_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    k = _kernel()
    z = torch.randn(6, 2, dtype=torch.float64)
    u = torch.randn(1, 6, dtype=torch.float64)
    x = torch.randn(4, 2, dtype=torch.float64)
    xb = torch.cat([x, torch.tensor([[1e10, -1e10]], dtype=torch.float64)])
    loc, var = conditional(k, x, z, u, whiten=True)
    loc_b, var_b = conditional(k, xb, z, u, whiten=True)
    torch.testing.assert_close(loc_b[..., :4], loc, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(var_b[..., :4], var, rtol=1e-12, atol=1e-14)


def _stationary(family: str, scaled: bool, ard: bool):
    dims = 3 if ard else None
    if family == "rbf":
        base = gpytorch.kernels.RBFKernel(ard_num_dims=dims)
    else:
        base = gpytorch.kernels.MaternKernel(nu=float(family), ard_num_dims=dims)
    kernel = (gpytorch.kernels.ScaleKernel(base) if scaled else base).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in kernel.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return kernel


@pytest.mark.parametrize("family", ["rbf", "0.5", "1.5", "2.5"])
@pytest.mark.parametrize("scaled", [True, False])
def test_tensor_kernel_gives_gpytorch_values_and_gradients(family, scaled):
    kernel = _stationary(family, scaled, ard=scaled)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(25, 3, generator=gen, dtype=torch.float64)
    z = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    ours = TensorKernel.of(kernel)
    assert ours is not None and ours.nu == (None if family == "rbf" else float(family))
    # on the diagonal of k(x, x) the distance is rounding noise, which Matern 1/2's
    # kink at r = 0 turns into ~1e-8; elsewhere the two agree to the last digits
    atol = 1e-7 if family == "0.5" else 1e-12
    for a, b, diag in [(x, None, False), (z, x, False), (x, None, True)]:
        ref = kernel_matrix(kernel, a, b, diag=diag)
        got = kernel_matrix(ours, a, b, diag=diag)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=atol)
    # gradients reach the raw parameters through the kernel's own constraints
    w = torch.randn(6, 25, generator=gen, dtype=torch.float64)
    params = list(kernel.parameters())
    ref = torch.autograd.grad((kernel_matrix(kernel, z, x)[0] * w).sum(), params)
    got = torch.autograd.grad((kernel_matrix(TensorKernel.of(kernel), z, x)[0] * w).sum(), params)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family", ["rbf", "1.5"])
@pytest.mark.parametrize("scaled", [True, False])
def test_a_kernel_batched_over_outputs_gives_gpytorch_values_and_gradients(family, scaled):
    shape = torch.Size([3])
    base = (
        gpytorch.kernels.RBFKernel(ard_num_dims=2, batch_shape=shape)
        if family == "rbf"
        else gpytorch.kernels.MaternKernel(nu=1.5, ard_num_dims=2, batch_shape=shape)
    )
    kernel = gpytorch.kernels.ScaleKernel(base, batch_shape=shape) if scaled else base
    kernel = kernel.double()
    with torch.no_grad():
        for p in kernel.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert TensorKernel.of(kernel) is None  # batched kernels only on request
    ours = TensorKernel.of(kernel, batched=True)
    assert ours.batch_shape == shape
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 2, generator=gen, dtype=torch.float64)  # particles of a layer
    z = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    for a, b, diag in [(z, None, False), (z, x, False), (x, None, True), (x[0], None, False)]:
        ref = kernel_matrix(kernel, a, b, diag=diag)
        got = kernel_matrix(ours, a, b, diag=diag)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    w = torch.randn(4, 3, 5, 7, generator=gen, dtype=torch.float64)
    params = list(kernel.parameters())
    ref = torch.autograd.grad((kernel_matrix(kernel, z, x) * w).sum(), params)
    mine = kernel_matrix(TensorKernel.of(kernel, batched=True), z, x)
    for g, r in zip(torch.autograd.grad((mine * w).sum(), params), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_tensor_kernel_declines_the_kernels_it_does_not_cover():
    kernels = gpytorch.kernels
    assert TensorKernel.of(kernels.PeriodicKernel()) is None
    assert TensorKernel.of(kernels.RBFKernel(active_dims=[0])) is None
    assert TensorKernel.of(kernels.RBFKernel(batch_shape=torch.Size([2]))) is None
    assert TensorKernel.of(kernels.ScaleKernel(kernels.LinearKernel())) is None
    assert TensorKernel.of(kernels.AdditiveKernel(kernels.RBFKernel(), kernels.RBFKernel())) is None
    with pytest.raises(ValueError, match="nu must be"):
        TensorKernel(torch.ones(1), nu=3.5)


def test_gaussian_log_evidence_and_its_closed_form_gradient():
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(12, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    eye = torch.eye(12, dtype=torch.float64)

    def cov():
        return A @ A.mT / 12 + 0.5 * eye

    ours = gaussian_log_evidence(cov(), r, jitter=1e-6)
    ref = MultivariateNormal(torch.zeros(12, dtype=torch.float64), cov() + 1e-6 * eye).log_prob(r)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    got = torch.autograd.grad(gaussian_log_evidence(cov(), r, jitter=1e-6), [A, r])
    want = torch.autograd.grad(ref, [A, r])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    # a batch of matrices, and the factorisation's retries: the gradient is the one of
    # the matrix that was factorised
    C = torch.stack([cov().detach(), 2 * cov().detach()]).requires_grad_(True)
    rb = torch.stack([r.detach(), -r.detach()])
    value = gaussian_log_evidence(C, rb)
    assert value.shape == (2,)
    torch.testing.assert_close(
        value, MultivariateNormal(torch.zeros_like(rb), C + 1e-6 * eye).log_prob(rb)
    )
    indefinite = torch.diag(torch.tensor([1.0, 1.0, -0.5], dtype=torch.float64))
    indefinite.requires_grad_(True)
    r3 = torch.ones(3, dtype=torch.float64)
    value = gaussian_log_evidence(indefinite, r3, jitter=0.1)  # fails at 0.1, works at 1
    (grad,) = torch.autograd.grad(value, [indefinite])
    shifted = (indefinite + torch.eye(3, dtype=torch.float64)).detach().requires_grad_(True)
    ref = MultivariateNormal(torch.zeros(3, dtype=torch.float64), shifted).log_prob(r3)
    torch.testing.assert_close(value, ref)
    torch.testing.assert_close(grad, torch.autograd.grad(ref, [shifted])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tensor_kernel_diagonal_is_the_outputscale_exactly(dtype):
    """k(x, x) has distance 0 on its diagonal, not the quadratic expansion's rounding,
    which Matern 1/2's kink at 0 turned into up to 1e-2 in float32."""
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=0.5)).to(dtype)
    x = 1000 + 10 * torch.randn(300, 4, dtype=dtype, generator=torch.Generator().manual_seed(0))
    K = TensorKernel.of(kernel)(x)
    scale = kernel.outputscale.detach()
    # the distance's floor, sqrt(1e-30), is the one departure from exactly 1
    torch.testing.assert_close(K.diagonal().detach(), scale.expand(300), rtol=1e-14, atol=0)


def test_cholesky_names_non_finite_entries_apart_from_indefinite_ones():
    bad = torch.eye(3, dtype=torch.float64)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        cholesky(bad)
    with pytest.raises(ValueError, match="not positive definite"):
        cholesky(-torch.eye(3, dtype=torch.float64))
