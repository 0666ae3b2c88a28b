import pytest
import torch

from pyro_trees.validation import check_finite


def test_check_finite_fast_path_agrees_with_the_full_scan():
    big = torch.full((3, 4), 3e38)  # finite entries whose sum overflows to inf
    assert check_finite(big, "x") is big
    ints = torch.arange(12).reshape(3, 4)
    assert check_finite(ints, "x") is ints
    for bad, match in ((float("nan"), "1 NaN and 0 infinite"), (-float("inf"), "0 NaN and 1")):
        x = torch.zeros(3, 4)
        x[1, 2] = bad
        with pytest.raises(ValueError, match=rf"x contains {match}.*\(1, 2\)"):
            check_finite(x, "x")
    # +inf and -inf sum to NaN: still caught, both counted
    x = torch.zeros(2, 2)
    x[0, 0], x[1, 1] = float("inf"), -float("inf")
    with pytest.raises(ValueError, match=r"0 NaN and 2 infinite values \(first at index \(0, 0"):
        check_finite(x, "x")
