"""VaRT as a Pyro user meets it: static sites for Predictive at any temperature, the
kl_weight weighting inside ``sample_tree``, composition as a mean function, names, dtypes,
AutoGuideList, save/load of the parameter store."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_trees.datasets import make_vart_step
from pyro_trees.guides import VaRTGuide
from pyro_trees.models import VaRT, VaRTForest, tree_likelihood, tree_mean


def _step(n=60, dtype=torch.float64, seed=0):
    d = make_vart_step(n, random_state=seed)
    return torch.tensor(d["X"], dtype=dtype), torch.tensor(d["y"], dtype=dtype)


def _mixed_guide(depth=3):
    """A guide whose hard trees differ in shape from draw to draw (each position splits
    with probability 1/2)."""
    model = VaRT(1)
    guide = VaRTGuide(model, depth)
    x, _ = _step(8)
    guide(x)  # the lazy start
    with torch.no_grad():
        guide.split_logits.zero_()
    return model, guide, x


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_predictive_returns_every_site_whatever_the_tree_shapes(parallel, temperature):
    # hard trees of different shapes raised KeyError: 'beta_0' (sequential) and dropped
    # the sites that the model's own prior draw lacked (parallel)
    model, guide, x = _mixed_guide()
    latents = {f"{k}_{d}" for k in ("split", "theta", "log_sigma") for d in range(4)}
    latents |= {f"beta_{d}" for d in range(3)}
    for seed in range(8):  # the model's own prior draw differs with the seed
        pyro.set_rng_seed(seed)
        with guide.temperature_set_to(temperature):
            out = Predictive(model, guide=guide, num_samples=12, parallel=parallel)(x)
        assert latents | {"obs", "mean"} <= set(out)
        assert out["obs"].shape == out["mean"].shape == (12, 8)
        assert torch.isfinite(out["obs"]).all()
        roots = out["split_0"].flatten()
        if temperature == 0:
            assert set(roots.tolist()) <= {0.0, 1.0}
        # the mean of each draw is the regression function of that draw's tree
        leaf = roots == 0
        if leaf.any():
            theta = out["theta_0"][leaf].reshape(-1, 2)
            expected = theta[:, :1] * x[:, 0] + theta[:, 1:]
            torch.testing.assert_close(out["mean"][leaf], expected)


def test_prior_predictive_is_static_although_prior_trees_are_unbounded():
    # deep prior trees: levels below site_depth are drawn without sites
    model = VaRT(1, split_alpha=0.99, split_beta=0.5, site_depth=1)
    x, _ = _step(5)
    for parallel in (False, True):
        out = Predictive(model, num_samples=30, parallel=parallel)(x)
        assert set(out) == {"split_0", "split_1", "beta_0", "theta_0", "theta_1"} | {
            "log_sigma_0",
            "log_sigma_1",
            "mean",
            "obs",
        }
        assert torch.isfinite(out["obs"]).all()
    depths = []
    for _ in range(40):
        tree = model.sample_tree(like=x)
        depths.append(tree["split"].shape[-1].bit_length() - 1)
    assert max(depths) >= 3  # the prior is not truncated at site_depth


def test_sample_tree_carries_the_elbo_weighting():
    model = VaRT(1, kl_weight=0.25, site_depth=2)
    x, _ = _step(4)
    tr = poutine.trace(model.sample_tree).get_trace(like=x)
    assert tr.nodes["split_0"]["scale"] == 0.25
    tr.compute_log_prob()
    # each node's prior terms are weighted by its indicator, then by kl_weight
    split0 = tr.nodes["split_0"]["value"]
    lp = tr.nodes["theta_0"]["fn"].log_prob(tr.nodes["theta_0"]["value"])
    if split0.item() == 1:
        assert tr.nodes["theta_0"]["log_prob_sum"] == 0
    else:
        torch.testing.assert_close(tr.nodes["theta_0"]["log_prob_sum"], 0.25 * lp.sum())


def test_vart_as_a_mean_function_in_a_users_own_model():
    x, y = _step(80)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    vart = VaRT(1, name="f")
    tree_guide = VaRTGuide(vart, 2, name="f")

    def my_model(x, y=None):
        tree = vart.sample_tree(like=x)
        f = tree_mean(tree, x)
        noise = pyro.sample("noise", dist.LogNormal(-2.0, 1.0))
        with pyro.plate("rows", x.shape[0]):
            return pyro.sample("y", dist.Normal(f, noise), obs=y)

    guide = AutoGuideList(my_model)
    guide.append(tree_guide)
    guide.append(AutoNormal(poutine.block(my_model, expose=["noise"])))
    svi = SVI(my_model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every site matched, none left to the prior
        losses = [svi.step(x, y) for _ in range(250)]
    assert losses[-1] < losses[0]
    # the tree sites of the user's model are kl_weight-weighted as in VaRT itself
    tr = poutine.trace(my_model).get_trace(x)
    assert tr.nodes["f.split_0"]["scale"] == vart.kl_weight
    out = Predictive(my_model, guide=guide, num_samples=30)(x)
    assert {"noise", "y", "f.split_0", "f.theta_2"} <= set(out)
    fit = out["y"].mean(0)
    assert torch.corrcoef(torch.stack([fit, y]))[0, 1] > 0.9
    assert float(out["noise"].mean()) < 0.5
    median = guide.median(x)
    assert {"noise", "f.split_0", "f.beta_1", "f.theta_2"} <= set(median)
    assert median["f.split_2"].tolist() == [0.0] * 4  # the truncation level


def test_two_named_instances_of_different_depth_in_one_model():
    x, y = _step(40)
    pyro.clear_param_store()
    first, second = VaRT(1, name="first"), VaRT(1, name="second")
    guides = [VaRTGuide(first, 2, name="first"), VaRTGuide(second, 3, name="second")]

    def additive(x, y=None):
        f = tree_mean(first.sample_tree(like=x), x) + tree_mean(second.sample_tree(like=x), x)
        with pyro.plate("rows", x.shape[0]):
            pyro.sample("y", dist.Normal(f, 0.1), obs=y)

    def guide(x, y=None):
        for g in guides:
            g(x)

    svi = SVI(additive, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            svi.step(x, y)
    store = pyro.get_param_store()
    assert store["first.split_logits"].shape == (3,)
    assert store["second.split_logits"].shape == (7,)
    assert all(k.startswith(("first.", "second.")) for k in store.keys())
    tr = poutine.trace(additive).get_trace(x)
    assert "first.split_2" in tr.nodes and "second.split_3" in tr.nodes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameters_follow_the_data_dtype(dtype):
    x, y = _step(30, dtype=dtype)
    pyro.clear_param_store()
    model = VaRT(1)
    guide = VaRTGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    losses = [svi.step(x, y) for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses)))
    for name, value in pyro.get_param_store().items():
        assert value.dtype == dtype, name
        assert torch.isfinite(value).all(), name
    with guide.temperature_set_to(0.0):
        out = Predictive(model, guide=guide, num_samples=5, parallel=True)(x)
    assert out["obs"].dtype == dtype


def test_param_store_save_load_and_trace_replay(tmp_path):
    x, y = _step(30)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = VaRT(1, name="v")
    guide = VaRTGuide(model, name="v")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    for _ in range(20):
        svi.step(x, y)

    def predict(m, g):
        pyro.set_rng_seed(1)
        with g.temperature_set_to(0.0):
            return Predictive(m, guide=g, num_samples=6)(x)

    before = predict(model, guide)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    model2 = VaRT(1, name="v")
    guide2 = VaRTGuide(model2, name="v")  # a fresh random start ...
    pyro.get_param_store().load(tmp_path / "params.pt")
    after = predict(model2, guide2)  # ... that the loaded store overrides
    for site in ("v.obs", "v.mean", "v.split_1"):
        torch.testing.assert_close(after[site], before[site], rtol=0, atol=0)
    # a hard guide draw replays through the model, site for site
    with guide2.temperature_set_to(0.0):
        guide_tr = poutine.trace(guide2).get_trace(x)
    model_tr = poutine.trace(poutine.replay(model2, trace=guide_tr)).get_trace(x, y)
    for name, site in guide_tr.nodes.items():
        if site["type"] == "sample" and not name.startswith("v.nodes"):
            assert model_tr.nodes[name]["value"] is site["value"]
    assert torch.isfinite(model_tr.log_prob_sum())


def test_tree_likelihood_is_the_mixture_of_eq_27():
    model = VaRT(2, site_depth=2)
    x = torch.randn(6, 2)
    tree = model.sample_tree(like=x)
    lik = tree_likelihood(tree, x)
    assert lik.batch_shape == (6,)
    torch.testing.assert_close(lik.mean, tree_mean(tree, x))


@pytest.mark.parametrize("cls", [VaRT, VaRTForest])
@pytest.mark.parametrize(
    "option, value",
    [
        ("kl_weight", 0.0),
        ("split_alpha", 1.0),
        ("split_beta", -1.0),
        ("split_scale", 0.0),
        ("leaf_scale", -1.0),
        ("noise_prior_scale", 0.0),
        ("missing", 1),
        ("missing_concentration", 0.0),
    ],
)
def test_the_tree_and_the_forest_refuse_the_same_bad_prior_options(cls, option, value):
    with pytest.raises(ValueError, match=f"^{option} must"):
        cls(2, **{option: value})


@pytest.mark.parametrize("missing", [False, True])
def test_node_weights_of_a_row_sum_to_one(missing):
    """``kappa_i P(x -> i)`` sums to one over the nodes of a relaxed tree of depth 3, with
    or without missing inputs: why the likelihood's mixture (``VaRT.obs_log_lik``) is
    not normalised again."""
    from pyro_trees.models.vart import log_existence
    from pyro_trees.models.vart_mixture import log_leaf_weights, with_bias

    torch.manual_seed(3)
    x = torch.randn(6, 3, dtype=torch.float64)
    if missing:
        x[0, 1] = x[3, 0] = float("nan")
    split = torch.cat([torch.rand(7, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)])
    tree = {
        "split": split,
        "log_exist": log_existence(split[:7]),
        "beta": torch.randn(7, 4, dtype=torch.float64),
        "rho": torch.rand(7, dtype=torch.float64) if missing else None,
    }
    total = log_leaf_weights(tree, with_bias(x)).logsumexp(-1)  # (6,)
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-12, rtol=0)
