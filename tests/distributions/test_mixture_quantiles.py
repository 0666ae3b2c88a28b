"""gaussian_mixture_quantiles: known mixtures, and the same answer whatever the layout;
row_mixture_quantiles on the rows compact_mixture_rows packs."""

import pytest
import torch

from pyro_trees.distributions import (
    compact_mixture_rows,
    gaussian_mixture_quantiles,
    row_mixture_quantiles,
)


def test_mixture_quantiles_of_known_mixtures():
    probs = (0.05, 0.5, 0.95)
    loc = torch.tensor([[[0.3]], [[-2.0]]], dtype=torch.float64).view(1, 2, 1)
    scale = torch.tensor([0.5, 3.0], dtype=torch.float64).view(1, 2, 1)
    q = gaussian_mixture_quantiles(
        torch.ones(1, 2, 1, dtype=torch.float64), loc, scale, probs, dim=(0, -1)
    )
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
    z = normal.icdf(torch.tensor(probs, dtype=torch.float64)).view(3, 1)
    torch.testing.assert_close(q, loc.view(1, 2) + scale.view(1, 2) * z, atol=1e-10, rtol=0)
    # a symmetric two-component mixture over two "trees" (weights 1/4 each, one zero)
    w = torch.tensor([[[0.25, 0.25, 0.0]], [[0.5, 0.0, 0.0]]], dtype=torch.float64)
    loc = torch.tensor([[[-3.0, 3.0, 99.0]], [[0.0, 0.0, 0.0]]], dtype=torch.float64)
    q = gaussian_mixture_quantiles(w, loc, torch.ones_like(loc), probs, dim=(0, -1))[:, 0]
    assert float(q[1]) == pytest.approx(0.0, abs=1e-10)
    assert float(q[0]) == pytest.approx(-float(q[2]), abs=1e-10)
    cdf = (w * torch.special.ndtr(q[2] - loc)).sum()
    assert float(cdf) == pytest.approx(0.95, abs=1e-12)


def test_a_mixture_gets_the_same_quantiles_whichever_mixtures_share_its_batch():
    """Each row alone and in a batch with rows that converge later (far, wide,
    bimodal): bitwise the same quantiles (a converged row stops moving)."""
    torch.manual_seed(0)
    n, k = 12, 5
    w = torch.rand(n, k, dtype=torch.float64).softmax(-1)
    loc = torch.randn(n, k, dtype=torch.float64) * torch.logspace(-2, 3, n).unsqueeze(-1)
    scale = torch.rand(n, k, dtype=torch.float64) * torch.logspace(-3, 1, n).unsqueeze(-1)
    probs = (0.05, 0.5, 0.95)
    together = gaussian_mixture_quantiles(w, loc, scale, probs)
    for i in range(n):
        alone = gaussian_mixture_quantiles(w[i : i + 1], loc[i : i + 1], scale[i : i + 1], probs)
        assert torch.equal(alone[:, 0], together[:, i]), i


def test_component_dims_may_be_anywhere():
    """The mixture over dims (0, -1) of ``(S, n, M)`` equals the same mixture laid out
    ``(n, S * M, 1)`` and summed over dim -2 (the Bayesian HME's layout)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(3, 4, 5, generator=gen, dtype=torch.float64)
    w = w / w.sum((0, -1), keepdim=True)
    loc = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64)
    scale = 0.2 + torch.rand(3, 4, 5, generator=gen, dtype=torch.float64)
    probs = (0.05, 0.95)
    q = gaussian_mixture_quantiles(w, loc, scale, probs, dim=(0, -1))
    assert q.shape == (2, 4)

    def layout(t):
        return t.permute(1, 0, 2).reshape(4, 15, 1)

    q2 = gaussian_mixture_quantiles(layout(w), layout(loc), layout(scale), probs, dim=-2)
    assert q2.shape == (2, 4, 1)
    torch.testing.assert_close(q2[..., 0], q, atol=1e-10, rtol=0)


@pytest.mark.parametrize("factor", [1e200, 1e307])
def test_quantiles_of_huge_mixtures_scale_with_them(factor):
    # the bracket mu +- 40 sigma overflowed to +-inf and its midpoint was NaN
    w = torch.tensor([0.3, 0.7], dtype=torch.float64)
    loc = torch.tensor([0.3, -2.0], dtype=torch.float64)
    scale = torch.tensor([0.5, 3.0], dtype=torch.float64)
    probs = (0.05, 0.5, 0.95)
    q = gaussian_mixture_quantiles(w, loc, scale, probs)
    q_big = gaussian_mixture_quantiles(w, factor * loc, factor * scale, probs)
    assert bool(torch.isfinite(q_big).all())
    torch.testing.assert_close(q_big / factor, q, rtol=1e-9, atol=0)


def test_row_mixture_quantiles_match_the_reference_solver():
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(9, 40, 6, generator=gen, dtype=torch.float64) ** 8  # uneven weights
    w[:, :, 2] = 0.0  # a node that is no leaf
    w = w / w.sum((0, -1), keepdim=True)
    loc = 3 * torch.randn(9, 40, 6, generator=gen, dtype=torch.float64)  # multimodal
    scale = 0.01 + torch.rand(9, 40, 6, generator=gen, dtype=torch.float64)
    probs = (0.05, 0.3, 0.95)
    ref = gaussian_mixture_quantiles(w, loc, scale, probs, dim=(0, -1))
    cw, cloc, cscale = compact_mixture_rows(w, loc, scale)
    # the weight dropped from a row is at most tol, and the padding is weight 0, scale 1
    assert ((1.0 - cw.sum(-1)).abs() <= 1e-12).all() and cw.shape[1] < 9 * 6
    assert (cscale[cw == 0] == 1.0).all()
    got = row_mixture_quantiles(cw, cloc, cscale, probs)
    torch.testing.assert_close(got, ref, atol=1e-9, rtol=0)
    # single precision inputs take the same path without the coarse first steps
    got32 = row_mixture_quantiles(cw.float(), cloc.float(), cscale.float(), probs, tol=1e-5)
    torch.testing.assert_close(got32.double(), ref, atol=1e-3, rtol=0)
