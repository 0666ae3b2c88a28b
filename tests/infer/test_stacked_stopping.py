"""StackedEarlyStopping: each fit of a stack scored, kept, stopped and restored as its own."""

import copy

import pyro
import pytest
import torch

from pyro_trees.guides import StackedGuides, VaRTForestGuide
from pyro_trees.infer import StackedEarlyStopping, VaRTForestELBO, fit
from pyro_trees.models import VaRTForest


@pytest.fixture(autouse=True)
def _local_params():
    with pyro.settings.context(module_local_params=True):
        yield


def test_each_fit_stops_and_is_restored_on_its_own():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=g)
    y = x[:, 0] - x[:, 1]
    model = VaRTForest(2, num_trees=3, depth=2)
    guides = [VaRTForestGuide(model, generator=g).double() for _ in range(2)]
    for guide in guides:
        guide.init_splits_from_data(x.double(), generator=g)
    stack = StackedGuides(guides)
    x, y = x.double(), y.double()
    weight = torch.ones(2, 40, dtype=x.dtype)
    weight[0, :10] = 0.0  # fit 0 holds out 10 rows
    # fit 0 is best after 10 steps, then worse (patience 2: stops at 30);
    # fit 1 improves at every evaluation and runs all 60 steps
    scores = {0: iter([5.0, 1.0, 2.0, 3.0]), 1: iter([5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.4])}
    seen = {}

    def metric(j):
        value = next(scores[j])
        if j == 0 and value == 1.0:
            seen["best"] = copy.deepcopy(guides[0].state_dict())
        return value

    loss = VaRTForestELBO()
    stopping = StackedEarlyStopping(
        metric, stack, fit_losses=lambda: loss.fit_losses, eval_every=10, patience=2
    )
    result = fit(
        model,
        stack,
        x,
        y,
        weight=weight,
        loss=loss,
        num_steps=60,
        lr=0.05,
        early_stopping=stopping,
        progress=False,
        seed=0,
    )
    first, second = stopping.results
    assert result.num_steps == 60  # the program runs until every fit has stopped
    assert (first.stopped, first.best_step, first.num_steps) == ("early_stopping", 10, 30)
    assert (second.stopped, second.best_step, second.num_steps) == ("num_steps", 60, 60)
    assert [s for s, _ in first.val_losses] == [0, 10, 20, 30]
    # fit 0 holds its state of step 10, not the stack's last values
    for name, value in guides[0].state_dict().items():
        assert torch.equal(value, seen["best"][name]), name
    final = stack.beta_loc[0].detach()
    assert not torch.equal(guides[0].beta_loc_unconstrained.detach(), final)
    # each fit's losses are its own; together they are the stack's loss
    summed = [a + b for a, b in zip(first.losses, second.losses[:30], strict=True)]
    assert summed == pytest.approx(result.losses[:30], rel=1e-10)
    assert first.seconds == second.seconds == result.seconds
    # once fit 0 stopped, the program computed fit 1 alone
    assert stack.running == [1]
    assert second.losses[30:] == pytest.approx(result.losses[30:], rel=1e-12)
