"""HME + RNNTreeGuide + TreeELBO on the Pyro user's path: defaults, plain SVI,
Predictive, dtypes, names, AutoGuideList, param-store save/load."""

import math

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_trees.datasets import make_pulse, make_steps

# imported here, not in a test: importing scikit-learn sets KMP_* variables, which the
# hygiene fixture would count as a test's change of the environment
from pyro_trees.guides import RNNTree, RNNTreeGuide
from pyro_trees.infer import HMEELBO, TreeELBO
from pyro_trees.models import HME


def _pulse(dtype=torch.float32, shift=0.0, scale=1.0):
    X, y = make_pulse(400)
    x = torch.tensor(X, dtype=dtype) * scale + shift
    return x, torch.tensor(y, dtype=dtype)


def _fit(x, y, steps, *, depth=3, name=None, lr=0.01, noise_scale=None, **guide_kw):
    model = HME(x.shape[1], depth, name=name, noise_scale=noise_scale)
    guide = RNNTreeGuide(x.shape[1], depth, name=name, **guide_kw)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), TreeELBO())
    losses = [svi.step(x, y) for _ in range(steps)]
    return model, guide, losses


def _tree_mse(model, guide, x, y) -> float:
    with torch.no_grad():
        return float(((model.leaf_loc[guide.rules().route(x), 0] - y) ** 2).mean())


def _corr(a, b) -> float:
    return float(torch.corrcoef(torch.stack([a.double().flatten(), b.double().flatten()]))[0, 1])


@pytest.mark.parametrize("shift, scale", [(0.0, 1.0), (5e3, 1e3)], ids=["raw", "rescaled"])
def test_defaults_and_plain_svi_fit_the_pulse(shift, scale):
    """The README snippet as written: no init calls, unstandardised inputs."""
    x, y = _pulse(shift=shift, scale=scale)
    model, guide, losses = _fit(x, y, 100)
    assert all(math.isfinite(v) for v in losses)
    assert _tree_mse(model, guide, x, y) < 0.1  # var(y) = 2.09
    grid = torch.linspace(-4, 4, 4001).unsqueeze(-1) * scale + shift
    assert len(set(guide.rules().route(grid).tolist())) == 8


def test_the_snippet_keeps_improving_on_step_functions_it_never_saw():
    """The README snippet's loop (``HME(1, 3)``, ``RNNTreeGuide(1, 3)``, ``TreeELBO()``,
    Adam 0.01, 600 steps) on three random step functions with noise (``make_steps``, seeds
    0-2): the predictive mean's MSE against the noise-free function falls from step 100
    to step 600 and ends below 0.06 (the variance of f is 1.22-1.43). Measured over
    PYRO_TREES_TEST_SEED 0-9: after 600 steps 0.0092-0.0104, 0.0241-0.0247 and
    0.0056-0.0058 (after 100: 0.069-0.076, 0.0285-0.0298, 0.0098-0.0109); over make_steps
    seeds 0-9 x 3 seeds, 0.038 at most, lower than after 100 steps in 30/30. With the
    former fixed sigma = 1 the same loop went from 0.13 to 0.26 on seed 0.

    For speed it runs the loop with the closed-form TreeELBO the estimators use
    (``HMEELBO``: the same value and gradients, ``tests/infer/test_hme_elbo.py``) and
    torch's Adam (what ``pyro.optim.Adam`` wraps), and reads the predictive mean
    exactly, ``q(leaf | x)`` times the experts' means; ``python -m benchmarks.pyro_path``
    runs the snippet as printed, ``Predictive`` included.
    """
    for seed in range(3):
        pyro.clear_param_store()  # else the second model adopts the first one's parameters
        X, y, f = make_steps(400, random_state=seed)
        x, y, f = (torch.tensor(a, dtype=torch.float32) for a in (X, y, f))
        model, guide = HME(1, 3), RNNTreeGuide(1, 3)
        poutine.trace(guide).get_trace(x, y)  # the lazy start of the first svi.step
        poutine.trace(model).get_trace(x, y)
        loss = HMEELBO()(model, guide)
        optim = torch.optim.Adam([*model.parameters(), *guide.parameters()], lr=0.01)
        mse = {}
        for step in range(1, 601):
            optim.zero_grad()
            loss(x, y).backward()
            optim.step()
            if step in (100, 600):
                with torch.no_grad():
                    mean = guide.tree(x).exp() @ model.leaf_loc[:, 0]
                    mse[step] = float(((mean - f) ** 2).mean())
        assert mse[600] < mse[100] and mse[600] < 0.06, (seed, mse)


def test_first_call_starts_model_and_guide_at_the_same_balanced_tree():
    torch.manual_seed(0)
    x = torch.randn(300, 3) * torch.tensor([1.0, 50.0, 0.01]) + torch.tensor([0.0, 7.0, -3.0])
    y = torch.sin(x[:, 0]) + (x[:, 2] > -3.0).float()
    model, guide = HME(3, 2, noise_scale=None), RNNTreeGuide(3, 2)
    assert not model.initialised and not guide.initialised
    guide(x)  # no targets: nothing to start from yet
    assert not guide.initialised
    poutine.trace(guide).get_trace(x, y)
    poutine.trace(model).get_trace(x, y)
    assert model.initialised and guide.initialised
    torch.testing.assert_close(guide.tree.x_loc, x.mean(0))
    torch.testing.assert_close(guide.tree.x_scale, x.std(0))
    leaf = guide.rules().route(x)
    onehot = torch.nn.functional.one_hot(leaf, 4).float()
    means = (onehot.T @ y) / onehot.sum(0)
    torch.testing.assert_close(model.leaf_loc[:, 0].detach(), means)
    with torch.no_grad():  # the routing posterior starts at that hard tree
        assert float(guide.tree(x).exp().gather(-1, leaf[:, None]).mean()) > 0.9


def test_guide_sharpness_sets_the_start_slopes():
    x, y = _pulse()
    slopes = {}
    for sharpness in (20.0, 40.0):
        pyro.clear_param_store()
        guide = RNNTreeGuide(1, 3, sharpness=sharpness)
        poutine.trace(guide).get_trace(x, y)
        with torch.no_grad():
            slopes[sharpness] = guide.tree._node_heads()[2][:, 0]
    torch.testing.assert_close(slopes[40.0], 2 * slopes[20.0])
    assert RNNTreeGuide(1, 3).sharpness == 40.0
    with pytest.raises(ValueError, match="sharpness"):
        RNNTreeGuide(1, 3, sharpness=0.0)


def test_init_none_leaves_the_start_random():
    x, y = _pulse()
    model, guide = HME(1, 2, init=None), RNNTreeGuide(1, 2, init=None)
    before = model.leaf_loc.detach().clone()
    poutine.trace(guide).get_trace(x, y)
    poutine.trace(model).get_trace(x, y)
    assert torch.equal(model.leaf_loc.detach(), before)
    assert torch.equal(guide.tree.x_scale, torch.ones(1))
    with pytest.raises(ValueError, match="init"):
        HME(1, 2, init="median")


def test_named_instances_of_different_depths_share_one_store():
    x, y = _pulse()
    _fit(x, y, 3, depth=2, name="small")
    store = pyro.get_param_store()
    small = {k: v.detach().clone() for k, v in store.items()}
    assert small and all(k.startswith("small.") for k in small)
    _fit(x, y, 3, depth=3, name="large")
    large = [k for k in store.keys() if k not in small]
    assert large and all(k.startswith("large.") for k in large)
    assert store["large.leaf_loc"].shape == (8, 1) and store["small.leaf_loc"].shape == (4, 1)
    for k, v in small.items():
        assert torch.equal(store[k].detach(), v), k


def test_same_name_other_depth_is_refused_with_a_clear_error():
    x, y = _pulse()
    _fit(x, y, 2, depth=2)
    with pytest.raises(ValueError, match="name="):
        _fit(x, y, 1, depth=3)


def test_rnn_tree_takes_a_name():
    tree = RNNTree(2, 2, name="router")
    tree(torch.randn(5, 2))
    assert pyro.get_param_store().keys() and all(
        k.startswith("router.") for k in pyro.get_param_store().keys()
    )


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_predictive_draws_are_the_posterior_predictive(feedback, parallel):
    x, y = _pulse()
    # The soft roll-out's start (ridge-fitted heads) routes vaguely; with a learnt noise
    # scale the exact bound then collapses every expert onto the mean of y within 60
    # steps (a constant fit, nothing to correlate with), so it keeps the paper's sigma.
    noise_scale = 1.0 if feedback == "soft" else None
    model, guide, _ = _fit(x, y, 60, feedback=feedback, noise_scale=noise_scale)
    samples = Predictive(model, guide=guide, num_samples=100, parallel=parallel)(x)
    assert samples["obs"].shape == (100, 400) and samples["leaf"].shape == (100, 400)
    with torch.no_grad():
        q = guide.tree.leaf_probs(x, num_samples=64)
        fit = q @ model.leaf_loc[:, 0]
    # draws of y are centred on the fit, and the leaves follow the routing posterior
    assert _corr(samples["obs"].mean(0), fit) > 0.9
    freq = torch.nn.functional.one_hot(samples["leaf"], 8).float().mean(0)
    assert float((freq - q).abs().sum(-1).mean()) < 0.35
    if feedback == "hard":
        assert _corr(samples["obs"].mean(0), y) > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_and_guide_follow_the_data_dtype(dtype):
    x, y = _pulse(dtype)
    model, guide, losses = _fit(x, y, 5)
    assert all(math.isfinite(v) for v in losses)
    for name, value in pyro.get_param_store().items():
        assert value.dtype == dtype and torch.isfinite(value).all(), name
    assert Predictive(model, guide=guide, num_samples=2)(x)["obs"].dtype == dtype


def test_guide_composes_with_an_autonormal_in_autoguidelist():
    x, y = _pulse(torch.float64)
    model, guide = HME(1, 3), RNNTreeGuide(1, 3)

    def user_model(x, y=None):
        offset = pyro.sample("offset", pyro.distributions.Normal(0.0, 1.0))
        return model(x, None if y is None else y - offset)

    guides = AutoGuideList(user_model)
    # global latents first, then the enumerated local site (TraceEnum_ELBO's order)
    guides.append(AutoNormal(poutine.block(user_model, expose=["offset"])))
    guides.append(guide)
    svi = SVI(user_model, guides, pyro.optim.Adam({"lr": 0.01}), TreeELBO())
    losses = [svi.step(x, y) for _ in range(20)]
    assert all(math.isfinite(v) for v in losses)
    samples = Predictive(user_model, guide=guides, num_samples=5)(x)
    assert samples["offset"].shape[0] == 5 and samples["obs"].shape == (5, 400)


def test_param_store_round_trip_reproduces_predictions_and_is_not_reinitialised(tmp_path):
    x, y = _pulse()
    model, guide, _ = _fit(x, y, 20, name="saved")

    def predict(m, g):
        pyro.set_rng_seed(3)
        return Predictive(m, guide=g, num_samples=4)(x)

    before = predict(model, guide)
    state = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.get_param_store().save(tmp_path / "p.pt")
    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "p.pt")
    model2, guide2 = HME(1, 3, name="saved"), RNNTreeGuide(1, 3, name="saved")
    # a first call with targets adopts the stored parameters instead of initialising
    poutine.trace(guide2).get_trace(x, y)
    poutine.trace(model2).get_trace(x, y)
    for k, v in pyro.get_param_store().items():
        assert torch.equal(v.detach(), state[k]), k
    torch.testing.assert_close(guide2.tree.x_loc, guide.tree.x_loc, rtol=0, atol=0)
    after = predict(model2, guide2)
    for site in ("obs", "leaf"):
        assert torch.equal(after[site], before[site]), site
    # and training goes on from there: the modules hold the store's tensors
    svi = SVI(model2, guide2, pyro.optim.Adam({"lr": 0.01}), TreeELBO())
    svi.step(x, y)
    assert not torch.equal(pyro.param("saved.leaf_loc").detach(), state["saved.leaf_loc"])
    assert torch.equal(model2.leaf_loc.detach(), pyro.param("saved.leaf_loc").detach())


def test_estimator_modules_are_not_reinitialised_by_a_later_call():
    from pyro_trees.estimators import RNNTreeRegressor

    X, y = make_pulse(80)
    est = RNNTreeRegressor(2, num_steps=5, random_state=0).fit(X, y)
    model, guide = est.model_, est.guide_
    loc = model.leaf_loc.detach().clone()
    offset = guide.tree.node_offset.detach().clone()
    x = torch.randn(80, 1, dtype=loc.dtype)
    t = 10.0 + torch.randn(80, dtype=loc.dtype)
    poutine.trace(guide).get_trace(x, t)
    poutine.trace(model).get_trace(x, t)
    assert torch.equal(model.leaf_loc.detach(), loc)
    assert torch.equal(guide.tree.node_offset.detach(), offset)
