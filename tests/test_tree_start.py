"""The balanced start: its split dimensions do not depend on the last bits of the inputs."""

import torch

from pyro_trees._tree_start import _first_max, balanced_start, input_scaling


def test_first_max_breaks_rounding_ties_by_index():
    assert _first_max(torch.tensor([1.0, 1.0 + 1e-15, 0.5], dtype=torch.float64)) == 0
    assert _first_max(torch.tensor([1.0, 1.0 + 1e-6, 0.5], dtype=torch.float64)) == 1
    assert _first_max(torch.tensor([-3.0, -1.0, -1.0 - 1e-14], dtype=torch.float64)) == 1


def test_the_start_does_not_depend_on_the_units_of_the_inputs():
    # standardised columns all have spread 1 up to rounding, which changes with the units
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.2, 7.0])
    y = torch.randn(50, generator=g, dtype=torch.float64)
    starts = []
    for units in (1.0, 1e6, 1e-3, 7.0):
        loc, scale = input_scaling(x * units)
        xs = (x * units - loc) / scale
        starts.append(balanced_start(xs, None, 3)[0])
        torch.testing.assert_close(starts[-1], starts[0], rtol=1e-9, atol=1e-9)
    assert {int(starts[0][0, :4].argmax())} == {0}  # the root: a tie, the first dimension
    with_y = [balanced_start((x * u - x.mean(0) * u) / (x.std(0) * u), y, 3)[0] for u in (1, 1e6)]
    torch.testing.assert_close(with_y[0], with_y[1], rtol=1e-9, atol=1e-9)
