"""VaRTClassification: the VaRT tree prior with a probit or softmax likelihood."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO

from pyro_trees.guides import VaRTGuide
from pyro_trees.infer.vart_elbo import vart_elbo
from pyro_trees.models import VaRTClassification
from pyro_trees.models.vart_classification import class_logits, tree_scores


@pytest.mark.parametrize("classes", [2, 3])
def test_vectorised_elbo_equals_trace_elbo(classes):
    torch.manual_seed(0)
    x = torch.randn(40, 2, dtype=torch.float64)
    y = torch.randint(classes, (40,))
    model = VaRTClassification(2, classes)
    guide = VaRTGuide(model, depth=2)
    tr = poutine.trace(guide).get_trace(x, y)
    values = {k: v["value"] for k, v in tr.nodes.items() if v["type"] == "sample"}
    ours = float(vart_elbo(model, guide, x, y, values=values).detach())
    pyros = -Trace_ELBO().loss(
        poutine.replay(model, trace=tr), poutine.replay(guide, trace=tr), x, y
    )
    assert ours == pytest.approx(pyros, rel=1e-10)


@pytest.mark.parametrize("classes, offset", [(2, None), (2, [0.7]), (4, None), (4, [0.1] * 4)])
def test_obs_log_lik_equals_the_mixture_written_out(classes, offset):
    """The likelihood hook's two products (and the probit's signed form) against the
    mixture written as one einsum and the link's normalised log-probabilities, for a
    batch of three trees."""
    torch.manual_seed(1)
    offset = None if offset is None else torch.tensor(offset, dtype=torch.float64)
    model = VaRTClassification(3, classes, offset=offset)
    t, b, m, k = 3, 11, 7, model.num_outputs
    mix_logits = torch.randn(t, b, m, dtype=torch.float64)
    x1 = torch.cat([torch.randn(b, 3, dtype=torch.float64), torch.ones(b, 1)], -1)
    theta = torch.randn(t, m, k * 4, dtype=torch.float64)
    y = torch.randint(classes, (b,))
    ours = model.obs_log_lik(mix_logits, x1, theta, None, y)
    weights = mix_logits.softmax(-1)
    scores = torch.einsum("tnm,tmkl,nl->tnk", weights, theta.reshape(t, m, k, 4), x1)
    ref = model._link(scores).gather(-1, y.expand(t, b).unsqueeze(-1)).squeeze(-1)
    assert ours.shape == (t, b)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("classes", [2, 4])
def test_tree_scores_equal_the_mixture_written_out(classes):
    """Prediction's scores (two products) against the mixture as one einsum, for one
    tree and for a batch of three (the tree's weights perturbed per member)."""
    from pyro_trees.models.vart_mixture import log_leaf_weights

    torch.manual_seed(2)
    model = VaRTClassification(3, classes).double()
    one = model.sample_tree(like=torch.zeros((), dtype=torch.float64))
    batch = {k: None if v is None else v.expand((3,) + v.shape) for k, v in one.items()}
    batch["theta"] = batch["theta"] + torch.randn_like(batch["theta"])
    x = torch.randn(9, 3, dtype=torch.float64)
    x1 = torch.cat([x, torch.ones(9, 1, dtype=torch.float64)], -1)
    k = model.num_outputs
    for tree in (one, batch):
        weights = log_leaf_weights(tree, x1).softmax(-1)
        theta = tree["theta"].reshape(tree["theta"].shape[:-1] + (k, 4))
        ref = torch.einsum("...nm,...mkl,nl->...nk", weights, theta, x1)
        ours = tree_scores(tree, x, k)
        assert ours.shape == ref.shape == tree["theta"].shape[:-2] + (9, k)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_links_and_shapes():
    model = VaRTClassification(3, 2)
    assert model.link == "probit" and model.num_outputs == 1 and model.leaf_width == 4
    model = VaRTClassification(3, 4)
    assert model.link == "softmax" and model.leaf_width == 16
    tree = model.sample_tree(like=torch.zeros(()))
    x = torch.randn(7, 3)
    assert tree_scores(tree, x, 4).shape == (7, 4)
    probs = model.class_log_probs(tree, x).exp()
    assert probs.shape == (7, 4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(7))
    # probit: P(y = 1) = Phi(f)
    f = torch.tensor([[-1.0], [0.0], [2.0]])
    p1 = class_logits(f, "probit").exp()[:, 1]
    torch.testing.assert_close(p1, torch.distributions.Normal(0.0, 1.0).cdf(f[:, 0]))


def test_bad_options():
    with pytest.raises(ValueError, match="num_classes"):
        VaRTClassification(2, 1)
    with pytest.raises(ValueError, match="probit"):
        VaRTClassification(2, 3, link="probit")
    with pytest.raises(ValueError, match="link"):
        VaRTClassification(2, 2, link="logit")
    with pytest.raises(ValueError, match="noise_prior_loc"):
        VaRTClassification(2, 2, noise_prior_loc=0.0)
    with pytest.raises(ValueError, match="class indices"):
        VaRTClassification(2, 2)(torch.randn(3, 2), torch.zeros(3))


@pytest.mark.parametrize("classes, bad", [(2, 2), (2, -1), (3, 3)])
def test_class_indices_out_of_range_are_refused(classes, bad):
    """By the model (Pyro's loss) and by the vectorised loss, which checks the labels
    once per tensor: under the probit link any other index would score as a class."""
    from pyro_trees.infer import VaRTELBO

    model = VaRTClassification(2, classes)
    guide = VaRTGuide(model, depth=2)
    x, y = torch.randn(6, 2), torch.tensor([0, 1, 0, 1, 0, bad])
    for loss in (VaRTELBO(), Trace_ELBO()):
        with pytest.raises(ValueError, match=rf"class indices in \[0, {classes}\)"):
            loss.loss(model, guide, x, y)
    assert abs(VaRTELBO().loss(model, guide, x, y.clamp(0, classes - 1))) < float("inf")


def test_the_offset_puts_a_leaf_value_of_zero_at_the_class_frequencies():
    from pyro_trees.models.vart_classification import base_rate_offset

    counts = torch.tensor([396.0, 4.0])
    b = base_rate_offset(counts, "probit")
    freq = (counts + 0.5) / (counts.sum() + 1.0)
    torch.testing.assert_close(torch.special.ndtr(b), freq[1:].float())
    counts3 = torch.tensor([10.0, 30.0, 0.0])
    b3 = base_rate_offset(counts3, "softmax")
    torch.testing.assert_close(b3.softmax(-1), ((counts3 + 0.5) / 41.5).float())
    x = torch.randn(5, 2)
    for classes, offset in ((2, b), (3, b3)):
        model = VaRTClassification(2, classes, offset=offset)
        tree = model.sample_tree(like=torch.zeros(()))
        tree = {**tree, "theta": torch.zeros_like(tree["theta"])}  # every leaf value 0
        probs = model.class_log_probs(tree, x).exp()
        expected = torch.cat([1 - freq[1:], freq[1:]]) if classes == 2 else b3.softmax(-1)
        torch.testing.assert_close(probs, expected.float().expand(5, -1))
        # the vectorised ELBO's likelihood reads the offset as the model's sites do
        xd, yd = torch.randn(30, 2, dtype=torch.float64), torch.randint(classes, (30,))
        pyro.clear_param_store()  # the guide of the other number of classes
        guide = VaRTGuide(model, depth=2)
        tr = poutine.trace(guide).get_trace(xd, yd)
        values = {k: v["value"] for k, v in tr.nodes.items() if v["type"] == "sample"}
        ours = float(vart_elbo(model, guide, xd, yd, values=values).detach())
        pyros = -Trace_ELBO().loss(
            poutine.replay(model, trace=tr), poutine.replay(guide, trace=tr), xd, yd
        )
        assert ours == pytest.approx(pyros, rel=1e-10)
    with pytest.raises(ValueError, match="offset"):
        VaRTClassification(2, 2, offset=torch.zeros(2))
    with pytest.raises(ValueError, match="offset"):
        VaRTClassification(2, 3, offset=torch.tensor([0.0, float("nan"), 0.0]))
