import math
import pickle

import pyro
import pytest
import torch
import torch.nn.functional as F

from pyro_trees import trees
from pyro_trees.guides import RNNTree, RNNTreeGuide, _node_split


@pytest.fixture(autouse=True)
def _scope():
    with pyro.get_param_store().scope():
        yield


@pytest.mark.parametrize("feedback", ["hard", "soft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leaf_logits_are_normalised(feedback, dtype):
    tree = RNNTree(3, 4, feedback=feedback).to(dtype)
    x = torch.randn(20, 3, dtype=dtype)
    lp = tree(x)
    assert lp.shape == (20, 16) and lp.dtype == dtype
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(20, dtype=dtype))


def test_soft_feedback_factorises_over_depth():
    """Eq. 14: leaf probabilities are products of per-depth decisions."""
    tree = RNNTree(2, 3, feedback="soft").double()
    x = torch.randn(7, 2, dtype=torch.float64)
    log_right, log_left = tree.depth_log_probs(x, noise=False)
    torch.testing.assert_close(torch.logaddexp(log_right, log_left), torch.zeros(7, 3).double())
    lp = tree(x, noise=False)
    bits = trees.leaf_bits(3)
    expected = (bits * log_right.unsqueeze(1) + (1 - bits) * log_left.unsqueeze(1)).sum(-1)
    torch.testing.assert_close(lp, expected)


def test_split_dimension_is_marginalised():
    """Eq. 13 by hand at the root under hard feedback."""
    tree = RNNTree(3, 1, feedback="hard").double()
    x = torch.randn(5, 3, dtype=torch.float64)
    log_dim, w0, w1 = tree._node_heads(torch.float64)
    p = (log_dim.exp() * torch.sigmoid(w0 + w1 * x)).sum(-1)
    torch.testing.assert_close(tree(x).exp()[:, 1], p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blockwise_split_log_probs_match_the_direct_formula(monkeypatch, dtype):
    """Values and gradients of the blockwise eq. 13 equal autograd through the
    direct ``(N, K, L)`` formula, across block boundaries and with sharp splits."""
    monkeypatch.setattr(_node_split, "_BLOCK_ELEMENTS", 7 * 4 * 3)  # 7-row blocks; N = 30
    torch.manual_seed(0)
    x = torch.randn(30, 3, dtype=dtype)
    # rows 3 and 17 lie so far out that every sigmoid of one side underflows: these
    # rows take the log-space path
    x[3], x[17] = -1e3, 1e3
    x.requires_grad_()
    log_dim = (torch.randn(4, 3, dtype=dtype) * 3).log_softmax(-1).requires_grad_()
    w0 = (torch.randn(4, 3, dtype=dtype) * 5).requires_grad_()
    w1 = (torch.randn(4, 3, dtype=dtype).abs() * 40 + 1).requires_grad_()
    g_right, g_left = torch.randn(2, 30, 4, dtype=dtype)

    z = w0 + w1 * x.unsqueeze(-2)
    direct = (
        torch.logsumexp(log_dim + F.logsigmoid(z), -1),
        torch.logsumexp(log_dim + F.logsigmoid(-z), -1),
    )
    blockwise = _node_split._NodeSplitLogProbs.apply(x, log_dim, w0, w1)
    inputs = (x, log_dim, w0, w1)
    for out_d, out_b in zip(direct, blockwise, strict=True):
        torch.testing.assert_close(out_b, out_d)
    assert direct[0][3].max() < -700 and direct[1][17].max() < -700  # far below tiny
    grads_d = torch.autograd.grad((direct[0] * g_right + direct[1] * g_left).sum(), inputs)
    grads_b = torch.autograd.grad((blockwise[0] * g_right + blockwise[1] * g_left).sum(), inputs)
    # float32: dz = r - (r + p) sigma(z) rounds differently from autograd's path
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    for grad_d, grad_b in zip(grads_d, grads_b, strict=True):
        torch.testing.assert_close(grad_b, grad_d, **tol)
    if dtype == torch.float64:
        assert torch.autograd.gradcheck(_node_split._NodeSplitLogProbs.apply, inputs)


def test_hard_tree_rules_agree_with_the_limit_of_the_soft_tree():
    """Replacing softmax by max and sigmoid by a step: scaling the split weights up
    and sharpening the dimension choice sends the posterior to the hard leaf."""
    torch.manual_seed(3)
    tree = RNNTree(2, 3, feedback="hard").double()
    x = torch.randn(300, 2, dtype=torch.float64)
    with torch.no_grad():
        tree.node_offset[:, :2] += torch.randn(7, 2, dtype=torch.float64) * 50
        tree.split_head.weight.mul_(1000)
        tree.split_head.bias.mul_(1000)
        tree.node_offset[:, 2:].mul_(1000)
    hard = tree.hard_leaf(x)
    soft = tree(x).argmax(-1)
    assert (hard == soft).float().mean() > 0.98


def _hard_routing_by_hand(tree, x):
    """The most likely tree from the guide's parameters, without ``rules()``: each
    node's GRU state rolled out along its own path (0 at the root, then the path's
    bits), the split dimension ``argmax`` of the dimension logits, the affine cut
    ``w0 + w1 x > 0``, then :func:`trees.hard_route`."""
    L, depth = tree.in_features, tree.depth
    go_right = torch.empty(x.shape[0], trees.num_internal(depth), dtype=torch.bool)
    with torch.no_grad():
        for node in range(1, 2**depth):
            h = tree.h0.unsqueeze(0)
            inp = h.new_zeros(1, 1)
            path = [(node >> s) & 1 for s in range(trees.depth_of(node) - 1, -1, -1)]
            for bit in [0.0] + [float(b) for b in path]:
                h = tree.cell(inp.fill_(bit), h)
            off = tree.node_offset[node - 1]
            dim_logits = tree.dim_head(h)[0] + off[:L]
            w = tree.split_head(h)[0] + off[L:]
            l = int(dim_logits.argmax())
            go_right[:, node - 1] = w[l] + w[L + l] * x[:, l] > 0
    return trees.hard_route(go_right)


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_rules_reproduce_routing_and_conditions(feedback):
    torch.manual_seed(4)
    tree = RNNTree(3, 3, feedback=feedback).double()
    tree.init_balanced(torch.randn(200, 3, dtype=torch.float64))
    with torch.no_grad():  # away from the balanced start: every node's own cut
        for p in tree.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rules = tree.rules()
    x = torch.randn(100, 3, dtype=torch.float64)
    leaf = rules.route(x)
    expected = _hard_routing_by_hand(tree, x)
    assert torch.equal(leaf, expected)
    assert torch.equal(tree.hard_leaf(x), expected)
    assert expected.unique().numel() >= 4  # the check sees several leaves
    for i, conds in enumerate(rules.leaf_conditions()):
        inside = torch.ones(100, dtype=torch.bool)
        for f, op, t in conds:
            v = x[:, f]
            inside &= {"<=": v <= t, ">": v > t, ">=": v >= t, "<": v < t}[op]
        assert torch.equal(inside, leaf == i)


def test_balanced_init_splits_every_node_in_half():
    x = torch.linspace(-1, 1, 64).unsqueeze(-1)
    tree = RNNTree(1, 3, feedback="hard")
    tree.init_balanced(x)
    counts = torch.bincount(tree.hard_leaf(x), minlength=8)
    assert counts.tolist() == [8] * 8


def test_balanced_init_on_binary_inputs_uses_every_bit_once_per_path():
    bits = trees.leaf_bits(4).double()  # all 16 patterns of 4 bits
    x = bits.repeat(4, 1)
    tree = RNNTree(4, 4, feedback="hard").double()
    tree.init_balanced(x)
    assert torch.equal(tree.hard_leaf(bits).sort().values, torch.arange(16))


def test_guide_samples_inside_the_data_plate():
    guide = RNNTreeGuide(2, 2)
    x = torch.randn(30, 2)
    trace = pyro.poutine.trace(guide).get_trace(x, subsample_size=10)
    site = trace.nodes["leaf"]
    assert site["value"].shape == (10,)
    assert site["infer"]["enumerate"] == "parallel"
    assert trace.nodes["data"]["value"].shape == (10,)


def test_noise_is_used_only_in_training_with_soft_feedback():
    tree = RNNTree(1, 3, feedback="soft")
    x = torch.randn(5, 1)
    tree.train()
    assert not torch.equal(tree(x), tree(x))
    tree.eval()
    torch.testing.assert_close(tree(x), tree(x))
    gen = torch.Generator().manual_seed(0)
    a = tree.leaf_probs(x, num_samples=4, generator=gen)
    gen = torch.Generator().manual_seed(0)
    torch.testing.assert_close(a, tree.leaf_probs(x, num_samples=4, generator=gen))
    # the generator is threaded through: the global stream is neither read nor moved
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    tree.leaf_probs(x, num_samples=4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.rand(3), expected)
    assert torch.allclose(a.sum(-1), torch.ones(5))


def test_pickle_round_trip():
    tree = RNNTree(2, 3)
    x = torch.randn(4, 2)
    torch.testing.assert_close(
        pickle.loads(pickle.dumps(tree))(x, noise=False), tree(x, noise=False)
    )


def test_bad_options():
    with pytest.raises(ValueError, match="feedback"):
        RNNTree(2, 3, feedback="other")
    with pytest.raises(ValueError, match="depth"):
        RNNTree(2, 0)
    with pytest.raises(ValueError, match="in_features"):
        RNNTree(0, 2)


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_too_deep_a_tree_says_how_much_memory_it_needs(feedback, monkeypatch):
    # 4 copies x 2**36 nodes x (3 x 2 + 32) values x 4 bytes = 38 TiB
    with pytest.raises(ValueError, match=r"2\*\*36 .*\(38 values per node.*about 38.0 TiB"):
        RNNTree(2, 36, feedback=feedback)
    with pytest.raises(ValueError, match=r"about 38.0 TiB"):
        RNNTreeGuide(2, 36, feedback=feedback)
    # The budget counts the heads' width 3 L and the GRU state, not the depth alone.
    monkeypatch.setattr(trees, "_available_memory_bytes", lambda device: 2**26)  # 64 MiB
    RNNTree(2, 16, feedback=feedback)  # 38 MiB
    with pytest.raises(ValueError, match=r"about 68.0 MiB but only 64.0 MiB"):
        RNNTree(12, 16, feedback=feedback)  # 3 x 12 + 32 = 68 values a node


@pytest.mark.cuda
def test_cuda_forward_and_rules():
    tree = RNNTree(2, 3).cuda()
    x = torch.randn(10, 2, device="cuda")
    assert tree(x).device.type == "cuda"
    assert tree.rules().route(x).device.type == "cuda"


def test_balanced_init_chooses_the_informative_dimension_with_targets():
    torch.manual_seed(0)
    x = torch.randn(400, 3)  # standardised: every dimension has the same spread
    y = (x[:, 2] > 0).long()  # only dimension 2 informs the labels
    tree = RNNTree(3, 1, feedback="hard")
    tree.init_balanced(x, y)
    assert int(tree.rules().feature[0]) == 2
    noise = torch.randint(0, 2, (400,))  # no dimension informs: the widest is kept
    tree.init_balanced(x, noise)
    assert int(tree.rules().feature[0]) == int(x.std(0).argmax())


def _brute_force_best_cut(x, y, classification):
    """Best impurity gain and cut of one dimension by trying every cut."""
    best, best_cut = -float("inf"), None
    values = x.unique()
    for lo, hi in zip(values[:-1], values[1:], strict=True):
        cut = 0.5 * (lo + hi)
        left, right = y[x <= cut], y[x > cut]
        if classification:

            def imp(v):
                p = torch.bincount(v, minlength=3).double()
                return len(v) - (p**2).sum() / max(len(v), 1)

        else:

            def imp(v):
                return ((v - v.mean()) ** 2).sum() if len(v) else torch.tensor(0.0)

        gain = float(imp(y) - imp(left) - imp(right))
        if gain > best + 1e-12:
            best, best_cut = gain, float(cut)
    return best, best_cut


@pytest.mark.parametrize("classification", [True, False])
def test_greedy_cuts_match_a_brute_force_search(classification):
    from pyro_trees._tree_start import _greedy_cuts

    torch.manual_seed(1)
    x = torch.randint(0, 7, (40, 3)).double()  # ties: cuts only between distinct values
    y = torch.randint(0, 3, (40,)) if classification else torch.randn(40).double()
    cut, gain = _greedy_cuts(x, y)
    for l in range(3):
        want_gain, want_cut = _brute_force_best_cut(x[:, l], y, classification)
        assert float(gain[l]) == pytest.approx(want_gain, rel=1e-9, abs=1e-9)
        assert float(cut[l]) == pytest.approx(want_cut)


def test_greedy_init_grows_the_tree_cart_would_grow():
    from sklearn.tree import DecisionTreeClassifier

    torch.manual_seed(2)
    x = torch.randn(300, 4).double()
    y = ((x[:, 1] > 0.7) | (x[:, 3] < -0.4)).long()
    tree = RNNTree(4, 2, feedback="hard").double()
    tree.init_balanced(x, y, cuts="greedy")
    cart = DecisionTreeClassifier(max_depth=2, random_state=0).fit(x.numpy(), y.numpy())
    rules = tree.rules()
    assert int(rules.feature[0]) == int(cart.tree_.feature[0])
    assert float(rules.threshold[0]) == pytest.approx(float(cart.tree_.threshold[0]), abs=1e-9)
    # Same partition as CART's depth-2 tree: every leaf holds points of one CART leaf.
    leaves = tree.hard_leaf(x)
    cart_leaf = torch.as_tensor(cart.apply(x.numpy()))
    for leaf in leaves.unique():
        assert cart_leaf[leaves == leaf].unique().numel() == 1


def test_greedy_init_needs_targets():
    with pytest.raises(ValueError, match="needs the targets"):
        RNNTree(2, 2, feedback="hard").init_balanced(torch.randn(10, 2), cuts="greedy")
    with pytest.raises(ValueError, match="cuts must be"):
        RNNTree(2, 2, feedback="hard").init_balanced(torch.randn(10, 2), cuts="median")


@pytest.mark.parametrize("in_features", [2, 8, 64])
def test_init_gives_the_chosen_dimension_the_same_weight_for_any_input_width(in_features):
    # The soft tree that trains starts close to the hard tree: every node's chosen
    # dimension carries sigmoid(dim_margin) of its dimension distribution, 64 inputs
    # or 2 (a fixed logit margin of 3 would leave it 24 % among 64).
    torch.manual_seed(0)
    x = torch.randn(400, in_features).double()
    tree = RNNTree(in_features, 3, feedback="hard").double()
    tree.init_balanced(x, dim_margin=3.0)
    log_dim, _, _ = tree._node_heads()
    top = log_dim.exp().max(-1).values  # (I,)
    assert torch.allclose(top, torch.full_like(top, 1 / (1 + math.exp(-3.0))), atol=1e-9)


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_node_offset_is_trained_only_under_hard_feedback(feedback):
    """Soft feedback keeps the per-node residual as a zero buffer under the same
    state_dict key: no parameter without a gradient, and checkpoints load either way."""
    tree = RNNTree(2, 3, feedback=feedback)
    params = dict(tree.named_parameters())
    assert ("node_offset" in params) == (feedback == "hard")
    state = tree.state_dict()
    assert state["node_offset"].shape == (7, 6)
    other = RNNTree(2, 3, feedback=feedback)
    other.load_state_dict(state)
    x = torch.randn(5, 2)
    torch.testing.assert_close(other(x, noise=False), tree(x, noise=False))


@pytest.mark.parametrize("feedback", ["hard", "soft"])
def test_conditional_and_aggregate_posteriors_by_hand(feedback):
    """Eqs. 23-24 on a depth-2 tree and three points, written out leaf by leaf."""
    torch.manual_seed(5)
    guide = RNNTreeGuide(2, 2, feedback=feedback).double()
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x = torch.randn(3, 2, dtype=torch.float64)
    q = guide.tree(x, noise=False).exp()  # (3, 4): leaves left-left, left-right, ...
    cond = guide.conditional_posteriors(x, noise=False)
    agg = guide.aggregate_posteriors(x, noise=False)
    assert cond.shape == (3, 3) and agg.shape == (3,)
    root_right, left, right = q[:, 2] + q[:, 3], q[:, 0] + q[:, 1], q[:, 2] + q[:, 3]
    # eq. 23: q(m_i = 1 | reach i, x) = q(reach 2i + 1 | x) / q(reach i | x)
    by_hand = torch.stack([root_right, q[:, 1] / left, q[:, 3] / right], -1)
    torch.testing.assert_close(cond, by_hand)
    # eq. 24: sums over the points of numerator and denominator
    by_hand = torch.stack(
        [root_right.sum() / 3, q[:, 1].sum() / left.sum(), q[:, 3].sum() / right.sum()]
    )
    torch.testing.assert_close(agg, by_hand)
    assert not torch.allclose(agg, cond.mean(0))  # weighted by the reach, not a plain mean
    # eq. 23 gives back the decisions the routing network made
    if feedback == "hard":
        torch.testing.assert_close(cond, torch.sigmoid(guide.tree.node_logits(x)))
    else:
        log_right, _ = guide.tree.depth_log_probs(x, noise=False)
        torch.testing.assert_close(cond, log_right.exp()[:, [0, 1, 1]])
    # differentiable, as the KL of App. B needs
    (g,) = torch.autograd.grad(agg.sum(), guide.tree.split_head.bias)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_rule_spread_is_where_the_chosen_split_routes_unsure():
    torch.manual_seed(5)
    tree = RNNTree(2, 2).double()
    x = 3.0 + 2.0 * torch.randn(200, 2, dtype=torch.float64)
    tree.init_scaling(x)
    tree.init_balanced(x, sharpness=4.0)
    rules, spread = tree.rules(), tree.rule_spread(level=0.9)
    log_dim, w0, w1 = tree._node_heads()
    for i in range(3):
        f = int(rules.feature[i])
        assert torch.isclose(spread["feature_prob"][i], log_dim[i, f].exp())
        lo, t, hi = spread["lower"][i], rules.threshold[i], spread["upper"][i]
        assert lo < t < hi
        # at the band's ends the chosen feature's soft split goes right w.p. 5 % and 95 %
        ends = torch.stack([lo, hi]).unsqueeze(-1).expand(2, 2).clone()
        z = (ends[:, f] - tree.x_loc[f]) / tree.x_scale[f]
        probs = torch.sigmoid(w0[i, f] + w1[i, f] * z).sort().values
        assert torch.allclose(probs, torch.tensor([0.05, 0.95], dtype=torch.float64))
    wider = tree.rule_spread(level=0.99)
    assert ((wider["upper"] - wider["lower"]) > (spread["upper"] - spread["lower"])).all()
    with pytest.raises(ValueError, match="level"):
        tree.rule_spread(level=1.0)
