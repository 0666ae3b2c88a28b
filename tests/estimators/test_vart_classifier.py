"""VaRTClassifier: probabilities, labels, binary and multiclass, pickling."""

import pickle

import numpy as np
import pytest
import torch

from pyro_trees.estimators import VaRTClassifier


def _small(**kwargs):
    """A quick fit: one fit of 60 steps (the pooling of ``num_fits`` has its own test)."""
    return VaRTClassifier(
        **{
            "depth": 2,
            "num_steps": 60,
            "num_samples": 10,
            "num_fits": 1,
            "random_state": 0,
            **kwargs,
        }
    )


def _blobs(n=150, classes=2, seed=0):
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])[:classes]
    y = rng.integers(classes, size=n)
    return centres[y] + rng.normal(size=(n, 2)), y


def test_binary_probabilities_labels_and_separable_accuracy():
    X, y = _blobs(classes=2)
    labels = np.array(["cat", "dog"])[y]
    clf = _small().fit(X, labels)
    assert clf.model_.link == "probit"
    assert list(clf.classes_) == ["cat", "dog"]
    p = clf.predict_proba(X)
    assert p.shape == (len(X), 2)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
    assert ((p >= 0) & (p <= 1)).all()
    Xt, yt = _blobs(classes=2, seed=1)
    acc = np.mean(clf.predict(Xt) == np.array(["cat", "dog"])[yt])
    assert acc > 0.95, acc  # the blobs are 4 standard deviations apart
    # the same rows in the same batch: an identity (in another batch, BLAS may round
    # the float32 tree arithmetic differently in the last bits)
    np.testing.assert_array_equal(clf.predict_log_proba(X[:5]), np.log(clf.predict_proba(X[:5])))
    np.testing.assert_allclose(clf.predict_proba(X[:5]), p[:5], rtol=1e-5)


def test_sample_importances_follow_the_informative_input():
    X, y = _blobs(classes=2)
    clf = _small().fit(X, y)
    draws = clf.sample_importances(X)
    assert draws.shape == (clf.num_samples, X.shape[1]) and np.allclose(draws.sum(1), 1.0)
    # the blobs differ in x_0 alone
    assert draws.mean(0).argmax() == clf.feature_importances_.argmax() == 0
    assert abs(draws.mean(0) - clf.feature_importances_).max() < 0.25


def test_multiclass_softmax():
    X, y = _blobs(n=210, classes=3)
    clf = _small().fit(X, y)
    assert clf.model_.link == "softmax" and clf.n_classes_ == 3
    p = clf.predict_proba(X)
    assert p.shape == (len(X), 3)
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-12)
    Xt, yt = _blobs(n=210, classes=3, seed=1)
    assert np.mean(clf.predict(Xt) == yt) > 0.9
    draws = clf.sample_proba(X[:4], num_samples=3)
    assert draws.shape == (3, 4, 3)
    raw = clf.sample_proba(X[:4]).mean(0)
    t = clf.temperature_
    assert 0.25 <= t <= 4.0
    scaled = np.exp(np.log(raw) / t)
    np.testing.assert_allclose(scaled / scaled.sum(1, keepdims=True), p[:4], atol=1e-10)


def test_pickle_and_refit_reproduce_exactly():
    X, y = _blobs(classes=3, n=90)
    clf = _small().fit(X, y)
    back = pickle.loads(pickle.dumps(clf))
    assert np.array_equal(back.predict_proba(X), clf.predict_proba(X))
    again = _small().fit(X, y)
    assert np.array_equal(again.predict_proba(X), clf.predict_proba(X))


def test_bad_options():
    X, y = _blobs(n=40)
    with pytest.raises(ValueError, match="num_samples"):
        _small(num_samples=0).fit(X, y)
    with pytest.raises(ValueError, match="probit"):
        _small(link="probit").fit(*_blobs(n=40, classes=3))
    with pytest.raises(ValueError, match="elbo"):
        _small(elbo="x").fit(X, y)
    with pytest.raises(ValueError, match="vectorised"):
        _small(elbo="trace").fit(X, y, sharded=True)
    with pytest.raises(ValueError, match="sharded"):
        _small().fit(X, y, sharded="yes")


def test_sharded_in_one_process_is_the_plain_fit():
    # one process holds every shard: sharded=True changes nothing
    X, y = _blobs(n=60)
    plain = _small(num_steps=20).fit(X, y).predict_proba(X)
    np.testing.assert_array_equal(
        _small(num_steps=20).fit(X, y, sharded=True).predict_proba(X), plain
    )


def test_defaults_learn_three_overlapping_classes():
    """The default schedule (not the quick one above) on a three-class table."""
    X, y = _blobs(n=300, classes=3, seed=1)
    Xt, yt = _blobs(n=300, classes=3, seed=2)
    clf = VaRTClassifier(random_state=0).fit(X, y)
    p = clf.predict_proba(Xt)
    assert p.shape == (300, 3) and np.allclose(p.sum(1), 1)
    assert clf.score(Xt, yt) > 0.9  # nearest-centre accuracy here is about 0.98


def test_n_fits_pools_the_trees_of_seeded_fits_and_calibrates_the_pool():
    import torch

    from pyro_trees.estimators._rng import MEMBER_SEED
    from pyro_trees.estimators._vart_posterior import hard_guide_draws
    from pyro_trees.models import stack_trees

    X, y = _blobs(n=120, classes=3)
    one = _small(num_samples=7).fit(X, y)
    clf = _small(num_samples=7, num_fits=2)
    clf.stack_max_rows = 0  # one fit after another (stacked fits: the test below)
    clf.fit(X, y)
    assert len(clf.guides_) == len(clf.fit_results_) == 2 and clf.guide_ is clf.guides_[0]
    # the first fit is num_fits=1's, step for step; the second has its own seed
    assert clf.fit_results_[0].val_losses == one.fit_result_.val_losses
    assert clf.fit_results_[1].val_losses != one.fit_result_.val_losses
    # 4 trees from the first fit (num_fits=1's seed), 3 from the second
    dummy = torch.zeros(1, 2)
    parts = [
        hard_guide_draws(clf.guides_[0], 4, dummy, clf.seed_ + 1),
        hard_guide_draws(clf.guides_[1], 3, dummy, clf.seed_ + 1 + MEMBER_SEED),
    ]
    pooled = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    ref = stack_trees(pooled, clf.guide_.depth)
    for key, value in clf.trees_.items():
        torch.testing.assert_close(value, ref[key], rtol=0, atol=0)
    # the temperature is the pool's: fitted again on the same held-out rows, it repeats
    Xs = clf._clip(torch.as_tensor(clf.x_scaler_.transform(X), dtype=torch.float32))
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(0))
    yt = torch.as_tensor(np.searchsorted(clf.classes_, y))
    assert clf._fit_temperature(Xs[perm[:12]], yt[perm[:12]]) == clf.temperature_
    loaded = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))
    state = one.__getstate__() if hasattr(one, "__getstate__") else dict(one.__dict__)
    state = {k: v for k, v in state.items() if k not in ("num_fits", "guides_", "fit_results_")}
    old = VaRTClassifier.__new__(VaRTClassifier)
    old.__setstate__(state)  # pickled before num_fits existed
    assert old.num_fits == 1
    np.testing.assert_array_equal(old.predict_proba(X), one.predict_proba(X))
    for bad in (0, 1.5, True, 8):  # 8 > num_samples
        with pytest.raises(ValueError, match="num_fits"):
            _small(num_samples=7, num_fits=bad).fit(X, y)


def test_stacked_fits_train_as_one_and_pool_as_before():
    """At the defaults' row counts the fits train as one stacked program: each its own
    guide, stopping and history; the pool predicts, calibrates and pickles as ever."""
    X, y = _blobs(n=120, classes=3)
    clf = _small(num_samples=7, num_fits=3).fit(X, y)
    assert len({r.seconds for r in clf.fit_results_}) == 1  # one loop for the three
    assert len({id(g) for g in clf.guides_}) == 3
    for r in clf.fit_results_:
        assert r.num_steps == r.val_losses[-1][0] and r.best_step is not None
    again = _small(num_samples=7, num_fits=3).fit(X, y)
    np.testing.assert_array_equal(again.predict_proba(X), clf.predict_proba(X))
    loaded = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(loaded.predict_proba(X), clf.predict_proba(X))
    assert (clf.predict(X) == y).mean() > 0.6


def test_stacked_fits_leave_out_the_rows_that_every_fit_holds_out(monkeypatch):
    """The classifier's fits share one held-out fold: the stacked program scores only
    the rows some fit learns from, each fit's own rows at weight 1."""
    from pyro_trees.estimators import _vart_fit

    seen = []

    def recording(ranks, model, guide, X, y, **kwargs):
        seen.append((X.shape[0], kwargs["weight"].clone()))
        return run_svi(ranks, model, guide, X, y, **kwargs)

    run_svi = _vart_fit.run_svi
    monkeypatch.setattr(_vart_fit, "run_svi", recording)
    X, y = _blobs(n=120, classes=3)
    clf = _small(num_samples=7, num_fits=3).fit(X, y)
    ((rows, weight),) = seen
    n_val = 120 - rows
    assert n_val > 0 and weight.shape == (3, rows) and bool((weight == 1).all())
    assert clf.fit_results_[0].val_losses  # early-stopped on the rows left out


def _rare(n=400, positives=4, seed=0, features=2):
    """``n`` rows of noise features, ``positives`` of them of class 1 at random."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, features))
    y = np.zeros(n, dtype=int)
    y[rng.choice(n, positives, replace=False)] = 1
    return X, y


def test_a_rare_class_absent_from_the_held_out_rows_is_not_calibrated_away():
    # 4 positives in 400 rows, none among the 40 held out: the held-out log loss fell
    # without end as the temperature sharpened, T stopped at 1/4 and the mean P(1) on
    # new rows was about 1e-6 (frequency 0.01)
    X, y = _rare()
    Xt, _ = _rare(seed=1)
    kwargs = {"num_steps": 100, "num_fits": 1, "random_state": 0}
    with pytest.warns(UserWarning, match="no held-out row of class 1"):
        clf = VaRTClassifier(**kwargs).fit(X, y)
    assert clf.temperature_ == 1.0
    raw = VaRTClassifier(calibrate=False, **kwargs).fit(X, y)
    np.testing.assert_array_equal(clf.predict_proba(Xt), raw.predict_proba(Xt))
    assert clf.predict_proba(Xt)[:, 1].mean() > 0.01 / 3


def _temperature_of(probs, y, monkeypatch):
    """``_fit_temperature`` of a fitted classifier at given held-out probabilities."""
    X, labels = _blobs(n=40)
    clf = _small(num_steps=2).fit(X, labels)
    probs = torch.as_tensor(np.asarray(probs, dtype=np.float64)).unsqueeze(0)
    monkeypatch.setattr(clf, "_tree_probs_std", lambda Xs: probs)
    y = torch.as_tensor(np.asarray(y))
    return clf._fit_temperature(torch.zeros(len(y), 2), y)


def test_temperature_is_kept_only_when_it_holds_out_of_sample(monkeypatch):
    rng = np.random.default_rng(0)
    # under-confident on many rows of both classes: a temperature below one, kept
    n = 200
    y = rng.integers(2, size=n)
    p1 = np.where(y == 1, 0.7, 0.3)
    flip = rng.random(n) < 0.15  # the best probability is 0.85: T = log(7 / 3) / log(0.85 / 0.15)
    p1 = np.where(flip, 1 - p1, p1)
    t = _temperature_of(np.c_[1 - p1, p1], y, monkeypatch)
    assert 0.35 < t < 0.7, t  # about 0.49
    # separable rows: the least log loss at the grid's edge, and it holds out of sample
    p1 = np.where(y == 1, 0.8, 0.2)
    assert _temperature_of(np.c_[1 - p1, p1], y, monkeypatch) == 0.25
    # one positive among 40 (a rare class) and under-predicted: the least log loss of all
    # 40 rows sharpens (T about 0.76, 39 negatives gain), but each row scored at the
    # temperature fitted without it loses more on the positive than the negatives gain
    y = np.r_[np.zeros(39, dtype=int), 1]
    p1 = np.r_[np.full(39, 0.05), 0.1]
    assert _temperature_of(np.c_[1 - p1, p1], y, monkeypatch) == 1.0
    # few held-out rows, one positive missed with confidence: the least log loss is at the
    # grid's upper edge, which does not hold out of sample either; skipped with a warning
    y, p1 = np.array([1, 0, 0]), np.array([0.001, 0.037, 0.053])
    with pytest.warns(UserWarning, match="edge of the temperature grid"):
        assert _temperature_of(np.c_[1 - p1, p1], y, monkeypatch) == 1.0


def test_a_rare_class_is_predicted_near_its_frequency():
    # noise features, 1 % positives: the leaves' prior mean at equal probabilities pulled
    # P(1) up to 0.039-0.040 on new rows (this schedule, the default kl_weight 0.3;
    # 0.074-0.085 at kl_weight 1); at the class frequencies (base_rate, the default)
    # 0.017-0.018
    freq = 0.01
    for seed in range(2):
        X, y = _rare(seed=seed)
        Xt, _ = _rare(n=1000, seed=seed + 100)
        kwargs = {"num_steps": 100, "num_fits": 1, "calibrate": False, "random_state": 0}
        p1 = VaRTClassifier(**kwargs).fit(X, y).predict_proba(Xt)[:, 1].mean()
        assert freq / 3 < p1 < 2 * freq, p1
        flat = VaRTClassifier(base_rate=False, **kwargs).fit(X, y)
        assert flat.predict_proba(Xt)[:, 1].mean() > 3 * freq
        assert flat.model_.offset is None


def test_export_text_prints_the_tree_with_each_leafs_class():
    """The classifier's most probable tree, as plot_tree draws it: its leaves' most
    probable classes at the inputs' training means (base rate and temperature
    applied), one line per leaf."""
    import re

    from pyro_trees.plotting import plot_tree

    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 2))
    y = np.where(X[:, 0] > 0, "yes", "no")
    clf = VaRTClassifier(depth=1, num_steps=60, num_samples=4, num_fits=1, random_state=0)
    text = clf.fit(X, y).export_text(feature_names=["dose", "age"])
    leaves = re.findall(r"class: (\w+) \(p = ([0-9.]+)\)", text)
    assert text.startswith("|--- dose <= ") and len(leaves) == 2
    assert [c for c, _ in leaves] == ["no", "yes"]  # left: dose <= t
    assert all(0.5 <= float(p) <= 1.0 for _, p in leaves)
    boxes = plot_tree(clf)
    assert len(boxes) == 3  # the same tree: one split, two leaves
