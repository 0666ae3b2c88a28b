"""Predictive summaries, per-layer samples and the collapse measure of the deep GP."""

import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import Predictive

from pyro_trees.gp import conditional
from pyro_trees.guides import DGPFactorisedGuide, DGPIntermediateGuide
from pyro_trees.infer import collapse_ratio, dgp_predict, layer_samples
from pyro_trees.models import DeepGP

with warnings.catch_warnings():
    # linear_operator (imported by GPyTorch) uses torch.jit.script, deprecated in torch 2.13
    warnings.simplefilter("ignore", DeprecationWarning)
    import gpytorch


def _rbf():
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()


def _sparse_gp(scale, generator=None):
    """A one-layer deep GP and a guide with random means (from ``generator``: the
    test's fixture, the same whatever seed the test starts from)."""
    Z = torch.linspace(-1, 1, 12, dtype=torch.float64).unsqueeze(-1)
    with pyro.settings.context(module_local_params=True):
        model = DeepGP([_rbf()], [Z], noise=0.2)
        guide = DGPFactorisedGuide(model, init_scale=scale)
        with torch.no_grad():
            guide.u_1_loc = torch.randn(1, 12, dtype=torch.float64, generator=generator)
    return model, guide


def test_predictive_matches_the_analytic_sparse_gp():
    """Monte Carlo over 4000 draws against the exact Gaussian. The fixture (means, y) is
    fixed; over 30 seeds of the draws the largest errors were 0.018 (mean), 0.010
    (variance), 0.014 (log-likelihood; sd 0.005) and 0.059 (interval width in sd)."""
    g = torch.Generator().manual_seed(0)
    model, guide = _sparse_gp(0.5, g)
    x = torch.linspace(-1.2, 1.2, 9, dtype=torch.float64).unsqueeze(-1)
    loc, var = conditional(
        model.kernels[0], x, model.z_1, guide.u_1_loc, guide.u_1_scale_tril, whiten=True
    )
    with torch.no_grad():
        var = var[0] + model.noise**2
        y = loc[0] + var.sqrt() * torch.randn(9, dtype=torch.float64, generator=g)
    pred = dgp_predict(model, guide, x, y, num_samples=4000)
    with torch.no_grad():
        exact = torch.distributions.Normal(loc[0], var.sqrt()).log_prob(y).mean()
        torch.testing.assert_close(pred["mean"], loc[0], atol=0.03, rtol=0)
        torch.testing.assert_close(pred["var"], var, atol=0.03, rtol=0.05)
    assert pred["log_lik"] == pytest.approx(float(exact), abs=0.02)
    assert (pred["lower"] < pred["mean"]).all() and (pred["mean"] < pred["upper"]).all()
    # a 95 % interval of N(mu, var): about +-1.96 sd
    width = (pred["upper"] - pred["lower"]) / (2 * var.sqrt())
    assert ((width - 1.96).abs() < 0.15).all()
    with pytest.raises(ValueError, match="level"):
        dgp_predict(model, guide, x, level=1.5)


def test_predictive_intervals_are_exact_quantiles_of_the_mixture():
    """Two layers, a wide guide: the predictive is a non-Gaussian mixture of the per-draw
    N(f_loc, f_var + noise^2). ``lower``/``upper`` are its exact quantiles (the mixture
    CDF there is (1 -+ level) / 2 to 1e-9) and agree with the empirical quantiles of
    10^6 draws of y per point from the same mixture."""
    Z = torch.linspace(-1, 1, 6, dtype=torch.float64).unsqueeze(-1)
    with pyro.settings.context(module_local_params=True):
        model = DeepGP([_rbf(), _rbf()], [Z, Z], noise=0.1)
        guide = DGPFactorisedGuide(model, init_scale=1.0)
        with torch.no_grad():  # the fixture: the same whatever seed the test starts from
            g = torch.Generator().manual_seed(0)
            guide.u_2_loc = torch.randn(1, 6, dtype=torch.float64, generator=g)
    x = torch.linspace(-1, 1, 4, dtype=torch.float64).unsqueeze(-1)
    S, level = 20, 0.9
    pyro.set_rng_seed(0)
    pred = dgp_predict(model, guide, x, num_samples=S, level=level)
    pyro.set_rng_seed(0)  # the same draws of the inner layers
    with pyro.settings.context(module_local_params=True), torch.no_grad():
        draws = Predictive(
            model, guide=guide, num_samples=S, return_sites=("f_loc", "f_var"), parallel=True
        )(x)
        loc = draws["f_loc"]
        sd = (draws["f_var"] + model.noise**2).sqrt()
    assert loc.shape == (S, 4)
    assert float(loc.std(0).min()) > 0.3 * float(sd.mean())  # a real mixture
    for key, p in (("lower", (1 - level) / 2), ("upper", (1 + level) / 2)):
        cdf = torch.special.ndtr((pred[key] - loc) / sd).mean(0)
        torch.testing.assert_close(cdf, torch.full_like(cdf, p), atol=1e-9, rtol=0)
    g = torch.Generator().manual_seed(1)
    K = 50_000
    y = loc + sd * torch.randn(K, S, 4, generator=g, dtype=torch.float64)  # (K, S, N)
    q = torch.quantile(
        y.reshape(K * S, 4), torch.tensor([(1 - level) / 2, (1 + level) / 2]).double(), dim=0
    )
    # within 5 standard errors of the empirical quantile, sqrt(p (1 - p) / n) / pdf(q)
    for key, p, emp in (("lower", (1 - level) / 2, q[0]), ("upper", (1 + level) / 2, q[1])):
        pdf = (torch.exp(-0.5 * ((pred[key] - loc) / sd) ** 2) / sd).mean(0) / (2 * math.pi) ** 0.5
        se = (p * (1 - p) / (K * S)) ** 0.5 / pdf
        assert ((pred[key] - emp).abs() <= 5 * se).all(), (key, pred[key], emp, se)
        # power: on most points the bound is under 2 % of the mixture's sd (one point's
        # 5 % quantile sits where the mixture's density is low)
        spread = ((sd**2 + loc**2).mean(0) - loc.mean(0) ** 2).sqrt()
        assert (5 * se < 0.02 * spread).double().mean() >= 0.75, (se, spread)
    torch.testing.assert_close(pred["mean"], loc.mean(0))


def test_collapse_ratio_separates_point_masses_from_the_prior():
    x = torch.linspace(-1, 1, 25, dtype=torch.float64).unsqueeze(-1)
    point, guide = _sparse_gp(1e-4)
    s = layer_samples(point, guide, x, num_samples=30)  # at most 0.002 over 30 seeds
    assert s["layers"][0].shape == (30, 25, 1) and s["compositions"][0].shape == (30, 25, 1)
    assert collapse_ratio(point, s, 1) < 0.05
    prior, guide = _sparse_gp(1.0)
    with torch.no_grad():
        guide.u_1_loc = torch.zeros(1, 12, dtype=torch.float64)
    # over 30 seeds: 0.958-1.036 with 1000 draws (0.933-1.073 with 300)
    s = layer_samples(prior, guide, x, num_samples=1000)
    assert collapse_ratio(prior, s, 1) == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="layer"):
        collapse_ratio(prior, s, 2)


def _interp(xq, xp, fp):
    """Piecewise-linear interpolation of ``fp`` on the sorted 1-D grid ``xp`` at ``xq``."""
    j = torch.searchsorted(xp, xq).clamp(1, len(xp) - 1)
    t = (xq - xp[j - 1]) / (xp[j] - xp[j - 1])
    return fp[j - 1] + t * (fp[j] - fp[j - 1])


@pytest.mark.parametrize("inducing", ["layer", "propagated"])
def test_layer_samples_compose_coherently(inducing):
    """Each draw is one function per layer: layer i's function on its grid, evaluated
    (interpolated) at draw s's composition i - 1, reproduces draw s's composition i,
    and layer 1 on the input grid is composition 1. The only differences are the 1e-6
    nugget of the joint draws (sd 1.4e-3 for a difference) and the interpolation;
    pairing a draw's layer with another draw's composition misses by > 5x the tolerance.
    Also the shapes, grids spanning the previous composition, and the figure."""
    Z = torch.linspace(-1, 1, 6, dtype=torch.float64).unsqueeze(-1)
    ks = [_rbf(), _rbf(), _rbf()]
    with pyro.settings.context(module_local_params=True):
        if inducing == "layer":
            model = DeepGP(ks, [Z] * 3)
            guide = DGPFactorisedGuide(model, init_scale=0.3)
        else:
            model = DeepGP(ks, Z, inducing="propagated", jitter=1e-4)
            guide = DGPIntermediateGuide(model, init_scale=0.3, whiten=False)
    x = torch.linspace(-1, 1, 15, dtype=torch.float64).unsqueeze(-1)
    S, G = 3, 300
    s = layer_samples(model, guide, x, num_samples=S, num_grid=G)
    assert [g.shape[0] for g in s["grids"]] == [15, G, G]
    comp, layers = s["compositions"], s["layers"]
    assert [c.shape for c in comp] == [(S, 15, 1)] * 3
    assert [v.shape for v in layers] == [(S, 15, 1), (S, G, 1), (S, G, 1)]
    # grids of inner layers cover the range of the previous composition
    lo, hi = comp[0].min(), comp[0].max()
    assert s["grids"][1].min() <= lo and s["grids"][1].max() >= hi
    tol = 0.01
    assert (layers[0] - comp[0]).abs().max() < tol
    for i in (1, 2):
        grid = s["grids"][i][:, 0]
        for d in range(S):
            at = comp[i - 1][d, :, 0]
            own = _interp(at, grid, layers[i][d, :, 0])
            assert (own - comp[i][d, :, 0]).abs().max() < tol, (i, d)
            other = _interp(at, grid, layers[i][(d + 1) % S, :, 0])
            assert (other - comp[i][d, :, 0]).abs().max() > 5 * tol, (i, d)
    import matplotlib

    matplotlib.use("Agg")
    from pyro_trees.plotting import plot_dgp_layers

    fig = plot_dgp_layers([s, s], data=(x, x[:, 0]), labels=["a", "b"])
    assert len(fig.axes) == 4
