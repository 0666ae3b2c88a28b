"""The VaRT rule export: unreachable regions are not printed (issue 28)."""

from types import SimpleNamespace

import torch

from pyro_trees.estimators._vart_export import _export_text
from pyro_trees.guides import VaRTGuide
from pyro_trees.models import VaRT


def _guide(beta_loc: torch.Tensor) -> VaRTGuide:
    """A depth-2 guide over ``beta_loc.shape[1] - 1`` inputs whose every node splits."""
    guide = VaRTGuide(VaRT(beta_loc.shape[1] - 1), depth=2)
    with torch.no_grad():
        guide.split_logits = torch.full((3,), 5.0)
        guide.beta_loc = beta_loc
        guide.theta_loc = torch.arange(7.0).unsqueeze(-1) * torch.eye(beta_loc.shape[1])[-1]
    return guide


def _scalers(width: int):
    unit = SimpleNamespace(mean=torch.zeros(width), scale=torch.ones(width))
    return unit, SimpleNamespace(mean=0.0, scale=1.0)


def test_vacuous_one_feature_splits_are_folded_into_their_reachable_side():
    # root: x > 0 goes left; node 2 (x > 0): x > -1 always holds; node 3 (x <= 0): x > 1 never
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, -1.0]]))
    text = _export_text(guide, *_scalers(1), feature_names=["x"])
    lines = text.splitlines()
    assert lines[0] == "|--- x > 0.000  [100%]"
    # leaf 4 (x > 0, x > -1) and leaf 7 (x <= 0, x <= 1) are the only regions (value = node - 1)
    assert [line.strip("| -") for line in lines if "value" in line] == [
        "value: 3.000 (sd 0.500; slopes x: +0)",
        "value: 6.000 (sd 0.500; slopes x: +0)",
    ]
    assert "-1.000" not in text and "1.000  [" not in text and len(lines) == 4


def test_reachable_splits_are_all_printed():
    # node 2 (x > 0) splits at x = 1, node 3 (x <= 0) at x = -1: four regions, four leaves
    guide = _guide(torch.tensor([[1.0, 0.0], [1.0, -1.0], [1.0, 1.0]]))
    text = _export_text(guide, *_scalers(1), feature_names=["x"])
    assert text.count("value:") == 4 and "x > 1.000" in text and "x <= -1.000" in text


def test_oblique_splits_empty_only_at_the_means_are_kept_and_marked():
    # root on x0 alone; node 3 (x0 <= 0) splits on x0 + 0.5 x1 > 1: reachable for large x1
    guide = _guide(torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 0.5, -1.0]]))
    text = _export_text(guide, *_scalers(2), feature_names=["a", "b"])
    assert text.count("value:") == 3  # node 2 folds (a > -1 under a > 0); node 3 keeps both
    marked = [line for line in text.splitlines() if "empty where" in line]
    assert len(marked) == 1 and "a > 1.000  [67%]" in marked[0]
