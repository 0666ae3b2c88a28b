import math
import pickle

import pyro
import pytest
import torch

from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import EarlyStopping, TreeELBO, fit
from pyro_trees.models import HME


def _problem():
    x = torch.linspace(-2, 2, 60).unsqueeze(-1)
    y = torch.where(x[:, 0] > 0, 1.0, -1.0)
    # init=None: the start is the constructed state (fit's starting-state semantics)
    model = HME(1, 2, noise_scale=None, init=None)
    return model, RNNTreeGuide(1, 2, feedback="hard", init=None), x, y


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
        early_stopping=EarlyStopping(lambda: next(values), eval_every=5, patience=3),
        progress=False,
    )
    assert result.stopped == "early_stopping"
    assert result.best_step == 10 and result.best_val == 4.0
    assert result.num_steps == 25


def test_the_result_says_a_callback_stopped_the_run():
    model, guide, x, y = _problem()
    result = fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        num_steps=50,
        progress=False,
        callback=lambda step, loss: step == 6,
    )
    assert result.stopped == "callback" and result.num_steps == 7
    full = fit(model, guide, x, y, loss=TreeELBO(), num_steps=3, progress=False)
    assert full.stopped == "num_steps"


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
        early_stopping=EarlyStopping(lambda: next(values), eval_every=5, patience=2),
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
        early_stopping=EarlyStopping(lambda: next(values), eval_every=5, patience=2),
        progress=False,
    )
    assert result.best_step == 5 and result.best_val == 1.0


def test_ctrl_c_propagates_after_the_step_and_keeps_what_was_learnt(tmp_path):
    model, guide, x, y = _problem()
    pyro.set_rng_seed(0)
    ref_model, ref_guide, _, _ = _problem()
    fit(ref_model, ref_guide, x, y, loss=TreeELBO(), num_steps=8, progress=False, seed=3)

    def interrupt(step, loss):
        if step == 7:
            raise KeyboardInterrupt

    path = tmp_path / "ckpt.pt"
    pyro.set_rng_seed(0)
    model, guide, x, y = _problem()
    with pytest.raises(KeyboardInterrupt):
        fit(
            model,
            guide,
            x,
            y,
            loss=TreeELBO(),
            num_steps=50,
            callback=interrupt,
            checkpoint=path,
            progress=False,
            seed=3,
        )
    state = torch.load(path, weights_only=False)
    assert state["result"].stopped == "interrupted" and state["result"].num_steps == 8
    # the modules hold the parameters after 8 steps, as a run of 8 steps leaves them
    for a, b in ((model, ref_model), (guide, ref_guide)):
        for key, value in a.state_dict().items():
            assert torch.equal(b.state_dict()[key], value), key


def test_checkpoint_and_resume(tmp_path):
    model, guide, x, y = _problem()
    path = tmp_path / "ckpt.pt"
    fit(model, guide, x, y, loss=TreeELBO(), num_steps=20, checkpoint=path, progress=False)
    state = torch.load(path, weights_only=False)
    assert state["step"] == 20
    result = fit(model, guide, x, y, loss=TreeELBO(), num_steps=35, resume=path, progress=False)
    assert result.num_steps == 35


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def _run(init_seed, **kwargs):
    """A fresh model and guide, initialised from ``init_seed``, trained by ``fit``."""
    pyro.set_rng_seed(init_seed)
    model, guide, x, y = _problem()
    result = fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        lr=0.05,
        lr_scheduler=_step_lr,
        progress=False,
        **kwargs,
    )
    return model, guide, result


@pytest.mark.parametrize("interrupt_at", [7, 12])
def test_resume_into_fresh_objects_continues_the_run_exactly(tmp_path, interrupt_at):
    """Interrupted after ``interrupt_at`` steps, then resumed into newly built (and
    differently initialised) modules: the same losses and parameters as one run, with
    the step schedule continuing where it stopped."""
    model, guide, full = _run(0, num_steps=30)

    def interrupt(step, loss):
        if step + 1 == interrupt_at:
            raise KeyboardInterrupt

    path = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        _run(0, num_steps=30, callback=interrupt, checkpoint=path)
    state = torch.load(path, weights_only=False)
    assert state["result"].stopped == "interrupted"
    assert state["result"].num_steps == interrupt_at
    assert state["step"] == interrupt_at
    assert state["scheduler"]["last_epoch"] == interrupt_at
    model2, guide2, resumed = _run(1, num_steps=30, resume=path)
    assert resumed.stopped == "num_steps"
    assert resumed.losses == full.losses  # exactly, step by step
    for a, b in ((model, model2), (guide, guide2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_resume_continues_the_random_streams(tmp_path, device):
    """Soft feedback feeds back quantisation noise, drawn on the device, so every step
    draws random numbers: the checkpoint's generators (the CPU's, and every CUDA
    device's when CUDA is in use) make the resumed run the uninterrupted one."""

    def run(seed, **kwargs):
        pyro.set_rng_seed(seed)
        x = torch.linspace(-2, 2, 60).unsqueeze(-1)
        y = torch.where(x[:, 0] > 0, 1.0, -1.0)
        model, guide = HME(1, 2, noise_scale=None), RNNTreeGuide(1, 2, feedback="soft")
        result = fit(
            model, guide, x, y, loss=TreeELBO(), lr=0.05, progress=False, device=device, **kwargs
        )
        return guide, result

    guide, full = run(0, num_steps=20)

    def interrupt(step, loss):
        if step == 8:
            raise KeyboardInterrupt

    path = tmp_path / "ckpt.pt"
    with pytest.raises(KeyboardInterrupt):
        run(0, num_steps=20, callback=interrupt, checkpoint=path)
    if device == "cuda":
        assert torch.load(path, weights_only=False)["cuda_rng"] is not None
    guide2, resumed = run(1, num_steps=20, resume=path)
    assert resumed.losses == full.losses
    for key, value in guide.state_dict().items():
        assert torch.equal(guide2.state_dict()[key], value), key


def test_resume_keeps_early_stopping_state(tmp_path):
    """The best state and the count of evaluations without improvement survive an
    interruption: the resumed run stops at the same step and restores the same best."""
    scripted = {0: 5.0, 5: 4.0, 10: 3.0, 15: 3.5, 20: 3.6, 25: 3.7, 30: 3.8}
    done = [0]

    def val_metric():
        return scripted[done[0]]

    def count(step, loss):
        done[0] = step + 1

    model, guide, full = _run(
        0,
        num_steps=40,
        early_stopping=EarlyStopping(val_metric, eval_every=5, patience=3),
        callback=count,
    )
    assert full.stopped == "early_stopping" and full.num_steps == 25 and full.best_step == 10

    def interrupt(step, loss):
        count(step, loss)
        if step + 1 == 17:
            raise KeyboardInterrupt

    path = tmp_path / "ckpt.pt"
    done[0] = 0
    with pytest.raises(KeyboardInterrupt):
        _run(
            0,
            num_steps=40,
            early_stopping=EarlyStopping(val_metric, eval_every=5, patience=3),
            callback=interrupt,
            checkpoint=path,
        )
    assert torch.load(path, weights_only=False)["result"].stopped == "interrupted"
    done[0] = 17
    model2, guide2, resumed = _run(
        1,
        num_steps=40,
        early_stopping=EarlyStopping(val_metric, eval_every=5, patience=3),
        callback=count,
        resume=path,
    )
    assert resumed.stopped == "early_stopping" and resumed.num_steps == 25
    assert resumed.best_step == 10 and resumed.losses == full.losses
    for a, b in ((model, model2), (guide, guide2)):
        for key, value in a.state_dict().items():
            assert torch.equal(b.state_dict()[key], value), key


@pytest.mark.parametrize("delay", [0.02, 0.1])
def test_a_real_ctrl_c_resumes_bit_identically(tmp_path, delay):
    """A SIGINT from another thread (as Ctrl-C delivers it), at an arbitrary moment of
    a minibatch fit with a scheduler: ``fit`` finishes the step in progress, writes the
    checkpoint and raises; the resumed run is the uninterrupted one, bit for bit."""
    import _thread
    import threading

    steps = 300  # each takes over 0.5 ms: the interrupt comes well before the end

    def run(init_seed, **kwargs):
        return _run(init_seed, num_steps=steps, subsample_size=16, **kwargs)

    model, guide, full = run(0, seed=1)
    path = tmp_path / "ckpt.pt"
    timer = threading.Timer(delay, _thread.interrupt_main)

    def start_the_clock(step, loss):
        if step == 0:
            timer.start()

    try:
        with pytest.raises(KeyboardInterrupt):
            run(0, seed=1, checkpoint=path, callback=start_the_clock)
    finally:
        timer.cancel()
    state = torch.load(path, weights_only=False)
    assert 0 < state["step"] < steps and state["result"].stopped == "interrupted"
    assert state["result"].losses == full.losses[: state["step"]]
    model2, guide2, resumed = run(1, resume=path)
    assert resumed.losses == full.losses
    for a, b in ((model, model2), (guide, guide2)):
        for key, value in a.state_dict().items():
            assert torch.equal(b.state_dict()[key], value), key


def test_resume_reads_an_older_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    _run(0, num_steps=10, checkpoint=path)
    state = torch.load(path, weights_only=False)
    for key in ("scheduler", "best_state", "bad_evals", "rng"):
        del state[key]  # as written before these were saved
    torch.save(state, path)
    _, _, resumed = _run(1, num_steps=15, resume=path)
    assert resumed.num_steps == 15 and all(map(math.isfinite, resumed.losses))


def test_pickled_model_and_guide_are_a_checkpoint():
    model, guide, x, y = _problem()
    fit(model, guide, x, y, loss=TreeELBO(), num_steps=20, progress=False)
    m2, g2 = pickle.loads(pickle.dumps((model, guide)))
    torch.testing.assert_close(m2.leaf_loc_unconstrained, model.leaf_loc_unconstrained)
    with pyro.get_param_store().scope():
        torch.testing.assert_close(g2.tree(x, noise=False), guide.tree(x, noise=False))


def test_bad_arguments():
    model, guide, x, y = _problem()
    with pytest.raises(ValueError, match="criterion"):
        EarlyStopping(patience=3)
    with pytest.raises(ValueError, match="criterion"):
        EarlyStopping(lambda: 0.0, val_args=(x, y))
    with pytest.raises(ValueError, match="eval_every"):
        EarlyStopping(lambda: 0.0, eval_every=0)
    with pytest.raises(ValueError, match="optimiser"):
        fit(model, guide, x, y, loss=TreeELBO(), optim="nope", progress=False)


@pytest.mark.cuda
def test_checkpoint_and_resume_on_cuda(tmp_path):
    """The checkpoint maps to the device; the saved CPU generator state comes back."""
    path = tmp_path / "ckpt.pt"
    _run(0, num_steps=6, checkpoint=path, device="cuda")
    model, guide, resumed = _run(1, num_steps=10, resume=path, device="cuda")
    assert resumed.num_steps == 10 and all(map(math.isfinite, resumed.losses))
    assert model.leaf_loc_unconstrained.is_cuda


def test_cpu_checkpoint_does_not_touch_cuda(tmp_path):
    """A CPU run stores no CUDA generator state (and so never initialises CUDA)."""
    path = tmp_path / "ckpt.pt"
    _run(0, num_steps=3, checkpoint=path)
    state = torch.load(path, weights_only=False)
    assert "cuda_rng" in state
    if not torch.cuda.is_initialized():
        assert state["cuda_rng"] is None


def test_resuming_a_finished_run_extends_it(tmp_path):
    """The final checkpoint is the training state, not the restored best one: a run of
    20 steps resumed to 40 is the run of 40 steps (same losses, same best, same
    parameters), although its best validation came early and was restored at step 20."""
    scripted = {0: 5.0, 5: 4.0, 10: 3.0, 15: 3.5, 20: 3.6, 25: 3.7, 30: 2.0, 35: 3.9, 40: 4.0}
    done = [0]

    def count(step, loss):
        done[0] = step + 1

    common = dict(
        early_stopping=EarlyStopping(lambda: scripted[done[0]], eval_every=5), callback=count
    )
    model, guide, full = _run(0, num_steps=40, **common)
    assert full.best_step == 30
    path = tmp_path / "ckpt.pt"
    done[0] = 0
    _, _, first = _run(0, num_steps=20, checkpoint=path, **common)
    assert first.stopped == "num_steps" and first.best_step == 10
    model2, guide2, resumed = _run(1, num_steps=40, resume=path, **common)
    assert resumed.losses == full.losses and resumed.best_step == 30
    for a, b in ((model, model2), (guide, guide2)):
        for key, value in a.state_dict().items():
            assert torch.equal(b.state_dict()[key], value), key


# The parts of fit, each alone.


def test_early_stopping_alone_keeps_the_best_state_and_counts_patience():
    from pyro_trees.infer import EarlyStopping, FitResult

    module = torch.nn.Linear(1, 1)
    values = iter([3.0, 2.0, 2.5, 2.6])
    result = FitResult()
    stopping = EarlyStopping(lambda: next(values), eval_every=2, patience=2)
    stopping.bind([module], result)
    stopping.score_start()
    with torch.no_grad():
        module.weight.fill_(1.0)
    assert not stopping.after_step(1, last=False)  # not an evaluation step
    assert not stopping.after_step(2, last=False)  # 2.0: the best so far
    with torch.no_grad():
        module.weight.fill_(5.0)
    assert not stopping.after_step(4, last=False)  # 2.5: one bad evaluation
    assert stopping.after_step(6, last=False)  # 2.6: patience spent
    assert result.best_step == 2 and result.best_val == 2.0
    assert result.val_losses == [(0, 3.0), (2, 2.0), (4, 2.5), (6, 2.6)]
    stopping.restore()
    assert float(module.weight.detach()) == 1.0


def test_train_steps_alone_stops_on_a_non_finite_loss_and_on_request():
    from pyro_trees.infer import FitResult, train_steps

    losses = iter([1.0, 0.5, float("nan"), 0.1])
    result = FitResult()
    train_steps(lambda: next(losses), 0, 10, result)
    assert result.stopped == "non_finite" and len(result.losses) == 3
    result = FitResult()
    train_steps(lambda: 1.0, 0, 10, result, after_step=lambda step, loss: step == 3)
    assert result.num_steps == 4 and result.stopped == "num_steps"


def test_train_steps_reads_losses_every_few_steps_and_stops_at_the_read_after_a_nan():
    from pyro_trees.infer import FitResult, train_steps

    values = [1.0, 0.9, 0.8, 0.7, 0.6, float("nan"), 0.4, 0.3, 0.2]
    steps, seen = iter(values), []
    result = FitResult()

    def after_step(step, loss):
        seen.append(loss)
        return False

    train_steps(
        lambda: torch.tensor(next(steps), dtype=torch.float64),
        0,
        9,
        result,
        after_step=after_step,
        read_every=4,
    )
    # read after steps 4 and 8 (counts): the NaN of step 6 stops the loop at the second
    # read, with the losses up to it; between reads after_step sees no loss
    assert seen == [None, None, None, 0.7, None, None, None]
    assert result.stopped == "non_finite" and len(result.losses) == 6
    assert math.isnan(result.losses[-1]) and result.losses[:5] == values[:5]
    # a request to stop between reads keeps every loss taken
    result = FitResult()
    train_steps(
        lambda: torch.tensor(2.0),
        0,
        10,
        result,
        after_step=lambda step, loss: step == 5,
        read_every=4,
    )
    assert result.losses == [2.0] * 6 and result.stopped == "num_steps"


def test_fit_records_the_same_losses_when_it_reads_them_every_step_or_in_blocks():
    """A fit read in blocks (nothing watches each step) and one read every step (a
    callback) take the same steps and record the same losses."""
    seen = []

    def quiet(step, loss):  # a callback that reads no loss (as a temperature schedule)
        seen.append(loss)

    quiet.reads_loss = False
    runs = []
    for callback in (None, lambda step, loss: False, quiet):
        pyro.set_rng_seed(0)
        model, guide, x, y = _problem()
        kwargs = {"num_steps": 70, "callback": callback}
        runs.append(fit(model, guide, x, y, loss=TreeELBO(), **kwargs))
    assert len(runs[0].losses) == 70
    assert runs[0].losses == runs[1].losses == runs[2].losses
    # read after 50 steps and after the last: the quiet callback sees those two losses
    assert [i for i, v in enumerate(seen) if v is not None] == [49, 69]
    assert seen[49] == runs[2].losses[49]


def test_checkpoint_alone_writes_every_n_steps(tmp_path):
    from pyro_trees.infer import Checkpoint

    path = tmp_path / "run.pt"
    saver = Checkpoint(path, every=3)
    for done in (1, 2):
        saver.after_step(done, lambda: {"x": 0})
    assert not path.exists()
    saver.after_step(3, lambda: {"x": 3})
    assert torch.load(path) == {"step": 3, "x": 3}
    assert not (tmp_path / "run.pt.tmp").exists()


def test_early_stopping_on_the_validation_loss():
    model, guide, x, y = _problem()
    stopping = EarlyStopping(val_args=(x[::2], y[::2]), eval_every=5, patience=2)
    result = fit(
        model, guide, x, y, loss=TreeELBO(), num_steps=30, early_stopping=stopping, progress=False
    )
    assert result.val_losses[0][0] == 0 and len(result.val_losses) >= 2
    assert all(math.isfinite(v) for _, v in result.val_losses)
    assert result.best_val == min(v for _, v in result.val_losses)


def test_checkpoint_path_or_object_and_progress_label(tmp_path):
    from pyro_trees.infer import Checkpoint

    model, guide, x, y = _problem()
    fit(
        model,
        guide,
        x,
        y,
        loss=TreeELBO(),
        num_steps=4,
        checkpoint=Checkpoint(tmp_path / "a.pt", every=2),
        progress="label",
    )
    assert torch.load(tmp_path / "a.pt", weights_only=False)["step"] == 4


@pytest.mark.parametrize(
    "options",
    [{}, {"lrd": 0.99, "weight_decay": 0.1, "clip_norm": 0.5}, {"centered_variance": True}],
)
def test_fused_clipped_adam_is_pyros_clipped_adam_to_the_last_bit(options):
    from pyro.optim.clipped_adam import ClippedAdam

    from pyro_trees.infer.fused_adam import FusedClippedAdam

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen), torch.randn(())]
    runs = []
    for cls in (ClippedAdam, FusedClippedAdam):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = cls(params, lr=0.05, **options)
        grads = torch.Generator().manual_seed(1)
        for step in range(12):
            for i, p in enumerate(params):
                # large gradients reach the clip; the scalar skips every third step
                p.grad = (
                    None
                    if (i == 2 and step % 3 == 0)
                    else 20 * torch.randn(p.shape, generator=grads)
                )
            opt.step()
        runs.append((params, opt))
    (ref, ref_opt), (ours, our_opt) = runs
    for a, b in zip(ref, ours, strict=True):
        assert torch.equal(a, b)
    assert ref_opt.param_groups[0]["lr"] == our_opt.param_groups[0]["lr"]
    # the states have the same layout: one class's state loads into the other
    ref_opt.load_state_dict(our_opt.state_dict())
    assert ref_opt.state[ref[0]]["step"] == our_opt.state[ours[0]]["step"]
