import numpy as np
import pytest

from pyro_trees.estimators import VaRTCausal, VaRTRegressor


@pytest.fixture(scope="module")
def causal():
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(150, 2))
    A = rng.binomial(1, 0.5, size=150)
    y = X[:, 0] + 3.0 * A + 0.1 * rng.normal(size=150)
    reg = VaRTRegressor(
        depth=2, kl_weight=1e-2, num_steps=150, lr=0.05, num_samples=40, random_state=0
    )
    return VaRTCausal(reg).fit(X, A, y), X


def test_cate_and_ate(causal):
    model, X = causal
    mean, lo, hi = model.cate(X[:10], level=0.9)
    assert mean.shape == lo.shape == hi.shape == (10,)
    assert (lo <= mean).all() and (mean <= hi).all()
    ate = model.ate(level=0.9)
    assert ate["lower"] <= ate["mean"] <= ate["upper"]
    assert ate["draws"].shape == (40,)
    # the constant effect 3 is recovered
    assert abs(ate["mean"] - 3.0) < 0.5
    # ATE draws are the per-tree averages of the CATE draws over the training X
    assert np.allclose(ate["draws"], model.sample_cate(X).mean(1))
    po = model.potential_outcomes(X[:5], level=0.8)
    assert set(po) == {0, 1} and po[1][0].shape == (5,)


def test_bad_input(causal):
    model, X = causal
    y = np.zeros(150)
    with pytest.raises(ValueError, match="single treatment arm"):
        VaRTCausal().fit(X, np.full(150, 2), y)
    with pytest.raises(ValueError, match="two treatment arms.*3 distinct"):
        VaRTCausal().fit(X, np.arange(150) % 3, y)
    with pytest.raises(ValueError, match="NaN"):
        VaRTCausal().fit(X, np.where(np.arange(150) < 5, np.nan, 1.0), y)
    with pytest.raises(ValueError, match="single treatment arm"):
        VaRTCausal().fit(X, np.ones(150), y)
    with pytest.raises(ValueError, match="one entry per row"):
        VaRTCausal().fit(X, np.ones(10), y)
    with pytest.raises(ValueError, match="not fitted"):
        VaRTCausal().cate(X)
    with pytest.raises(ValueError, match="features"):
        model.cate(X[:, :1])
    with pytest.raises(ValueError, match="level"):
        model.ate(level=1.5)


def test_forest_outcome_model():
    """A VaRTForestRegressor serves as the outcome model: one CATE draw per forest."""
    from pyro_trees.estimators import VaRTForestRegressor

    rng = np.random.default_rng(0)
    X, A = rng.normal(size=(80, 2)), rng.integers(0, 2, size=80)
    y = X[:, 0] + 2.0 * A + 0.1 * rng.normal(size=80)
    reg = VaRTForestRegressor(
        num_trees=5, depth=2, num_steps=150, lr=0.05, num_samples=10, num_fits=2, random_state=0
    )
    causal = VaRTCausal(reg).fit(X, A, y)
    assert isinstance(causal.regressor_, VaRTForestRegressor)
    assert causal.sample_cate(X[:4]).shape == (10, 4)
    assert abs(causal.ate()["mean"] - 2.0) < 0.5
    default = VaRTCausal(num_trees=4, random_state=0)
    assert default.get_params()["num_trees"] == 4
    with pytest.raises(ValueError, match="num_trees"):
        VaRTCausal(reg, num_trees=4).fit(X, A, y)


def test_random_state_seeds_a_given_regressor_without_one():
    rng = np.random.default_rng(1)
    X, A = rng.normal(size=(60, 2)), rng.integers(0, 2, size=60)
    y = X[:, 0] + A + 0.1 * rng.normal(size=60)
    reg = VaRTRegressor(depth=2, num_steps=20, num_samples=8)  # random_state=None
    first, again = (VaRTCausal(reg, random_state=3).fit(X, A, y) for _ in range(2))
    assert first.regressor_.random_state == 3 and reg.random_state is None
    assert first.ate()["mean"] == again.ate()["mean"]
    own = VaRTCausal(VaRTRegressor(depth=2, num_steps=20, num_samples=8, random_state=5))
    assert own.set_params(random_state=3).fit(X, A, y).regressor_.random_state == 5


def test_ate_over_the_training_rows_of_a_data_frame_does_not_warn():
    """The stored training covariates are not checked again as new input: a fit on a
    DataFrame must not make ``ate()`` warn about missing feature names."""
    pd = pytest.importorskip("pandas")
    import warnings

    rng = np.random.default_rng(1)
    X = pd.DataFrame(rng.uniform(-1, 1, size=(60, 2)), columns=["a", "b"])
    A = rng.binomial(1, 0.5, size=60)
    y = X["a"].to_numpy() + 2.0 * A
    reg = VaRTRegressor(depth=1, num_steps=5, num_samples=5, validation_fraction=0)
    model = VaRTCausal(reg, random_state=0).fit(X, A, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ate = model.ate()
        model.cate(X)  # a frame with the fitted names: no warning either
    np.testing.assert_allclose(ate["draws"], model.sample_cate(X).mean(1))


def test_arms_of_any_labels_are_encoded_control_first():
    """Two arms of any labels (strings, 1/2, booleans) fit as 0/1 would: the sorted second
    label is the treatment (scikit-learn's classes_[1]); potential_outcomes is keyed by
    the labels; a pickle keeps them."""
    import pickle

    rng = np.random.default_rng(1)
    X = rng.uniform(-1, 1, size=(60, 2))
    A = rng.binomial(1, 0.5, size=60)
    y = X[:, 0] + 2.0 * A

    def fit(arms):
        reg = VaRTRegressor(depth=2, num_steps=20, num_samples=5, validation_fraction=0)
        return VaRTCausal(reg, random_state=0).fit(X, np.asarray(arms)[A], y)

    ref = fit([0, 1])
    assert list(ref.arms_) == [0, 1]
    for labels in (["control", "treated"], [1, 2], [False, True]):
        est = fit(labels)
        assert list(est.arms_) == labels
        np.testing.assert_array_equal(est.sample_cate(X), ref.sample_cate(X))
        assert set(est.potential_outcomes(X[:3])) == set(labels)
    again = pickle.loads(pickle.dumps(est))
    assert list(again.arms_) == [False, True]
    np.testing.assert_array_equal(again.sample_cate(X), ref.sample_cate(X))
