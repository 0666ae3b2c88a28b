import io
import math

import gpytorch
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive

from pyro_trees.distributions import BalancedLeaf, tree_balance_kl
from pyro_trees.guides import HeteroscedasticGPGuide, RNNTree
from pyro_trees.infer import CollapsedELBO, TreeELBO
from pyro_trees.models import HeteroscedasticGP


@pytest.fixture(autouse=True)
def _scope():
    with pyro.get_param_store().scope():
        yield


def _model(depth=2, sparse=0, dtype=torch.float64, seed=0, features=1):
    torch.manual_seed(seed)
    z = torch.randn(sparse, features, dtype=dtype) if sparse else None
    model = HeteroscedasticGP(features, depth, inducing_points=z).to(dtype)
    with torch.no_grad():
        model.leaf_log_scale = torch.randn(2**depth, dtype=dtype) * 0.5
        model.mean_constant = torch.tensor(0.3, dtype=dtype)
        model.kernel.base_kernel.lengthscale = 0.7
        model.kernel.outputscale = 1.3
    guide = HeteroscedasticGPGuide(features, depth, num_inducing=sparse).to(dtype)
    return model, guide


def _data(n=30, dtype=torch.float64, features=1):
    x = torch.linspace(-1, 1, n, dtype=dtype).unsqueeze(-1)
    if features > 1:  # a second, informative-free input so every head gets a gradient
        x = torch.cat([x, torch.randn(n, features - 1, dtype=dtype)], -1)
    y = torch.sin(3 * x[:, 0]) + 0.1 * (1 + (x[:, 0] > 0)) * torch.randn(n, dtype=dtype)
    return x, y


def test_collapsed_bound_equals_brute_force_integral():
    """log Z(q(m)) by a 2-D quadrature over f, plus the KL to the balance prior."""
    model, _ = _model()
    x = torch.tensor([[-0.5], [0.4]], dtype=torch.float64)
    y = torch.tensor([0.2, -0.7], dtype=torch.float64)
    logits = torch.randn(2, 4, dtype=torch.float64)
    bound = model.collapsed_bound(x, y, logits)

    q = logits.softmax(-1)
    s = model.leaf_log_scale.detach()
    K = model.kernel(x).to_dense().detach()
    g = torch.linspace(-6, 6, 481, dtype=torch.float64)
    F1, F2 = torch.meshgrid(g, g, indexing="ij")
    f = torch.stack([F1, F2], -1) + model.mean_constant.detach()  # (G, G, 2)
    prior = dist.MultivariateNormal(
        model.mean_constant.detach().expand(2), covariance_matrix=K
    ).log_prob(f)
    loglik = (q * dist.Normal(f.unsqueeze(-1), s.exp()).log_prob(y.unsqueeze(-1).expand(2, 4))).sum(
        (-1, -2)
    )
    dA = (g[1] - g[0]) ** 2
    log_z = torch.logsumexp(prior + loglik, dim=(0, 1)) + math.log(dA)
    kl = tree_balance_kl(logits, 2)
    assert torch.allclose(bound, log_z - kl, atol=1e-6, rtol=0)


def test_collapsed_bound_is_l1_at_optimal_q_f():
    """L2 = L1(q*(f), q(m)) with the Gaussian q*(f), and L1 is lower for any other q(f)."""
    model, _ = _model()
    x, y = _data(7)
    logits = torch.randn(7, 4, dtype=torch.float64)
    bound = model.collapsed_bound(x, y, logits)
    q = logits.softmax(-1)
    s = model.leaf_log_scale.detach()
    c = model.mean_constant.detach()
    prec = q @ torch.exp(-2 * s)
    K = model.kernel(x).to_dense().detach() + 1e-6 * torch.eye(7, dtype=torch.float64)
    cov = torch.linalg.inv(torch.linalg.inv(K) + torch.diag(prec))
    mu = cov @ (prec * (y - c))

    def l1(mu, cov):
        e2 = (y - c - mu) ** 2 + cov.diagonal()
        ell = (-0.5 * math.log(2 * math.pi) - (q * s).sum(-1) - 0.5 * prec * e2).sum()
        kl_f = torch.distributions.kl_divergence(
            dist.MultivariateNormal(mu, covariance_matrix=cov),
            dist.MultivariateNormal(torch.zeros(7, dtype=torch.float64), covariance_matrix=K),
        )
        return ell - kl_f - tree_balance_kl(logits, 2)

    assert torch.allclose(bound, l1(mu, cov), atol=1e-6)
    assert l1(mu + 0.05, cov) < bound and l1(mu, 1.2 * cov) < bound


def test_single_noise_level_is_homoscedastic_gp_evidence():
    model, _ = _model()
    x, y = _data(25)
    with torch.no_grad():
        model.leaf_log_scale = torch.full((4,), -1.1, dtype=torch.float64)
    uniform = torch.zeros(25, 4, dtype=torch.float64)  # q = p's marginal: no KL
    bound = model.collapsed_bound(x, y, uniform)

    class ExactGP(gpytorch.models.ExactGP):
        def __init__(self, lik):
            super().__init__(x, y, lik)
            self.mean_module = gpytorch.means.ConstantMean()
            self.covar_module = model.kernel

        def forward(self, inp):
            return gpytorch.distributions.MultivariateNormal(
                self.mean_module(inp), self.covar_module(inp)
            )

    lik = gpytorch.likelihoods.GaussianLikelihood().double()
    gp = ExactGP(lik).double()
    with torch.no_grad():
        lik.noise = math.exp(2 * -1.1)
        gp.mean_module.constant.fill_(float(model.mean_constant))
    gp.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, gp)
    with gpytorch.settings.max_cholesky_size(10**6):
        expected = mll(gp(x), y) * 25
    assert torch.allclose(bound, expected, atol=1e-5)


def test_collapsed_elbo_trains_with_plain_svi_and_grads_reach_all_parameters():
    # two inputs: with one, the split-dimension softmax is constant (no gradient)
    model, guide = _model(features=2)
    x, y = _data(20, features=2)
    loss = CollapsedELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=loss)
    first = svi.step(x, y)
    assert math.isfinite(first)
    model.zero_grad()
    guide.zero_grad()
    loss.differentiable_loss(model, guide, x, y).backward()
    named = list(model.named_parameters()) + list(guide.named_parameters())
    missing = [n for n, p in named if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing, missing
    store = set(pyro.get_param_store().keys())
    assert any("leaf_log_scale" in k for k in store) and any("kernel" in k for k in store)
    assert loss.loss(model, guide, x, y) == pytest.approx(
        float(-model.collapsed_bound(x, y, guide.tree(x)).detach())
    )


def test_sparse_model_with_tree_elbo_and_subsampling():
    model, guide = _model(sparse=6, features=2)
    x, y = _data(40, features=2)
    elbo = TreeELBO()
    loss = elbo.differentiable_loss(model, guide, x, y, subsample_size=10)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    named = list(model.named_parameters()) + list(guide.named_parameters())
    missing = [n for n, p in named if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing, missing
    trace = pyro.poutine.trace(model).get_trace(x, None, 10)
    assert isinstance(trace.nodes["leaf"]["fn"], BalancedLeaf)
    assert trace.nodes["u"]["value"].shape == (6,)
    assert trace.nodes["f"]["value"].shape == (10,)
    assert trace.nodes["obs"]["value"].shape == (10,)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=elbo)
    assert math.isfinite(svi.step(x, y, 10))
    post = Predictive(model, guide=guide, num_samples=3)(x)
    assert post["obs"].shape == (3, 40) and post["u"].shape[-1] == 6


def test_sparse_ell_matches_analytic_expectation_over_f():
    """With u fixed, obs + f_var is E_{p(f|u)} of the log-likelihood (by sampling f)."""
    model, _ = _model(depth=1, sparse=5)
    x, y = _data(6)
    u = torch.randn(5, dtype=torch.float64)
    leaf = torch.tensor([0, 1, 1, 0, 1, 0])
    cond = pyro.poutine.condition(model, {"u": u, "leaf": leaf})
    tr = pyro.poutine.trace(cond).get_trace(x, y)
    tr.compute_log_prob()
    analytic = tr.nodes["obs"]["log_prob"] + tr.nodes["f_var"]["log_prob"]
    tr_f = pyro.poutine.trace(pyro.poutine.condition(model, {"u": u, "leaf": leaf})).get_trace(
        x, None
    )
    loc, scale = tr_f.nodes["f"]["fn"].loc, tr_f.nodes["f"]["fn"].scale
    f = loc + scale * torch.randn(200000, 6, dtype=torch.float64)
    s = model.leaf_log_scale.detach()[leaf]
    mc = dist.Normal(f, s.exp()).log_prob(y).mean(0)
    assert torch.allclose(analytic, mc, atol=0.02 * float(analytic.detach().abs().max()))


def test_prior_predictive_exact_model():
    model, _ = _model()
    x, _ = _data(8)
    samples = Predictive(model, num_samples=3)(x)
    assert samples["obs"].shape == (3, 8) and samples["leaf"].shape == (3, 8)


def test_predict_tree_and_posterior_and_rules():
    model, guide = _model()
    x, y = _data(30)
    x_new = torch.linspace(-1.2, 1.2, 9, dtype=torch.float64).unsqueeze(-1)
    tree = model.predict(x_new, guide, x, y, routing="hard")
    post = model.predict(x_new, guide, x, y, routing="posterior")
    assert tree.mean.shape == (9,) and tree.f_var.shape == (9,)
    assert torch.equal(tree.mean, post.mean)
    leaf = guide.tree.hard_leaf(x_new)
    s = model.leaf_log_scale.detach()
    assert torch.allclose(tree.noise_var, torch.exp(2 * s[leaf]))
    assert torch.allclose(post.leaf_probs.sum(-1), torch.ones(9, dtype=torch.float64))
    assert bool((tree.f_var >= 0).all()) and torch.isfinite(post.log_prob(y[:9])).all()
    # a single-leaf mixture reduces to a Gaussian
    assert torch.allclose(
        tree.log_prob(y[:9]), dist.Normal(tree.mean, tree.variance.sqrt()).log_prob(y[:9])
    )
    rules = model.noise_rules(guide)
    assert torch.equal(rules.route(x_new), leaf)
    text = rules.export_text(["x"])
    # every leaf that some input reaches, once (export_text prunes the others)
    reachable = rules.leaf_reachable()
    assert text.count("log sigma") == int(reachable.sum()) and f"{float(s[0]):.3f}" in text
    # sparse prediction needs no training data
    sm, sg = _model(sparse=4)
    pred = sm.predict(x_new, sg, routing="posterior")
    assert pred.mean.shape == (9,) and bool((pred.f_var > 0).all())


def test_init_from_data_balances_and_sets_scales():
    torch.manual_seed(1)
    x = torch.linspace(-1, 1, 120, dtype=torch.float64).unsqueeze(-1)
    sd = torch.where(x[:, 0] < 0, 0.05, 0.5)
    y = torch.sin(2 * x[:, 0]) + sd * torch.randn(120, dtype=torch.float64)
    model = HeteroscedasticGP(1, 1).double()
    guide = HeteroscedasticGPGuide(1, 1).double()
    model.init_from_data(x, y, guide, num_steps=30)
    rules = model.noise_rules(guide)
    assert abs(float(rules.threshold[0])) < 0.05
    s = model.leaf_log_scale.detach()
    assert float(s[1] - s[0]) > 1.0  # the right half is the noisy one


def test_save_load_exact(tmp_path):
    model, guide = _model()
    x, y = _data(15)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=CollapsedELBO())
    for _ in range(3):
        svi.step(x, y)
    buf = io.BytesIO()
    torch.save({"model": model, "guide": guide}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    m2, g2 = loaded["model"], loaded["guide"]
    x_new = torch.linspace(-1, 1, 5, dtype=torch.float64).unsqueeze(-1)
    for routing in ("hard", "posterior"):
        a = model.predict(x_new, guide, x, y, routing=routing)
        b = m2.predict(x_new, g2, x, y, routing=routing)
        for u, v in zip(a, b, strict=True):
            assert torch.equal(u, v)
    with torch.no_grad():
        assert torch.equal(
            model.collapsed_bound(x, y, guide.tree(x)), m2.collapsed_bound(x, y, g2.tree(x))
        )


def test_bad_input():
    model, guide = _model()
    x, y = _data(10)
    with pytest.raises(ValueError, match="in_features"):
        HeteroscedasticGP(0)
    with pytest.raises(ValueError, match="depth"):
        HeteroscedasticGP(1, 0)
    # 2**60 leaves would not fit: the error says what and how much, before allocating
    with pytest.raises(ValueError, match="noise scales.*EiB"):
        HeteroscedasticGP(1, 60)
    with pytest.raises(ValueError, match="kernel"):
        HeteroscedasticGP(1, kernel="rbf")
    with pytest.raises(ValueError, match="inducing_points"):
        HeteroscedasticGP(1, inducing_points=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="NaN"):
        HeteroscedasticGP(1, inducing_points=torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="num_inducing"):
        HeteroscedasticGPGuide(1, num_inducing=-1)
    with pytest.raises(ValueError, match="x must"):
        model.collapsed_bound(x[:, 0], y, torch.zeros(10, 4))
    with pytest.raises(ValueError, match="y must"):
        model.collapsed_bound(x, y[:5], torch.zeros(10, 4))
    bad = y.clone()
    bad[0] = float("inf")
    with pytest.raises(ValueError, match="y contains"):
        model.collapsed_bound(x, bad, torch.zeros(10, 4))
    with pytest.raises(ValueError, match="leaf_logits"):
        model.collapsed_bound(x, y, torch.zeros(10, 3))
    with pytest.raises(ValueError, match="routing"):
        model.predict(x, guide, x, y, routing="mode")
    with pytest.raises(ValueError, match="training data"):
        model.predict(x, guide)
    with pytest.raises(ValueError, match="subsample_size"):
        model(x, y, 5)
    sparse, _ = _model(sparse=3)
    with pytest.raises(ValueError, match="sparse model and guide"):
        sparse.set_optimal_inducing_posterior(x, y, guide)
    with pytest.raises(ValueError, match="collapsed_bound"):
        CollapsedELBO().loss(lambda x, y: None, guide, x, y)


def test_recipe_user_model():
    """The module docstring's recipe: an RNN-Tree partition inside a user's own model.

    Poisson counts whose rate changes at x = 0.3 (not the median, 0.5): the tree must
    move its balanced start to the change point and recover both rates.
    """
    torch.manual_seed(0)
    n, depth = 200, 1
    x = torch.rand(n, 1)
    true_rate = torch.where(x[:, 0] < 0.3, 1.0, 8.0)
    y = torch.poisson(true_rate)

    class CountsByRegion(pyro.nn.PyroModule):
        def __init__(self):
            super().__init__()
            self.log_rate = pyro.nn.PyroParam(torch.zeros(2**depth))

        def forward(self, x, y=None):
            with pyro.plate("data", x.shape[0], dim=-1):
                leaf = pyro.sample("leaf", BalancedLeaf(depth, x.shape[0]))
                return pyro.sample("obs", dist.Poisson(self.log_rate.exp()[leaf]), obs=y)

    class RegionGuide(pyro.nn.PyroModule):
        def __init__(self):
            super().__init__()
            self.tree = RNNTree(1, depth, feedback="hard")

        def forward(self, x, y=None):
            with pyro.plate("data", x.shape[0], dim=-1):
                pyro.sample(
                    "leaf",
                    dist.Categorical(logits=self.tree(x)),
                    infer={"enumerate": "parallel"},
                )

    model, guide = CountsByRegion(), RegionGuide()
    guide.tree.init_balanced(x, y)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.08}), loss=TreeELBO())
    for _ in range(100):
        svi.step(x, y)
    rules = guide.tree.rules(leaf_values=[f"{r:.2f}" for r in model.log_rate.exp().tolist()])
    assert abs(float(rules.threshold[0]) - 0.3) < 0.05, rules.export_text()
    rates = model.log_rate.exp().detach()
    low, high = sorted(rates.tolist())
    assert abs(low - 1.0) < 0.3 and abs(high - 8.0) < 1.0
    acc = (guide.tree.hard_leaf(x) == guide.tree.hard_leaf(torch.tensor([[0.9]]))).eq(
        x[:, 0] >= 0.3
    )
    assert acc.float().mean() > 0.97


@pytest.mark.cuda
def test_cuda_matches_cpu():
    model, guide = _model(features=2)
    x, y = _data(12, features=2)
    logits = torch.randn(12, 4, dtype=torch.float64)
    cpu = model.collapsed_bound(x, y, logits)
    model.cuda()
    guide.cuda()
    gpu = model.collapsed_bound(x.cuda(), y.cuda(), logits.cuda())
    assert torch.allclose(cpu, gpu.cpu(), atol=1e-8)
    pred = model.predict(x.cuda(), guide, x.cuda(), y.cuda(), routing="posterior")
    assert pred.mean.device.type == "cuda" and bool(torch.isfinite(pred.log_prob(y.cuda())).all())
    sparse, sguide = _model(sparse=4, features=2)
    sparse.cuda()
    sguide.cuda()
    loss = TreeELBO().differentiable_loss(sparse, sguide, x.cuda(), y.cuda(), 6)
    assert torch.isfinite(loss)


def test_sparse_collapsed_bound_at_the_data_is_the_exact_bound():
    """With Z = X, Titsias' bound is the exact evidence (Q = K, zero trace term), and
    the optimal q(u) predicts as the exact GP."""
    exact, guide = _model(features=2)
    x, y = _data(12, features=2)
    sparse = HeteroscedasticGP(2, 2, inducing_points=x).double()
    sparse.load_state_dict({**exact.state_dict(), "inducing_points_unconstrained": x})
    sguide = HeteroscedasticGPGuide(2, 2, num_inducing=12).double()
    sguide.tree.load_state_dict(guide.tree.state_dict())
    logits = guide.tree(x)
    a, b = exact.collapsed_bound(x, y, logits), sparse.collapsed_bound(x, y, logits)
    assert torch.allclose(a, b, atol=1e-4, rtol=0)
    # the sparse bound is below the exact one elsewhere
    sparse.inducing_points = x[:5]
    assert float(sparse.collapsed_bound(x, y, logits).detach()) < float(a.detach())
    sparse.inducing_points = x
    sparse.set_optimal_inducing_posterior(x, y, sguide)
    x_new = torch.randn(7, 2, dtype=torch.float64)
    pe = exact.predict(x_new, guide, x, y)
    ps = sparse.predict(x_new, sguide)
    assert torch.allclose(pe.mean, ps.mean, atol=1e-4)
    assert torch.allclose(pe.f_var, ps.f_var, atol=1e-4)
    # CollapsedELBO trains the sparse model as the exact one
    loss = CollapsedELBO().differentiable_loss(sparse, sguide, x, y)
    assert torch.allclose(loss, -b, atol=1e-4)


def test_exact_marginals_of_a_row_do_not_depend_on_the_other_rows():
    from pyro_trees.models._hgp_maths import exact_f_marginals

    torch.manual_seed(0)
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
    x = torch.randn(20, 2, dtype=torch.float64)
    resid = torch.sin(x[:, 0])
    r = torch.full((20,), 0.1, dtype=torch.float64)
    x_new = torch.randn(4, 2, dtype=torch.float64)
    with torch.no_grad():
        loc, var = exact_f_marginals(kernel, x, resid, r, x_new, 1e-6)
    for far in (1e10, 1e30, 1e200):
        batch = torch.cat([x_new, torch.tensor([[far, 0.0]], dtype=torch.float64)])
        with torch.no_grad():
            loc_b, var_b = exact_f_marginals(kernel, x, resid, r, batch, 1e-6)
        torch.testing.assert_close(loc_b[:4], loc, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(var_b[:4], var, rtol=1e-10, atol=1e-12)
        # the far row is uncorrelated with the data: the prior
        assert float(loc_b[4]) == 0.0
        torch.testing.assert_close(var_b[4], kernel.outputscale.detach())


def test_a_start_that_raised_runs_again_at_the_next_call():
    """A first step on bad data raises inside the start; the model is not left marked
    as started, so the next step on good data starts from the data, as a fresh model's
    first step does."""
    x, y = _data(40)
    model = HeteroscedasticGP(1, 2, name="again").double()
    HeteroscedasticGPGuide(model, hidden_size=4).double()
    with pytest.raises(ValueError):
        model.start_once(x, y[:-1])
    torch.manual_seed(0)
    model.start_once(x, y)
    fresh = HeteroscedasticGP(1, 2, name="fresh").double()
    HeteroscedasticGPGuide(fresh, hidden_size=4, name="fresh_guide").double()
    torch.manual_seed(0)
    fresh.start_once(x, y)
    torch.testing.assert_close(model.leaf_log_scale.detach(), fresh.leaf_log_scale.detach())
