"""Every loss of ours, under plain ``pyro.infer.SVI``, trains every parameter of the model
and the guide, eager and compiled, with Pyro's global parameter store and with
module-local parameters: ``SVI`` optimises only the parameters a loss reads through
Pyro, so a parameter read outside the module's Pyro context would silently stay put."""

import pyro
import pytest
import torch
from pyro.infer import SVI

from pyro_trees.guides import (
    BayesianHMEGuide,
    DGPFactorisedGuide,
    GaussianEncoder,
    PairNet,
    RestartPlate,
    RNNTreeGuide,
    TreeVIGuide,
    VaRTForestGuide,
    VaRTGuide,
)
from pyro_trees.infer import (
    DGPELBO,
    HMEELBO,
    BayesianHMEELBO,
    TreeVIELBO,
    VaRTELBO,
    VaRTForestELBO,
)
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models import (
    HME,
    BayesianHME,
    ConstrainedClusteringVAE,
    DeepGP,
    GraphPriorVAE,
    VaRT,
    VaRTClassification,
    VaRTForest,
)

BACKEND = "aot_eager"  # traces and differentiates like inductor, without generating code


def _data(classes: int = 0):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(60, 3, generator=g, dtype=torch.float64)
    if classes:
        return x, (x[:, 0] * classes).long().clamp_max(classes - 1)
    return x, torch.sin(4 * x[:, 0]) + 0.1 * torch.randn(60, generator=g, dtype=x.dtype)


def _vart():
    model = VaRT(3)
    return model, VaRTGuide(model, 2), VaRTELBO, _data()


def _vart_classification():
    model = VaRTClassification(3, 3)
    return model, VaRTGuide(model, 2), VaRTELBO, _data(3)


def _forest():
    model = VaRTForest(3, num_trees=3, depth=2)
    return model, VaRTForestGuide(model), VaRTForestELBO, _data()


def _hme():
    return HME(3, 2, experts="linear").double(), RNNTreeGuide(3, 2).double(), HMEELBO, _data()


def _treevi_guide(tree: bool):
    parents = [-1, 0, 0, 1, 1, 2, 3, 3] if tree else None
    net = PairNet(3, 2, hidden_sizes=(4,)) if tree else None
    return TreeVIGuide(GaussianEncoder(3, 2, hidden_sizes=(4,)), parents, pair_net=net)


def _treevi_data():
    return (torch.rand(8, 3, generator=torch.Generator().manual_seed(2)).round(),)


def _graph_prior():
    edges = torch.tensor([[0, 1], [1, 2], [2, 3], [4, 5], [6, 7]])
    model = GraphPriorVAE(edges, 3, num_nodes=8, latent_dim=2, hidden_sizes=(4,))
    return model, _treevi_guide(True), TreeVIELBO, _treevi_data()


def _clustering():
    model = ConstrainedClusteringVAE(
        3, 2, latent_dim=2, hidden_sizes=(4,), constraints=[[0, 1], [2, 3]], weights=[1.0, -1.0]
    )
    return model, _treevi_guide(False), TreeVIELBO, _treevi_data()


def _deep_gp():
    import gpytorch

    x, y = _data()
    kernels = [gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) for _ in range(2)]
    model = DeepGP(kernels, x[:6].clone(), whiten=False)
    return model, DGPFactorisedGuide(model), DGPELBO, (x, y)


def _bayesian_hme():
    x, y = _data()
    model = BayesianHME(3)
    guide = BayesianHMEGuide(model, init="random", num_restarts=2)
    return RestartPlate(model, 2), guide, BayesianHMEELBO, (x, y)


def _trained(model, guide):
    """Every trainable tensor of the model and guide, by name."""
    out = {}
    for who, module in (("model", model), ("guide", guide)):
        for name, p in module.named_parameters():
            if p.requires_grad:
                out[f"{who}.{name}"] = p
    return out


# the HME and its RNN-Tree guide register parameters in Pyro's global store (under
# TreeELBO too), so module-local parameters are not offered for that pair; the TreeVI
# models and guide hold plain nn.Parameters, which Pyro's SVI cannot train with
# module-local parameters under any loss (Trace_ELBO raises the same AttributeError), nor
# the deep GP's GPyTorch kernels
_GLOBAL_ONLY = ("hme", "treevi graph prior", "treevi clustering, mean-field", "deep gp")
_CASES = [
    pytest.param(build, local, id=f"{name}-{'module-local' if local else 'global store'}")
    for name, build in (
        ("vart", _vart),
        ("classes", _vart_classification),
        ("forest", _forest),
        ("hme", _hme),
        ("treevi graph prior", _graph_prior),
        ("treevi clustering, mean-field", _clustering),
        ("deep gp", _deep_gp),
        ("bayesian hme", _bayesian_hme),
    )
    for local in (False, True)
    if not (local and name in _GLOBAL_ONLY)
]


@pytest.mark.parametrize("compile", [False, BACKEND], ids=["eager", "compiled"])
@pytest.mark.parametrize(("build", "local"), _CASES)
def test_svi_trains_every_parameter(build, local, compile):
    with isolated_params(), pyro.settings.context(module_local_params=local):
        model, guide, loss_cls, data = build()
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss_cls(compile=compile))
        svi.step(*data)  # the lazy starts
        before = {k: v.detach().clone() for k, v in _trained(model, guide).items()}
        assert before, "nothing to train"
        for _ in range(3):
            svi.step(*data)
        after = _trained(model, guide)
        still = sorted(k for k, v in before.items() if torch.equal(v, after[k].detach()))
        assert not still, f"{loss_cls.__name__} under plain SVI left {still} unchanged"
