"""Scikit-learn style Bayesian HME regressor: closed-form VB with model selection."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyro.distributions as dist
import torch
from sklearn.base import RegressorMixin
from tqdm.auto import tqdm

from pyro_trees.distributions.mixture_quantiles import gaussian_mixture_quantiles
from pyro_trees.estimators._base import TabularEstimator
from pyro_trees.estimators._constraints import (
    SEED_AND_DEVICE,
    Anything,
    Integer,
    OneOf,
    Real,
    validate_params,
)
from pyro_trees.estimators._rng import local_seed
from pyro_trees.estimators._template import fit_seed
from pyro_trees.infer.bayesian_hme_vb import (
    SCHEDULES,
    VBData,
    grow_selection,
    merge_selections,
    schedule_by_name,
    select_topology,
)
from pyro_trees.topology import Topology, enumerate_topologies
from pyro_trees.validation import check_level

__all__ = ["BayesianHMERegressor"]

_ROUTINGS = ("hard", "posterior")
# max_experts=None: at most this many experts, and at most as many experts as the rows
# give one row per parameter of a linear expert; the bound selects among them
_AUTO_MAX_EXPERTS = 5
_POINTS_PER_PARAM = 1


def _mixture_std(d: dist.MixtureSameFamily) -> torch.Tensor:
    """The standard deviation of a Gaussian mixture over ``dim=-2`` (event ``(D,)``),
    ``batch + (D,)``, without squaring numbers that overflow: its terms are divided by a
    power of two at or above the largest of them (exact, so ordinary rows get the bits of
    ``d.variance.sqrt()``)."""
    w = d.mixture_distribution.probs.unsqueeze(-1)  # (..., E, 1)
    loc = d.component_distribution.base_dist.loc  # (..., E, D)
    scale = d.component_distribution.base_dist.scale
    mean = (w * loc).sum(-2, keepdim=True)
    dev = loc - mean
    big = torch.maximum(scale.amax(-2, keepdim=True), dev.abs().amax(-2, keepdim=True))
    s = torch.exp2(torch.ceil(torch.log2(big.clamp_min(torch.finfo(big.dtype).tiny))))
    var = (w * (scale / s).pow(2)).sum(-2) + (w * (dev / s).pow(2)).sum(-2)
    return s.squeeze(-2) * var.sqrt()


def _as_topology(value) -> Topology:
    if isinstance(value, Topology):
        return value
    if isinstance(value, tuple) and len(value) == 2 and not all(isinstance(v, int) for v in value):
        return Topology.from_nested(value)
    try:
        return Topology(value)
    except ValueError as exc:
        raise ValueError(f"invalid topology {value!r}: {exc}") from None


class BayesianHMERegressor(RegressorMixin, TabularEstimator):
    """Bayesian hierarchical mixture of linear experts (Bishop & Svensén, 2003).

    ``fit`` runs the paper's closed-form variational Bayes
    (:mod:`pyro_trees.infer.bayesian_hme_vb`) on every candidate topology from many
    random restarts (run as one batch), keeps the best bound per topology and selects the
    topology with the highest bound. The bounds also give model-averaging weights
    ``exp(bound)`` (``weights_``).

    :param max_experts: search every topology with ``min_experts..max_experts``
        experts, unique up to mirror symmetry (ignored when ``topologies`` is given).
        ``None`` (default): ``N // (L + 1)`` (at least one row per parameter of a
        linear expert) clipped to ``[min_experts, 5]``; the bound then chooses among
        them.
    :param int min_experts: see ``max_experts``.
    :param topologies: a :class:`~pyro_trees.topology.Topology`, a list of them (gate
        sets or nested pairs are converted), or ``None`` for the search above.
    :param int num_restarts: random starts per topology.
    :param int num_cycles: coordinate-ascent cycles per start (at most).
    :param anneal: deterministic annealing of the likelihood temperature: ``False`` (none),
        ``True`` (``"excess"``), a name of
        :data:`~pyro_trees.infer.bayesian_hme_vb.SCHEDULES` (the readings of the paper's
        schedule, see :func:`~pyro_trees.infer.bayesian_hme_vb.temperature_schedule`),
        or a list of names: the restarts are then split evenly between the schedules
        (and ``keep`` between them, rounded up) and the best bound per topology is kept.
        Annealing runs over the first ``num_cycles // 4`` cycles (the paper's 200 of 800).
    :param float tol: a restart stops once its bound moves by at most ``tol * N`` in a
        cycle at temperature 1.
    :param prune_after: keep only the best ``keep`` starts per topology after this many
        cycles (``None``: run every start to the end).
    :param int keep: see ``prune_after``.
    :param int grow: after the random restarts, search every topology again from
        ``grow`` starts per way of growing it out of the best solution of a topology
        with one expert fewer (split one leaf into a gate and two copies of its expert,
        then ``num_cycles // 2`` cycles at temperature 1; smallest sizes first, see
        :func:`~pyro_trees.infer.grow_selection`); a topology keeps the
        higher bound. ``0`` turns this off.
    :param str routing: what :meth:`predict` returns: ``"posterior"`` (default: the
        predictive mean, the mixture over experts, which minimises the expected squared
        error) or ``"hard"`` (the mean of the most probable expert, the paper's choice
        for multi-modal inverse problems).
    :param float prior_a: Gamma shape of the precisions' priors.
    :param float prior_b: Gamma rate of the precisions' priors.
    :param search_dtype: ``"float64"`` (default) or ``None`` runs everything in double
        precision. ``"float32"`` (faster on a CPU) runs the restarts in single
        precision and then polishes the best start of every topology in double
        precision, so that ``bounds_`` and the states are exact, but its restarts can
        reach worse optima (see the guide page of the Bayesian HME).
    :param random_state: ``None`` or an int seed for the random starts and for
        :meth:`sample`.
    :param device: torch device of the search (default: the CPU).
    :param bool progress: show a progress bar over the search's stages (one per
        annealing schedule, and the growth).

    Inputs and targets are standardised inside (the search runs on the standardised
    scale); predictions, intervals and ``elbo_`` are in the units of ``y``.

    Fitted attributes: ``topology_`` (selected), ``elbo_`` (its bound, on the original
    scale of ``y``), ``topologies_``, ``bounds_`` (best bound per topology, original
    scale), ``weights_`` (normalised ``exp(bounds_)``), ``state_`` (the selected
    :class:`~pyro_trees.infer.bayesian_hme_vb.VBState`), ``states_`` (the best state per
    topology), ``search_seconds_``, ``search_cycles_`` (coordinate-ascent cycles summed
    over all restarts), ``grown_`` (per topology: its best state came from a grown start),
    ``random_bounds_`` (best bound per topology from the random restarts alone).

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import BayesianHMERegressor
    >>> X = np.linspace(-1, 1, 40)[:, None]
    >>> y = np.abs(X[:, 0])
    >>> reg = BayesianHMERegressor(max_experts=2, num_restarts=2, num_cycles=5, grow=0,
    ...                            random_state=0).fit(X, y)
    >>> reg.predict(X[:3]).shape
    (3,)
    >>> lower, upper = reg.predict_interval(X[:3], level=0.9)
    >>> bool((lower <= upper).all())
    True
    """

    def __init__(
        self,
        max_experts: int | None = None,
        min_experts: int = 1,
        topologies=None,
        num_restarts: int = 20,
        num_cycles: int = 200,
        anneal: bool = False,
        tol: float = 1e-4,
        prune_after: int | None = None,
        keep: int = 5,
        grow: int = 3,
        routing: str = "posterior",
        prior_a: float = 1e-3,
        prior_b: float = 1e-3,
        search_dtype: str | None = "float64",
        random_state: int | None = None,
        device=None,
        progress: bool = False,
    ):
        self.max_experts = max_experts
        self.min_experts = min_experts
        self.topologies = topologies
        self.num_restarts = num_restarts
        self.num_cycles = num_cycles
        self.anneal = anneal
        self.tol = tol
        self.prune_after = prune_after
        self.keep = keep
        self.grow = grow
        self.routing = routing
        self.prior_a = prior_a
        self.prior_b = prior_b
        self.search_dtype = search_dtype
        self.random_state = random_state
        self.device = device
        self.progress = progress

    _multi_output = True
    _default_dtype = "float64"  # the closed-form updates need double precision
    _parameter_constraints = {
        **SEED_AND_DEVICE,
        "max_experts": Integer(1, none=True),
        "min_experts": Integer(1),
        "topologies": Anything("_candidates (Topology objects, gate sets, nested pairs)"),
        "num_restarts": Integer(1),
        "num_cycles": Integer(1),
        "anneal": Anything("_schedules (a bool, a schedule's name or a list of them)"),
        "tol": Real(0),
        "prune_after": Integer(0, none=True),
        "keep": Integer(1),
        "grow": Integer(0),
        "routing": OneOf(*_ROUTINGS),
        "prior_a": Real(0, low_open=True),
        "prior_b": Real(0, low_open=True),
        "search_dtype": OneOf("float32", "float64", None),
    }

    # ------------------------------------------------------------------ fitting
    def _max_experts(self, n: int, n_features: int) -> int:
        if self.max_experts is not None:
            return self.max_experts
        auto = min(_AUTO_MAX_EXPERTS, n // (_POINTS_PER_PARAM * (n_features + 1)))
        return max(self.min_experts, auto, 1)

    def _candidates(self, n: int = 0, n_features: int = 0) -> list[Topology]:
        if self.topologies is None:
            return enumerate_topologies(self._max_experts(n, n_features), self.min_experts)
        if isinstance(self.topologies, Topology):
            return [self.topologies]
        if isinstance(self.topologies, (str, bytes)) or not hasattr(self.topologies, "__iter__"):
            raise ValueError(f"invalid topology {self.topologies!r}: give Topology objects")
        tops = [_as_topology(t) for t in self.topologies]
        if not tops:
            raise ValueError("topologies is empty")
        return tops

    def _schedules(self) -> list[str]:
        anneal = self.anneal
        if anneal is False or anneal is None:
            return ["none"]
        if anneal is True:
            return ["excess"]
        names = [anneal] if isinstance(anneal, str) else list(anneal)
        if not names or any(n not in SCHEDULES for n in names):
            raise ValueError(
                f"anneal must be a bool, one of {sorted(SCHEDULES)} or a list of them, "
                f"got {anneal!r}"
            )
        return names

    def fit(self, X, y, *, sharded: bool = False):
        """Search the topologies and keep the one with the highest bound.

        Under ``torchrun`` the closed-form VB is data-parallel: each rank keeps its rows
        (rows ``r::W`` of the same ``X``, or with ``sharded=True`` the shard it passed)
        and every sum over rows in the updates and the bound is all-reduced
        (:class:`~pyro_trees.infer.VBData`'s ``reduce``), so every rank computes the same
        factors, bounds and choices, equal to one process's up to the order of the
        sums. The per-row parts of ``states_`` (``xi``, ``log_r``) are those of the
        rank's own rows.

        :param X: inputs ``(N, L)``.
        :param y: targets ``(N,)`` or ``(N, D)``.
        :param bool sharded: under ``torchrun``, each rank passes only its own rows
            (scalers and row counts over every rank's rows).
        :raises ValueError: for NaN/inf, mismatched lengths, fewer points than experts,
            an invalid topology or invalid settings.
        """
        validate_params(self)
        names = self._schedules()
        dtypes = {None: None, "float64": None, "float32": torch.float32}
        if len(names) > self.num_restarts:
            raise ValueError(
                f"num_restarts ({self.num_restarts}) must be at least the number of annealing "
                f"schedules ({len(names)})"
            )
        xs, ys = self._validate_fit(X, y, sharded=sharded)
        self.y_ndim_ = ys.dim()
        ts = ys.unsqueeze(-1) if ys.dim() == 1 else ys
        n_all, ranks = self.n_global_rows_, self.ranks_
        tops = self._candidates(n_all, xs.shape[1])
        most = max(top.num_experts for top in tops)
        if most > n_all:
            raise ValueError(
                f"fewer data points ({n_all}) than experts ({most}): use fewer experts"
            )
        reduce = None
        if ranks.size > 1:  # each rank's rows; sums over rows all-reduced
            if not ranks.sharded:
                xs, ts = xs[ranks.rank :: ranks.size], ts[ranks.rank :: ranks.size]
            reduce = ranks.all_sum
        self.seed_ = fit_seed(self.random_state, ranks)
        generator = torch.Generator().manual_seed(self.seed_)
        sels = []
        stages = tqdm(
            total=len(names) + (self.grow > 0),
            desc=type(self).__name__,
            disable=not self.progress,
            leave=False,
        )
        for i, name in enumerate(names):
            share = self.num_restarts // len(names) + (i < self.num_restarts % len(names))
            sels.append(
                select_topology(
                    xs,
                    ts,
                    tops,
                    num_restarts=share,
                    temperatures=schedule_by_name(name, self.num_cycles),
                    tol=self.tol,
                    prior_a=self.prior_a,
                    prior_b=self.prior_b,
                    generator=generator,
                    prune_after=self.prune_after,
                    keep=max(1, math.ceil(self.keep / len(names))),
                    search_dtype=dtypes[self.search_dtype],
                    reduce=reduce,
                )
            )
            stages.update()
        sel = merge_selections(sels)
        random_bounds = sel.bounds
        if self.grow > 0:
            sel = grow_selection(
                xs,
                ts,
                sel,
                starts_per_split=self.grow,
                num_cycles=max(1, self.num_cycles // 2),
                tol=self.tol,
                prior_a=self.prior_a,
                prior_b=self.prior_b,
                generator=generator,
                search_dtype=dtypes[self.search_dtype],
                reduce=reduce,
            )
            stages.update()
        stages.close()
        # log p(y) = log p(y_std) - N sum_d log std_d: report bounds on the scale of y
        jacobian = n_all * float(np.log(self.y_scaler_.scale).sum())
        self.topologies_ = sel.topologies
        self.bounds_ = (sel.bounds - jacobian).cpu().numpy()
        self.random_bounds_ = (random_bounds - jacobian).cpu().numpy()
        self.weights_ = sel.weights.cpu().numpy()
        # each state is kept in its own memory, not as a view of its restarts' batch
        self.states_ = [state.clone() for state in sel.states]
        self.best_index_ = sel.best
        self.topology_ = sel.topologies[sel.best]
        self.state_ = self.states_[sel.best]
        self.elbo_ = float(self.bounds_[sel.best])
        self.search_seconds_ = sel.seconds
        self.search_cycles_ = sel.cycles
        self.grown_ = (
            sel.grown.cpu().numpy()
            if sel.grown is not None
            else np.zeros(len(sel.topologies), bool)
        )
        return self

    # ------------------------------------------------------------------ prediction
    def _components(self, X, index: int):
        """Log gate probabilities ``(N, E)``, expert means ``(N, E, D)`` and predictive
        standard deviations ``(N, E, D)`` on the standardised scale, for topology
        ``index``.

        The quadratic forms :math:`x^\\top S x` of the variances overflow for far-away
        rows (``x`` of ``1e200`` gives ``1e400``); they are evaluated at :math:`x / s`
        with :math:`s` the power of two at or above :math:`\\max_j |x_j|` (an exact
        scaling, so ordinary rows get the same bits as without it) and only the
        standard deviations and the probit-corrected gate logits, which grow at most
        like :math:`|x|`, are scaled back.
        """
        state = self.states_[index]
        top = self.topologies_[index]
        data = VBData.build(X, torch.zeros(X.shape[0], 1, dtype=X.dtype), top)
        xb = data.x
        s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1)))).unsqueeze(-1)  # (N, 1), >= 1
        small = dataclasses.replace(data, x=xb / s)
        if top.num_gates:
            mean_a = small.x @ state.v_mean.T  # (N, G), a / s
            var_a = small.quad(state.v_cov).T  # var(a) / s^2
            # MacKay's probit approximation of E[sigma(a)] under a Gaussian a:
            # a / sqrt(1 + pi var(a) / 8), with numerator and denominator divided by s
            kappa = (1 / s**2 + math.pi * var_a / 8).rsqrt()
            log_pi = top.expert_log_probs(kappa * mean_a)
        else:
            log_pi = xb.new_zeros(xb.shape[0], 1)
        means = torch.einsum("np,jdp->njd", xb, state.w_mean)
        var = (state.tau_b / state.tau_a)[None, :] / s**2 + small.quad(state.w_cov).T  # (N, E)
        sd = s * var.sqrt()
        return log_pi, means, sd.unsqueeze(-1).expand(means.shape)

    def predict_distribution(self, X, average: bool = False) -> dist.MixtureSameFamily:
        """Approximate predictive density ``p(y | x)`` on the scale of ``y``.

        A mixture of Gaussians over experts: weights from the gates' posterior mean
        logits with MacKay's probit correction, variance ``1 / E[tau_j] + x^T S_j x``.
        With ``average=True`` every searched topology contributes, weighted by
        ``weights_`` (Bayesian model averaging by the bound).

        :returns: a :class:`~pyro.distributions.MixtureSameFamily` with batch shape
            ``(N,)`` and event shape ``(D,)``.
        """
        Xs = self._validate_predict(X)
        indices = range(len(self.topologies_)) if average else [self.best_index_]
        log_w, means, sds = [], [], []
        for k in indices:
            lp, m, sd = self._components(Xs, k)
            shift = math.log(self.weights_[k]) if average and self.weights_[k] > 0 else 0.0
            if average and self.weights_[k] <= 0:
                continue
            log_w.append(lp + shift)
            means.append(m)
            sds.append(sd)
        log_w, means, sds = torch.cat(log_w, -1), torch.cat(means, -2), torch.cat(sds, -2)
        loc = self.y_scaler_.inverse(means)
        scale = self.y_scaler_.inverse_scale(sds)
        comp = dist.Normal(loc, scale).to_event(1)
        return dist.MixtureSameFamily(dist.Categorical(logits=log_w), comp)

    def _out(self, value: torch.Tensor) -> np.ndarray:
        value = value.detach().to("cpu", torch.float64).numpy()
        return value[..., 0] if self.y_ndim_ == 1 else value

    def _routing(self, routing: str | None) -> str:
        routing = self.routing if routing is None else routing
        if routing not in _ROUTINGS:
            raise ValueError(f"routing must be one of {_ROUTINGS}, got {routing!r}")
        return routing

    def predict(
        self, X, *, return_std: bool = False, routing: str | None = None, average: bool = False
    ):
        """Predictions ``(N,)`` (or ``(N, D)``): the mean of the most probable expert
        (``routing="hard"``) or the predictive mean, the mixture over the experts under
        the gates' posterior (``routing="posterior"``); default: the ``routing`` option.

        With ``average=True`` the predictive is the Bayesian model average over every
        searched topology with weights ``weights_`` (``exp(bound)``, normalised; see
        :meth:`predict_distribution`), and ``"hard"`` picks the most probable expert of
        that pooled mixture.

        :param bool return_std: also return the standard deviation of the predictive
            distribution (the whole mixture, whatever ``routing``), same shape.

        Predictions, standard deviations and the intervals of :meth:`predict_interval`
        are finite for inputs of any finite magnitude (standardised inputs below about
        ``1e300``): the linear experts extrapolate, and so do their standard deviations,
        without squaring the inputs.
        """
        routing = self._routing(routing)
        d = self.predict_distribution(X, average=average)
        if routing == "posterior":
            mean = self._out(d.mean)
        else:
            probs = d.mixture_distribution.probs  # (N, E)
            best = probs.argmax(-1)
            loc = d.component_distribution.base_dist.loc  # (N, E, D)
            mean = self._out(loc[torch.arange(loc.shape[0]), best])
        if return_std:
            return mean, self._out(_mixture_std(d))
        return mean

    def predict_interval(self, X, level: float = 0.9, *, average: bool = False):
        """Central predictive interval of each output's marginal mixture.

        :returns: ``(lower, upper)`` arrays of the shape of :meth:`predict`.
        """
        level = check_level(level)
        d = self.predict_distribution(X, average=average)
        w = d.mixture_distribution.probs.unsqueeze(-1)  # (N, E, 1)
        loc = d.component_distribution.base_dist.loc  # (N, E, D)
        scale = d.component_distribution.base_dist.scale
        alpha = (1 - level) / 2
        lower, upper = gaussian_mixture_quantiles(w, loc, scale, (alpha, 1 - alpha), dim=-2)
        return self._out(lower), self._out(upper)

    def sample(self, X, num_samples: int | None = None, *, average: bool = False) -> np.ndarray:
        """Draws of ``y`` from the predictive distribution: ``(num_samples, N)`` (or
        ``(num_samples, N, D)``), seeded by ``random_state`` (the same draws on every
        call; unseeded: fresh draws).

        :param num_samples: draws per row (default ``None``: 100).
        """
        num_samples = 100 if num_samples is None else int(num_samples)
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        d = self.predict_distribution(X, average=average)
        with local_seed(self.random_state, self.device_):
            return self._out(d.sample((num_samples,)))
