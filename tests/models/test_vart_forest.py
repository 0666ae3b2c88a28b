"""VaRTForest: site shapes, the prior variance of the sum against K, batched == looped."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive

from pyro_trees.models import VaRTForest, forest_mean, tree_mean
from pyro_trees.models.vart_forest import forest_of_nodes, forest_tree


def test_sites_and_shapes():
    x = torch.randn(7, 3)
    model = VaRTForest(3, num_trees=5, depth=2)
    trace = poutine.trace(model).get_trace(x)
    assert trace.nodes["split_1"]["value"].shape == (5, 2)
    assert trace.nodes["beta_1"]["value"].shape == (5, 2, 4)
    assert trace.nodes["theta_2"]["value"].shape == (5, 4, 4)
    assert "split_2" not in trace.nodes  # the truncation level holds leaves only
    assert trace.nodes["obs"]["value"].shape == (1, 7)
    assert model(x).shape == (7,)
    for parallel in (True, False):
        draws = Predictive(model, num_samples=4, parallel=parallel)(x)
        assert draws["obs"].shape == draws["mean"].shape == (4, 1, 7)  # the guide page's
        assert draws["theta_0"].shape == (4, 5, 1, 4)


def test_named_sites():
    model = VaRTForest(2, num_trees=3, depth=1, name="f")
    trace = poutine.trace(model).get_trace(torch.randn(4, 2))
    assert {"f.split_0", "f.theta_1", "f.log_sigma", "f.obs", "f.trees"} <= set(trace.nodes)


def _prior_var(num_trees, x, draws=3000, seed=0):
    pyro.set_rng_seed(seed)
    model = VaRTForest(x.shape[1], num_trees=num_trees, depth=3)
    with torch.no_grad(), pyro.plate("draws", draws, dim=-3):
        forest = model.sample_forest(like=x)
    return forest_mean(forest, x).var(0)  # (N,)


def test_prior_variance_of_the_sum_does_not_grow_with_k():
    x = torch.tensor([[0.5, -1.0], [2.0, 0.3]])
    one, many = _prior_var(1, x), _prior_var(40, x, seed=1)
    # Monte Carlo over 3000 prior draws: a 1/K leaf scale, or none, fails by far (x40)
    ratio = many / one
    assert ((ratio > 0.8) & (ratio < 1.25)).all(), ratio
    # and it is s^2 |x1|^2 E[sum_i w_i^2] <= s^2 |x1|^2 (weights on the simplex)
    bound = x.pow(2).sum(-1) + 1.0
    assert (many < 1.1 * bound).all() and (many > 0.2 * bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_equals_loop_over_trees(dtype):
    torch.manual_seed(0)
    x = torch.randn(11, 3, dtype=dtype)
    model = VaRTForest(3, num_trees=6, depth=3)
    with torch.no_grad():
        forest = model.sample_forest(like=x)
    loop = sum(tree_mean({k: v[i] for k, v in forest.items()}, x) for i in range(6))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(forest_mean(forest, x), loop, atol=tol)


@pytest.mark.parametrize("depth", [1, 3])
def test_complete_rows_path_has_the_general_paths_gradients(depth):
    """The complete-rows path (nodes first, in probability space) gives the values and
    gradients of the general path (log space through the ancestor matrices, taken for
    inputs with a batch dimension), for a batch of forests."""
    torch.manual_seed(2)
    x = torch.randn(9, 3, dtype=torch.float64)
    model = VaRTForest(3, num_trees=5, depth=depth)
    with torch.no_grad():
        forest = model.sample_forest(like=x)
    forest = {k: torch.stack([v, v.flip(0)]).requires_grad_() for k, v in forest.items()}
    keys = ("beta", "theta", "split", "log_exist")
    complete, general = forest_mean(forest, x), forest_mean(forest, x.unsqueeze(0))
    torch.testing.assert_close(complete, general, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(complete.pow(2).sum(), [forest[k] for k in keys])
    want = torch.autograd.grad(general.pow(2).sum(), [forest[k] for k in keys])
    for k, g, w in zip(keys, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=k)


def test_forest_mean_refuses_inputs_of_another_shape():
    """A single row without its row dimension, or another number of inputs, raises
    (a 1-D row broadcast against the trees and returned one number per tree)."""
    forest = VaRTForest(5, num_trees=4, depth=2).sample_forest()
    x = torch.randn(3, 5)
    assert forest_mean(forest, x[:1]).shape == (1,)
    for bad in (x[0], torch.randn(3, 4)):
        with pytest.raises(ValueError, match=r"shape \(N, 5\)"):
            forest_mean(forest, bad)


def test_forest_mean_refuses_inputs_of_another_dtype():
    """float32 rows and a float64 forest raise a ValueError naming both dtypes (torch's
    own error named neither tensor)."""
    forest = VaRTForest(3, num_trees=2, depth=2).sample_forest(
        like=torch.zeros((), dtype=torch.float64)
    )
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"x is torch.float32 but the forest's tensors are"):
        forest_mean(forest, x)
    assert forest_mean(forest, x.double()).dtype == torch.float64


def test_checks():
    with pytest.raises(ValueError, match="num_trees"):
        VaRTForest(2, num_trees=0)
    with pytest.raises(ValueError, match="depth"):
        VaRTForest(2, depth=0)
    with pytest.raises(ValueError, match="shape"):
        VaRTForest(2)(torch.randn(3, 3))


def test_forest_mean_differentiates_after_a_call_in_inference_mode():
    """The cached ancestor matrices first built under ``inference_mode`` still enter a
    backward pass later (a normal tensor, not an inference tensor)."""
    from pyro_trees.trees import _ancestor_paths

    _ancestor_paths.cache_clear()
    forest = VaRTForest(2, num_trees=3, depth=2).sample_forest()
    x = torch.randn(4, 2)
    with torch.inference_mode():
        before = forest_mean(forest, x)
    beta = forest["beta"].clone().requires_grad_()
    after = forest_mean(dict(forest, beta=beta), x)
    after.sum().backward()
    assert torch.allclose(before, after.detach())
    assert beta.grad is not None and torch.isfinite(beta.grad).all()


@pytest.mark.parametrize("keepdim", [False, True])
def test_batches_of_forests_equal_each_forest_alone(keepdim):
    """Forests of batch shape ``B + (K,)`` (posterior draws) give ``B + (N,)`` (``B +
    (1, N)`` with ``keepdim``), each batch entry the sum of its own trees."""
    torch.manual_seed(1)
    x = torch.randn(7, 2, dtype=torch.float64)
    model = VaRTForest(2, num_trees=4, depth=2)
    with torch.no_grad():
        draws = [model.sample_forest(like=x) for _ in range(6)]
    forest = {
        k: torch.stack([d[k] for d in draws]).reshape((2, 3) + draws[0][k].shape) for k in draws[0]
    }
    out = forest_mean(forest, x, keepdim=keepdim)
    assert out.shape == ((2, 3, 1, 7) if keepdim else (2, 3, 7))
    for s, draw in enumerate(draws):
        loop = sum(tree_mean({k: v[i] for k, v in draw.items()}, x) for i in range(4))
        got = out.reshape(6, 7)[s]
        assert torch.allclose(got, loop, atol=1e-12)


def test_forest_of_nodes_equals_forest_tree_of_the_levels():
    torch.manual_seed(2)
    model = VaRTForest(2, num_trees=3, depth=3)
    with torch.no_grad():
        levels = model.sample_forest()
    depth, k = 3, 3
    split = [torch.rand(k, 1 << d) for d in range(depth)]
    beta = [torch.randn(k, 1 << d, 3) for d in range(depth)]
    theta = [torch.randn(k, 1 << d, 3) for d in range(depth + 1)]
    rho = [torch.rand(k, 1 << d) for d in range(depth)]
    by_levels = forest_tree(split, beta, theta, rho)
    nodes = forest_of_nodes(
        torch.cat(split, -1), torch.cat(beta, -2), torch.cat(theta, -2), torch.cat(rho, -1)
    )
    assert by_levels.keys() == nodes.keys() == levels.keys() | {"rho"}
    for key, value in by_levels.items():
        assert value.shape == nodes[key].shape, key
        torch.testing.assert_close(value, nodes[key], rtol=0, atol=0)
    # log_exist: the sum of the ancestors' log split indicators (node 6 = right, left)
    s = torch.cat(split, -1)
    expected = s[:, 0].log() + s[:, 2].log() + s[:, 5].log()
    torch.testing.assert_close(nodes["log_exist"][:, 12], expected)
