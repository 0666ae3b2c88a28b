import pyro
import pytest
import torch
from pyro.infer import Predictive

from pyro_trees.distributions import BalancedLeaf
from pyro_trees.models import HME


@pytest.fixture(autouse=True)
def _scope():
    with pyro.get_param_store().scope():
        yield


@pytest.mark.parametrize("experts", ["constant", "linear"])
def test_sites_and_shapes(experts):
    model = HME(3, 2, experts=experts)
    x = torch.randn(11, 3)
    trace = pyro.poutine.trace(model).get_trace(x)
    assert isinstance(trace.nodes["leaf"]["fn"], BalancedLeaf)
    assert trace.nodes["leaf"]["value"].shape == (11,)
    assert trace.nodes["obs"]["value"].shape == (11,)
    samples = Predictive(model, num_samples=4)(x, subsample_size=5)
    assert samples["obs"].shape == (4, 5)


def test_enumerated_leaf_broadcasts():
    model = HME(2, 2, num_outputs=3, noise_scale=None)
    x = torch.randn(6, 2)
    d = model.expert(x, torch.arange(4).unsqueeze(-1))
    assert d.batch_shape == (4, 6) and d.event_shape == (3,)


def test_categorical_experts():
    model = HME(2, 3, likelihood="categorical", num_classes=4)
    x = torch.randn(9, 2)
    y = model(x)
    assert y.shape == (9,) and int(y.max()) < 4


def test_init_experts_is_an_m_step():
    model = HME(1, 1, noise_scale=None).double()
    x = torch.zeros(4, 1, dtype=torch.float64)
    y = torch.tensor([1.0, 3.0, 10.0, 14.0], dtype=torch.float64)
    probs = torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, 1]], dtype=torch.float64)
    model.init_experts(x, y, probs)
    torch.testing.assert_close(model.leaf_loc.detach()[:, 0], torch.tensor([2.0, 12.0]).double())
    torch.testing.assert_close(model.scale().detach(), torch.tensor([2.5**0.5]).double())


def test_the_first_calls_start_keeps_the_noise_off_zero_on_noise_free_data():
    """The Pyro path's start (first call with targets) floors the learnt noise scale at
    0.05 sd(y): on the noise-free pulse the hard start's residual is ~0, and a noise
    scale there made the first loss ~56,000 nats a point. An explicit M-step keeps the
    floor it is given (the estimators' 1e-3 by default)."""
    from pyro_trees.datasets import make_pulse
    from pyro_trees.guides import RNNTreeGuide
    from pyro_trees.infer import TreeELBO

    X, y = make_pulse(400)
    x, y = torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    model, guide = HME(1, 3), RNNTreeGuide(1, 3)
    loss = TreeELBO().loss(model, guide, x, y)
    sd = float(y.std())
    assert float(model.scale().detach()) == pytest.approx(0.05 * sd, rel=1e-4)
    assert loss / len(y) < 50  # it was ~56,000 nats a point
    explicit = HME(1, 3)
    with torch.no_grad():  # every point at its best expert: a residual of ~0
        best = model.leaf_log_likelihood(x, y, model.expert_params()).argmax(-1)
    explicit.init_experts(x, y, torch.nn.functional.one_hot(best, 8))
    assert float(explicit.scale().detach()) < 0.05 * sd


def test_bad_arguments():
    with pytest.raises(ValueError, match="likelihood"):
        HME(2, 2, likelihood="poisson")
    with pytest.raises(ValueError, match="num_classes"):
        HME(2, 2, likelihood="categorical")
    with pytest.raises(ValueError, match="noise_scale"):
        HME(2, 2, noise_scale=0.0)
    model = HME(2, 2)
    with pytest.raises(ValueError, match=r"shape \(N, 2\)"):
        model(torch.randn(5, 3))
    with pytest.raises(ValueError, match="rows"):
        model(torch.randn(5, 2), torch.randn(4))
    # one output takes y as (N,), as the module says, not as a column
    with pytest.raises(ValueError, match=r"shape \(5,\); got \(5, 1\)"):
        model(torch.randn(5, 2), torch.randn(5, 1))
    with pytest.raises(ValueError, match=r"shape \(5, 3\); got \(5,\)"):
        HME(2, 2, num_outputs=3)(torch.randn(5, 2), torch.randn(5))
    with pytest.raises(ValueError, match=r"class labels of x's 5 rows"):
        HME(2, 2, likelihood="categorical", num_classes=3)(
            torch.randn(5, 2), torch.zeros(5, 1, dtype=torch.long)
        )


def test_too_deep_a_tree_says_how_much_memory_the_experts_need():
    # 4 copies (value, gradient, two Adam moments) x 2**36 leaves x 4 bytes x values
    with pytest.raises(ValueError, match=r"2\*\*36 .*\(1 values per leaf.*about 1.0 TiB"):
        HME(2, 36)
    # linear experts: (1 + L) x outputs values per leaf = (1 + 3) x 2
    with pytest.raises(ValueError, match=r"8 values per leaf.*about 8.0 TiB"):
        HME(3, 36, experts="linear", num_outputs=2, noise_scale=None)
    with pytest.raises(ValueError, match=r"5 values per leaf.*about 5.0 TiB"):
        HME(3, 36, likelihood="categorical", num_classes=5)
    with pytest.raises(ValueError, match="depth"):
        HME(2, 0)


def test_the_memory_budget_counts_the_experts(monkeypatch):
    from pyro_trees import trees

    monkeypatch.setattr(trees, "_available_memory_bytes", lambda device: 2**26)  # 64 MiB
    HME(3, 16, experts="constant")  # 4 x 2**16 x 4 bytes = 1 MiB
    with pytest.raises(ValueError, match=r"about 80.0 MiB but only 64.0 MiB"):
        HME(3, 16, experts="linear", noise_scale=None, num_outputs=20)  # 80 values a leaf
    assert HME(2, 16).leaf_loc.shape == (2**16, 1)  # the depths used in practice pass
