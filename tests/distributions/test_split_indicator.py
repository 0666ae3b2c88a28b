import math

import pytest
import torch

from pyro_trees.distributions import RelaxedSplitIndicator, SplitIndicator


def test_split_indicator_is_bernoulli_on_hard_values():
    p = torch.tensor([0.2, 0.7])
    d = SplitIndicator(p)
    for v in (0.0, 1.0):
        value = torch.full((2,), v)
        expected = torch.distributions.Bernoulli(p).log_prob(value)
        assert torch.allclose(d.log_prob(value), expected)
    # linear in s in between
    half = d.log_prob(torch.full((2,), 0.5))
    assert torch.allclose(half, 0.5 * (p.log() + (1 - p).log()))
    s = d.sample((20000,))
    assert set(s.unique().tolist()) <= {0.0, 1.0}
    assert torch.allclose(s.mean(0), p, atol=0.02)
    assert d.expand((3, 2)).sample().shape == (3, 2)


def test_relaxed_indicator_approaches_hard_as_temperature_vanishes():
    logits = torch.tensor([-1.0, 0.0, 2.0])
    hard = None
    gaps = []
    for tau in (1.0, 0.1, 0.01, 1e-3, 0.0):
        torch.manual_seed(0)
        s = RelaxedSplitIndicator(logits, tau).rsample((5000,))
        assert ((s >= 0) & (s <= 1)).all()
        gaps.append(float(torch.minimum(s, 1 - s).mean()))
        if tau == 0.0:
            hard = s
        elif tau == 1e-3:
            near = s
    # distance to {0, 1} shrinks monotonically to zero
    assert all(a > b for a, b in zip(gaps[:-1], gaps[1:], strict=True))
    assert gaps[-1] == 0.0
    # same noise: tiny temperature rounds to the hard draw almost everywhere
    assert float((near.round() == hard).float().mean()) > 0.999
    assert torch.allclose(hard.mean(0), torch.sigmoid(logits), atol=0.02)


def test_relaxed_indicator_log_prob_and_gradient():
    logits = torch.tensor([0.3, -0.4], requires_grad=True)
    d = RelaxedSplitIndicator(logits, 0.5)
    s = d.rsample()
    lp = d.log_prob(s)
    p = torch.sigmoid(logits)
    assert torch.allclose(lp, s * p.log() + (1 - s) * (1 - p).log())
    s.sum().backward()
    assert logits.grad is not None and (logits.grad != 0).all()
    with pytest.raises(ValueError, match="temperature"):
        RelaxedSplitIndicator(logits, -1.0)
    assert math.isclose(
        float(RelaxedSplitIndicator(logits, 0.5).expand((4, 2)).rsample().shape[0]), 4
    )
