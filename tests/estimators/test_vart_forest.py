"""VaRTForestRegressor: fit/predict, calibrated intervals, exact pickling, bad input."""

import pickle

import numpy as np
import pytest
import torch

from pyro_trees.distributions import gaussian_mixture_quantiles
from pyro_trees.estimators import VaRTForestRegressor, VaRTRegressor
from pyro_trees.models import forest_mean

# quick fits at a constant rate (lr_decay's default schedule is for the default 1,000 steps)
SMALL = {
    "num_trees": 8,
    "depth": 2,
    "num_steps": 150,
    "lr": 0.05,
    "lr_decay": 1.0,
    "num_samples": 30,
}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(150, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1] + 0.1 * rng.normal(size=150)
    return X, y


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    return VaRTForestRegressor(**SMALL, random_state=0).fit(X, y)


def test_fit_predict_interval(fitted, data):
    X, y = data
    assert isinstance(fitted, VaRTRegressor)
    pred = fitted.predict(X)
    assert pred.shape == (150,) and np.isfinite(pred).all()
    assert fitted.score(X, y) > 0.8
    lo, hi = fitted.predict_interval(X, level=0.9)
    assert (lo <= pred).all() and (pred <= hi).all()
    mean, std = fitted.predict(X[:5], return_std=True)
    assert std.shape == (5,) and (std > 0).all()
    assert fitted.sample(X[:4], num_samples=7).shape == (7, 4)
    assert fitted.sample_function(X[:4]).shape == (30, 4)
    imp = fitted.feature_importances_
    assert imp.shape == (3,) and abs(imp.sum() - 1) < 1e-6 and imp[2] < imp[0]
    # a forest is not one tree: export_text is not offered (hasattr says so)
    assert not hasattr(fitted, "export_text")
    with pytest.raises(AttributeError, match="export_text") as err:
        fitted.export_text()
    assert "single tree" in str(err.value.__cause__)


def test_interval_is_the_mixture_quantile_of_the_posterior_forests(fitted, data):
    """One Gaussian per posterior forest: its mean the forest's sum, its scale the
    forest's noise times noise_factor_; the interval is that mixture's quantile."""
    X, _ = data
    Xs = fitted._prepare(X[:6])
    leaf = fitted._posterior().leaves()
    loc = forest_mean(leaf["forest"], Xs)  # (S, 6)
    scale = leaf["log_sigma"].exp()[:, None].expand_as(loc)
    weight = torch.full_like(loc, 1 / loc.shape[0])
    q = gaussian_mixture_quantiles(weight.T.double(), loc.T.double(), scale.T.double(), (0.05,))
    lo, _ = fitted.predict_interval(X[:6], level=0.9)
    ref = fitted._outputs(q.reshape(1, -1))[0]
    assert np.allclose(lo, ref, atol=1e-6)


def test_calibrated_coverage_on_new_rows(fitted):
    rng = np.random.default_rng(1)
    X = rng.uniform(-2, 2, size=(2000, 3))
    y = np.sin(2 * X[:, 0]) + X[:, 1] + 0.1 * rng.normal(size=2000)
    lo, hi = fitted.predict_interval(X, level=0.9)
    cover = np.mean((y >= lo) & (y <= hi))
    assert 0.8 <= cover <= 0.98, cover  # 15 held-out rows set the factor


def test_pickle_reproduces_predictions_exactly(fitted, data):
    X, _ = data
    loaded = pickle.loads(pickle.dumps(fitted))
    assert np.array_equal(loaded.predict(X), fitted.predict(X))
    a, b = loaded.predict_interval(X), fitted.predict_interval(X)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.array_equal(loaded.sample(X[:5]), fitted.sample(X[:5]))


def test_seeded_fits_repeat_and_trace_elbo_runs(data):
    X, y = data
    kw = dict(SMALL, num_steps=20, random_state=3)
    a = VaRTForestRegressor(**kw).fit(X, y).predict(X[:5])
    b = VaRTForestRegressor(**kw).fit(X, y).predict(X[:5])
    assert np.array_equal(a, b)
    c = VaRTForestRegressor(**dict(kw, elbo="trace", num_steps=5)).fit(X, y)
    assert np.isfinite(c.predict(X[:5])).all()


def test_bad_n_trees(data):
    X, y = data
    with pytest.raises(ValueError, match="num_trees"):
        VaRTForestRegressor(num_trees=0, num_steps=2).fit(X, y)


def test_defaults_fit_friedmans_function_with_calibrated_intervals():
    """The default schedule (not the quick one above) on new rows."""
    from sklearn.datasets import make_friedman1

    X, y = make_friedman1(n_samples=300, noise=1.0, random_state=0)
    Xt, yt = make_friedman1(n_samples=500, noise=1.0, random_state=1)
    est = VaRTForestRegressor(random_state=0).fit(X, y)
    rmse = float(np.sqrt(np.mean((est.predict(Xt) - yt) ** 2)))
    lo, hi = est.predict_interval(Xt, level=0.9)
    cover = float(np.mean((yt >= lo) & (yt <= hi)))
    assert rmse < 0.6 * float(np.std(yt))  # a constant predictor scores std(y), about 5
    assert 0.75 <= cover <= 0.99


def test_lr_decay_schedule_reaches_its_end_and_rejects_bad_values(data):
    """The learning rate falls geometrically to ``lr * lr_decay`` after ``num_steps``."""
    est = VaRTForestRegressor(lr=0.03, lr_decay=0.05, num_steps=40)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.03)
    sched = est._lr_scheduler()(opt)
    for _ in range(40):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.03 * 0.05, rel=1e-9)
    assert VaRTRegressor()._lr_scheduler() is None  # the single tree's default: constant
    X, y = data
    with pytest.raises(ValueError, match="lr_decay"):
        VaRTForestRegressor(lr_decay=0.0, num_steps=2).fit(X, y)


def test_lr_decay_changes_the_fit_and_old_pickles_keep_a_constant_rate(data):
    X, y = data
    kw = dict(SMALL, num_steps=30, random_state=2, validation_fraction=0)
    a = VaRTForestRegressor(**kw).fit(X, y)
    b = VaRTForestRegressor(**dict(kw, lr_decay=0.05)).fit(X, y)
    assert not np.allclose(a.predict(X[:5]), b.predict(X[:5]))
    state = a.__getstate__()
    del state["lr_decay"]  # an estimator pickled before lr_decay existed
    old = VaRTForestRegressor.__new__(VaRTForestRegressor)
    old.__setstate__(state)
    assert old.lr_decay == 1.0 and np.array_equal(old.predict(X[:5]), a.predict(X[:5]))


def test_small_tables_train_the_fits_as_one_stack(data):
    """Up to ``stack_max_rows`` training rows the three fits train as one program: each
    keeps its own fold, guide, stopping and history, and the fit is reproducible."""
    X, y = data
    kw = dict(SMALL, num_steps=60, eval_every=10, patience=2, random_state=4)
    est = VaRTForestRegressor(**kw).fit(X, y)
    results = est.fit_results_
    assert len({r.seconds for r in results}) == 1  # one loop for the three
    for r in results:
        assert r.val_losses[0][0] == 0 and r.best_step is not None
        assert r.num_steps == r.val_losses[-1][0]  # its own losses, up to where it stopped
        assert r.stopped in ("early_stopping", "num_steps")
    guides = est.guides_
    assert len({id(g) for g in guides}) == 3
    assert not torch.equal(guides[0].beta_loc, guides[1].beta_loc)
    again = VaRTForestRegressor(**kw).fit(X, y)
    assert np.array_equal(est.predict(X[:7]), again.predict(X[:7]))
    lo, hi = est.predict_interval(X[:7], level=0.9)
    assert np.all(lo < hi)


def test_tiny_tables_without_held_out_rows_train_the_fits_as_one_stack():
    """Under about 20 rows nothing is held out: the fits still train as one program, each
    on every row for every step (its own losses, no validation), different from each
    other, reproducible, and predicting as a pool."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(12, 2))
    y = X[:, 0] + 0.1 * rng.normal(size=12)
    kw = dict(SMALL, num_steps=40, random_state=2)
    est = VaRTForestRegressor(**kw).fit(X, y)
    results = est.fit_results_
    assert len(results) == 3 and len({r.seconds for r in results}) == 1  # one loop
    for r in results:
        assert r.num_steps == 40 and not r.val_losses and r.best_step is None
        assert all(np.isfinite(r.losses))
    assert len({tuple(r.losses) for r in results}) == 3  # three fits, three histories
    guides = est.guides_
    assert not torch.equal(guides[0].beta_loc, guides[1].beta_loc)
    assert guides[0].temperature == pytest.approx(est._temperature_schedule()(40))
    again = VaRTForestRegressor(**kw).fit(X, y)
    assert np.array_equal(est.predict(X), again.predict(X))
    lo, hi = est.predict_interval(X, level=0.9)
    assert np.all(lo < hi) and est.noise_factor_ == 1.0  # no rows to calibrate on


def test_which_fits_stack(data):
    """The rule: full batches of few rows, several fits, one process, complete inputs, no
    refit; the fits otherwise run one after another. Without held-out rows they stack
    too (every fit on every row)."""
    from pyro_trees.estimators._template import VART_HELD_OUT, held_out_rows

    X, y = data
    est = VaRTForestRegressor(**SMALL, random_state=0).fit(X, y)
    Xs = torch.as_tensor(X, dtype=torch.float32)
    split = held_out_rows(150, 0.1, VART_HELD_OUT, ranks=est.ranks_, seed=0, device=Xs.device)
    assert est._stacks_fits(Xs, split)
    for change in ({"refit": True}, {"num_fits": 1}, {"batch_size": 50}, {"elbo": "trace"}):
        assert not est.set_params(**change)._stacks_fits(Xs, split), change
        est.set_params(**{k: VaRTForestRegressor().get_params()[k] for k in change})
    assert est._stacks_fits(Xs, split)
    none_held = held_out_rows(150, 0.0, VART_HELD_OUT, ranks=est.ranks_, seed=0)
    assert est._stacks_fits(Xs, none_held)
    est.stack_max_rows = 100  # 135 training rows: too many
    assert not est._stacks_fits(Xs, split)
    del est.stack_max_rows
    assert est._stacks_fits(Xs, split)
    # a stack whose step would not fit the memory trains one fit after another
    from unittest import mock

    with mock.patch("pyro_trees.trees.require_memory", side_effect=ValueError("no memory")):
        assert not est._stacks_fits(Xs, split)
    # missing values train one fit after another (their model routes them)
    Xm = X.copy()
    Xm[0, 0] = np.nan
    est_m = VaRTForestRegressor(**dict(SMALL, num_steps=10), random_state=0).fit(Xm, y)
    assert len({r.seconds for r in est_m.fit_results_}) == 3
