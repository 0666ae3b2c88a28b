"""The Pyro user's contract, one parametrised test over every model + guide pair.

Each system registers a :class:`Case`: how a user builds its model and guide with their
defaults, the paper's toy problem, and the shortest plain ``pyro.infer.SVI`` loop that the
docs show. The tests then check, for every case, what a Pyro user relies on:

* the shortest SVI loop reaches the paper's toy figure (loose tolerance, short run);
* ``Predictive`` (sequential and ``parallel=True``) returns posterior predictive draws of
  every observed site, centred on the fit and not on the prior;
* float32 and float64 both train without NaN (or the unsupported one is refused at
  construction with a message naming the supported one);
* two instances with different ``name=`` prefixes coexist in one parameter store;
* the guide works inside ``AutoGuideList`` beside an autoguide for a user's own latent;
* a guide trace replays through the model (``poutine.replay``);
* saving and loading the parameter store reproduces predictions exactly.

The toy fit of each case runs once per module (``fitted`` fixture) and the other tests
read it, so the file costs about one short fit per system.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList, AutoNormal
from pyro.poutine.subsample_messenger import _Subsample

from tests.conftest import SEED

Args = tuple[tuple, dict]


@dataclass
class Case:
    """One model + guide pair as a Pyro user meets it.

    :param id: test id.
    :param build: ``build(name=None, dtype=torch.float64) -> (model, guide)`` with the
        classes' defaults; ``name`` is the parameter-store prefix of both.
    :param data: ``data(dtype) -> (args, kwargs)`` of the toy problem, observations
        included, as ``svi.step(*args, **kwargs)`` takes them.
    :param predict_args: ``predict_args(args, kwargs) -> (args, kwargs)`` without the
        observations, as ``Predictive(...)(*args, **kwargs)`` takes them.
    :param observed: names of the observed sites that ``Predictive`` must return.
    :param figure: ``figure(model, guide, args, kwargs) -> float``, the paper's toy figure
        after the fit.
    :param passes: ``passes(value) -> bool``: loose tolerance on ``figure``.
    :param paper: the paper's figure, in words, for the failure message.
    :param centred: ``centred(samples, args, kwargs) -> float``: a score in [-1, 1]
        (e.g. a correlation) of the predictive draws with the fitted function or data;
        draws from the prior score near 0.
    :param min_centred: the lowest acceptable ``centred`` score.
    :param steps: SVI steps of the short toy fit.
    :param lr: Adam's learning rate in the shortest loop.
    :param loss: the ELBO class the docs use (``Trace_ELBO`` unless the model needs
        another).
    :param dtypes: dtypes the model trains in; any other is refused at construction.
    :param num_samples: predictive draws.
    :param restarts: fits of the module's toy fit, from seeds ``SEED + 1000 r``; the one
        with the lowest mean loss over its last 50 steps is kept, as the training guide
        advises for multimodal posteriors (``fit_restarts``). Set, with the spread that
        asks for it, where one start lands in a poor optimum on some seeds.
    :param fit_dtype: dtype of the module's toy fit.
    """

    id: str
    build: Callable[..., tuple]
    data: Callable[[torch.dtype], Args]
    predict_args: Callable[[tuple, dict], Args]
    observed: tuple[str, ...]
    figure: Callable[..., float]
    passes: Callable[[float], bool]
    paper: str
    centred: Callable[[dict, tuple, dict], float]
    min_centred: float = 0.5
    steps: int = 300
    lr: float = 0.01
    loss: Callable[[], Any] = Trace_ELBO
    dtypes: tuple = (torch.float32, torch.float64)
    num_samples: int = 20
    extra: dict = field(default_factory=dict)
    restarts: int = 1
    fit_dtype: torch.dtype = torch.float64


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two tensors of the same number of elements."""
    a = a.detach().double().reshape(-1)
    b = b.detach().double().reshape(-1)
    a = a - a.mean()
    b = b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def train(case: Case, *, name=None, dtype=torch.float64, steps=None, data=None):
    """The shortest plain SVI loop, as the docs show it."""
    model, guide = case.build(name=name, dtype=dtype)
    args, kwargs = data if data is not None else case.data(dtype)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": case.lr}), case.loss())
    losses = [svi.step(*args, **kwargs) for _ in range(case.steps if steps is None else steps)]
    return model, guide, (args, kwargs), losses


CASES: list[Case] = []

# ---------------------------------------------------------------------------------------
# HME with the tree-balance prior and the RNN-Tree guide (pulse data)
# ---------------------------------------------------------------------------------------


def _hme_build(name=None, dtype=torch.float64):
    from pyro_trees.guides import RNNTreeGuide
    from pyro_trees.models import HME

    return HME(1, 3, name=name), RNNTreeGuide(1, 3, name=name)


def _hme_data(dtype):
    from pyro_trees.datasets import make_pulse

    X, y = make_pulse(400)
    return (torch.tensor(X, dtype=dtype), torch.tensor(y, dtype=dtype)), {}


def _hme_tree_mse(model, guide, args, kwargs):
    """Training MSE of the most likely tree (the paper: 'almost perfect'; var(y) 2.09)."""
    x, y = args
    with torch.no_grad():
        leaf = guide.rules().route(x)
        return float(((model.leaf_loc[leaf, 0] - y) ** 2).mean())


def _hme_loss():
    from pyro_trees.infer import TreeELBO

    return TreeELBO()


CASES.append(
    Case(
        id="hme-rnn-tree-pulse",
        build=_hme_build,
        data=_hme_data,
        predict_args=lambda args, kwargs: ((args[0],), {}),
        observed=("obs",),
        figure=_hme_tree_mse,
        # HME(1, 3)'s defaults (noise scale learnt): 0.0043-0.0044 over seeds 0-9 in
        # float64 (with the former fixed sigma = 1: 0.0137-0.0595)
        passes=lambda v: v < 0.1,
        paper="the depth-3 RNN-Tree fits all 8 pulse levels 'almost perfectly' (F.1)",
        centred=lambda samples, args, kwargs: corr(samples["obs"].mean(0), args[1]),
        min_centred=0.9,
        steps=300,
        lr=0.01,
        loss=_hme_loss,
    )
)


# ---------------------------------------------------------------------------------------
# Bayesian HME (toy / robot arm)
# ---------------------------------------------------------------------------------------


def _bhme_build(name=None, dtype=torch.float64):
    from pyro_trees.guides import BayesianHMEGuide
    from pyro_trees.models import BayesianHME
    from pyro_trees.topology import Topology

    # the paper's toy model: 2 gates, 3 experts, (E (E E)); dtype follows the data
    model = BayesianHME(1, 1, Topology([1, 3]), name=name or "")
    return model, BayesianHMEGuide(model)


def _bhme_data(dtype):
    from pyro_trees.datasets.bayesian_hme import toy_inverse

    t, x = toy_inverse(200, seed=0)
    return (torch.as_tensor(t, dtype=dtype), torch.as_tensor(x, dtype=dtype)), {}


def _bhme_elbo(model, guide, args, kwargs):
    elbo = Trace_ELBO(num_particles=1000, vectorize_particles=True, max_plate_nesting=1)
    with torch.no_grad():
        return -elbo.loss(model, guide, *args, **kwargs)


def _bhme_on_branches(samples, args, kwargs):
    # share of draws x whose forward map x + 0.3 sin(2 pi x) lands within 0.2 of the input
    t = args[0][:, 0]
    x = samples["obs"][..., 0]
    return float(((x + 0.3 * torch.sin(2 * math.pi * x) - t).abs() < 0.2).double().mean())


CASES.append(
    Case(
        id="bayesian_hme-toy",
        build=_bhme_build,
        data=_bhme_data,
        predict_args=lambda args, kwargs: ((args[0],), {}),
        observed=("obs",),
        figure=_bhme_elbo,
        passes=lambda value: value > 120.0,
        paper="Ockham hill peaks at 3 experts; closed-form VB here: bound 126.2, "
        "its q's ELBO 128.0 (2 experts: 50.5)",
        centred=_bhme_on_branches,
        min_centred=0.8,
        steps=300,
        lr=0.003,
    )
)


# ---------------------------------------------------------------------------------------
# VaRT (the step function)
# ---------------------------------------------------------------------------------------


def _vart_build(name=None, dtype=torch.float64):
    from pyro_trees.guides import VaRTGuide
    from pyro_trees.models import VaRT

    model = VaRT(1, name=name)
    return model, VaRTGuide(model, name=name)


def _vart_data(dtype):
    from pyro_trees.datasets import make_vart_step

    d = make_vart_step(100, random_state=0)
    return (torch.tensor(d["X"], dtype=dtype), torch.tensor(d["y"], dtype=dtype)), {}


def _vart_rmse(model, guide, args, kwargs):
    """RMSE of the posterior predictive mean to the step function on new inputs."""
    from pyro_trees.datasets import make_vart_step

    d = make_vart_step(500, random_state=1)
    x = torch.tensor(d["X"], dtype=args[0].dtype)
    draws = Predictive(model, guide=guide, num_samples=50)(x)["obs"]
    return float((draws.mean(0).double() - torch.as_tensor(d["f"])).pow(2).mean().sqrt())


CASES.append(
    Case(
        id="vart",
        build=_vart_build,
        data=_vart_data,
        predict_args=lambda args, kwargs: ((args[0],), {}),
        observed=("obs", "mean"),
        figure=_vart_rmse,
        passes=lambda v: v < 0.25,
        paper="Figure A: the posterior concentrates on the steps (no number; the steps "
        "differ by 1 to 2, the noise s.d. is 0.1); here the RMSE of the predictive mean",
        centred=lambda samples, args, kwargs: corr(samples["obs"].mean(0), args[1]),
        min_centred=0.9,
        steps=300,
        lr=0.05,
    )
)


def _vart_forest_build(name=None, dtype=torch.float64):
    from pyro_trees.guides import VaRTForestGuide
    from pyro_trees.models import VaRTForest

    model = VaRTForest(1, num_trees=10, depth=2, kl_weight=1e-3, name=name)
    return model, VaRTForestGuide(model, name=name)


CASES.append(
    Case(
        id="vart-forest",
        build=_vart_forest_build,
        data=_vart_data,
        predict_args=lambda args, kwargs: ((args[0],), {}),
        observed=("obs", "mean"),
        figure=_vart_rmse,
        passes=lambda v: v < 0.35,
        paper="no paper figure (forests are this package's extension); the step "
        "function as for the single tree, RMSE of the predictive mean",
        centred=lambda samples, args, kwargs: corr(samples["obs"].mean(0), args[1]),
        min_centred=0.9,
        steps=300,
        lr=0.05,
    )
)


# ---------------------------------------------------------------------------------------
# VaRT classification (a threshold, probit link)
# ---------------------------------------------------------------------------------------


def _vart_clf_build(name=None, dtype=torch.float64):
    from pyro_trees.guides import VaRTGuide
    from pyro_trees.models import VaRTClassification

    model = VaRTClassification(1, 2, name=name)
    return model, VaRTGuide(model, depth=2, name=name)


def _vart_clf_data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 1, generator=g, dtype=torch.float64).to(dtype)
    return (x, (x[:, 0] > 0.3).long()), {}


def _vart_clf_accuracy(model, guide, args, kwargs):
    """Accuracy of the posterior predictive's most probable class on new inputs."""
    x = torch.linspace(-2, 2, 101, dtype=args[0].dtype).unsqueeze(-1)
    probs = Predictive(model, guide=guide, num_samples=20)(x)["probs"].mean(0)
    return float((probs.argmax(-1) == (x[:, 0] > 0.3).long()).double().mean())


CASES.append(
    Case(
        id="vart_classification",
        build=_vart_clf_build,
        data=_vart_clf_data,
        predict_args=lambda args, kwargs: ((args[0],), {}),
        observed=("obs", "probs"),
        figure=_vart_clf_accuracy,
        passes=lambda v: v > 0.9,
        paper="no paper figure (VaRT's future work): a threshold at 0.3 learnt by the "
        "probit tree; accuracy of the predictive on a grid",
        centred=lambda samples, args, kwargs: corr(samples["probs"].mean(0)[:, 1], args[1]),
        min_centred=0.7,
        steps=100,
        lr=0.05,
    )
)


# ---------------------------------------------------------------------------------------
# Deep GP (the step function), three guides
# ---------------------------------------------------------------------------------------
# The paper (Ustyuzhaninov et al., Fig. 2) fits y = sin(7 exp(x)) with an SE layer then a
# periodic one; its figure is qualitative: every guide's composition fits the data.


def _dgp_build(guide_cls, inducing):
    def build(name=None, dtype=torch.float64):
        import gpytorch

        from pyro_trees.models import DeepGP

        kernels = [
            gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()),
            gpytorch.kernels.ScaleKernel(gpytorch.kernels.PeriodicKernel()),
        ]
        Z = torch.linspace(-1, 1, 15, dtype=dtype).unsqueeze(-1)
        model = DeepGP(kernels, Z, inducing=inducing, name=name or "")
        return model, guide_cls(model, name=name or "")

    return build


def _dgp_data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.linspace(-1, 1, 50, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(7 * torch.exp(x[:, 0])) + 0.05 * torch.randn(50, generator=g, dtype=x.dtype)
    return (x.to(dtype), y.to(dtype)), {}


def _dgp_figure(model, guide, args, kwargs):
    """RMSE of the predictive mean to the noiseless sin(7 exp(x)) at the 50 inputs."""
    from pyro_trees.infer import dgp_predict

    x = args[0]
    mean = dgp_predict(model, guide, x, num_samples=100)["mean"]
    return float((mean - torch.sin(7 * torch.exp(x[:, 0]))).pow(2).mean().sqrt())


def _dgp_cases():
    from pyro_trees.guides import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide

    # The intermediate guide's toy fit follows the docs' snippet (torch's default float32,
    # restarts kept by the loss). Measured over 20 seeds of one 500-step start: float32
    # lands in a poor optimum (RMSE 0.36-0.64, final loss 215-418; the others 0.08-0.20,
    # loss 34-141) on 3 of 20; float64 on 5 of 10 (guide page, "Known limitations").
    # Three restarts: all three poor with probability about 0.3 %.
    robust = {"dgp-intermediate": dict(restarts=3, fit_dtype=torch.float32)}
    for cid, cls, inducing in (
        ("dgp-factorised", DGPFactorisedGuide, "layer"),
        ("dgp-joint", DGPJointGuide, "layer"),
        ("dgp-intermediate", DGPIntermediateGuide, "propagated"),
    ):
        yield Case(
            id=cid,
            build=_dgp_build(cls, inducing),
            data=_dgp_data,
            predict_args=lambda args, kwargs: ((args[0],), {}),
            observed=("obs",),
            figure=_dgp_figure,
            passes=lambda v: v < 0.25,
            paper="Fig. 2: the composition fits the data (qualitative; noise sd 0.05)",
            centred=lambda s, args, kwargs: corr(s["obs"].mean(0), args[1]),
            min_centred=0.8,
            steps=500,
            lr=0.01,
            **robust.get(cid, {}),
        )


CASES += list(_dgp_cases())


# ---------------------------------------------------------------------------------------
# Heteroscedastic GP (F.3 noise)
# ---------------------------------------------------------------------------------------


def _hgp_data(n):
    """The F.3 noise task (four-step log sigma), ``n`` of its 1,200 points, y standardised."""
    import numpy as np

    from pyro_trees.datasets import make_noise_task, noise_task_mean

    X, Y, _ = make_noise_task(1200, random_state=0)
    rows = np.sort(np.random.default_rng(0).permutation(len(Y))[:n])
    mean, std = Y[rows].mean(), Y[rows].std()

    def data(dtype):
        x = torch.tensor(X[rows], dtype=dtype)
        return x, torch.tensor((Y[rows] - mean) / std, dtype=dtype)

    truth = torch.tensor((noise_task_mean(X[rows, 0]) - mean) / std)
    return data, math.log(std), truth


def _hgp_case(case_id, n, inducing, steps, loss, kwargs):
    from pyro_trees.datasets import noise_log_sigma
    from pyro_trees.guides import HeteroscedasticGPGuide
    from pyro_trees.models import HeteroscedasticGP

    data, log_std, truth = _hgp_data(n)
    middles = torch.tensor([[-1.625], [-0.875], [-0.125], [0.625]])

    def build(name=None, dtype=torch.float64):
        z = None if not inducing else torch.linspace(-2, 1, inducing, dtype=dtype)[:, None]
        model = HeteroscedasticGP(1, 2, inducing_points=z, name=name).to(dtype)
        return model, HeteroscedasticGPGuide(model).to(dtype)

    def figure(model, guide, args, kw):
        x = middles.to(args[0].dtype)
        log_sigma = model.predict(x, guide).log_sigma.double() + log_std
        return float((log_sigma - torch.tensor(noise_log_sigma(middles[:, 0].numpy()))).abs().max())

    return Case(
        id=case_id,
        build=build,
        data=lambda dtype: (data(dtype), dict(kwargs)),
        predict_args=lambda args, kw: ((args[0],), {}),
        observed=("obs",),
        figure=figure,
        passes=lambda v: v < 0.5,
        paper="Fig. 2c / 5: the four-step log sigma recovered (benchmark: within 0.25 at N = 960)",
        centred=lambda samples, args, kw: corr(
            samples["f"].mean(0).reshape(-1), truth.to(samples["f"].dtype)
        ),
        min_centred=0.8,
        steps=steps,
        lr=0.02,
        loss=loss,
    )


CASES += [
    _hgp_case("hgp-exact", 300, 0, 150, Trace_ELBO, {}),
    _hgp_case("hgp-sparse", 960, 20, 300, Trace_ELBO, {"subsample_size": 128}),
]


# ---------------------------------------------------------------------------------------
# TreeVI (synthetic graph VAE, graph prior, constrained clustering)
# ---------------------------------------------------------------------------------------


TREEVI_T2 = [-1, 0, 1, 0]  # the paper's T2: edges (1,2), (1,4), (2,3), 0-based parents
TREEVI_GROUPS = 200


def _treevi_synthetic_data(dtype):
    from pyro_trees.models import SyntheticGraphVAE

    x = SyntheticGraphVAE().generate(TREEVI_GROUPS, torch.Generator().manual_seed(0))
    return (x.to(dtype),), {}


def _treevi_build_synthetic(name=None, dtype=torch.float64):
    from pyro_trees.guides import GroupEncoder, TreeVIGuide
    from pyro_trees.models import SyntheticGraphVAE

    name = name or ""
    model = SyntheticGraphVAE(name=name)
    guide = TreeVIGuide(GroupEncoder(4, 4, 4), TREEVI_T2, plate="groups", name=name)
    return model, guide


def _treevi_build_mixture(name=None, dtype=torch.float64):
    from pyro_trees.guides import GroupEncoder, PairNet, TreeVIMixtureGuide

    model, _ = _treevi_build_synthetic(name, dtype)
    nets = [PairNet(4, 4, num_nodes=4) for _ in range(2)]
    guide = TreeVIMixtureGuide(
        GroupEncoder(4, 4, 4),
        [[-1, 0, 0, 1], TREEVI_T2],
        pair_net=nets,
        plate="groups",
        name=name or "",
    )
    return model, guide


def _treevi_mixture_elbo():
    from pyro_trees.infer import MixtureTreeELBO

    return MixtureTreeELBO()


def _treevi_gap(make_elbo):
    """log p(x) minus the ELBO, per instance (20 Monte Carlo passes over all groups)."""

    def figure(model, guide, args, kwargs):
        elbo = make_elbo()
        x = args[0]
        with torch.no_grad():
            value = -sum(elbo.loss(model, guide, *args, **kwargs) for _ in range(20)) / 20
            exact = float(model.exact_log_likelihood(x).sum())
        return (exact - value) / x[..., 0].numel()

    return figure


def _treevi_reconstructions(samples, args, kwargs):
    # posterior predictive mean of x against the data (draws from the prior score ~0)
    return corr(samples["x"].mean(0), args[0])


def _treevi_graph_data(dtype):
    from pyro_trees.models import SyntheticGraphVAE

    # the synthetic groups as one graph of 4 * 50 instances: eq. 18's affinity per block
    x = SyntheticGraphVAE().generate(50, torch.Generator().manual_seed(0))
    return (x.reshape(-1, 4).to(dtype),), {}


def _treevi_build_graph(name=None, dtype=torch.float64):
    from pyro_trees.guides import GaussianEncoder, TreeVIGuide
    from pyro_trees.infer import maximum_spanning_tree
    from pyro_trees.models import SYNTHETIC_AFFINITY, GraphPriorVAE

    adjacency = torch.block_diag(*[SYNTHETIC_AFFINITY] * 50)
    tree = maximum_spanning_tree(adjacency.masked_fill(adjacency == 0, -math.inf))
    model = GraphPriorVAE(
        adjacency, 4, latent_dim=4, hidden_sizes=(), likelihood="normal", name=name or ""
    )
    guide = TreeVIGuide(GaussianEncoder(4, 4, hidden_sizes=()), tree, name=name or "")
    return model, guide


def _treevi_graph_gap(model, guide, args, kwargs):
    """log p(x) of the generating model minus the fitted ELBO, per instance."""
    from pyro_trees.models import SyntheticGraphVAE

    x = args[0]
    with torch.no_grad():
        value = -sum(Trace_ELBO().loss(model, guide, x) for _ in range(20)) / 20
        exact = float(SyntheticGraphVAE().exact_log_likelihood(x.reshape(-1, 4, 4)).sum())
    return (exact - value) / x.shape[0]


def _treevi_clusters():
    """Three noisy binary prototypes (120 instances, 12 features) and 200 random pairs:
    must-links inside a class, cannot-links across (weight +-10)."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(120) % 3
    protos = (torch.rand(3, 12, generator=g) < 0.5).float()
    x = (protos[labels] + (torch.rand(120, 12, generator=g) < 0.1).float()) % 2
    pairs = torch.randint(0, 120, (200, 2), generator=g)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    return x, labels, pairs, torch.where(same, 10.0, -10.0)


def _treevi_build_clustering(name=None, dtype=torch.float64):
    from pyro_trees.guides import GaussianEncoder, TreeVIGuide
    from pyro_trees.infer import maximum_spanning_tree
    from pyro_trees.models import ConstrainedClusteringVAE

    _, _, pairs, w = _treevi_clusters()
    must = pairs[w > 0]
    forest = maximum_spanning_tree(torch.ones(len(must)), edges=must, num_nodes=120)
    model = ConstrainedClusteringVAE(
        12, 3, latent_dim=2, hidden_sizes=(32,), constraints=pairs, weights=w, name=name or ""
    )
    return model, TreeVIGuide(GaussianEncoder(12, 2, (32,)), forest, name=name or "")


def _treevi_clustering_accuracy(model, guide, args, kwargs):
    """Accuracy of the hard assignments under the best matching of clusters to classes."""
    from scipy.optimize import linear_sum_assignment

    _, labels, _, _ = _treevi_clusters()
    pred = model.predict(guide.median(args[0]))
    counts = torch.zeros(3, 3)
    counts.index_put_((pred, labels), torch.ones(len(labels)), accumulate=True)
    rows, cols = linear_sum_assignment(-counts.numpy())
    return float(counts[rows, cols].sum()) / len(labels)


CASES += [
    Case(
        id="treevi-synthetic-T2",
        build=_treevi_build_synthetic,
        data=_treevi_synthetic_data,
        predict_args=lambda args, kwargs: (args, kwargs),
        observed=("x",),
        figure=_treevi_gap(Trace_ELBO),
        passes=lambda gap: 0 <= gap < 0.27,
        paper="Table 1, TreeVI (T2): gap to exact log p(x) 0.27 per instance (snippet: 0.028)",
        centred=_treevi_reconstructions,
        steps=300,
        lr=0.005,
    ),
    Case(
        id="treevi-synthetic-mtreevi",
        build=_treevi_build_mixture,
        data=_treevi_synthetic_data,
        predict_args=lambda args, kwargs: (args, kwargs),
        observed=("x",),
        figure=_treevi_gap(_treevi_mixture_elbo),
        passes=lambda gap: 0 <= gap < 0.017 + 0.05,
        paper="Table 1, MTreeVI (T1, T2): gap to exact log p(x) 0.017 per instance",
        centred=_treevi_reconstructions,
        steps=300,
        lr=0.005,
        loss=_treevi_mixture_elbo,
    ),
    Case(
        id="treevi-graph-prior",
        build=_treevi_build_graph,
        data=_treevi_graph_data,
        predict_args=lambda args, kwargs: (args, kwargs),
        observed=("x",),
        figure=_treevi_graph_gap,
        passes=lambda gap: gap < 0.5,
        paper="no toy in the paper: Sec. 4.1's groups as one graph, gap to the true log p(x)",
        centred=_treevi_reconstructions,
        # a learnt linear decoder and noise: 300 steps leave most variance to the noise
        min_centred=0.3,
        steps=300,
        lr=0.05,
    ),
    Case(
        id="treevi-constrained-clustering",
        build=_treevi_build_clustering,
        data=lambda dtype: ((_treevi_clusters()[0].to(dtype),), {}),
        predict_args=lambda args, kwargs: (args, kwargs),
        observed=("x",),
        figure=_treevi_clustering_accuracy,
        passes=lambda acc: acc >= 0.8,
        paper="Sec. 4.2, MNIST with constraints: TreeVI ACC 97.4 % (toy here: 3 prototypes)",
        centred=_treevi_reconstructions,
        steps=300,
        lr=0.01,
        # one start merges two clusters on 2 of 20 seeds (ACC 0.667-0.675, final loss
        # 400-431; the others ACC 0.86-0.99, loss below 120): three restarts
        restarts=3,
    ),
]


# ---------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------

IDS = [c.id for c in CASES]


@pytest.fixture(scope="module")
def fitted(request):
    """One short toy fit per case, kept for the module; its param store travels with it."""
    cache = {}

    def get(case: Case):
        if case.id not in cache:
            best = None
            for r in range(case.restarts):
                pyro.clear_param_store()
                pyro.set_rng_seed(SEED + 1000 * r)
                model, guide, data, losses = train(case, dtype=case.fit_dtype)
                score = sum(losses[-50:]) / len(losses[-50:])
                if best is None or score < best[0]:
                    best = (score, model, guide, data, losses, pyro.get_param_store().get_state())
            cache[case.id] = best[1:]
        model, guide, data, losses, state = cache[case.id]
        pyro.get_param_store().set_state(state)
        return model, guide, data, losses

    return get


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shortest_svi_reaches_toy_figure(case, fitted):
    model, guide, (args, kwargs), losses = fitted(case)
    assert all(math.isfinite(v) for v in losses)
    value = case.figure(model, guide, args, kwargs)
    assert case.passes(value), f"{case.id}: toy figure {value:.4g}; paper: {case.paper}"


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_predictive_is_posterior_predictive(case, parallel, fitted):
    model, guide, (args, kwargs), _ = fitted(case)
    pargs, pkwargs = case.predict_args(args, kwargs)
    samples = Predictive(model, guide=guide, num_samples=case.num_samples, parallel=parallel)(
        *pargs, **pkwargs
    )
    for site in case.observed:
        assert site in samples, f"{case.id}: Predictive lost observed site {site!r}"
        value = samples[site]
        assert value.shape[0] == case.num_samples
        assert torch.isfinite(value).all()
    score = case.centred(samples, args, kwargs)
    assert score >= case.min_centred, f"{case.id}: predictive draws score {score:.3f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dtype_trains_or_is_refused(case, dtype):
    if dtype not in case.dtypes:
        with pytest.raises(ValueError, match="float"):
            case.build(name=None, dtype=dtype)
        return
    model, guide, _, losses = train(case, dtype=dtype, steps=20)
    assert all(math.isfinite(v) for v in losses), f"{case.id} in {dtype}: {losses}"
    for name, value in pyro.get_param_store().items():
        assert torch.isfinite(value).all(), f"{case.id} in {dtype}: {name} is not finite"
        if value.is_floating_point():
            assert value.dtype == dtype, f"{case.id}: {name} is {value.dtype}, not {dtype}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_named_instances_share_one_param_store(case):
    data = case.data(torch.float64)
    train(case, name="first", steps=3, data=data)
    store = pyro.get_param_store()
    first = {k: v.detach().clone() for k, v in store.items()}
    assert first and all(k.startswith("first") for k in first), sorted(first)
    train(case, name="second", steps=3, data=data)
    second = [k for k in store.keys() if k not in first]
    assert second and all(k.startswith("second") for k in second), sorted(second)
    for k, v in first.items():
        assert torch.equal(store[k].detach(), v), f"{case.id}: training 'second' moved {k}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_guide_composes_in_autoguidelist(case):
    model, guide = case.build(name=None, dtype=torch.float64)
    args, kwargs = case.data(torch.float64)

    def user_model(*a, **k):
        # A latent of the user's own beside ours, with its own autoguide.
        pyro.sample("user_offset", dist.Normal(0.0, 1.0))
        return model(*a, **k)

    # Global sites first, as Pyro expects them before enumerated local ones.
    guides = AutoGuideList(user_model)
    guides.append(AutoNormal(poutine.block(user_model, expose=["user_offset"])))
    guides.append(guide)
    svi = SVI(user_model, guides, pyro.optim.Adam({"lr": case.lr}), case.loss())
    losses = [svi.step(*args, **kwargs) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    pargs, pkwargs = case.predict_args(args, kwargs)
    samples = Predictive(user_model, guide=guides, num_samples=3)(*pargs, **pkwargs)
    assert "user_offset" in samples
    assert all(site in samples for site in case.observed)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_guide_trace_replays_through_model(case, fitted):
    model, guide, (args, kwargs), _ = fitted(case)
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
    latents = [
        n for n, s in guide_trace.nodes.items() if s["type"] == "sample" and not s["is_observed"]
    ]
    assert latents, f"{case.id}: the guide samples nothing"
    for n in latents:
        if n in model_trace.nodes:
            assert model_trace.nodes[n]["value"] is guide_trace.nodes[n]["value"]
    assert math.isfinite(float(model_trace.log_prob_sum().detach()))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_param_store_save_load_reproduces_predictions(case, fitted, tmp_path):
    model, guide, (args, kwargs), _ = fitted(case)
    pargs, pkwargs = case.predict_args(args, kwargs)

    def predict(m, g):
        pyro.set_rng_seed(1)
        return Predictive(m, guide=g, num_samples=3)(*pargs, **pkwargs)

    before = predict(model, guide)
    pyro.get_param_store().save(tmp_path / "params.pt")
    pyro.clear_param_store()
    model2, guide2 = case.build(name=None, dtype=case.fit_dtype)
    pyro.get_param_store().load(tmp_path / "params.pt")
    after = predict(model2, guide2)
    for site in case.observed:
        torch.testing.assert_close(after[site], before[site], rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_guide_base_gives_posterior_draws_and_quantiles(case, fitted):
    from pyro_trees.guides import TreeGuide

    model, guide, (args, kwargs), _ = fitted(case)
    assert isinstance(guide, TreeGuide)
    guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
    latents = {
        n
        for n, s in guide_trace.nodes.items()
        if s["type"] == "sample" and not s["is_observed"] and not isinstance(s["fn"], _Subsample)
    }
    draws = guide.sample_posterior(*args, num_samples=4, **kwargs)
    assert latents <= set(draws), sorted(latents - set(draws))
    for site, value in draws.items():
        assert value.shape[0] == 4 and torch.isfinite(value.double()).all(), site
    bands = guide.quantiles([0.1, 0.9], *args, num_samples=20, **kwargs)
    for site, value in bands.items():
        assert value.shape[0] == 2 and bool((value[0] <= value[1]).all()), site
