"""VaRTClassifier: probabilities, labels, binary and multiclass, pickling."""

import pickle

import numpy as np
import pytest

from pyro_trees.estimators import VaRTClassifier


def _small(**kwargs):
    """A quick fit: one fit of 60 steps (the pooling of ``n_fits`` has its own test)."""
    return VaRTClassifier(
        **{"depth": 2, "num_steps": 60, "num_samples": 10, "n_fits": 1, "random_state": 0, **kwargs}
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
    from pyro_trees.models._vart_mixture import _stack_trees

    X, y = _blobs(n=120, classes=3)
    one = _small(num_samples=7).fit(X, y)
    clf = _small(num_samples=7, n_fits=2).fit(X, y)
    assert len(clf.guides_) == len(clf.fit_results_) == 2 and clf.guide_ is clf.guides_[0]
    # the first fit is n_fits=1's, step for step; the second has its own seed
    assert clf.fit_results_[0].val_losses == one.fit_result_.val_losses
    assert clf.fit_results_[1].val_losses != one.fit_result_.val_losses
    # 4 trees from the first fit (n_fits=1's seed), 3 from the second
    dummy = torch.zeros(1, 2)
    parts = [
        hard_guide_draws(clf.guides_[0], 4, dummy, clf.seed_ + 1),
        hard_guide_draws(clf.guides_[1], 3, dummy, clf.seed_ + 1 + MEMBER_SEED),
    ]
    pooled = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    ref = _stack_trees(pooled, clf.guide_.depth)
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
    state = {k: v for k, v in state.items() if k not in ("n_fits", "guides_", "fit_results_")}
    old = VaRTClassifier.__new__(VaRTClassifier)
    old.__setstate__(state)  # pickled before n_fits existed
    assert old.n_fits == 1
    np.testing.assert_array_equal(old.predict_proba(X), one.predict_proba(X))
    for bad in (0, 1.5, True, 8):  # 8 > num_samples
        with pytest.raises(ValueError, match="n_fits"):
            _small(num_samples=7, n_fits=bad).fit(X, y)
