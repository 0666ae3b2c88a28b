"""The TreeVI models on the Pyro user's path: ``Predictive`` draws ``x`` (it does not
return the data), ``name=`` prefixes, dtypes that follow the data, ``AutoGuideList``,
param-store save/load and trace replay, for each of the three models."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal

from pyro_trees.guides import GaussianEncoder, GroupEncoder, PairNet, TreeVIGuide
from pyro_trees.infer import PairwiseELBO
from pyro_trees.models import ConstrainedClusteringVAE, GraphPriorVAE, SyntheticGraphVAE

N, F, D = 12, 5, 2
CHAIN = [-1] + list(range(N - 1))


def _synthetic(name=""):
    model = SyntheticGraphVAE(name=name)
    x = SyntheticGraphVAE().generate(30, torch.Generator().manual_seed(0))
    net = PairNet(4, 4, num_nodes=4)
    guide = TreeVIGuide(
        GroupEncoder(4, 4, 4), [-1, 0, 1, 0], pair_net=net, plate="groups", name=name
    )
    return model, guide, x, Trace_ELBO


def _graph(name=""):
    x = (torch.rand(N, F, generator=torch.Generator().manual_seed(0)) < 0.4).float()
    edges = torch.stack([torch.arange(N - 1), torch.arange(1, N)], 1)
    model = GraphPriorVAE(edges, F, num_nodes=N, latent_dim=D, hidden_sizes=(8,), name=name)
    guide = TreeVIGuide(GaussianEncoder(F, D, (8,)), CHAIN, pair_net=PairNet(F, D, (8,)), name=name)
    return model, guide, x, Trace_ELBO


def _clustering(name=""):
    x = (torch.rand(N, F, generator=torch.Generator().manual_seed(1)) < 0.4).float()
    pairs, w = torch.tensor([[0, 1], [2, 3], [4, 9]]), torch.tensor([3.0, -2.0, 1.5])
    model = ConstrainedClusteringVAE(
        F, 3, latent_dim=D, hidden_sizes=(8,), constraints=pairs, weights=w, name=name
    )
    guide = TreeVIGuide(GaussianEncoder(F, D, (8,)), CHAIN, pair_net=PairNet(F, D, (8,)), name=name)
    return model, guide, x, lambda: PairwiseELBO(2)


MODELS = {"synthetic": _synthetic, "graph": _graph, "clustering": _clustering}


def _fit(make, steps=60, name="", dtype=torch.float64):
    model, guide, x, loss = make(name)
    x = x.to(dtype)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), loss())
    losses = [svi.step(x) for _ in range(steps)]
    return model, guide, x, losses


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("kind", MODELS)
def test_predictive_draws_x_from_the_posterior_predictive(kind, parallel):
    model, guide, x, _ = _fit(MODELS[kind])
    out = Predictive(model, guide=guide, num_samples=30, parallel=parallel)(x)
    assert out["x"].shape == (30,) + x.shape
    assert out["z"].shape[0] == 30 and out["z"].shape[-1] == (4 if kind == "synthetic" else D)
    # draws, not the data: they differ from it and from each other
    assert not torch.equal(out["x"][0], x)
    assert (out["x"].std(0) > 0).any()
    # centred on the data: the predictive mean follows it
    mean, data = out["x"].mean(0).flatten(), x.flatten()
    r = torch.corrcoef(torch.stack([mean, data]))[0, 1]
    assert r > (0.8 if kind == "synthetic" else 0.2), float(r)
    # outside Predictive x stays observed
    tr = poutine.trace(model).get_trace(x)
    assert tr.nodes["x"]["is_observed"] and torch.equal(tr.nodes["x"]["value"], x)


@pytest.mark.parametrize("kind", MODELS)
def test_named_instances_share_one_param_store(kind):
    _fit(MODELS[kind], steps=3, name="a")
    store = pyro.get_param_store()
    first = {k: v.detach().clone() for k, v in store.items()}
    assert first and all(k.startswith("a.") for k in first), sorted(first)
    _fit(MODELS[kind], steps=3, name="b")
    new = [k for k in store.keys() if k not in first]
    assert new and all(k.startswith("b.") for k in new)
    for k, v in first.items():
        assert torch.equal(store[k], v)


def test_models_have_their_own_prefix():
    _fit(MODELS["clustering"], steps=1, name="c")
    keys = set(pyro.get_param_store().keys())
    assert {"c.cluster_loc", "c.cluster_logits", "c.cluster_log_scale"} <= keys
    assert any(k.startswith("c.decoder$$$") for k in keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", MODELS)
def test_dtype_follows_the_data(kind, dtype):
    model, guide, x, losses = _fit(MODELS[kind], steps=5, dtype=dtype)
    assert all(torch.isfinite(torch.tensor(losses)))
    for k, v in pyro.get_param_store().items():
        assert v.dtype == dtype, k
    for t in (*model.buffers(), *guide.buffers()):
        assert not t.is_floating_point() or t.dtype == dtype


@pytest.mark.parametrize("kind", ["synthetic", "graph"])
def test_guide_in_autoguidelist_beside_autonormal(kind):
    model, guide, x, _ = MODELS[kind]()

    def user_model(x):
        pyro.sample("user_offset", dist.Normal(0.0, 1.0))
        return model(x)

    guides = AutoGuideList(user_model)
    guides.append(guide)
    guides.append(AutoNormal(poutine.block(user_model, expose=["user_offset"])))
    svi = SVI(user_model, guides, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    for _ in range(3):
        assert torch.isfinite(torch.tensor(svi.step(x.double())))
    out = Predictive(user_model, guide=guides, num_samples=4)(x.double())
    assert {"user_offset", "z", "x"} <= set(out)
    assert not torch.equal(out["x"][0], x.double())


@pytest.mark.parametrize("kind", MODELS)
def test_param_store_save_load_reproduces_predictions(kind, tmp_path):
    model, guide, x, _ = _fit(MODELS[kind], steps=20, name="m")

    def predict(m, g):
        pyro.set_rng_seed(3)
        return Predictive(m, guide=g, num_samples=3)(x)

    before = predict(model, guide)
    pyro.get_param_store().save(tmp_path / "p.pt")
    pyro.clear_param_store()
    model2, guide2, _, _ = MODELS[kind]("m")  # fresh, differently initialised objects
    pyro.get_param_store().load(tmp_path / "p.pt")
    after = predict(model2, guide2)
    for site in ("x", "z"):
        torch.testing.assert_close(after[site], before[site], rtol=0, atol=0)
    # and training goes on with the loaded tensors
    svi = SVI(model2, guide2, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
    name, stored = next(iter(pyro.get_param_store().items()))
    old = stored.detach().clone()
    if kind != "clustering":
        svi.step(x)
        assert not torch.equal(pyro.get_param_store()[name].detach(), old)


def test_param_store_refuses_another_shape_under_one_name():
    _fit(MODELS["graph"], steps=1, name="g")
    x = torch.zeros(N, F + 1)
    edges = torch.stack([torch.arange(N - 1), torch.arange(1, N)], 1)
    other = GraphPriorVAE(edges, F + 1, num_nodes=N, latent_dim=D, hidden_sizes=(8,), name="g")
    with pytest.raises(ValueError, match="another name"):
        other(x)


@pytest.mark.parametrize("kind", MODELS)
def test_guide_trace_replays_through_model(kind):
    model, guide, x, _ = _fit(MODELS[kind], steps=3)
    guide_trace = poutine.trace(guide).get_trace(x)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(x)
    assert model_trace.nodes["z"]["value"] is guide_trace.nodes["z"]["value"]
    assert torch.isfinite(model_trace.log_prob_sum().detach())


def test_synthetic_predictive_refuses_a_subsample():
    model, guide, x, _ = _fit(MODELS["synthetic"], steps=2)
    with pytest.raises(ValueError, match="without subsample_size"):
        Predictive(model, guide=guide, num_samples=2)(x, subsample_size=5)


def test_clustering_predict_follows_the_dtype_of_z():
    model = ConstrainedClusteringVAE(F, 3, latent_dim=D, hidden_sizes=(8,))
    z = torch.randn(N, D, dtype=torch.float64)
    assert model.predict(z).shape == (N,)
    assert model.cluster_loc.dtype == torch.float64


@pytest.mark.cuda
@pytest.mark.parametrize("kind", MODELS)
def test_model_and_guide_follow_data_to_cuda(kind):
    model, guide, x, loss = MODELS[kind]()
    x = x.cuda()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), loss())
    assert torch.isfinite(torch.tensor(svi.step(x)))
    assert all(p.is_cuda for p in guide.parameters())
    out = Predictive(model, guide=guide, num_samples=3, parallel=True)(x)
    assert out["x"].is_cuda and out["z"].is_cuda
