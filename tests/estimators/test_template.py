"""The one fit template: the seed rule, the held-out rule of each family, the split."""

import numpy as np
import pytest
import torch

from pyro_trees.estimators import (
    BayesianHMERegressor,
    HeteroscedasticGPRegressor,
    RNNTreeClassifier,
    RNNTreeRegressor,
    VaRTClassifier,
    VaRTForestRegressor,
    VaRTRegressor,
)
from pyro_trees.estimators._distributed import Ranks
from pyro_trees.estimators._template import (
    VART_HELD_OUT,
    HeldOut,
    HeldOutRule,
    SVIEstimator,
    fit_seed,
    held_out_rows,
)


def test_fit_seed_is_random_state_or_a_draw_from_torchs_global_stream():
    ranks = Ranks()
    assert fit_seed(7, ranks) == 7
    torch.manual_seed(0)
    a = fit_seed(None, ranks)
    torch.manual_seed(0)
    assert (
        fit_seed(None, ranks)
        == a
        == int(torch.randint(2**31, (), generator=torch.Generator().manual_seed(0)))
    )


@pytest.mark.parametrize(
    ("rule", "n", "fraction", "want"),
    [
        (VART_HELD_OUT, 120, 0.1, 12),
        (VART_HELD_OUT, 60, 0.1, 10),  # at least min(10, N // 5)
        (VART_HELD_OUT, 30, 0.1, 6),
        (VART_HELD_OUT, 19, 0.1, 0),  # 3 < 4: none
        (VART_HELD_OUT, 120, 0.0, 0),
        (HeldOutRule(min_expected=5), 40, 0.2, 8),  # the RNN-Tree's
        (HeldOutRule(min_expected=5), 24, 0.2, 0),  # 4.8 expected < 5: none
        (HeldOutRule(), 10, 0.05, 1),  # the GP's: at least one
    ],
)
def test_held_out_sizes_of_each_family(rule, n, fraction, want):
    assert rule.size(n, fraction) == want


def test_each_family_declares_its_held_out_rule():
    assert VaRTRegressor._held_out_rule is VART_HELD_OUT
    assert VaRTForestRegressor._held_out_rule is VART_HELD_OUT
    assert VaRTClassifier._held_out_rule is VART_HELD_OUT
    assert RNNTreeRegressor._held_out_rule.min_expected == 5
    assert HeteroscedasticGPRegressor._held_out_rule == HeldOutRule()
    for cls in (VaRTRegressor, VaRTClassifier, RNNTreeClassifier, HeteroscedasticGPRegressor):
        assert issubclass(cls, SVIEstimator) and cls.fit is SVIEstimator.fit


def test_held_out_rows_draw_from_the_family_generator_and_fold_disjointly():
    ranks = Ranks()
    gen = torch.Generator().manual_seed(3)
    split = held_out_rows(50, 0.2, VART_HELD_OUT, ranks=ranks, seed=3, generator=gen)
    assert split.n_val == 10 and split.num_folds == 5
    assert torch.equal(split.perm, torch.randperm(50, generator=torch.Generator().manual_seed(3)))
    folds = [split.fold(k)[0] for k in range(5)]
    assert torch.equal(torch.cat(folds).sort().values, torch.arange(50))
    rows, rest = split.fold(2)
    assert set(rows.tolist()).isdisjoint(rest.tolist()) and len(rest) == 40
    numpy_split = held_out_rows(50, 0.2, HeldOutRule(), ranks=ranks, seed=3)
    assert numpy_split.perm.tolist() == np.random.default_rng(3).permutation(50).tolist()
    none = held_out_rows(50, 0.0, HeldOutRule(), ranks=ranks, seed=3)
    assert none.n_val == 0 and none.num_folds == 1 and torch.equal(none.perm, torch.arange(50))
    assert isinstance(none, HeldOut)


@pytest.mark.parametrize(
    "make",
    [
        lambda: RNNTreeRegressor(depth=1, hidden_size=4, num_steps=2),
        lambda: HeteroscedasticGPRegressor(depth=1, num_steps=2, init_steps=2),
        lambda: BayesianHMERegressor(max_experts=1, num_restarts=1, num_cycles=2, grow=0),
        lambda: VaRTRegressor(depth=1, num_steps=2, num_samples=2),
    ],
    ids=["rnn_tree", "heteroscedastic_gp", "bayesian_hme", "vart"],
)
def test_every_estimator_records_the_seed_of_an_unseeded_fit(make):
    X = np.linspace(-1, 1, 30).reshape(-1, 1)
    y = X[:, 0] ** 2
    torch.manual_seed(5)
    est = make().fit(X, y)
    torch.manual_seed(5)
    assert est.seed_ == int(torch.randint(2**31, ()))
    again = make().set_params(random_state=est.seed_).fit(X, y)
    np.testing.assert_array_equal(again.predict(X), est.predict(X))
