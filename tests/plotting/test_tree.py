"""plot_tree draws what export_text prints, with the uncertainty of rules and leaves."""

import re

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from sklearn.exceptions import NotFittedError

from pyro_trees.estimators import (
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)
from pyro_trees.guides import RNNTree, RNNTreeGuide, VaRTGuide
from pyro_trees.models import VaRT
from pyro_trees.plotting import plot_tree

NUMBER = r"-?\d+\.\d+"


def _guide(beta_loc: torch.Tensor) -> VaRTGuide:
    """A depth-2 guide over one input whose every node splits (split logit 5); node
    ``i``'s leaf intercept is ``i - 1``."""
    guide = VaRTGuide(VaRT(beta_loc.shape[1] - 1), depth=2)
    with torch.no_grad():
        guide.split_logits = torch.full((3,), 5.0)
        guide.beta_loc = beta_loc
        guide.theta_loc = torch.arange(7.0).unsqueeze(-1) * torch.eye(beta_loc.shape[1])[-1]
    return guide


def _lines(boxes):
    return [b.get_text().splitlines() for b in boxes]


def test_a_folded_vart_tree_draws_its_reachable_leaves_only():
    # root: x > 0 goes left; both children's splits are vacuous (export_text folds them)
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]]))
    fig, ax = plt.subplots()
    boxes = plot_tree(guide, feature_names=["x"], ax=ax)
    lines = _lines(boxes)
    assert len(boxes) == 3  # the root and the two regions
    assert lines[0][0] == "x <= 0.00" and lines[0][2] == "P(split) 0.99"
    # the test's side (x <= 0) on the left: node 7's leaf, then node 4's
    assert lines[1][0] == "mean 6.00" and lines[2][0] == "mean 3.00"
    for leaf in lines[1:]:  # truncation-depth leaves: an interval, no split probability
        assert leaf[1].startswith("90% [") and len(leaf) == 2
    # the threshold's credible interval holds the threshold (split weights' sd 0.05)
    lo, hi = map(float, re.findall(NUMBER, lines[0][1]))
    assert -0.3 < lo < 0.0 < hi < 0.3
    # every box plus the root's True/False marks, all in the axes given
    assert [t.get_text() for t in ax.texts if t not in boxes] == ["True", "False"]
    assert len(ax.texts) == 5 and not ax.axison


def test_a_full_vart_tree_and_max_depth():
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, -1.0], [1.0, 1.0]]))
    text = plot_tree(guide)
    assert len(text) == 7 and sum(t.get_text().startswith("mean") for t in text) == 4
    cut = _lines(plot_tree(guide, max_depth=1))
    assert len(cut) == 7 and [c[0] for c in cut].count("(...)") == 4
    root_only = _lines(plot_tree(guide, max_depth=0))
    assert [c[0] for c in root_only] == ["x_0 <= 0.00", "(...)", "(...)"]


def test_level_sets_the_intervals():
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, -1.0], [1.0, 1.0]]))
    wide = _lines(plot_tree(guide, level=0.99))
    narrow = _lines(plot_tree(guide, level=0.5))
    assert wide[2][1].startswith("99% [") and narrow[2][1].startswith("50% [")

    def width(line):
        lo, hi = map(float, re.findall(NUMBER, line))
        return hi - lo

    assert width(wide[2][1]) > width(narrow[2][1])


@pytest.fixture(scope="module")
def regression_frame():
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    X = pd.DataFrame(rng.uniform(-2, 2, size=(80, 2)), columns=["dose", "age"])
    y = np.where(X["dose"] > 0, 2.0, -1.0) + 0.1 * rng.normal(size=80)
    return X, y


def test_a_vart_regressor_draws_its_export_text_in_the_units_of_its_frame(regression_frame):
    X, y = regression_frame
    est = VaRTRegressor(depth=2, num_steps=40, num_samples=5, random_state=0).fit(X, y)
    text = est.export_text()
    boxes = _lines(plot_tree(est))
    leaves = [b for b in boxes if b[0].startswith("mean")]
    assert len(leaves) == text.count("value:")
    assert len(boxes) - len(leaves) == (text.count("\n") - text.count("value:")) // 2
    # the frame's names, and the leaves' values as export_text prints them
    assert boxes[0][0].split(" <= ")[0] in ("dose", "age")
    values = sorted(float(v) for v in re.findall(r"value: (" + NUMBER + ")", text))
    drawn = sorted(float(b[0].split()[1]) for b in leaves)
    assert np.allclose(values, drawn, atol=0.006)


def test_a_vart_classifier_shows_class_probabilities():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    y = np.where(X[:, 0] > 0, "yes", "no")
    clf = VaRTClassifier(depth=1, num_steps=30, num_samples=4, num_fits=1, random_state=0)
    clf.fit(X, y)
    boxes = _lines(plot_tree(clf, class_names=["No", "Yes"]))
    leaves = [b for b in boxes if b[0].startswith("No:")]
    assert len(leaves) == len(boxes) - 1 >= 2
    for leaf in leaves:
        assert leaf[1].startswith("Yes: ")
        probs = [float(line.split(": ")[1]) for line in leaf[:2]]
        assert abs(sum(probs) - 1.0) <= 0.011


def test_a_bare_rnn_tree_and_its_guide():
    x = torch.linspace(-1, 1, 64).unsqueeze(-1)
    tree = RNNTree(1, 2, hidden_size=4)
    tree.init_balanced(x)
    labels = ["a", "b", "c", "d"]
    boxes = _lines(plot_tree(tree, feature_names=["x"], leaf_labels=labels))
    assert [b[0] for b in boxes if len(b) == 1] == labels  # four regions, in order
    split = boxes[0]
    assert split[0].startswith("x <= ") and split[2].startswith("P(feature) ")
    t = float(split[0].split()[-1])
    lo, hi = map(float, re.findall(NUMBER, split[1]))
    assert lo < t < hi  # the band where the soft tree routes unsure holds the threshold
    guide = RNNTreeGuide(1, 2, hidden_size=4)
    guide.tree.init_balanced(x)
    assert len(plot_tree(guide)) == 7


@pytest.fixture(scope="module")
def pulse():
    X = np.linspace(0, 4, 80).reshape(-1, 1)
    y = np.where((X[:, 0] > 1) & (X[:, 0] < 3), 3.0, 0.0)
    return X, y


def test_an_rnn_tree_regressor_draws_its_export_text(pulse):
    X, y = pulse
    est = RNNTreeRegressor(depth=2, hidden_size=4, num_steps=5, random_state=0).fit(X, y)
    text = est.export_text(feature_names=["x"])
    boxes = _lines(plot_tree(est, feature_names=["x"], decimals=3))
    leaves = [b for b in boxes if b[0].startswith("mean")]
    assert len(leaves) == text.count("value:")
    values = [float(v) for v in re.findall(r"value: (" + NUMBER + ")", text)]
    assert sorted(values) == sorted(float(b[0].split()[1]) for b in leaves)
    for leaf in leaves:  # value +- z * noise: an interval centred on the value
        lo, hi = map(float, re.findall(NUMBER, leaf[1]))
        assert lo < float(leaf[0].split()[1]) < hi
    thresholds = sorted(float(v) for v in re.findall(r"x <= (" + NUMBER + ")", text))
    drawn = sorted(float(b[0].split()[-1]) for b in boxes if b[0].startswith("x <="))
    assert drawn == thresholds


def test_an_rnn_tree_classifier_names_its_classes(pulse):
    X, y = pulse
    est = RNNTreeClassifier(depth=1, hidden_size=4, num_steps=5, random_state=0)
    est.fit(X, (y > 0).astype(int))
    boxes = _lines(plot_tree(est, class_names=["low", "high"]))
    assert len(boxes) == 3
    assert all(b[0].startswith("low: ") and b[1].startswith("high: ") for b in boxes[1:])


def test_what_plot_tree_refuses():
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]]))
    with pytest.raises(ValueError, match="1 inputs"):
        plot_tree(guide, feature_names=["a", "b"])
    with pytest.raises(ValueError, match="leaf_labels"):
        plot_tree(guide, leaf_labels=["a"])
    with pytest.raises(ValueError, match="level"):
        plot_tree(guide, level=1.0)
    with pytest.raises(ValueError, match="sum of trees"):
        plot_tree(VaRTForestRegressor())
    with pytest.raises(NotFittedError):
        plot_tree(VaRTRegressor())
    with pytest.raises(TypeError, match="plot_tree draws"):
        plot_tree(object())


def test_a_vart_classifiers_leaves_start_from_its_base_rate():
    """The leaves' class probabilities include the model's base-rate offset, as
    ``predict_proba`` and ``export_text`` do: on a 90/10 table the drawn leaves agree
    with the printed ones."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(300, 2))
    y = np.where((X[:, 0] > 0.8) | (rng.uniform(size=300) < 0.05), "yes", "no")
    clf = VaRTClassifier(depth=1, num_steps=80, num_samples=4, num_fits=1, random_state=0)
    printed = [
        float(p) for p in re.findall(r"class: no \(p = ([0-9.]+)\)", clf.fit(X, y).export_text())
    ]
    drawn = [float(b[0].split(": ")[1]) for b in _lines(plot_tree(clf)) if b[0].startswith("no:")]
    assert clf.model_.offset is not None and len(printed) == len(drawn) == 2
    assert np.allclose(sorted(printed), sorted(drawn), atol=0.03)
