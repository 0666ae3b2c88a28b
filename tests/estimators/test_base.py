import numpy as np
import pytest
import torch

from pyro_trees.estimators._base import TreeEstimatorMixin


class _Constant(TreeEstimatorMixin):
    """Predicts a fixed array: ``score``'s checks without any training."""

    def __init__(self, pred=None, kind: str = "regressor"):
        self.pred = pred
        self.kind = kind
        self._estimator_type = kind

    def predict(self, X):
        return np.asarray(self.pred)[: len(X)]


def test_score_values():
    reg = _Constant(np.array([1.0, 2.0, 3.0, 4.0]))
    X = np.zeros((4, 1))
    assert reg.score(X, [1.0, 2.0, 3.0, 4.0]) == 1.0
    assert reg.score(X, np.array([[1.0], [2.0], [3.0], [5.0]])) == pytest.approx(1 - 1 / 8.75)
    assert reg.score(X, torch.tensor([1.0, 2.0, 3.0, 4.0])) == 1.0
    multi = _Constant(np.arange(8.0).reshape(4, 2))
    assert multi.score(X, np.arange(8.0).reshape(4, 2)) == 1.0
    clf = _Constant(np.array(["a", "b", "b", "a"]), kind="classifier")
    assert clf.score(X, ["a", "b", "a", "a"]) == 0.75


@pytest.mark.parametrize("kind", ["regressor", "classifier"])
def test_score_rejects_bad_targets_by_name(kind):
    est = _Constant(np.array([0.0, 1.0, 1.0, 0.0]), kind=kind)
    X = np.zeros((4, 1))
    with pytest.raises(ValueError, match="mismatched lengths: X has 4 rows, y has 3"):
        est.score(X, [0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="1 NaN and 0 infinite"):
        est.score(X, [0.0, np.nan, 1.0, 0.0])
    with pytest.raises(ValueError, match="0 NaN and 1 infinite"):
        est.score(X, [0.0, np.inf, 1.0, 0.0])
    with pytest.raises(ValueError, match=r"shape \(n_samples,\)"):
        est.score(X, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="1-D"):
        est.score(X, np.zeros((4, 1, 1)))
    with pytest.raises(ValueError, match="1-D"):
        est.score(X, 0.0)
