import pickle

import pyro
import pytest
import torch

from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import TreeELBO, fit
from pyro_trees.models import HME


def _problem():
    x = torch.linspace(-2, 2, 60).unsqueeze(-1)
    y = torch.where(x[:, 0] > 0, 1.0, -1.0)
    return HME(1, 2, noise_scale=None), RNNTreeGuide(1, 2, feedback="hard"), x, y


def test_fit_reduces_the_loss_and_leaves_global_store_alone():
    model, guide, x, y = _problem()
    pyro.clear_param_store()
    result = fit(model, guide, x, y, loss=TreeELBO(), num_steps=80, lr=0.05, progress=False)
    assert result.num_steps == 80 and result.stopped == "num_steps"
    assert result.losses[-1] < result.losses[0]
    assert len(pyro.get_param_store()) == 0


def test_two_models_with_the_same_names_do_not_share_parameters():
    m1, g1, x, y = _problem()
    m2, g2, _, _ = _problem()
    fit(m1, g1, x, y, loss=TreeELBO(), num_steps=30, lr=0.05, progress=False)
    before = m1.leaf_loc_unconstrained.detach().clone()
    fit(m2, g2, x, -y, loss=TreeELBO(), num_steps=30, lr=0.05, progress=False)
    torch.testing.assert_close(m1.leaf_loc_unconstrained.detach(), before)


def test_early_stopping_restores_the_best_parameters():
    model, guide, x, y = _problem()
    # The first value scores the starting state (step 0).
    values = iter([5.0, 4.5, 4.0, 6.0, 7.0, 8.0, 9.0] + [10.0] * 100)
    result = fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        num_steps=200,
        val_metric=lambda: next(values),
        eval_every=5,
        patience=3,
        progress=False,
    )
    assert result.stopped == "early_stopping"
    assert result.best_step == 10 and result.best_val == 4.0
    assert result.num_steps == 25


def test_early_stopping_keeps_the_starting_state_when_it_is_best():
    model, guide, x, y = _problem()
    start = [p.detach().clone() for p in model.parameters()]
    values = iter([1.0] + [2.0] * 100)
    result = fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        num_steps=50,
        lr=0.1,
        val_metric=lambda: next(values),
        eval_every=5,
        patience=2,
        progress=False,
    )
    assert result.best_step == 0 and result.val_losses[0] == (0, 1.0)
    for before, after in zip(start, model.parameters(), strict=True):
        torch.testing.assert_close(after.detach(), before)


def test_a_tie_with_the_starting_state_keeps_the_trained_one():
    model, guide, x, y = _problem()
    values = iter([1.0, 1.0] + [2.0] * 100)
    result = fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        num_steps=50,
        val_metric=lambda: next(values),
        eval_every=5,
        patience=2,
        progress=False,
    )
    assert result.best_step == 5 and result.best_val == 1.0


def test_ctrl_c_keeps_what_was_learnt():
    model, guide, x, y = _problem()

    def interrupt(step, loss):
        if step == 7:
            raise KeyboardInterrupt

    result = fit(
        model, guide, x, y, loss=TreeELBO(), num_steps=50, callback=interrupt, progress=False
    )
    assert result.stopped == "interrupted" and result.num_steps == 8


def test_checkpoint_and_resume(tmp_path):
    model, guide, x, y = _problem()
    path = tmp_path / "ckpt.pt"
    fit(model, guide, x, y, loss=TreeELBO(), num_steps=20, checkpoint=path, progress=False)
    state = torch.load(path, weights_only=False)
    assert state["step"] == 20
    result = fit(model, guide, x, y, loss=TreeELBO(), num_steps=35, resume=path, progress=False)
    assert result.num_steps == 35


def test_pickled_model_and_guide_are_a_checkpoint():
    model, guide, x, y = _problem()
    fit(model, guide, x, y, loss=TreeELBO(), num_steps=20, progress=False)
    m2, g2 = pickle.loads(pickle.dumps((model, guide)))
    torch.testing.assert_close(m2.leaf_loc_unconstrained, model.leaf_loc_unconstrained)
    with pyro.get_param_store().scope():
        torch.testing.assert_close(g2.tree(x, noise=False), guide.tree(x, noise=False))


def test_bad_arguments():
    model, guide, x, y = _problem()
    with pytest.raises(ValueError, match="patience"):
        fit(model, guide, x, y, loss=TreeELBO(), patience=3, progress=False)
    with pytest.raises(ValueError, match="optimiser"):
        fit(model, guide, x, y, loss=TreeELBO(), optim="nope", progress=False)
