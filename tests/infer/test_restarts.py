import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import TraceMeanField_ELBO
from pyro.nn import PyroModule, PyroParam

from pyro_trees.infer import elbo_estimate, fit, fit_restarts
from pyro_trees.infer.restarts import RestartsResult

# z ~ N(0, 1), y_i | z ~ N(z, 1): the posterior is N(sum(y) / (n + 1), 1 / (n + 1)) and
# log p(y) is a Gaussian's log density in closed form.
Y = torch.tensor([0.3, 1.1, 0.7, 1.9, 1.4], dtype=torch.float64)


class Model(PyroModule):
    def forward(self, y, shift=0.0):
        z = pyro.sample("z", dist.Normal(torch.zeros((), dtype=y.dtype), 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(z + shift, 1.0), obs=y)


class Guide(PyroModule):
    def __init__(self, loc=0.0, scale=1.0):
        super().__init__()
        self.loc = PyroParam(torch.tensor(float(loc), dtype=torch.float64))
        self.scale = PyroParam(
            torch.tensor(float(scale), dtype=torch.float64), constraint=dist.constraints.positive
        )

    def forward(self, y, shift=0.0):
        pyro.sample("z", dist.Normal(self.loc, self.scale))


def _posterior(y):
    n = len(y)
    return float(y.sum()) / (n + 1), (1.0 / (n + 1)) ** 0.5


def _log_evidence(y):
    n = len(y)
    cov = torch.eye(n, dtype=y.dtype) + torch.ones(n, n, dtype=y.dtype)
    return float(dist.MultivariateNormal(torch.zeros(n, dtype=y.dtype), cov).log_prob(y))


def _closed_form_elbo(y, m, s):
    # E_q[log p(y | z)] + E_q[log p(z)] + H[q] for q = N(m, s^2)
    n = len(y)
    loglik = -0.5 * n * math.log(2 * math.pi) - 0.5 * (float(((y - m) ** 2).sum()) + n * s**2)
    logprior = -0.5 * math.log(2 * math.pi) - 0.5 * (m**2 + s**2)
    entropy = 0.5 * math.log(2 * math.pi * math.e * s**2)
    return loglik + logprior + entropy


def test_elbo_estimate_is_the_evidence_at_the_exact_posterior():
    # log p(y, z) - log q(z) = log p(y) for every z when q is the posterior: zero variance
    m, s = _posterior(Y)
    value = elbo_estimate(Model(), Guide(m, s), Y, num_repeats=3)
    assert value == pytest.approx(_log_evidence(Y), abs=1e-10)


def test_elbo_estimate_matches_the_closed_form_elbo():
    pyro.set_rng_seed(0)
    m, s = 0.2, 0.9
    loss = TraceMeanField_ELBO(num_particles=200, vectorize_particles=True)
    value = elbo_estimate(Model(), Guide(m, s), Y, loss=loss, num_repeats=50)
    # 10,000 draws of a quadratic in z: standard error about 0.01 here
    assert value == pytest.approx(_closed_form_elbo(Y, m, s), abs=0.05)
    assert len(pyro.get_param_store()) == 0


def test_elbo_estimate_passes_model_keywords():
    m, s = _posterior(Y - 1.0)
    value = elbo_estimate(Model(), Guide(m, s), Y, shift=1.0, num_repeats=2)
    assert value == pytest.approx(_log_evidence(Y - 1.0), abs=1e-10)


def test_restart_zero_is_a_plain_fit_and_more_restarts_do_not_change_it():
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return Model(), Guide(float(torch.randn((), generator=g)) * 3, 1.0)

    opts = dict(num_steps=25, lr=0.05, progress=False)
    pyro.set_rng_seed(7)
    model, guide = make(7)
    plain = fit(model, guide, Y, **opts)
    one = fit_restarts(make, Y, num_restarts=1, seed=7, keep_all=True, **opts)
    three = fit_restarts(make, Y, num_restarts=3, seed=7, keep_all=True, **opts)
    assert one.results[0].losses == plain.losses
    assert three.results[0].losses == plain.losses
    assert float(three.fits[0][1].loc.detach()) == float(guide.loc.detach())
    assert three.seeds == [7, 1007, 2007]
    assert one.elbos[0] == three.elbos[0]  # scored from the same seed


def test_the_highest_elbo_wins_and_ranks_as_the_closed_form():
    # no training: each restart is its start, so the winner is known in closed form
    starts = {0: (2.5, 1.0), 1: (0.9, 0.45), 2: (-1.0, 0.3), 3: (1.2, 2.0)}

    def make(seed):
        return Model(), Guide(*starts[seed])

    # 20,000 draws: standard error at most about 0.06 on these starts
    loss = TraceMeanField_ELBO(num_particles=1000, vectorize_particles=True)
    out = fit_restarts(
        make, Y, num_restarts=4, seed=0, seed_stride=1, num_steps=0, loss=loss, score_repeats=20
    )
    exact = [_closed_form_elbo(Y, *starts[r]) for r in range(4)]
    assert out.best == max(range(4), key=exact.__getitem__) == 1
    for est, ref in zip(out.elbos, exact, strict=True):
        assert est == pytest.approx(ref, abs=0.3)
    assert out.elbo == out.elbos[1] and out.result is out.results[1]
    assert float(out.guide.loc.detach()) == 0.9 and out.fits == []


def test_training_restarts_reach_the_posterior():
    def make(seed):
        return Model(), Guide(4.0 * (-1) ** seed, 0.2)

    out = fit_restarts(make, Y, num_restarts=2, seed_stride=1, num_steps=150, lr=0.1,
                       progress=False, loss=TraceMeanField_ELBO(num_particles=8))  # fmt: skip
    m, s = _posterior(Y)
    assert float(out.guide.loc.detach()) == pytest.approx(m, abs=0.1)
    assert float(out.guide.scale.detach()) == pytest.approx(s, rel=0.25)
    assert out.elbo == pytest.approx(_log_evidence(Y), abs=0.1)
    assert out.seconds == pytest.approx(sum(r.seconds for r in out.results))
    assert len(pyro.get_param_store()) == 0


def test_a_custom_score_and_non_finite_scores():
    def make(seed):
        return Model(), Guide(float(seed), 1.0)

    scores = {0: math.nan, 1: 2.0, 2: math.inf, 3: 1.0}
    out = fit_restarts(make, Y, num_restarts=4, seed_stride=1, num_steps=0,
                       score=lambda m, g: scores[int(g.loc.detach())])  # fmt: skip
    assert out.best == 1
    assert math.isnan(out.elbos[0]) and math.isnan(out.elbos[2]) and out.elbos[3] == 1.0
    with pytest.warns(RuntimeWarning, match="no restart has a finite ELBO"):
        out = fit_restarts(make, Y, num_restarts=2, num_steps=0, score=lambda m, g: -math.inf)
    assert out.best == 0 and isinstance(out, RestartsResult)


def test_loss_from_make_is_used():
    calls = []

    class CountingELBO(TraceMeanField_ELBO):
        def differentiable_loss(self, model, guide, *args, **kwargs):
            calls.append(1)
            return super().differentiable_loss(model, guide, *args, **kwargs)

    def make(seed):
        return Model(), Guide(), CountingELBO()

    fit_restarts(make, Y, num_restarts=1, num_steps=3, score_repeats=2, progress=False)
    assert len(calls) >= 3 + 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_restarts=0), "num_restarts must be a positive integer"),
        (dict(num_restarts=1.5), "num_restarts must be a positive integer"),
        (dict(num_restarts=True), "num_restarts must be a positive integer"),
        (dict(score_repeats=0), "score_repeats must be a positive integer"),
    ],
)
def test_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_restarts(lambda seed: (Model(), Guide()), Y, num_steps=0, **kwargs)


def test_bad_factories_and_options():
    with pytest.raises(ValueError, match="make must be a callable"):
        fit_restarts(None, Y)
    with pytest.raises(ValueError, match=r"must return \(model, guide\)"):
        fit_restarts(lambda s: Model(), Y, num_steps=0)
    with pytest.raises(ValueError, match="loss given both"):
        fit_restarts(lambda s: (Model(), Guide(), TraceMeanField_ELBO()), Y, num_steps=0,
                     loss=TraceMeanField_ELBO())  # fmt: skip
    with pytest.raises(ValueError, match="num_repeats must be a positive integer"):
        elbo_estimate(Model(), Guide(), Y, num_repeats=0)
