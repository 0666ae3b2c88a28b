"""``TreeVIELBO`` is ``Trace_ELBO`` of the instance-level TreeVI models as one tensor
program: the same value and gradients on the same draws, eager and compiled, full batch
and minibatch; the data checks of the eager path; a warned fallback elsewhere."""

import pickle
import warnings

import pyro
import pytest
import torch
from pyro.infer import Trace_ELBO
from torch.profiler import ProfilerActivity, profile

from pyro_trees.guides import GaussianEncoder, GroupEncoder, PairNet, TreeVIGuide
from pyro_trees.infer import TreeVIELBO
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models import ConstrainedClusteringVAE, GraphPriorVAE, SyntheticGraphVAE

# see tests/infer/test_compiled.py: the compiler's capture without code generation
BACKEND = "aot_eager"
N, F, D = 12, 5, 3


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    parents = (torch.rand(N, generator=gen) * torch.arange(N)).long()
    parents[0] = -1
    x = (torch.rand(N, F, generator=gen, dtype=torch.float64) > 0.5).double()
    return parents, x


def _model(kind: str):
    if kind.startswith("graph"):
        edges = torch.stack([torch.arange(N - 1), torch.arange(1, N)], 1)
        like = "normal" if kind.endswith("normal") else "bernoulli"
        return GraphPriorVAE(
            edges, F, num_nodes=N, latent_dim=D, hidden_sizes=(8,), likelihood=like
        ).double()
    return ConstrainedClusteringVAE(
        F,
        3,
        latent_dim=D,
        hidden_sizes=(8,),
        constraints=[[0, 1], [2, 5], [3, 9], [7, 4]],
        weights=[1.0, -2.0, 3.0, 0.5],
    ).double()


def _guide(kind: str, parents):
    encoder = GaussianEncoder(F, D, (8,))
    if kind == "mean-field":
        return TreeVIGuide(encoder, None).double()
    if kind == "codes":
        return TreeVIGuide(encoder, parents, pair_inputs="codes").double()  # default pair_net
    if kind == "edge features":
        edges = torch.rand(N, 2, generator=torch.Generator().manual_seed(3))
        net = PairNet(F, D, (8,), edge_features=2)
        return TreeVIGuide(encoder, parents, pair_net=net, edge_features=edges).double()
    if kind == "pair offsets":
        net = PairNet(F, D, (8,), num_nodes=N, offsets="pair")
        torch.nn.init.normal_(net.pair_bias, std=0.5)
        return TreeVIGuide(encoder, parents, pair_net=net).double()
    return TreeVIGuide(encoder, parents, pair_net=PairNet(F, D, (8,))).double()


def _grads(value, params):
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


BATCH = torch.tensor([3, 0, 7, 1, 9, 5, 4])
CASES = [
    ("graph", "tree"),
    ("graph normal", "tree"),
    ("graph", "mean-field"),
    ("clustering", "tree"),
    ("clustering", "mean-field"),
    ("clustering", "codes"),
    ("graph", "edge features"),
    ("graph", "pair offsets"),
]


@pytest.mark.parametrize("compile", [False, BACKEND], ids=["eager", "compiled"])
@pytest.mark.parametrize("batch", [False, True], ids=["full batch", "minibatch"])
@pytest.mark.parametrize(("model_kind", "guide_kind"), CASES)
def test_equals_trace_elbo_on_the_same_draws(model_kind, guide_kind, batch, compile):
    parents, x = _data()
    kwargs = {"idx": BATCH} if batch else {}
    with isolated_params():
        torch.manual_seed(1)
        model, guide = _model(model_kind), _guide(guide_kind, parents)
        loss = TreeVIELBO(compile=compile)
        for seed in (5, 6):  # the second call: cached inputs, a compiled program reused
            torch.manual_seed(seed)
            a = Trace_ELBO().differentiable_loss(model, guide, x, **kwargs)
            params = [*model.parameters(), *guide.parameters()]
            torch.manual_seed(seed)
            b = loss.differentiable_loss(model, guide, x, **kwargs)
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-10)
            for gb, ga in zip(_grads(b, params), _grads(a, params), strict=True):
                torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-10)
        if compile:
            assert loss._compiled.failed is None


def test_a_full_batch_step_reads_nothing_back():
    parents, x = _data()
    with isolated_params():
        model, guide = _model("clustering"), _guide("tree", parents)
        loss = TreeVIELBO()
        loss.differentiable_loss(model, guide, x)  # the data's one check
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss.differentiable_loss(model, guide, x).backward()
    reads = [e for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert not reads


def test_plain_svi_trains_with_minibatches_and_a_seeded_fit_draws_alike():
    parents, x = _data()

    def run(loss):
        with isolated_params():
            torch.manual_seed(0)
            model, guide = _model("graph"), _guide("tree", parents)
            svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), loss)
            return [svi.step(x, idx=b) for b in (BATCH, None, BATCH[:3], None)]

    torch.testing.assert_close(run(TreeVIELBO()), run(Trace_ELBO()), rtol=1e-9, atol=1e-9)


def test_rows_are_checked_as_the_model_checks_them():
    parents, x = _data()
    bad = x.clone()
    bad[2, 0] = float("nan")
    outside = torch.tensor([0, 1, 3])
    with isolated_params():
        model, guide = _model("graph"), _guide("tree", parents)
        loss = TreeVIELBO()
        # a batch without the bad row trains, as under Trace_ELBO; one with it raises
        assert torch.isfinite(loss.differentiable_loss(model, guide, bad, idx=outside))
        for kwargs in ({}, {"idx": torch.tensor([2, 5])}):
            with pytest.raises(ValueError, match="NaN and .* infinite"):
                loss.differentiable_loss(model, guide, bad, **kwargs)
            with pytest.raises(ValueError, match="NaN and .* infinite"):
                Trace_ELBO().differentiable_loss(model, guide, bad, **kwargs)
        # an in-place edit of the checked tensor is seen (checks once per version)
        good = x.clone()
        loss.differentiable_loss(model, guide, good)
        good[4, 1] = float("inf")
        with pytest.raises(ValueError, match="NaN and .* infinite"):
            loss.differentiable_loss(model, guide, good)
    with isolated_params():
        model, guide = _model("clustering"), _guide("tree", parents)
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            TreeVIELBO().differentiable_loss(model, guide, x * 2)
        with pytest.raises(ValueError, match="out of range"):
            TreeVIELBO().differentiable_loss(model, guide, x, idx=torch.tensor([0, N]))


def test_other_models_and_guides_train_with_trace_elbo_after_one_warning():
    gen = torch.Generator().manual_seed(0)
    model = SyntheticGraphVAE()
    x = model.generate(6, generator=gen)
    guide = TreeVIGuide(GroupEncoder(4, 4, 4), [-1, 0, 0, 1], plate="groups")
    loss = TreeVIELBO()
    with isolated_params():
        with pytest.warns(RuntimeWarning, match="group plate"):
            torch.manual_seed(3)
            a = loss.differentiable_loss(model, guide, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss.differentiable_loss(model, guide, x)  # warned once
        torch.manual_seed(3)
        torch.testing.assert_close(a, Trace_ELBO().differentiable_loss(model, guide, x))
    assert "group plate" in loss.fallback


def test_the_loss_pickles():
    loss = TreeVIELBO(compile=BACKEND)
    parents, x = _data()
    with isolated_params():
        loss.differentiable_loss(_model("graph"), _guide("tree", parents), x)
    again = pickle.loads(pickle.dumps(loss))
    assert again.compile == BACKEND and again._checked == {} and again.fallback is None


def _ring_graph(strength: float, name: str):
    edges = torch.stack([torch.arange(N), (torch.arange(N) + 1) % N], 1)
    model = GraphPriorVAE(
        edges, F, num_nodes=N, latent_dim=D, hidden_sizes=(8,), strength=strength, name=name
    )
    return model.double()


def test_each_model_and_each_change_of_a_model_is_scored_afresh():
    parents, x = _data()
    with isolated_params():
        guide, loss = _guide("tree", parents), TreeVIELBO()
        weak, strong = _ring_graph(0.05, "weak"), _ring_graph(0.45, "strong")
        for model in (weak, strong, _model("clustering")):
            torch.manual_seed(2)
            a = loss.differentiable_loss(model, guide, x)
            torch.manual_seed(2)
            torch.testing.assert_close(a, Trace_ELBO().differentiable_loss(model, guide, x))
        torch.manual_seed(2)
        before = loss.differentiable_loss(weak, guide, x)
        weak.strength = 0.45  # the whole graph's prior factor is kept per strength
        torch.manual_seed(2)
        a = loss.differentiable_loss(weak, guide, x)
        torch.manual_seed(2)
        torch.testing.assert_close(a, Trace_ELBO().differentiable_loss(weak, guide, x))
        assert not torch.isclose(a, before)


def test_an_encoder_of_another_latent_width_raises():
    parents, x = _data()
    for tree in (parents, None):
        with isolated_params():
            guide = TreeVIGuide(GaussianEncoder(F, 1, (8,)), tree).double()
            with pytest.raises(ValueError, match="latent_dim must be the model's"):
                TreeVIELBO().differentiable_loss(_model("graph"), guide, x)


def test_a_bernoulli_graph_model_refuses_values_other_than_0_and_1():
    parents, x = _data()
    grey = x.clone()
    grey[0, 0] = 0.5
    with isolated_params(), pyro.validation_enabled(True):
        model, guide = _model("graph"), _guide("tree", parents)
        with pytest.raises(ValueError):
            Trace_ELBO().differentiable_loss(model, guide, grey)
        with pytest.raises(ValueError, match="0 or 1 for the Bernoulli likelihood"):
            TreeVIELBO().differentiable_loss(model, guide, grey)


def test_a_model_class_that_overrides_forward_trains_with_trace_elbo():
    class Scaled(GraphPriorVAE):
        def forward(self, x, *args, **kwargs):
            with pyro.poutine.scale(scale=0.1):
                return super().forward(x, *args, **kwargs)

    parents, x = _data()
    edges = torch.stack([torch.arange(N - 1), torch.arange(1, N)], 1)
    with isolated_params():
        model = Scaled(edges, F, num_nodes=N, latent_dim=D, hidden_sizes=(8,)).double()
        guide = _guide("tree", parents)
        with pytest.warns(RuntimeWarning, match="overrides the forward of GraphPriorVAE"):
            torch.manual_seed(1)
            a = TreeVIELBO().differentiable_loss(model, guide, x)
        torch.manual_seed(1)
        torch.testing.assert_close(a, Trace_ELBO().differentiable_loss(model, guide, x))


def test_every_minibatch_of_one_size_shares_one_program():
    # pointer jumping runs ceil(log2 B) jumps whatever the forest's height
    gen = torch.Generator().manual_seed(4)
    n = 64
    parents = (torch.rand(n, generator=gen) * torch.arange(n)).long()
    parents[0] = -1
    guide = TreeVIGuide(GaussianEncoder(F, D, (8,)), parents, pair_net=PairNet(F, D, (8,)))
    x = torch.rand(n, F, generator=gen).round()
    counts = {len(guide.step_inputs(x, torch.randperm(n, generator=gen)[:16])["forest"]["jumps"])}
    counts.add(len(guide.step_inputs(x, torch.arange(16))["forest"]["jumps"]))  # a chain
    assert counts == {4}
