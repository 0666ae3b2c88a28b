"""Declared parameter checks: the constraint kinds, and every estimator's table."""

import numpy as np
import pytest
from sklearn.base import BaseEstimator

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)
from pyro_trees.estimators._constraints import (
    Anything,
    Boolean,
    Integer,
    OneOf,
    Real,
    validate_params,
)

ALL = [
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTCausal,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
]


@pytest.mark.parametrize("cls", ALL)
def test_every_constructor_parameter_is_declared_and_the_defaults_pass(cls):
    est = cls()
    assert set(est.get_params(deep=False)) == set(cls._parameter_constraints)
    validate_params(est)


def test_integer_refuses_bools_floats_and_values_below_its_bound():
    c = Integer(1, none=True)
    for ok in (1, 7, np.int64(3), None):
        c.check("n", ok)
    for bad in (0, -2, 2.5, 3.0, True, "4"):
        with pytest.raises(ValueError, match=r"^n must be an integer >= 1 or None, got "):
            c.check("n", bad)
    with pytest.raises(ValueError, match=r"an integer in \[0, 2\], got 3"):
        Integer(0, 2).check("k", 3)


def test_real_bounds_open_and_closed_and_non_finite_values():
    c = Real(0, 1, high_open=True)
    for ok in (0, 0.0, 0.5, np.float32(0.9)):
        c.check("f", ok)
    for bad in (1, 1.0, -0.1, float("nan"), float("inf"), True, "0.1", None):
        with pytest.raises(ValueError, match=r"f must be a number in \[0, 1\), got "):
            c.check("f", bad)
    with pytest.raises(ValueError, match="lr must be a number > 0, got 0"):
        Real(0, low_open=True).check("lr", 0)
    Real(0, none=True).check("clip_margin", None)


def test_one_of_compares_types_too():
    c = OneOf(True, False, "auto")
    for ok in (True, False, "auto"):
        c.check("refit_leaves", ok)
    for bad in (1, 0, "yes", None):  # 1 == True, but 1 is not True
        with pytest.raises(ValueError, match="refit_leaves must be one of True, False, 'auto'"):
            c.check("refit_leaves", bad)
    Boolean().check("refit", np.bool_(True))
    with pytest.raises(ValueError, match="refit must be True or False, got 1"):
        Boolean().check("refit", 1)
    Anything("fit").check("regressor", object())


def test_an_undeclared_parameter_is_the_estimators_error():
    class Loose(BaseEstimator):
        _parameter_constraints = {"a": Integer()}

        def __init__(self, a=1, b=2):
            self.a, self.b = a, b

    with pytest.raises(TypeError, match="declares no constraint for 'b'"):
        validate_params(Loose())


@pytest.mark.parametrize(
    ("cls", "params", "match"),
    [
        (VaRTRegressor, {"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
        (VaRTRegressor, {"calibrate": "x"}, "calibrate must be one of"),
        (VaRTForestRegressor, {"num_trees": 0}, "num_trees must be an integer >= 1, got 0"),
        (VaRTClassifier, {"link": "logit"}, "link must be one of 'probit', 'softmax', None"),
        (RNNTreeRegressor, {"feedback": "x"}, "feedback must be one of 'hard', 'soft'"),
        (HeteroscedasticGPRegressor, {"tree_lr": -1.0}, "tree_lr must be a number > 0"),
        (BayesianHMERegressor, {"grow": -1}, "grow must be an integer >= 0, got -1"),
        (VaRTCausal, {"num_trees": 0}, "num_trees must be an integer >= 1 or None, got 0"),
    ],
)
def test_fit_refuses_a_bad_option_before_reading_the_data(cls, params, match):
    with pytest.raises(ValueError, match=match):
        if cls is VaRTCausal:
            cls(**params).fit(np.zeros((4, 1)), np.array([0, 1, 0, 1]), np.zeros(4))
        else:
            cls(**params).fit(np.zeros((4, 1)), np.zeros(4))
