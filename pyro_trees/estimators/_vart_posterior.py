"""The posterior trees behind every prediction of
:class:`~pyro_trees.estimators.VaRTRegressor`: drawn once from the guide with a fixed
seed, stacked and cut to their leaves, and the predictive sites of the model under them.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pyro
import torch
from pyro.infer import Predictive

from pyro_trees.distributions import compact_mixture_rows as _compact_rows
from pyro_trees.distributions import row_mixture_quantiles as _row_mixture_quantiles
from pyro_trees.estimators._rng import MEMBER_SEED, local_seed
from pyro_trees.estimators.vart_memory import PREDICT_BYTES, ROW_BYTES_PER_NODE
from pyro_trees.estimators.vart_memory import check_prediction_memory as _check_prediction_memory
from pyro_trees.models import leaf_mixtures as _leaf_mixtures
from pyro_trees.models import leaf_tree as _leaf_tree
from pyro_trees.models import row_mixtures as _row_mixtures
from pyro_trees.models import stack_trees as _stack_trees


def clip_to_training_range(est, Xs: torch.Tensor) -> torch.Tensor:
    """Standardised inputs clipped to the training rows' range (``est.x_min_``,
    ``est.x_max_``) widened by ``est.clip_margin`` times its width on each side
    (``clip_margin=None``, or no range yet: unchanged)."""
    if est.clip_margin is not None and getattr(est, "x_min_", None) is not None:
        pad = float(est.clip_margin) * (est.x_max_ - est.x_min_)
        Xs = torch.minimum(torch.maximum(Xs, est.x_min_ - pad), est.x_max_ + pad)
    return Xs


#: seeds the prior draws of ``rho`` (where a missing input goes) for posterior trees of
#: a fit without missing values, offset from ``seed_``
MISSING_SEED = 7919


def training_range(ranks, Xtr: torch.Tensor):
    """``(x_min, x_max)`` ``(L,)``: each feature's range over the training rows ``Xtr``
    (all ranks' rows, :meth:`Ranks.min <pyro_trees.estimators._distributed.Ranks.min>`),
    missing values (NaN) left out; a feature with no observed value has range
    ``[0, 0]`` (its standardised mean), so that new values of it are clipped there."""
    missing = torch.isnan(Xtr)
    if not bool(missing.any()):
        return ranks.min(Xtr.min(0).values), ranks.max(Xtr.max(0).values)
    lo = torch.where(missing, math.inf, Xtr).min(0).values
    hi = torch.where(missing, -math.inf, Xtr).max(0).values
    seen = ~missing.all(0)
    zero = torch.zeros_like(lo)
    return ranks.min(torch.where(seen, lo, zero)), ranks.max(torch.where(seen, hi, zero))


def prior_rho_sites(model, samples: dict, depth: int, seed: int) -> dict:
    """Draws of the ``rho_d`` sites (where a missing input goes) from the prior of
    ``model``, one per posterior draw in ``samples`` (each ``rho_d`` of the shape of
    ``split_d``), seeded ``seed`` without touching the global streams: the posterior of
    ``rho`` for a fit that saw no missing value (the likelihood does not read it).
    Empty when ``samples`` has ``rho_d`` sites already."""
    site = model.site
    if site("rho_0") in samples:
        return {}
    like = samples[site("split_0")]
    opts = {"dtype": like.dtype, "device": like.device}
    with local_seed(seed, like.device), torch.no_grad():
        return {
            site(f"rho_{d}"): model.rho_prior(samples[site(f"split_{d}")].shape, **opts).sample()
            for d in range(depth)
        }


def missing_model(model):
    """``model`` itself, or a copy with ``missing=True`` when it has no ``rho`` sites
    (a fit without missing values, asked about rows with some)."""
    if model.missing:
        return model
    other = copy.copy(model)
    other.missing = True
    return other


def hard_guide_draws(guide, num_samples: int, like: torch.Tensor, seed: int) -> dict:
    """``num_samples`` draws of ``guide``'s sites with hard split indicators
    (temperature 0), seeded ``seed`` on ``like``'s device without touching the global
    streams; ``like`` is one dummy input row (its dtype and device)."""
    with (
        local_seed(seed, like.device),
        pyro.settings.context(module_local_params=True),
        pyro.validation_enabled(False),
        guide.temperature_set_to(0.0),
        torch.no_grad(),
    ):
        return Predictive(guide, num_samples=num_samples, parallel=True)(like)


def check_n_fits(num_fits, num_samples) -> int:
    """``num_fits`` checked: an integer from 1 to ``num_samples`` (every fit gives at least
    one of the ``num_samples`` pooled posterior draws)."""
    if isinstance(num_fits, bool) or int(num_fits) != num_fits or num_fits < 1:
        raise ValueError(f"num_fits must be an integer >= 1, got {num_fits!r}")
    if int(num_fits) > int(num_samples):
        raise ValueError(
            f"num_fits ({num_fits}) must not exceed num_samples ({num_samples}): every fit "
            "gives at least one posterior draw"
        )
    return int(num_fits)


def fitted_guides(est) -> list:
    """The fitted guides of a VaRT estimator whose posterior draws are pooled:
    ``est.guides_`` (estimators pickled before ``num_fits`` existed have ``guide_`` alone)."""
    return list(getattr(est, "guides_", None) or [est.guide_])


def pooled_guide_draws(guides, num_samples: int, like: torch.Tensor, seed: int) -> dict:
    """:func:`hard_guide_draws` pooled over the fits ``guides`` of ``num_fits``: fit ``j``
    gives ``num_samples // F`` draws (one more for the first ``num_samples % F``),
    seeded ``seed + j * MEMBER_SEED``, concatenated along the draws; one fit's draws
    are ``hard_guide_draws(guides[0], num_samples, like, seed)``."""
    f = len(guides)
    draws = [
        hard_guide_draws(g, num_samples // f + (j < num_samples % f), like, seed + j * MEMBER_SEED)
        for j, g in enumerate(guides)
    ]
    if f == 1:
        return draws[0]
    return {k: torch.cat([d[k] for d in draws]) for k in draws[0]}


class _PosteriorTrees:
    """Prediction machinery of :class:`~pyro_trees.estimators.VaRTRegressor`: the inputs
    clipped as new rows, the ``num_samples`` hard posterior trees (cached, redrawn with
    the same seed after unpickling) and the model's predictive sites under them."""

    def _prepare(self, X) -> torch.Tensor:
        return self._clip(self._validate_predict(X))

    def _clip(self, Xs: torch.Tensor) -> torch.Tensor:
        return clip_to_training_range(self, Xs)

    def _posterior_trees(self) -> dict:
        """``num_samples`` hard trees from the guide, drawn once with a fixed seed."""
        if getattr(self, "_tree_samples", None) is None:
            dummy = torch.zeros(1, self.n_features_in_, dtype=self.dtype_, device=self.device_)
            _check_prediction_memory(
                self.guide_.depth, int(self.num_samples), self.n_features_in_, dummy.device
            )
            samples = pooled_guide_draws(
                fitted_guides(self), int(self.num_samples), dummy, self._seed() + 1
            )
            shift = math.log(getattr(self, "noise_factor_", 1.0))
            if shift != 0.0:  # calibrated noise: every leaf's scale times noise_factor_
                for key in samples:
                    if key.startswith("log_sigma"):  # a tree's leaves, or a forest's
                        samples[key] = samples[key] + shift
            self._tree_samples = samples
        return self._tree_samples

    def _predictive(self, Xs: torch.Tensor, sites: tuple[str, ...], seed_offset: int):
        samples, model = self._posterior_trees(), self.model_
        if bool(torch.isnan(Xs).any()) and not model.missing:  # rho from its prior
            samples = {**samples, **self._prior_rho(samples)}
            model = missing_model(model)
        rows = max(1, PREDICT_BYTES // (8 * 4 * int(self.num_samples) * self._row_nodes()))
        out = {s: [] for s in sites}
        with (
            local_seed(self._seed() + seed_offset, Xs.device),
            pyro.settings.context(module_local_params=True),
            pyro.validation_enabled(False),
            torch.no_grad(),
        ):
            pred = Predictive(
                model, posterior_samples=samples, return_sites=list(sites), parallel=True
            )
            for start in range(0, Xs.shape[0], rows):
                res = pred(Xs[start : start + rows])
                for s in sites:  # a forest's sites keep its summed trees dim: (S, 1, n)
                    out[s].append(res[s].reshape(res[s].shape[0], -1))
        return {s: self._outputs(torch.cat(v, dim=-1)) for s, v in out.items()}

    def _raw_leaves(self) -> dict:
        """The trees of :meth:`_leaf_trees` with factor-1 noise."""
        tree = self._leaf_trees()
        shift = math.log(getattr(self, "noise_factor_", 1.0))
        return dict(tree, log_sigma=tree["log_sigma"] - shift) if shift else tree

    def _leaf_trees(self) -> dict:
        """The posterior trees of ``_posterior_trees`` stacked and cut to their leaves
        (:func:`_leaf_tree`), cached alongside the draws they come from."""
        samples = self._posterior_trees()
        cache = getattr(self, "_leaf_cache", None)
        if cache is None or cache[0] is not samples:
            cache = (samples, self._stack(samples))
            self._leaf_cache = cache
        return cache[1]

    def _function_draws(self, Xs: torch.Tensor) -> np.ndarray:
        """:meth:`sample_function` of standardised rows, every posterior tree."""
        tree = self._leaf_trees()
        nodes = self._row_nodes()
        rows = max(1, PREDICT_BYTES // (8 * 4 * int(self.num_samples) * nodes))
        out = []
        with torch.no_grad():
            for start in range(0, Xs.shape[0], rows):
                logits, means, _ = _leaf_mixtures(tree, Xs[start : start + rows])
                out.append((logits.softmax(-1) * means).sum(-1))
        return self._outputs(torch.cat(out, -1))

    def _stack(self, samples: dict) -> dict:
        """The posterior draws by site, stacked and cut to their leaves (with ``rho``
        drawn from its prior for a fit without missing values, :meth:`_prior_rho`)."""
        samples = {**samples, **self._prior_rho(samples)}
        return _leaf_tree(_stack_trees(samples, self.guide_.depth))

    def _prior_rho(self, samples: dict) -> dict:
        """``rho_d`` sites for the posterior draws ``samples`` of a fit that saw no
        missing value (:func:`prior_rho_sites`, seeded ``seed_ + MISSING_SEED``: the same
        draws at every call and after pickling); empty for one that did."""
        seed = self._seed() + MISSING_SEED
        return prior_rho_sites(self.model_, samples, self.guide_.depth, seed)

    def _row_nodes(self) -> int:
        """Nodes per posterior draw and row that prediction holds at once (batching)."""
        return 2 ** (self.guide_.depth + 1) * getattr(self.guide_, "num_trees", 1)

    def _take(self, draws: np.ndarray, num_samples) -> np.ndarray:
        if num_samples is not None:
            num_samples = int(num_samples)
            if not 1 <= num_samples <= int(self.num_samples):
                raise ValueError(
                    f"num_samples must lie in [1, {self.num_samples}] (the estimator's "
                    f"num_samples: one function draw per posterior tree), got {num_samples}"
                )
            draws = draws[:num_samples]
        return draws

    def _calibration_batches(self, *tensors: torch.Tensor, parts: int = 1):
        """Matching row slices of ``tensors`` (each ``(N, ...)``), small enough that
        their ``(S, rows, parts M)`` double mixture tensors fit the prediction budget."""
        nodes = self._row_nodes() * int(parts)
        rows = max(1, PREDICT_BYTES // (ROW_BYTES_PER_NODE * int(self.num_samples) * nodes))
        for start in range(0, tensors[0].shape[0], rows):
            yield tuple(t[start : start + rows] for t in tensors)

    @torch.no_grad()
    def _mixture_std(self, Xs: torch.Tensor) -> torch.Tensor:
        """Standard deviations ``(N,)`` of the posterior predictive at standardised rows
        ``Xs`` ``(N, L)``: the Gaussian mixture over the ``num_samples`` trees and their
        leaves, calibrated noise included."""
        tree = self._leaf_trees()
        var = []
        for (xb,) in self._calibration_batches(Xs):
            logits, loc, scale = _row_mixtures(tree, xb)  # (S, n, M)
            weight = logits.exp() / logits.shape[0]
            m = (weight * loc).sum((0, -1))
            second = (weight * (loc * loc + scale * scale)).sum((0, -1))
            var.append((second - m * m).clamp_min(0.0))
        return torch.cat(var).sqrt()

    @torch.no_grad()
    def _mixture_quantiles(self, Xs: torch.Tensor, probs) -> torch.Tensor:
        """Quantiles ``(len(probs), N)`` of that posterior predictive mixture at ``Xs``."""
        tree = self._leaf_trees()
        out = []
        for (xb,) in self._calibration_batches(Xs):
            logits, loc, scale = _row_mixtures(tree, xb)
            weight = logits.exp() / logits.shape[0]
            out.append(_row_mixture_quantiles(*_compact_rows(weight, loc, scale), probs))
        return torch.cat(out, -1)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tree_samples"] = None  # redrawn with the same seed after loading
        state["_leaf_cache"] = None
        return state
