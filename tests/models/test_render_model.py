"""``pyro.render_model`` draws every model's graph (with the optional ``graphviz``,
``pip install pyro-trees[viz]``): each model's sample sites, plates and observed site."""

import pyro
import pytest
import torch

graphviz = pytest.importorskip("graphviz", reason="render_model needs graphviz (the viz extra)")

from pyro_trees import models  # noqa: E402
from pyro_trees.topology import Topology  # noqa: E402


def _deep_gp():
    gpytorch = pytest.importorskip("gpytorch")
    x = torch.linspace(-1, 1, 8).unsqueeze(-1)
    kernels = [gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) for _ in range(2)]
    return models.DeepGP(kernels, x[::2]), (x, torch.sin(3 * x[:, 0]))


def _vart():
    from pyro_trees.guides import VaRTGuide

    model = models.VaRT(1)
    VaRTGuide(model, depth=2)  # the guide's truncation: the model's sites down to depth 2
    return model, (torch.linspace(-1, 1, 6).unsqueeze(-1), torch.linspace(0, 1, 6))


def _heteroscedastic_gp():
    from pyro_trees.guides import HeteroscedasticGPGuide

    x = torch.linspace(-1, 1, 6).unsqueeze(-1)
    model = models.HeteroscedasticGP(in_features=1, depth=1)
    HeteroscedasticGPGuide(model, hidden_size=4)  # conditioned on y, it scores at its routing
    return model, (x, torch.sin(3 * x[:, 0]))


def _cases():
    x, y = torch.linspace(-1, 1, 6).unsqueeze(-1), torch.linspace(0, 1, 6)
    x2 = torch.rand(4, 3).round()
    edges = torch.tensor([[0, 1], [1, 2], [2, 3]])
    return {
        "HME": (lambda: (models.HME(1, 2), (x, y)), ("leaf", "obs")),
        "BayesianHME": (
            lambda: (models.BayesianHME(1, 1, Topology.balanced(1)), (x, y)),
            ("obs",),
        ),
        "HeteroscedasticGP": (_heteroscedastic_gp, ("leaf", "collapsed_bound")),
        "VaRT": (_vart, ("split_1", "beta_1", "theta_2", "obs")),
        "VaRTClassification": (
            lambda: (models.VaRTClassification(1), (x, (y > 0.5).long())),
            ("split_0", "obs"),
        ),
        "VaRTForest": (
            lambda: (models.VaRTForest(1, num_trees=2, depth=1), (x, y)),
            ("split_0", "theta_1", "obs"),
        ),
        "DeepGP": (_deep_gp, ("obs",)),
        "SyntheticGraphVAE": (
            lambda: ((m := models.SyntheticGraphVAE()), (m.generate(2),)),
            ("z",),
        ),
        "GraphPriorVAE": (
            lambda: (
                models.GraphPriorVAE(edges, 3, num_nodes=4, latent_dim=2, hidden_sizes=(8,)),
                (x2,),
            ),
            ("z",),
        ),
        "ConstrainedClusteringVAE": (
            lambda: (
                models.ConstrainedClusteringVAE(
                    3, 2, latent_dim=2, hidden_sizes=(8,), constraints=[[0, 1]], weights=[1.0]
                ),
                (x2,),
            ),
            ("z",),
        ),
    }


CASES = _cases()


def test_every_model_class_is_covered():
    classes = {n for n in models.__all__ if isinstance(getattr(models, n), type)}
    classes -= {"HGPPrediction"}  # a prediction's record, not a model
    assert classes == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_model_draws_the_sites(name):
    build, sites = CASES[name]
    model, args = build()
    graph = pyro.render_model(model, model_args=args, render_distributions=True)
    assert isinstance(graph, graphviz.Digraph)
    for site in sites:
        assert f"\t{site} [" in graph.source or f"\t{site} ->" in graph.source, graph.source
