"""The posterior trees behind every prediction of
:class:`~pyro_trees.estimators.VaRTRegressor` (and its forest), an object the estimator
holds (:class:`PosteriorTrees`): drawn once from the guides with a fixed seed, stacked
and cut to their leaves, and what prediction reads from them (the predictive sites of
the model, the function draws, the exact mixture's spread and quantiles). The
classifier uses the draws' helpers (:func:`pooled_guide_draws`, :func:`prior_rho_sites`).
"""

from __future__ import annotations

import copy
import math

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

#: seeds the prior draws of ``rho`` (where a missing input goes) for posterior trees of
#: a fit without missing values, offset from ``seed_``
MISSING_SEED = 7919


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


def stack_tree(samples: dict, model, depth: int) -> dict:
    """A single tree's posterior draws by site (``rho`` included), stacked and cut to
    their leaves (:func:`_leaf_tree`)."""
    return _leaf_tree(_stack_trees(samples, depth))


def _scaled_noise(samples: dict, noise_factor: float) -> dict:
    """``samples`` (draws by site) with every leaf's noise scale times ``noise_factor``:
    ``log(noise_factor)`` added to the ``log_sigma`` sites (a tree's leaves, or a
    forest's); ``samples`` itself when the factor is 1."""
    shift = math.log(noise_factor)
    if shift != 0.0:
        for key in samples:
            if key.startswith("log_sigma"):
                samples[key] = samples[key] + shift
    return samples


class PosteriorTrees:
    """The ``num_samples`` hard posterior trees behind every prediction of a fitted
    :class:`~pyro_trees.estimators.VaRTRegressor` (or forest), and what prediction reads
    from them: drawn once from the fits' guides (:func:`pooled_guide_draws`, seeded
    ``seed + 1``), every leaf's noise scale times ``noise_factor``, stacked and cut to
    their leaves by ``stack`` (``rho`` drawn from its prior, seeded ``seed +
    MISSING_SEED``, for a fit without missing values). All inputs and outputs are
    standardised. The estimator holds one (:meth:`of`), redrawn after unpickling.

    :param guides: the fits' guides.
    :param model: the fitted model.
    :param int depth: the guides' truncation depth.
    :param int num_samples: posterior draws, shared out among the fits.
    :param int seed: the fit's ``seed_``.
    :param like: one dummy input row ``(1, L)`` (its dtype and device).
    :param float noise_factor: the calibrated factor on the leaves' noise.
    :param stack: ``stack(samples, model, depth)``: the draws as leaf trees
        (:func:`stack_tree`, or the forest's).
    """

    def __init__(
        self, guides, model, *, depth, num_samples, seed, like, noise_factor=1.0, stack=stack_tree
    ):
        self.guides, self.model, self.depth = list(guides), model, int(depth)
        self.num_samples, self.seed, self.like = int(num_samples), int(seed), like
        self.noise_factor, self.stack_fn = float(noise_factor), stack
        self.num_trees = getattr(self.guides[0], "num_trees", 1)
        _check_prediction_memory(self.depth, self.num_samples, like.shape[-1], like.device)
        samples = pooled_guide_draws(self.guides, self.num_samples, like, self.seed + 1)
        self.samples = _scaled_noise(samples, self.noise_factor)
        self._leaves = None

    def calibrated(self, noise_factor: float) -> PosteriorTrees:
        """These trees with every leaf's noise scale times ``noise_factor``: the trees
        :meth:`of` draws once the estimator holds that factor (the same values), without
        drawing them again. These must be at factor 1."""
        if self.noise_factor != 1.0:
            raise ValueError(f"these trees already hold noise factor {self.noise_factor}")
        other = copy.copy(self)
        other.noise_factor = float(noise_factor)
        other.samples = _scaled_noise(dict(self.samples), other.noise_factor)
        other._leaves = None
        return other

    @classmethod
    def of(cls, est) -> PosteriorTrees:
        """The posterior trees of a fitted estimator (its ``seed_``, ``noise_factor_``
        and ``_stack_posterior``)."""
        like = torch.zeros(1, est.n_features_in_, dtype=est.dtype_, device=est.device_)
        return cls(
            fitted_guides(est),
            est.model_,
            depth=est.guide_.depth,
            num_samples=int(est.num_samples),
            seed=est._seed(),
            like=like,
            noise_factor=getattr(est, "noise_factor_", 1.0),
            stack=est._stack_posterior,
        )

    def prior_rho(self, samples: dict) -> dict:
        """``rho_d`` sites for the draws ``samples`` of a fit that saw no missing value
        (:func:`prior_rho_sites`, seeded ``seed + MISSING_SEED``: the same draws at every
        call and after pickling); empty for one that did."""
        return prior_rho_sites(self.model, samples, self.depth, self.seed + MISSING_SEED)

    def stack(self, samples: dict) -> dict:
        """Draws by site, stacked and cut to their leaves (``rho`` from its prior where
        the fit saw no missing value)."""
        return self.stack_fn({**samples, **self.prior_rho(samples)}, self.model, self.depth)

    def leaves(self) -> dict:
        """:meth:`stack` of the posterior draws, cached."""
        if self._leaves is None:
            self._leaves = self.stack(self.samples)
        return self._leaves

    def raw_leaves(self) -> dict:
        """:meth:`leaves` with factor-1 noise."""
        tree = self.leaves()
        shift = math.log(self.noise_factor)
        return dict(tree, log_sigma=tree["log_sigma"] - shift) if shift else tree

    def fit_leaves(self, j: int) -> dict:
        """Fit ``j``'s own posterior trees (factor-1 noise), which score its held-out
        fold: :meth:`raw_leaves` when there is one fit, else ``num_samples`` hard trees
        of guide ``j`` seeded ``seed + 1 + j * MEMBER_SEED``."""
        if len(self.guides) == 1:
            return self.raw_leaves()
        seed = self.seed + 1 + j * MEMBER_SEED
        return self.stack(hard_guide_draws(self.guides[j], self.num_samples, self.like, seed))

    def all_fit_leaves(self) -> list[dict]:
        """:meth:`fit_leaves` of every fit."""
        return [self.fit_leaves(j) for j in range(len(self.guides))]

    @property
    def row_nodes(self) -> int:
        """Nodes per posterior draw and row that prediction holds at once (batching)."""
        return 2 ** (self.depth + 1) * self.num_trees

    def batches(self, *tensors: torch.Tensor, parts: int = 1):
        """Matching row slices of ``tensors`` (each ``(N, ...)``), small enough that
        their ``(S, rows, parts M)`` double mixture tensors fit the prediction budget."""
        nodes = self.row_nodes * int(parts)
        rows = max(1, PREDICT_BYTES // (ROW_BYTES_PER_NODE * self.num_samples * nodes))
        for start in range(0, tensors[0].shape[0], rows):
            yield tuple(t[start : start + rows] for t in tensors)

    def predictive(self, Xs: torch.Tensor, sites: tuple[str, ...], seed: int) -> dict:
        """The model's ``sites`` under the posterior draws at rows ``Xs`` ``(N, L)``,
        each ``(num_samples, N)``, seeded ``seed`` (the global streams left alone)."""
        samples, model = self.samples, self.model
        if bool(torch.isnan(Xs).any()) and not model.missing:  # rho from its prior
            samples = {**samples, **self.prior_rho(samples)}
            model = missing_model(model)
        rows = max(1, PREDICT_BYTES // (8 * 4 * self.num_samples * self.row_nodes))
        out = {s: [] for s in sites}
        with (
            local_seed(seed, Xs.device),
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
        return {s: torch.cat(v, dim=-1) for s, v in out.items()}

    @torch.no_grad()
    def function_draws(self, Xs: torch.Tensor) -> torch.Tensor:
        """The regression function under every posterior tree at rows ``Xs``,
        ``(num_samples, N)``."""
        tree = self.leaves()
        rows = max(1, PREDICT_BYTES // (8 * 4 * self.num_samples * self.row_nodes))
        out = []
        for start in range(0, Xs.shape[0], rows):
            logits, means, _ = _leaf_mixtures(tree, Xs[start : start + rows])
            out.append((logits.softmax(-1) * means).sum(-1))
        return torch.cat(out, -1)

    @torch.no_grad()
    def mixture_std(self, Xs: torch.Tensor) -> torch.Tensor:
        """Standard deviations ``(N,)`` of the posterior predictive at rows ``Xs``
        ``(N, L)``: the Gaussian mixture over the trees and their leaves, calibrated
        noise included."""
        tree = self.leaves()
        var = []
        for (xb,) in self.batches(Xs):
            logits, loc, scale = _row_mixtures(tree, xb)  # (S, n, M)
            weight = logits.exp() / logits.shape[0]
            m = (weight * loc).sum((0, -1))
            second = (weight * (loc * loc + scale * scale)).sum((0, -1))
            var.append((second - m * m).clamp_min(0.0))
        return torch.cat(var).sqrt()

    @torch.no_grad()
    def mixture_quantiles(self, Xs: torch.Tensor, probs) -> torch.Tensor:
        """Quantiles ``(len(probs), N)`` of that posterior predictive mixture at ``Xs``."""
        tree = self.leaves()
        out = []
        for (xb,) in self.batches(Xs):
            logits, loc, scale = _row_mixtures(tree, xb)
            weight = logits.exp() / logits.shape[0]
            out.append(_row_mixture_quantiles(*_compact_rows(weight, loc, scale), probs))
        return torch.cat(out, -1)
