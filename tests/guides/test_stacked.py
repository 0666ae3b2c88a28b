"""StackedGuides: the guides' parameters with a leading dimension of fits, written back."""

import pyro
import pytest
import torch

from pyro_trees.guides import StackedGuides, VaRTForestGuide, VaRTGuide
from pyro_trees.models import VaRT, VaRTForest


@pytest.fixture(autouse=True)
def _local_params():
    with pyro.settings.context(module_local_params=True):
        yield


def _guides(num=3, seed=0, **kwargs):
    model = VaRTForest(2, num_trees=4, depth=2, **kwargs)
    guides = []
    for j in range(num):
        g = torch.Generator().manual_seed(seed + j)
        guide = VaRTForestGuide(model, init="random", generator=g).double()
        with torch.no_grad():  # every parameter of every guide its own value
            for p in guide.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        guides.append(guide)
    return model, guides


def test_params_are_the_guides_params_stacked():
    _, guides = _guides()
    stack = StackedGuides(guides)
    x = torch.randn(5, 2, dtype=torch.float64)
    q = stack.params(x)
    for j, guide in enumerate(guides):
        for name, value in guide.params(x).items():
            assert torch.equal(q[name][j], value), name  # theta_loc over K included
    # only the stack trains: the guides are not its submodules
    assert len(list(stack.parameters())) == len(VaRTForestGuide._PARAMS)


def test_unstack_writes_each_fit_into_its_guide():
    _, guides = _guides()
    stack = StackedGuides(guides)
    x = torch.randn(5, 2, dtype=torch.float64)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(torch.arange(len(guides), dtype=p.dtype).reshape((-1,) + (1,) * (p.dim() - 1)))
    q = stack.params(x)
    assert stack.unstack() is stack.guides
    for j, guide in enumerate(guides):
        for name, value in guide.params(x).items():
            assert torch.allclose(q[name][j], value, rtol=1e-12), name


def test_noise_and_relaxed_have_the_fits_dimension():
    _, guides = _guides(num=2)
    stack = StackedGuides(guides)
    q = stack.params(torch.randn(3, 2, dtype=torch.float64))
    split, beta, theta, log_sigma = stack.relaxed(q, stack.noise(q), 0.5)
    assert split.shape == (2, 4, 3) and beta.shape == (2, 4, 3, 3)
    assert theta.shape == (2, 4, 7, 3) and log_sigma.shape == (2,)


def test_refuses_what_it_cannot_stack():
    model, guides = _guides(num=1)
    with pytest.raises(ValueError, match="at least one"):
        StackedGuides([])
    with pytest.raises(ValueError, match="one class"):
        StackedGuides([guides[0], VaRTGuide(VaRT(2), depth=2, init="random")])
    other = VaRTForestGuide(VaRTForest(2, num_trees=5, depth=2), init="random").double()
    with pytest.raises(ValueError, match="differ in shape"):
        StackedGuides([guides[0], other])
    _, missing = _guides(num=1, missing=True)
    with pytest.raises(ValueError, match="missing inputs"):
        StackedGuides(missing)
    with pytest.raises(ValueError, match="VaRT guides"):
        StackedGuides([torch.nn.Linear(1, 1)])


def test_refuses_the_global_param_store():
    _, guides = _guides(num=2)
    with pyro.settings.context(module_local_params=False):
        with pytest.raises(ValueError, match="module-local"):
            StackedGuides(guides)


def test_keep_computes_the_running_fits_only():
    _, guides = _guides(num=3)
    stack = StackedGuides(guides)
    x = torch.randn(4, 2, dtype=torch.float64)
    full = stack.params(x)
    stack.keep([0, 2])
    q = stack.params(x)
    for name, value in q.items():
        assert torch.equal(value, full[name][[0, 2]]), name
    assert torch.equal(stack.select(torch.arange(3)), torch.tensor([0, 2]))
    q["beta_loc"].sum().backward()
    assert torch.count_nonzero(stack.beta_loc.grad[1]) == 0  # a stopped fit: no gradient
    assert torch.count_nonzero(stack.beta_loc.grad[0]) > 0
    assert stack.running_index("cpu").tolist() == [0, 2]
    stack.keep([0, 1, 2])  # every fit again
    assert stack.running is None and stack.select(torch.arange(3)).tolist() == [0, 1, 2]
    assert stack.running_index("cpu").tolist() == [0, 1, 2]
    # a repeated index would have trained a fit twice, or counted as every fit
    for bad in ([], [3], [-1], [0, 0, 1], [1, 1]):
        with pytest.raises(ValueError, match="running must name"):
            stack.keep(bad)
