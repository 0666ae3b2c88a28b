"""VaRTRegressor: fit/predict contract, intervals, pickling, batching and bad input."""

import math
import pickle

import numpy as np
import pyro
import pytest
import torch

from pyro_trees.distributions import gaussian_mixture_quantiles, mixture_quantiles
from pyro_trees.estimators import (
    VaRTRegressor,
    _vart_calibration,
    _vart_fit,
    _vart_posterior,
    noise_factor_from_curve,
    noise_factor_from_scores,
    vart_memory,
)
from pyro_trees.estimators._rng import MEMBER_SEED
from pyro_trees.estimators._vart_calibration import _coverage_scores
from pyro_trees.estimators._vart_fit import clip_to_training_range
from pyro_trees.estimators._vart_posterior import hard_guide_draws
from pyro_trees.models import mixture_params, row_mixtures, stack_trees, with_bias

# the settings of the module's fitted estimators (fixtures ``fitted`` and ``stopped``)
SMALL = {"depth": 2, "num_steps": 150, "lr": 0.05, "num_samples": 50, "random_state": 0}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, size=(120, 3))
    y = np.where(X[:, 0] > 0, 2.0 + X[:, 1], -1.0) + 0.1 * rng.normal(size=120)
    return X, y


@pytest.fixture(scope="module")
def fitted(data):
    X, y = data
    return VaRTRegressor(**SMALL).fit(X, y)


@pytest.fixture(scope="module")
def stopped(data):
    """The same fit with ``refit=False``: the early-stopped guide is the model."""
    X, y = data
    return VaRTRegressor(**SMALL, refit=False).fit(X, y)


def test_fit_predict_interval_and_score(fitted, data):
    X, y = data
    pred = fitted.predict(X)
    assert pred.shape == (120,) and np.isfinite(pred).all()
    lo, hi = fitted.predict_interval(X, level=0.9)
    assert lo.shape == hi.shape == (120,)
    assert (lo <= hi).all()
    lo50, hi50 = fitted.predict_interval(X, level=0.5)
    assert ((hi50 - lo50) <= (hi - lo) + 1e-9).all()
    # the step function is learnt far better than the constant predictor
    assert fitted.score(X, y) > 0.8
    draws = fitted.sample(X[:7], num_samples=20)
    assert draws.shape == (20, 7)
    assert fitted.sample_function(X[:7]).shape == (50, 7)
    imp = fitted.feature_importances_
    assert imp.shape == (3,) and np.isclose(imp.sum(), 1.0) and imp.argmax() == 0


def test_predict_is_deterministic_batched_and_pickles_exactly(fitted, data, monkeypatch):
    X, _ = data
    pred = fitted.predict(X)
    assert np.array_equal(pred, fitted.predict(X))
    clone = pickle.loads(pickle.dumps(fitted))
    assert np.array_equal(clone.predict(X), pred)
    assert np.array_equal(clone.predict_interval(X)[0], fitted.predict_interval(X)[0])
    # tiny prediction batches: same trees, same numbers
    monkeypatch.setattr(_vart_posterior, "PREDICT_BYTES", 1)
    fitted._tree_samples = None
    assert np.allclose(fitted.predict(X[:12]), pred[:12], atol=1e-5)
    # one row at a time agrees with all rows at once
    assert np.allclose(fitted.predict(X[5:6]), pred[5:6], atol=1e-5)


def test_export_text_and_params(fitted):
    text = fitted.export_text(feature_names=["a", "b", "c"])
    assert "value:" in text and text.endswith("\n")
    assert text.splitlines()[0].startswith("|--- ")
    assert "a" in text.splitlines()[0]  # the root splits on the informative feature
    with pytest.raises(ValueError, match="feature_names"):
        fitted.export_text(feature_names=["a"])
    assert fitted.get_params()["depth"] == 2
    assert "depth=2" in repr(fitted)


def test_sample_importances_spread_feature_importances_over_the_posterior_trees(fitted, data):
    X, _ = data
    draws = fitted.sample_importances(X)
    assert draws.shape == (50, 3) and np.allclose(draws.sum(1), 1.0)
    assert (draws >= 0).all() and draws.std(0).max() > 0  # the trees differ
    mean = draws.mean(0)
    # y depends on x_0 (the step) and x_1 (a slope in one leaf), never on x_2
    assert mean.argmax() == fitted.feature_importances_.argmax() == 0
    assert mean[2] == mean.min()
    assert np.array_equal(fitted.sample_importances(X), draws)  # the predictions' trees


def test_minibatch_training_runs(data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=20, batch_size=16, num_samples=5, random_state=1)
    est.fit(X, y)
    assert est.fit_result_.num_steps == 20
    assert np.isfinite(est.predict(X)).all()


def test_bad_input(fitted, data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=1)
    with pytest.raises(ValueError, match="not fitted"):
        est.predict(X)
    yn = y.copy()
    yn[3] = np.nan  # missing inputs are routed (tests/estimators/test_missing.py), targets not
    with pytest.raises(ValueError, match="NaN"):
        est.fit(X, yn)
    Xi = X.copy()
    Xi[0, 0] = np.inf
    with pytest.raises(ValueError, match="infinity"):
        fitted.predict(Xi)
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        est.fit(X, y[:-1])
    with pytest.raises(ValueError, match="features"):
        fitted.predict(X[:, :2])
    with pytest.raises(ValueError, match="level"):
        fitted.predict_interval(X, level=1.0)
    with pytest.raises(ValueError, match="level"):
        fitted.predict_interval(X, level=0.0)
    with pytest.raises(ValueError, match=r"depth 60 .* would need about"):
        VaRTRegressor(depth=60).fit(X, y)
    with pytest.raises(ValueError, match="num_samples"):
        fitted.sample(X, num_samples=0)
    with pytest.raises(ValueError, match="num_samples"):
        fitted.sample_function(X, num_samples=51)


def test_early_stopping_and_noise_calibration(fitted, data):
    X, y = data
    # the fixture held out 12 of 120 rows: early stopping's best step is the refit's
    # length, the noise factor the conformal quantile of the held-out scores
    res = fitted.stopping_result_
    assert res.best_step is not None and res.best_step <= res.num_steps
    assert res.val_losses and res.best_val == min(v for _, v in res.val_losses)
    assert fitted.fit_result_.num_steps == max(res.best_step, 1)
    cal = fitted.noise_calibration_
    assert cal["rule"] == "coverage" and cal["level"] == 0.9 and cal["scores"].shape == (12,)
    scores = torch.as_tensor(cal["scores"])
    assert fitted.noise_factor_ == min(noise_factor_from_scores(scores, 0.9, None), 256.0)
    trees_ = fitted._posterior().samples
    with torch.random.fork_rng():
        fitted.noise_factor_, c = 1.0, fitted.noise_factor_
        fitted._tree_samples = None
        raw = fitted._posterior().samples
        fitted.noise_factor_ = c
        fitted._tree_samples = None
    for key in raw:  # calibration shifts every leaf's log noise scale by log c, nothing else
        shift = math.log(c) if key.startswith("log_sigma_") else 0.0
        assert torch.allclose(trees_[key], raw[key] + shift, atol=1e-6)
    # held-out targets far noisier than the training residuals need a large factor ...
    Xs = fitted._prepare(X[:60])
    mean = torch.as_tensor(fitted.y_scaler_.transform(fitted.predict(X[:60])))
    noisy = mean + 3.0 * torch.randn(60, generator=torch.Generator().manual_seed(0))
    c_fit = fitted.noise_factor_
    try:
        for rule in ("coverage", "likelihood"):
            fitted.calibrate = rule
            assert fitted._calibrate_noise([(Xs, noisy.float())]) > 5.0
        # ... and targets drawn from the calibrated predictive itself about the fitted
        # factor (the factor is relative to the uncalibrated noise)
        draws = fitted.sample(X[:60])  # (50, 60): one draw per posterior tree
        pick = np.random.default_rng(0).integers(0, 50, size=60)  # a random tree per row
        own = draws[pick, np.arange(60)]
        own = torch.as_tensor(fitted.y_scaler_.transform(own))
        for rule in ("coverage", "likelihood"):
            fitted.calibrate = rule
            assert 1 / 1.5 < fitted._calibrate_noise([(Xs, own.float())]) / c_fit < 1.5
    finally:
        fitted.calibrate = "coverage"
        fitted._calibrate_noise([_held_out(fitted, data)])  # restore noise_calibration_
    assert fitted.noise_factor_ == c_fit
    assert np.array_equal(fitted.noise_calibration_["scores"], cal["scores"])


def _raw_tree(est) -> dict:
    """Every node of the estimator's posterior trees (not only their leaves), with the
    factor-1 noise: the full mixtures the estimator's leaf-node computations must equal."""
    tree = stack_trees(est._posterior().samples, est.guide_.depth)
    shift = math.log(est.noise_factor_)
    return dict(tree, log_sigma=tree["log_sigma"] - shift) if shift else tree


def _held_out(est, data):
    """The estimator's held-out rows, standardised, as ``fit`` drew them."""
    X, y = data
    n_val = max(round(0.1 * len(y)), min(10, len(y) // 5))
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(est._seed()))[:n_val]
    Xs = torch.as_tensor(est.x_scaler_.transform(X[idx.numpy()]), dtype=torch.float32)
    ys = torch.as_tensor(est.y_scaler_.transform(y[idx.numpy()]), dtype=torch.float32)
    return Xs, ys


def test_coverage_calibration_covers_the_held_out_rows_at_the_level(fitted, stopped, data):
    X, y = data
    Xs, ys = _held_out(fitted, data)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:12].numpy()
    scores = fitted.coverage_scores(X[idx], y[idx])
    # the stored scores are the held-out rows' (float32 vs float64 residuals aside)
    np.testing.assert_allclose(scores, fitted.noise_calibration_["scores"], rtol=1e-4)
    c, covered = fitted.noise_factor_, int((scores <= fitted.noise_factor_).sum())
    # 12 rows at 0.9: position 11.7, between the 11th and 12th score (log-linear), above
    # or below one alike (the refit's held-out rows chose nothing but its length)
    srt = np.sort(scores)
    assert c == pytest.approx(min(srt[10] ** 0.3 * srt[11] ** 0.7, 256.0), rel=1e-5)
    assert covered == 11 or srt[10] == srt[11]
    # the early-stopped model (refit=False) shrinks below one only to the one-sided 95 %
    # bound of the quantile, which 12 rows cannot give (it needs 29)
    s_srt = np.sort(stopped.noise_calibration_["scores"])
    if s_srt[10] ** 0.3 * s_srt[11] ** 0.7 >= 1.0:
        assert stopped.noise_factor_ == pytest.approx(s_srt[10] ** 0.3 * s_srt[11] ** 0.7)
    else:
        assert stopped.noise_factor_ == 1.0
    # a row is inside the exact central 90 % interval iff its score is at most c:
    # check on the calibrated mixture with the factor just above / below each score
    tree = _raw_tree(fitted)
    logits, loc, scale = mixture_params(tree, with_bias(Xs))
    w = logits.double().softmax(-1) / logits.shape[0]
    z = (ys.double().unsqueeze(-1) - loc.double()) / scale.double()
    for j in np.flatnonzero(scores > 2.0**-6):
        for f, inside in ((1.001, True), (0.999, False)):
            cdf = float((w[:, j] * torch.special.ndtr(z[:, j] / (scores[j] * f))).sum())
            assert (0.05 <= cdf <= 0.95) == inside
    # the likelihood rule is still available, and no calibration gives factor 1
    est = VaRTRegressor(
        depth=2, num_steps=30, num_samples=20, calibrate="likelihood", random_state=0
    ).fit(X, y)
    cal = est.noise_calibration_
    assert cal["rule"] == "likelihood"
    assert est.noise_factor_ == noise_factor_from_curve(
        torch.as_tensor(cal["grid"]), torch.as_tensor(cal["log_density"])
    )
    for off in (None, False):
        est = VaRTRegressor(depth=2, num_steps=5, num_samples=4, calibrate=off).fit(X, y)
        assert est.noise_factor_ == 1.0 and not hasattr(est, "noise_calibration_")


def test_coverage_rule_falls_back_to_the_likelihood_with_few_held_out_rows(data):
    X, y = data
    # 40 rows: 8 held out, fewer than the 9 a 0.9 conformal quantile needs
    est = VaRTRegressor(depth=2, num_steps=20, num_samples=10, random_state=0).fit(X[:40], y[:40])
    cal = est.noise_calibration_
    assert cal["scores"].shape == (8,) and cal["rule"] == "likelihood"
    assert est.noise_factor_ == noise_factor_from_curve(
        torch.as_tensor(cal["grid"]), torch.as_tensor(cal["log_density"])
    )
    # a lower level needs fewer rows: 0.8 * 9 = 7.2 <= 8
    est = VaRTRegressor(
        depth=2, num_steps=20, num_samples=10, calibration_level=0.8, random_state=0
    ).fit(X[:40], y[:40])
    assert est.noise_calibration_["rule"] == "coverage"


def test_noise_factor_from_scores_exact_order_statistics():
    # 19 scores at 0.9: position 18 exactly, the 18th smallest; 18 of 19 rows covered
    s = torch.linspace(1.0, 3.0, 19)[torch.randperm(19, generator=torch.Generator().manual_seed(1))]
    c = noise_factor_from_scores(s, 0.9)
    assert c == pytest.approx(1.0 + 2.0 * 17 / 18) and int((s <= c + 1e-6).sum()) == 18
    # 10 scores: position 9.9, log-linear between the 9th and the 10th
    s = torch.tensor([2.0**k for k in range(1, 11)], dtype=torch.float64)
    assert noise_factor_from_scores(s, 0.9) == pytest.approx(2.0**9.9)
    assert noise_factor_from_scores(s, 0.5) == pytest.approx(2.0**5.5)
    assert noise_factor_from_scores(s[:8], 0.9) is None  # 8 < 0.9 / 0.1 rows
    assert noise_factor_from_scores(torch.tensor([1.0, math.inf] * 10), 0.9) == math.inf
    # position on an order statistic with an uncovered (inf) row above it: that order
    # statistic, and inf when it is the uncovered row itself (0 * log(inf) = nan used to
    # make both fall through to the shrink branch, which returned 1: no widening)
    s = torch.cat([torch.linspace(1.0, 3.0, 18), torch.tensor([math.inf])])
    assert noise_factor_from_scores(s, 0.9) == pytest.approx(3.0)
    assert noise_factor_from_scores(torch.tensor([1.0] * 8 + [math.inf]), 0.9) == math.inf
    # below one: shrink only to the 95 % upper bound s_(u) of the quantile, with u the
    # least index with P(Bin(n, 0.9) <= u - 1) >= 0.95 (none below 29 rows: c = 1)
    small = torch.linspace(0.1, 0.5, 28, dtype=torch.float64)
    assert noise_factor_from_scores(small, 0.9) == 1.0
    # confidence=None: the point estimate, position 0.9 * 29 = 26.1, log-linear
    free = math.exp(0.9 * math.log(float(small[25])) + 0.1 * math.log(float(small[26])))
    assert noise_factor_from_scores(small, 0.9, confidence=None) == pytest.approx(free)
    for n in (29, 100, 400):
        s = torch.linspace(0.1, 0.5, n, dtype=torch.float64)
        cdf = np.cumsum([math.comb(n, k) * 0.9**k * 0.1 ** (n - k) for k in range(n + 1)])
        u = int(np.argmax(cdf >= 0.95)) + 1
        assert u <= n
        assert noise_factor_from_scores(s, 0.9) == pytest.approx(float(s[u - 1]))
        assert float(s[u - 1]) > float(s[math.floor(0.9 * (n + 1)) - 1])


def test_conformal_factor_covers_new_exchangeable_rows_at_the_level():
    # scores of held-out and new rows from one distribution (all >= 1, no shrinking):
    # the chance that a new row is covered, averaged over draws, is about the level
    gen = torch.Generator().manual_seed(0)
    for n in (10, 15, 40):
        scores = 1.0 + torch.rand(4000, n, generator=gen, dtype=torch.float64)  # U(1, 2)
        cover = [noise_factor_from_scores(row, 0.9) - 1.0 for row in scores]  # P(new <= c)
        assert np.mean(cover) == pytest.approx(0.9, abs=0.01)


def test_coverage_scores_of_a_single_gaussian_are_exact():
    # one component: inside the central 90 % interval iff |z| / c <= z_0.95
    z = torch.tensor([0.0, 0.01, 0.5, -1.0, 3.0, -40.0, 1e4], dtype=torch.float64)
    scores = _coverage_scores(torch.ones(1, 7, 1, dtype=torch.float64), z.view(1, 7, 1), 0.9)
    q = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.95)))
    expect = (z.abs() / q).clamp_min(2.0**-6)
    expect[-1] = math.inf  # not covered at the largest factor, 2**8
    torch.testing.assert_close(scores, expect, rtol=1e-6, atol=0.0)
    # two equal-weight components at z = -2 and +2 around the target: covered for any c
    w = torch.full((1, 1, 2), 0.5, dtype=torch.float64)
    assert float(_coverage_scores(w, torch.tensor([[[-2.0, 2.0]]]), 0.9)) == 2.0**-6


def test_without_validation_every_row_trains(data):
    X, y = data
    est = VaRTRegressor(
        depth=2, num_steps=15, num_samples=4, validation_fraction=0.0, init="random"
    ).fit(X, y)
    assert est.fit_result_.num_steps == 15 and est.fit_result_.best_step is None
    assert est.noise_factor_ == 1.0
    for bad in ("conformal", 1, "Coverage"):
        with pytest.raises(ValueError, match="calibrate"):
            VaRTRegressor(calibrate=bad).fit(X, y)
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="calibration_level"):
            VaRTRegressor(calibration_level=bad).fit(X, y)
    est.set_params(calibrate="likelihood", calibration_level=0.8)
    assert est.get_params()["calibrate"] == "likelihood"
    assert est.get_params()["calibration_level"] == 0.8
    assert "calibration_level=0.8" in repr(est)
    with pytest.raises(ValueError, match="validation_fraction"):
        VaRTRegressor(validation_fraction=1.0).fit(X, y)
    with pytest.raises(ValueError, match="init"):
        VaRTRegressor(init="kmeans").fit(X, y)
    with pytest.raises(ValueError, match="eval_every"):
        VaRTRegressor(eval_every=0).fit(X, y)


@pytest.mark.cuda
def test_cuda_estimator(data):
    X, y = data
    est = VaRTRegressor(depth=2, num_steps=5, num_samples=4, device="cuda", random_state=0)
    est.fit(X, y)
    assert est.predict(X).shape == (120,)
    assert est.predict_interval(X)[0].shape == (120,)


def test_noise_factor_rule_widens_freely_and_shrinks_only_when_certain():
    grid = torch.logspace(-1, 1, 41, dtype=torch.float64)
    c = grid.log()

    # a Gaussian-scale log likelihood of n rows peaked at c0: n * (-log c - c0^2 / (2 c^2))
    def curve(n, c0):
        return n * (-c - c0**2 / (2 * grid**2))

    assert noise_factor_from_curve(grid, curve(10, 2.0)) == pytest.approx(2.0, rel=0.06)
    # few rows preferring a smaller noise: the upper bound exceeds one, keep the fitted noise
    assert noise_factor_from_curve(grid, curve(5, 0.7)) == 1.0
    # many rows: shrink, but only to the upper end of the profile interval (above c0)
    many = noise_factor_from_curve(grid, curve(500, 0.5))
    assert 0.5 < many < 0.6


def test_inputs_far_beyond_the_training_range_are_clipped(fitted, data):
    X, _ = data
    train = torch.randperm(120, generator=torch.Generator().manual_seed(0))[12:].numpy()
    lo, hi = X[train, 1].min(), X[train, 1].max()  # the training rows' range
    far = X[:5].copy()
    far[:, 1] = 1e6  # a data-entry outlier, far beyond the training range of feature 1
    edge = far.copy()
    edge[:, 1] = hi + 0.5 * (hi - lo)  # the default margin: half the range
    np.testing.assert_allclose(fitted.predict(far), fitted.predict(edge), rtol=1e-5)
    mild = far.copy()
    mild[:, 1] = hi + 0.1 * (hi - lo)  # inside the margin: extrapolated, not clipped
    assert not np.allclose(fitted.predict(mild), fitted.predict(far))
    fitted.clip_margin = 0.0
    try:
        edge[:, 1] = hi
        np.testing.assert_allclose(fitted.predict(far), fitted.predict(edge), rtol=1e-5)
        fitted.clip_margin = None
        assert np.abs(fitted.predict(far)).max() > 1e3  # linear leaves extrapolate
    finally:
        fitted.clip_margin = 0.5
    with pytest.raises(ValueError, match="clip_margin"):
        VaRTRegressor(depth=2, num_steps=1, clip_margin=-1.0).fit(X, data[1])


def test_held_out_rows_are_clipped_like_new_rows(data):
    X, y = data
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(0)).numpy()
    held, train = perm[:12], perm[12:]
    X2 = X.copy()
    X2[held[0], 0] = 1e4  # a held-out row far out in feature 0
    kw = dict(depth=2, num_steps=60, lr=0.05, num_samples=20, random_state=0)
    est = VaRTRegressor(**kw).fit(X2, y)
    # the clipping range is the training rows' alone
    Xs = torch.as_tensor(est.x_scaler_.transform(X2[train]), dtype=torch.float32)
    torch.testing.assert_close(est.x_max_, Xs.max(0).values)
    torch.testing.assert_close(est.x_min_, Xs.min(0).values)
    # early stopping and calibration saw the outlier clipped, as predict sees a new row:
    # the stored held-out scores are coverage_scores' (which clip) on the raw rows, and
    # the fit is the one with that input already at the clipping edge
    np.testing.assert_allclose(
        est.noise_calibration_["scores"], est.coverage_scores(X2[held], y[held]), rtol=1e-5
    )


def test_exact_interval_is_the_mixture_quantile_and_matches_the_scores(fitted, data):
    X, y = data
    lo, hi = fitted.predict_interval(X, 0.9)
    assert lo.shape == hi.shape == (120,) and (lo < hi).all()
    # the predictive CDF at the bounds is 0.05 and 0.95
    tree = _raw_tree(fitted)
    logits, loc, scale = mixture_params(tree, with_bias(fitted._prepare(X)))
    w = logits.double().softmax(-1) / logits.shape[0]
    c = fitted.noise_factor_
    for bound, p in ((lo, 0.05), (hi, 0.95)):
        q = torch.as_tensor(fitted.y_scaler_.transform(bound))
        z = (q.unsqueeze(-1) - loc.double()) / (c * scale.double())
        cdf = (w * torch.special.ndtr(z)).sum((0, -1))
        # (the estimator scales the noise in float32: log sigma - log c)
        torch.testing.assert_close(cdf, torch.full_like(cdf, p), atol=1e-6, rtol=0)
    # inside iff the row's coverage score is at most the noise factor (here everywhere)
    inside = (y >= lo) & (y <= hi)
    assert np.array_equal(inside, fitted.coverage_scores(X, y) <= c)
    # the Monte Carlo interval estimates the same bounds (50 draws per row)
    lo_d, hi_d = fitted.predict_interval(X, 0.9, method="draws")
    width = float(np.mean(hi - lo))
    assert abs(float(np.mean(hi_d - lo_d)) - width) < 0.1 * width
    assert np.array_equal(pickle.loads(pickle.dumps(fitted)).predict_interval(X)[0], lo)
    with pytest.raises(ValueError, match="method"):
        fitted.predict_interval(X, method="mc")


def test_compact_rows_keep_the_quantiles_and_scores():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(6, 5, 7, generator=gen, dtype=torch.float64) ** 30  # a few heavy ones
    w[:, :, 3] = 0.0  # absent nodes
    w = w / w.sum((0, -1), keepdim=True)
    loc = torch.randn(6, 5, 7, generator=gen, dtype=torch.float64)
    scale = 0.1 + torch.rand(6, 5, 7, generator=gen, dtype=torch.float64)
    cw, cloc, cscale = (
        t.unsqueeze(0) for t in mixture_quantiles.compact_mixture_rows(w, loc, scale)
    )
    assert cw.shape[0] == 1 and cw.shape[1] == 5 and cw.shape[2] < 6 * 7
    assert ((1.0 - cw.sum((0, -1))).abs() <= 1e-12).all()
    probs = (0.05, 0.95)
    torch.testing.assert_close(
        gaussian_mixture_quantiles(cw, cloc, cscale, probs, dim=(0, -1)),
        gaussian_mixture_quantiles(w, loc, scale, probs, dim=(0, -1)),
        atol=1e-9,
        rtol=0,
    )
    z = (0.3 - loc) / scale
    cz = mixture_quantiles.compact_mixture_rows(w, z)[1].unsqueeze(0)
    torch.testing.assert_close(
        _coverage_scores(cw, cz, 0.9), _coverage_scores(w, z, 0.9), rtol=1e-7, atol=0
    )


def test_unseeded_fits_draw_their_seed_from_the_global_torch_stream(data):
    X, y = data
    kw = {"depth": 2, "num_steps": 20, "num_samples": 10}

    def unseeded(global_seed):
        pyro.set_rng_seed(global_seed)
        return VaRTRegressor(**kw).fit(X, y)

    a, b, c = unseeded(1), unseeded(2), unseeded(1)
    assert a.seed_ != b.seed_ and a.seed_ == c.seed_
    pa = a.predict(X)
    assert not np.allclose(pa, b.predict(X))
    assert np.array_equal(pa, c.predict(X))
    # the fitted estimator's predictions do not depend on the global state ...
    pyro.set_rng_seed(5)
    a._tree_samples = None
    assert np.array_equal(a.predict(X), pa)
    # ... survive pickling, and random_state=seed_ repeats the fit
    assert np.array_equal(pickle.loads(pickle.dumps(a)).predict(X), pa)
    again = VaRTRegressor(**kw, random_state=a.seed_).fit(X, y)
    assert np.array_equal(again.predict(X), pa)
    seeded = VaRTRegressor(**kw, random_state=7).fit(X, y)
    assert seeded.seed_ == 7


def test_estimators_pickled_without_seed_keep_the_old_seed_rule(fitted, data):
    X, _ = data
    old = pickle.loads(pickle.dumps(fitted))
    del old.seed_  # as pickled before seed_ existed: random_state=0 was the seed
    assert np.array_equal(old.predict(X), fitted.predict(X))
    old.random_state, old._tree_samples = None, None  # None meant seed 0
    assert np.array_equal(old.predict(X), fitted.predict(X))
    old.random_state, old._tree_samples = 1, None
    assert not np.array_equal(old.predict(X), fitted.predict(X))


def test_estimators_pickled_before_newer_parameters_keep_their_behaviour(stopped, data):
    X, y = data
    state = pickle.loads(pickle.dumps(stopped)).__getstate__()
    # as pickled before they existed
    names = ("refit", "min_calibration_rows", "num_fits", "guides_", "fit_results_")
    for name in (*names, "stopping_results_"):
        del state[name]
    old = VaRTRegressor.__new__(VaRTRegressor)
    old.__setstate__(state)
    assert old.refit is False and old.min_calibration_rows is None and old.num_fits == 1
    assert old.stopping_results_ == []
    assert old.get_params()["refit"] is False
    np.testing.assert_array_equal(old.predict(X), stopped.predict(X))
    old.set_params(num_steps=20, num_samples=10).fit(X, y)  # refits as it was fitted
    assert old.stopping_result_ is None


def test_sample_beyond_the_trees_follows_the_interval_mixture(fitted, data):
    X, _ = data
    rows = X[:5]
    base = fitted.sample(rows)  # (50, 5): one draw per posterior tree
    many = fitted.sample(rows, num_samples=4000)
    assert many.shape == (4000, 5) and np.isfinite(many).all()
    assert np.array_equal(many[:50], base)  # the first round is the default draw
    assert np.array_equal(fitted.sample(rows, num_samples=20), base[:20])
    assert not np.allclose(many[50:100], base)  # later rounds draw afresh
    assert np.array_equal(pickle.loads(pickle.dumps(fitted)).sample(rows, 120), many[:120])
    # every draw follows the mixture over the 50 trees that predict_interval inverts:
    # 4000 draws per row fall inside its exact 80 % interval 80 +- 2 (3 sd) % of the time
    lo, hi = fitted.predict_interval(rows, level=0.8)
    inside = ((many >= lo) & (many <= hi)).mean(0)
    assert np.abs(inside - 0.8).max() < 0.02, inside


def test_depth_memory_checks_count_parameters_and_prediction(fitted, data, monkeypatch):
    from pyro_trees import trees

    X, y = data
    budget = 250 * 2**20
    monkeypatch.setattr(trees, "_available_memory_bytes", lambda device: budget)
    # 2048 rows of 34 weights at depth 10 train in 196 MiB, but 200 posterior trees
    # need about 350 MiB: refused before any training
    Xw = np.random.default_rng(0).normal(size=(2048, 33))
    with pytest.raises(ValueError, match=r"depth 10 .* num_samples=200 .* would need about"):
        VaRTRegressor(depth=10, num_steps=1, validation_fraction=0, num_samples=200).fit(
            Xw, Xw[:, 0]
        )
    # few rows, many inputs: the guide's parameters, gradients and Adam moments count
    Xl = np.random.default_rng(0).normal(size=(8, 5000))
    with pytest.raises(ValueError, match=r"depth 10 .* training on 8 rows .* would need about"):
        VaRTRegressor(depth=10, num_steps=1, validation_fraction=0).fit(Xl, Xl[:, 0])
    # and at prediction time, with the estimator's num_samples then
    clone = pickle.loads(pickle.dumps(fitted))
    clone.set_params(num_samples=10**6)
    with pytest.raises(ValueError, match=r"num_samples=1,000,000 .* would need about"):
        clone.predict(X)
    # every depth of the UCI benchmarks (3 to 10, up to 33 inputs, 200 trees) fits 1 GiB
    budget = 2**30
    for depth in (3, 5, 7, 10):
        vart_memory.check_training_memory(depth, 2048, 33, None)
        vart_memory.check_prediction_memory(depth, 200, 33, None)


def test_cross_fitted_calibration_pools_disjoint_folds(stopped, data):
    X, y = data  # 120 rows, 12 held out
    fitted = stopped  # refit=False: each fold's scores come from its early-stopped fit
    est = VaRTRegressor(**SMALL, min_calibration_rows=30, refit=False).fit(X, y)
    # the main fit is the fit without cross-fitting, to the last digit
    np.testing.assert_array_equal(est.predict(X), fitted.predict(X))
    cal = est.noise_calibration_
    np.testing.assert_array_equal(cal["scores"], fitted.noise_calibration_["scores"])
    # ceil(30 / 12) = 3 folds of 12 rows: two extra fits
    assert [len(f) for f in cal["fold_scores"]] == [12, 12]
    assert fitted.noise_calibration_["fold_scores"] == []
    pooled = torch.as_tensor(np.concatenate([cal["scores"], *cal["fold_scores"]]))
    assert est.noise_factor_ == min(noise_factor_from_scores(pooled, 0.9), 256.0)
    # fold k: rows perm[12 k : 12 (k + 1)] of the main fit's permutation, scored by a fit
    # seeded seed_ + k that holds them out
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(0))
    Xt = torch.as_tensor(est.x_scaler_.transform(X), dtype=torch.float32)  # standardised
    yt = torch.as_tensor(est.y_scaler_.transform(y), dtype=torch.float32)
    for k in (1, 2):
        rows, rest = perm[12 * k : 12 * (k + 1)], torch.cat([perm[: 12 * k], perm[12 * (k + 1) :]])
        other = VaRTRegressor(**{**SMALL, "random_state": k})
        other.seed_ = k
        est._share_inputs(other)
        other._fit_split(Xt, yt, rows, rest, torch.Generator().manual_seed(k))
        other.noise_factor_, other._tree_samples = 1.0, None
        scores = other.coverage_scores(X[rows.numpy()], y[rows.numpy()])
        np.testing.assert_allclose(cal["fold_scores"][k - 1], scores, rtol=1e-6)
    # the interval at the pooled factor: a test row is inside iff its score <= the factor
    lo, hi = est.predict_interval(X[:20], level=0.9)
    inside = (y[:20] >= lo) & (y[:20] <= hi)
    np.testing.assert_array_equal(inside, est.coverage_scores(X[:20], y[:20]) <= est.noise_factor_)


def test_cross_fitting_fold_count_and_bad_values(data):
    X, y = data
    # 50 rows, 10 held out: at most 50 // 10 = 5 folds however many rows are asked for
    est = VaRTRegressor(
        depth=2, num_steps=10, num_samples=8, random_state=1, min_calibration_rows=10**6
    ).fit(X[:50], y[:50])
    assert [len(f) for f in est.noise_calibration_["fold_scores"]] == [10] * 4
    # enough rows already: no extra fit; the likelihood rule never cross-fits
    for kwargs in ({"min_calibration_rows": 10}, {"calibrate": "likelihood"}):
        est = VaRTRegressor(
            depth=2,
            num_steps=10,
            num_samples=8,
            random_state=1,
            **{"min_calibration_rows": 40, **kwargs},
        ).fit(X[:50], y[:50])
        assert est.noise_calibration_["fold_scores"] == []
    assert est.get_params()["min_calibration_rows"] == 40
    for bad in (0, -3, 2.5, True, "100"):
        with pytest.raises(ValueError, match="min_calibration_rows"):
            VaRTRegressor(num_steps=5, min_calibration_rows=bad).fit(X, y)


def _replay(est, X, y, params: dict, seed: int):
    """What replays one of ``est``'s fits by hand: its permutation of the rows (seeded
    ``seed``, as ``fit`` draws it), the standardised data, and a fresh estimator of
    ``params`` with ``seed_ = seed`` sharing ``est``'s scalers."""
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    Xt = torch.as_tensor(est.x_scaler_.transform(X), dtype=torch.float32)  # standardised
    yt = torch.as_tensor(est.y_scaler_.transform(y), dtype=torch.float32)
    other = VaRTRegressor(**params)
    other.seed_ = seed
    est._share_inputs(other)
    return perm, Xt, yt, other


def test_refit_trains_a_fresh_guide_for_the_stopping_step_and_calibrates_freely(
    fitted, stopped, data
):
    X, y = data  # 120 rows, 12 held out
    est = fitted  # refit=True, the default
    assert est.get_params()["refit"] is True
    stop, ref = est.stopping_result_, est.fit_result_
    # early stopping is refit=False's fit, step for step
    assert stop.best_step == stopped.fit_result_.best_step
    assert stop.val_losses == stopped.fit_result_.val_losses
    assert stopped.stopping_result_ is None
    # the model: a fresh guide trained that many steps, without validation
    steps = max(stop.best_step, 1)
    assert ref.num_steps == steps and ref.best_step is None and not ref.val_losses
    assert not np.allclose(est.predict(X), stopped.predict(X))
    perm, Xt, yt, other = _replay(est, X, y, SMALL, 0)
    seed = _vart_fit._REFIT_SEED
    other._fit_split(
        Xt,
        yt,
        perm[:12],
        perm[12:],
        torch.Generator().manual_seed(seed),
        seed=seed,
        num_steps=steps,
    )
    other.noise_factor_, other._tree_samples = 1.0, None
    np.testing.assert_allclose(est.predict(X), other.predict(X), rtol=1e-6, atol=1e-7)
    # the held-out rows, which chose no parameter of the refit, set the factor by the
    # conformal quantile without the shrinking bound
    cal = est.noise_calibration_
    assert cal["confidence"] is None and stopped.noise_calibration_["confidence"] == 0.95
    idx = perm[:12].numpy()
    np.testing.assert_allclose(cal["scores"], other.coverage_scores(X[idx], y[idx]), rtol=1e-6)
    scores = torch.as_tensor(cal["scores"])
    assert est.noise_factor_ == min(noise_factor_from_scores(scores, 0.9, None), 256.0)
    # pickling reproduces it; bad values are refused
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(again.predict_interval(X[:9]), est.predict_interval(X[:9]))
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="refit"):
            VaRTRegressor(num_steps=5, refit=bad).fit(X, y)


def test_refit_with_cross_fitting_refits_every_fold(data):
    X, y = data
    kw = dict(depth=2, num_steps=40, num_samples=8, random_state=3, min_calibration_rows=20)
    est = VaRTRegressor(**kw).fit(X[:60], y[:60])
    plain = VaRTRegressor(**kw, refit=False).fit(X[:60], y[:60])
    (fold,) = est.noise_calibration_["fold_scores"]  # 10 held-out rows: one extra fold
    (plain_fold,) = plain.noise_calibration_["fold_scores"]
    assert fold.shape == plain_fold.shape == (10,)
    assert not np.allclose(fold, plain_fold)  # the fold's scores come from its own refit
    pooled = torch.as_tensor(np.concatenate([est.noise_calibration_["scores"], fold]))
    assert est.noise_factor_ == min(noise_factor_from_scores(pooled, 0.9, None), 256.0)


def test_fast_prediction_matches_the_full_mixture(fitted, data):
    """predict / sample_function and the exact interval, computed on the trees' leaf nodes
    with the per-row solver, equal the full mixtures of every node (Predictive's ``mean``
    site, and gaussian_mixture_quantiles on all components)."""
    X, _ = data
    Xs = fitted._prepare(X)
    ym, ys = float(fitted.y_scaler_.mean), float(fitted.y_scaler_.scale)
    tree = stack_trees(fitted._posterior().samples, fitted.guide_.depth)
    logits, loc, scale = mixture_params(tree, with_bias(Xs))
    w = logits.double().softmax(-1) / logits.shape[0]
    q = gaussian_mixture_quantiles(w, loc.double(), scale.double(), (0.05, 0.95), dim=(0, -1))
    q = (q * ys + ym).numpy()
    lo, hi = fitted.predict_interval(X, 0.9)
    np.testing.assert_allclose(lo, q[0], rtol=0, atol=1e-7 * float(ys))
    np.testing.assert_allclose(hi, q[1], rtol=0, atol=1e-7 * float(ys))
    mean = fitted._posterior().predictive(Xs, ("mean",), fitted.seed_ + 2)["mean"]
    mean = fitted._outputs(mean)
    np.testing.assert_allclose(fitted.sample_function(X), mean, rtol=0, atol=1e-5 * float(ys))


def test_compact_scores_match_the_coverage_scores():
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(9, 40, 6, generator=gen, dtype=torch.float64) ** 8  # uneven weights
    w[:, :, 2] = 0.0  # a node that is no leaf
    w = w / w.sum((0, -1), keepdim=True)
    loc = 3 * torch.randn(9, 40, 6, generator=gen, dtype=torch.float64)  # multimodal
    scale = 0.01 + torch.rand(9, 40, 6, generator=gen, dtype=torch.float64)
    z = (0.3 - loc) / scale
    torch.testing.assert_close(
        _vart_calibration._compact_scores(w, z, 0.9), _coverage_scores(w, z, 0.9), rtol=1e-7, atol=0
    )


def _same_params(a, b) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_n_fits_each_fit_holds_out_its_own_fold(data):
    X, y = data  # 120 rows, 12 held out: ten folds
    kw = dict(depth=2, num_steps=60, lr=0.05, num_samples=7, random_state=4)
    one = VaRTRegressor(**kw).fit(X, y)
    est = VaRTRegressor(**kw, num_fits=2).fit(X, y)
    assert len(est.guides_) == len(est.fit_results_) == len(est.stopping_results_) == 2
    assert est.guide_ is est.guides_[0] and est.stopping_result_ is est.stopping_results_[0]
    # the first fit is num_fits=1's: held-out fold 0, stopped, refitted
    assert est.stopping_result_.val_losses == one.stopping_result_.val_losses
    assert _same_params(est.guides_[0], one.guide_)
    # the second holds out fold 1, seeded seed_ + MEMBER_SEED, and is refitted too
    perm, Xt, yt, other = _replay(est, X, y, kw, 4)
    seed = 4 + MEMBER_SEED
    rest = torch.cat([perm[:12], perm[24:]])
    other._fit_split(Xt, yt, perm[12:24], rest, torch.Generator().manual_seed(seed), seed=seed)
    assert est.stopping_results_[1].val_losses == other.fit_result_.val_losses
    for stop, res in zip(est.stopping_results_, est.fit_results_, strict=True):
        assert res.num_steps == max(stop.best_step, 1) and not res.val_losses
    assert not _same_params(est.guides_[0], est.guides_[1])
    # between them the fits learned from every row: the clipping range is all rows'
    torch.testing.assert_close(est.x_min_, Xt.min(0).values)
    torch.testing.assert_close(est.x_max_, Xt.max(0).values)
    # the 7 posterior trees: 4 from the first fit (num_fits=1's seed), 3 from the second
    dummy = torch.zeros(1, 3)
    first = hard_guide_draws(est.guides_[0], 4, dummy, est.seed_ + 1)
    second = hard_guide_draws(est.guides_[1], 3, dummy, est.seed_ + 1 + MEMBER_SEED)
    draws = est._posterior().samples
    for key, value in draws.items():
        shifted = torch.cat([first[key], second[key]])
        if key.startswith("log_sigma"):
            shifted = shifted + math.log(est.noise_factor_)
        torch.testing.assert_close(value, shifted, rtol=0, atol=1e-6)
    # fold j is scored under fit j's 7 trees moved by each fit's offset from their mean
    scores = est.noise_calibration_["scores"]
    assert scores.shape == (24,)
    fits = [
        est._posterior().stack(hard_guide_draws(g, 7, dummy, est.seed_ + 1 + j * MEMBER_SEED))
        for j, g in enumerate(est.guides_)
    ]
    for j, rows in enumerate([perm[:12], perm[12:24]]):
        xj, yj = clip_to_training_range(est, Xt[rows]), yt[rows].double()
        mix = [row_mixtures(f, xj) for f in fits]  # (7, 12, M) each
        means = torch.stack([(lw.exp() * loc).sum(-1).mean(0) for lw, loc, _ in mix])

        def cdf(c, mix=mix, means=means, j=j, yj=yj):  # the pool's shape about fit j
            lw, loc, scale = mix[j]
            out = 0.0
            for d in means - means.mean(0):
                z = (yj - d).unsqueeze(-1) - loc
                out = out + (lw.exp() * torch.special.ndtr(z / (c * scale))).sum(-1).mean(0) / 2
            return out

        s = torch.as_tensor(scores[12 * j : 12 * (j + 1)]).unsqueeze(-1)
        inside = [((cdf(s * f) >= 0.05) & (cdf(s * f) <= 0.95)) for f in (0.999, 1.001)]
        floor = s.squeeze(-1) <= 2.0**-6  # covered from the grid's smallest factor on
        assert (inside[1] | floor).all()
        assert (~inside[0] | floor).all()
        assert not floor.all()
    # with one fit the scores are num_fits=1's coverage scores (fold 0 under its trees)
    np.testing.assert_allclose(
        one.noise_calibration_["scores"],
        one.coverage_scores(X[perm[:12].numpy()], y[perm[:12].numpy()]),
        rtol=1e-5,
    )
    pooled = torch.as_tensor(scores)
    assert est.noise_factor_ == min(noise_factor_from_scores(pooled, 0.9, None), 256.0)
    assert not np.allclose(est.predict(X), one.predict(X))
    again = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(again.predict_interval(X[:9]), est.predict_interval(X[:9]))


def test_n_fits_folds_wrap_around_and_cross_fitting_adds_the_folds_after_them(data):
    X, y = data
    kw = dict(depth=2, num_steps=10, num_samples=12, random_state=6)
    # 20 rows, 4 held out: five folds; the sixth fit holds out fold 0 again
    est = VaRTRegressor(**kw, num_fits=6, refit=False).fit(X[:20], y[:20])
    assert est.stopping_results_ == [] and est.stopping_result_ is None
    assert est.noise_calibration_["scores"].shape == (24,)
    assert est.noise_calibration_["confidence"] is None  # a pool shrinks on the quantile
    # 12 held-out rows a fold; 36 rows asked: folds 0 and 1 are the fits', fold 2 extra
    est = VaRTRegressor(**kw, num_fits=2, min_calibration_rows=36).fit(X, y)
    assert [len(f) for f in est.noise_calibration_["fold_scores"]] == [12]
    assert est.noise_calibration_["scores"].shape == (24,)


def test_n_fits_without_held_out_rows_trains_each_fit_fully_and_rejects_bad_values(data):
    X, y = data
    kw = dict(depth=2, num_steps=20, num_samples=6, random_state=5, validation_fraction=0)
    est = VaRTRegressor(**kw, num_fits=3).fit(X, y)
    assert est.stopping_result_ is None
    assert [r.num_steps for r in est.fit_results_] == [20, 20, 20]
    assert _same_params(est.guide_, VaRTRegressor(**kw).fit(X, y).guide_)
    assert est._posterior().samples["log_sigma_2"].shape[0] == 6
    assert est.feature_importances_.shape == (3,)
    for bad in (0, 2.5, True, 7):  # 7 > num_samples: a fit without a posterior tree
        with pytest.raises(ValueError, match="num_fits"):
            VaRTRegressor(**dict(kw, num_fits=bad)).fit(X, y)


def test_progress_bars_name_each_of_several_fits(monkeypatch):
    import tqdm.auto

    labels = []

    class Bar:
        def __init__(self, *args, desc=None, **kwargs):
            labels.append(desc)

        def __getattr__(self, name):  # update, set_postfix, close, ...
            return lambda *args, **kwargs: None

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    X = np.random.default_rng(0).normal(size=(40, 2))
    VaRTRegressor(num_steps=3, num_fits=2, num_samples=4, progress=True, random_state=0).fit(
        X, X[:, 0]
    )
    assert labels == ["VaRT fit 1/2", "VaRT fit 1/2 refit", "VaRT fit 2/2", "VaRT fit 2/2 refit"]
