"""``VaRTRegressor``: scikit-learn style variational regression tree with Bayesian intervals.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.base import RegressorMixin
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from pyro_trees.estimators._constraints import Boolean, Checked, Integer, OneOf, Real
from pyro_trees.estimators._template import HeldOut
from pyro_trees.estimators._vart_calibration import (
    CALIBRATION_ROWS,
    NoiseCalibration,
    _mixture_scores,
    _pool_shaped_mixtures,
)
from pyro_trees.estimators._vart_export import (
    _export_text,
    _importance_draws,
)
from pyro_trees.estimators._vart_fit import VART_CONSTRAINTS, VaRTFits, clip_to_training_range
from pyro_trees.estimators._vart_posterior import PosteriorTrees, stack_tree
from pyro_trees.models import row_mixtures as _row_mixtures
from pyro_trees.models import tree_mean
from pyro_trees.models.vart import VaRT
from pyro_trees.validation import check_level, resolve_dtype

__all__ = ["VaRTRegressor"]


def _describes_one_tree(est) -> bool:
    """``export_text``'s availability: a forest is not one readable tree, so that
    ``hasattr(forest, "export_text")`` is ``False`` (scikit-learn's ``available_if``)."""
    if not est._one_tree:
        raise AttributeError(
            "export_text describes a single tree and a forest is not one: see "
            "feature_importances_ and pyro_trees.plotting.plot_importances"
        )
    return True


class VaRTRegressor(RegressorMixin, VaRTFits):
    """A variational regression tree (VaRT) with posterior predictive intervals.

    Fits :class:`~pyro_trees.models.VaRT` with the truncated guide
    :class:`~pyro_trees.guides.VaRTGuide` by maximising the :math:`\\lambda`-weighted ELBO
    (eq. 4) with ClippedAdam through :func:`~pyro_trees.infer.fit`, annealing the Gumbel-softmax
    temperature geometrically from ``temperature_start`` to ``temperature_end``. Inputs
    and targets are standardised internally; predictions are in the original units.

    Predictions use ``num_samples`` trees drawn once from the guide with hard split
    indicators (temperature 0, the limit of eq. 22) and a fixed seed, so ``predict`` is
    deterministic and identical after pickling; inputs of any length are processed in
    batches against the same trees.

    **Missing values.** ``X`` may hold NaN (``y`` may not), at fit, at prediction, or
    both. When training rows have some, the model is VaRT with ``missing=True``: each
    split learns :math:`\\rho_i`, the probability that a missing input goes right, with a
    Beta posterior; a row is routed by the posterior trees, each with its own draw of
    :math:`\\rho`, and the leaves read a missing input as its training mean, so its
    interval widens where the route is uncertain. A fit without missing values is
    exactly the fit it always was; rows with NaN at prediction then take
    :math:`\\rho` from its prior, :math:`\\mathrm{Beta}(1, 1)` (the posterior when no
    training value was missing), so a split on a missing input sends them both ways.
    ``missing_fraction_`` ``(L,)`` records the share of training rows missing each
    feature. The routing rule is :func:`pyro_trees.trees.split_log_probs`; the VaRT
    guide page has the details.

    :param int depth: truncation depth :math:`D` of the guide.
    :param float kl_weight: :math:`\\lambda` of eq. 4 (the paper uses ``1e-3``).
    :param int num_steps: gradient steps.
    :param float lr: ClippedAdam learning rate.
    :param float lr_decay: the learning rate falls geometrically from ``lr`` to
        ``lr * lr_decay`` over ``num_steps`` steps, as the temperature falls (``1``: constant;
        the refit of ``refit=True`` follows the same schedule).
    :param int num_fits: fits pooled by the predictive, which is their equal mixture: the
        ``num_samples`` posterior trees are shared out among them (``num_samples // num_fits``
        each, one more for the first ``num_samples % num_fits``), so prediction costs do not
        grow with it. With held-out rows each fit holds out its own fold of the
        held-out split's size (fit :math:`j` fold :math:`j`; the folds are disjoint, and
        wrap around past :math:`\\lfloor N / n_{val} \\rfloor` of them), is
        early-stopped there (and with ``refit`` refitted), and learns from the other
        rows: between them the fits learn from every row. Each fold's rows are scored
        under their own fit's posterior trees, which never saw them, moved by each
        fit's offset from the fits' mean at that row: the pooled predictive's spread
        about a mean that never saw the row. The pooled scores set the one noise factor
        of the pooled predictive (``"coverage"`` takes their quantile as it is, below
        one too: the scores' centre, one fit, errs more than the pool's mean, so no
        confidence bound is added; VaRT guide page). Without held-out rows
        the fits differ only in their seeds. Their guides are kept in ``guides_``
        (``guide_`` is the first) and their results in ``fit_results_`` (the stopped
        fits of ``refit`` in ``stopping_results_``); ``feature_importances_`` is their
        mean. Training costs about ``num_fits`` times one fit; without ``refit`` and
        up to ``stack_max_rows`` training rows (a class attribute: 2,048 here, 1,024 for
        the forest) the fits train as one program
        (:class:`~pyro_trees.guides.StackedGuides`), which costs less (the training
        guide's "Several fits as one program").
    :param batch_size: minibatch size (``subsample_size`` of the ``data`` plate);
        ``None`` uses full batches up to 2048 rows.
    :param float temperature_start: initial Gumbel-softmax temperature.
    :param float temperature_end: final temperature.
    :param int num_samples: posterior trees used by ``predict`` and ``predict_interval``
        (and by the noise calibration). Prediction costs grow linearly with it; the
        predictive mixture has about ``num_samples`` times as many components per row
        as one tree.
    :param float split_alpha: prior split probability at the root (see VaRT).
    :param float split_beta: depth decay of the prior split probability.
    :param float split_scale: prior standard deviation of the split weights.
    :param float leaf_scale: prior standard deviation of the leaf weights.
    :param float validation_fraction: share of the training rows held out (at random,
        seeded by ``seed_``) for early stopping and noise calibration; ``0``
        trains on every row for ``num_steps`` steps without either (the paper's runs).
        At least ``min(10, N // 5)`` rows are held out; none when that is below 4.
    :param int patience: early stopping: evaluations (every ``eval_every`` steps) of the
        held-out RMSE of :meth:`~pyro_trees.guides.VaRTGuide.mean_tree` without improvement before
        training stops; the best parameters are kept. ``None`` trains all ``num_steps`` and keeps
        the best.
    :param int eval_every: steps between held-out evaluations.
    :param calibrate: how the held-out rows set one factor :math:`c` that
        multiplies every leaf's noise scale (stored as ``noise_factor_``; ``None`` or
        ``False``: none, :math:`c = 1`). At small :math:`\\lambda` the KL term hardly
        constrains the leaf noise, which then shrinks to the training residuals; the
        held-out rows measure the residuals on data the tree has not seen. At most 512
        held-out rows enter; what both rules read is kept in ``noise_calibration_``. The
        reasons behind the rules and their measured coverage are in the VaRT guide page.

        * ``"coverage"`` (default): split conformal calibration of the interval
          (:func:`~pyro_trees.estimators.noise_factor_from_scores`). Each held-out row's score
          (:meth:`coverage_scores`) is the least factor from which it lies inside the
          central ``calibration_level`` interval of the posterior predictive (eq. 32
          over the ``num_samples`` trees, computed exactly from the Gaussian mixture;
          with several ``num_fits``, in the pool's shape about the row's own fit);
          :math:`\\hat c` is the score at position :math:`\\mathrm{level}\\,(n+1)` of
          the :math:`n` sorted scores (interpolated), so that a new row is covered
          with probability close to the level whatever the shape of the residuals.
          With ``refit`` (the default) or several ``num_fits``, :math:`c = \\hat c`.
          With one fit and ``refit=False``, as with the likelihood rule,
          :math:`c = \\hat c` when :math:`\\hat c \\ge 1`, and below one the noise
          is shrunk only to the one-sided 95 % upper confidence bound of the score
          quantile (not at all with fewer than 29 rows at 0.9). With
          fewer than :math:`\\mathrm{level}/(1-\\mathrm{level})` held-out rows (9 at
          0.9) the likelihood rule is used (``noise_calibration_["rule"]`` says
          which). Intervals of other levels keep the predictive's shape. The factor
          scales only the leaf noise: where the spread of the posterior trees'
          predictions alone already covers a row, no factor narrows its interval.
        * ``"likelihood"`` (``True``): :math:`c` read off the held-out log posterior
          predictive density :math:`\\ell(c)` (log grid over :math:`[1/8, 64]`,
          :func:`~pyro_trees.estimators.noise_factor_from_curve`): :math:`c = \\hat c` when the
          maximiser :math:`\\hat c \\ge 1`; otherwise the noise is shrunk only as far as the
          held-out rows make certain, :math:`c = \\min(1, c_+)` with :math:`c_+` the
          upper end of the profile likelihood interval
          :math:`2(\\ell(\\hat c) - \\ell(c)) \\le 2.71` (one-sided 95 %).
    :param float calibration_level: the central interval probability whose held-out
        coverage ``calibrate="coverage"`` sets, in ``(0, 1)``.
    :param min_calibration_rows: ``calibrate="coverage"`` only: score at least this
        many held-out rows by cross-fitting (the CV+ idea of Barber et al., 2021; ``None``,
        the default: the held-out split alone). The training rows are cut into disjoint
        folds of the held-out split's size (folds :math:`0, \\dots, F-1` are the
        ``num_fits`` fits' own); each further fold :math:`k < K` is scored by one extra
        fit that holds it out (for early stopping too, like the fits) and is seeded
        ``seed_ + k``, with :math:`K` the least number of folds with that many rows (at
        most ``N // n_val``, every row once; with several ``num_fits`` in the pool's
        shape, as the fits' folds are). The pooled scores set the factor of the
        estimator's fits, which alone predict; training costs :math:`\\max(K - F, 0)`
        fits more. ``noise_calibration_["fold_scores"]`` keeps the extra folds' scores.
    :param bool refit: separate choosing the number of steps from calibrating the noise
        (early stopping picks the checkpoint that fits the held-out rows best, so those
        rows end up fitted better than new rows). With ``refit=True`` the stopped fit
        (kept as ``stopping_result_``) only gives its number of steps :math:`T` (its
        best step, at least 1); a fresh guide, seeded ``seed_ + 104729``, trains
        :math:`T` steps of the same temperature schedule on the same training rows
        without early stopping and is the fitted model (``fit_result_``). The held-out
        rows chose nothing of it but :math:`T`, so ``"coverage"`` takes the conformal
        quantile as it is, below one as well (no confidence bound;
        ``noise_calibration_["confidence"]`` is ``None``). Training costs up to twice as
        much. Cross-fitted folds (``min_calibration_rows``) are refitted the same way.
        Without held-out rows it changes nothing.
    :param float init_split_prob: initial split probability :math:`\\tilde\\gamma_i` of
        every internal node of the guide. The split logits move slowly, so at 0.9 a
        hard posterior tree prunes about one node in ten at random, and those
        subtrees' (hardly trained) stand-in leaves spread the posterior trees'
        predictions; 0.99 (default) starts from the full tree of depth ``depth``.
    :param str init: ``"data"`` (default) starts the split rules through random
        training points
        (:meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.init_splits_from_data`);
        ``"random"`` uses random hyperplanes through the origin of the standardised inputs.
    :param str elbo: ``"vectorised"`` (default) trains with
        :class:`~pyro_trees.infer.VaRTELBO`, the same estimator of the
        :math:`\\lambda`-weighted ELBO as ``Trace_ELBO`` computed without Pyro's per-site
        tracing (several times faster per step on small data); ``"trace"`` uses
        :class:`pyro.infer.Trace_ELBO` on the model and guide.
    :param clip_margin: clip every input of a new row to the range it had in the
        training rows (per feature; the rows the model learns from, not the held-out
        ones), widened by ``clip_margin`` times its width on each side; ``None`` never
        clips. Linear leaves extrapolate without bound, so one far outlying input (a
        data-entry error, say) would otherwise give an arbitrarily large prediction,
        while a mild extrapolation of a linear trend is often right. Training is
        unaffected; the held-out rows are clipped like new rows for early stopping and
        calibration (one far outlying held-out row can otherwise make the untrained
        start look best to early stopping).
    :param random_state: an int seeds initialisation, training and the draws of the
        posterior trees used for prediction; fitting and predicting leave the global
        random streams (Python, NumPy, torch) as they were. ``None``: ``fit`` draws a
        seed from torch's global stream, so unseeded fits differ from one another. The
        seed in use is kept as ``seed_``: a fitted estimator's predictions are
        reproducible across calls and after pickling either way, and
        ``random_state=seed_`` repeats the fit.
    :param device: torch device for training and prediction (default CPU).
    :param dtype: ``"float32"`` (default) or ``"float64"`` (a string or a torch dtype):
        the precision of training and prediction.
    :param bool progress: show a progress bar.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTRegressor
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> est = VaRTRegressor(depth=2, num_steps=3, num_samples=5, random_state=0).fit(X, X[:, 0])
    >>> lower, upper = est.predict_interval(X[:3], level=0.9)
    >>> est.predict(X[:3]).shape, bool((lower <= upper).all())
    ((3,), True)
    """

    def __init__(
        self,
        depth: int = 5,
        kl_weight: float = 1e-3,
        *,
        num_steps: int = 1000,
        lr: float = 0.03,
        lr_decay: float = 1.0,
        num_fits: int = 1,
        batch_size: int | None = None,
        temperature_start: float = 1.0,
        temperature_end: float = 0.1,
        num_samples: int = 50,
        validation_fraction: float = 0.1,
        patience: int | None = 5,
        eval_every: int = 20,
        calibrate: str | bool | None = "coverage",
        calibration_level: float = 0.9,
        min_calibration_rows: int | None = None,
        refit: bool = True,
        init: str = "data",
        init_split_prob: float = 0.99,
        elbo: str = "vectorised",
        clip_margin: float | None = 0.5,
        split_alpha: float = 0.95,
        split_beta: float = 2.0,
        split_scale: float = 1.0,
        leaf_scale: float = 1.0,
        random_state: int | None = None,
        device=None,
        dtype="float32",
        progress: bool = False,
    ):
        self.depth = depth
        self.kl_weight = kl_weight
        self.num_steps = num_steps
        self.lr = lr
        self.lr_decay = lr_decay
        self.num_fits = num_fits
        self.batch_size = batch_size
        self.temperature_start = temperature_start
        self.temperature_end = temperature_end
        self.num_samples = num_samples
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.calibrate = calibrate
        self.calibration_level = calibration_level
        self.min_calibration_rows = min_calibration_rows
        self.refit = refit
        self.init = init
        self.init_split_prob = init_split_prob
        self.elbo = elbo
        self.clip_margin = clip_margin
        self.split_alpha = split_alpha
        self.split_beta = split_beta
        self.split_scale = split_scale
        self.leaf_scale = leaf_scale
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.progress = progress

    _parameter_constraints = {
        "dtype": Checked(resolve_dtype),
        **VART_CONSTRAINTS,
        "lr_decay": Real(0, low_open=True),
        "calibrate": OneOf("coverage", "likelihood", None, True, False),
        "calibration_level": Real(0, 1, low_open=True, high_open=True),
        "min_calibration_rows": Integer(1, none=True),
        "refit": Boolean(),
    }

    # ------------------------------------------------------------------ fitting
    def _after_fit(self, X, y, split: HeldOut, fits: list) -> None:
        """The noise calibration on the fits' held-out rows (and, with
        ``min_calibration_rows``, cross-fitted folds), then the posterior trees drawn
        once: predicting changes no attribute."""
        held = self._pool(fits)
        calibration = NoiseCalibration.of(self)
        ranks, n, n_val = self.ranks_, X.shape[0], split.n_val
        num_folds = int(ranks.min(calibration.folds(n, n_val)))
        self.noise_factor_ = 1.0
        self._tree_samples = None
        if n_val and calibration.rule is not None:  # the held-out rows are in random order
            # the fits' own folds are scored; cross-fitting adds the folds after them
            first = int(ranks.min(min(len(held), n // n_val)))
            fits = self._posterior().all_fit_leaves()  # each fit's trees, drawn once
            extra = [self._fold_scores(X, y, split, k, fits) for k in range(first, num_folds)]
            rows = -(-CALIBRATION_ROWS // ranks.size) if ranks.spread else CALIBRATION_ROWS
            rows = -(-rows // len(held))  # shared among the fits
            held = [(Xva[:rows], yva[:rows]) for Xva, yva in held]
            self.noise_factor_ = self._calibrate_noise(held, extra, fits)
            self._tree_samples = self._posterior().calibrated(self.noise_factor_)
        self._posterior().leaves()  # drawn here once: predicting changes no attribute

    def _calibrate_noise(self, held, extra=(), fits=None) -> float:
        """The noise factor of ``calibrate`` (:class:`NoiseCalibration`) from each
        fit's held-out standardised rows, ``held`` a list of ``(Xva, yva)`` ``(n_j, L)``,
        ``(n_j,)``, one per fit in the order of ``guides_``; ``extra``: cross-fitted
        folds' scores; ``fits``: the fits' posterior trees (default:
        :meth:`PosteriorTrees.all_fit_leaves`). Each fit's rows are read under its own
        posterior trees (factor 1), which never saw them, in the pool's shape
        (:func:`_pool_shaped_mixtures`); what the rule read is kept in
        ``noise_calibration_``."""
        posterior = self._posterior()
        fits = posterior.all_fit_leaves() if fits is None else fits
        mixtures = [
            _pool_shaped_mixtures(fits[j], fits, posterior.batches(Xva, yva, parts=len(fits)))
            for j, (Xva, yva) in enumerate(held)
        ]
        c, self.noise_calibration_ = NoiseCalibration.of(self).factor(
            mixtures,
            extra,
            num_samples=int(self.num_samples),
            num_fits=len(fits),
            ranks=self.ranks_,
        )
        return c

    def _fold_scores(self, X, y, split, k: int, fits: list[dict]) -> torch.Tensor:
        """Coverage scores of fold ``k`` of the held-out ``split`` (a
        :class:`~pyro_trees.estimators._template.HeldOut`) under one
        fit that holds them out (for early stopping, as each of the estimator's fits does
        with its own fold), seeded ``seed_ + k``, in the pool's shape
        (:func:`_pool_shaped_mixtures` about that fit, with the offsets of the
        estimator's fits, whose posterior trees are ``fits``)."""
        rows, rest = split.fold(k)
        params = dict(self.get_params(), calibrate=None, min_calibration_rows=None)
        params.update(progress=False, random_state=self._seed() + k, num_fits=1)
        other = type(self)(**params)
        other.seed_ = self._seed() + k
        self._share_inputs(other)
        gen = torch.Generator().manual_seed(other.seed_)
        own = HeldOut(torch.cat([rows, rest]), split.n_val)  # fold k first
        ((Xva, yva),) = other._pool(other._fit_all(X, y, own, gen))
        other.noise_factor_, other._tree_samples = 1.0, None
        batches = self._posterior().batches(
            Xva[:CALIBRATION_ROWS], yva[:CALIBRATION_ROWS], parts=len(fits)
        )
        mixtures = _pool_shaped_mixtures(other._posterior().raw_leaves(), fits, batches)
        scores = _mixture_scores(mixtures, float(self.calibration_level))
        return self.ranks_.gather(scores)

    def _model(self, num_features: int, depth: int):
        """The model of a fit: :class:`~pyro_trees.models.VaRT` of the prior's parameters."""
        keys = ("kl_weight", "split_alpha", "split_beta", "split_scale", "leaf_scale")
        return VaRT(
            num_features, missing=self._fit_missing(), **{k: getattr(self, k) for k in keys}
        )

    def _held_out_score(self, guide, Xva, yva) -> float:
        """The held-out RMSE of the guide's central tree (all ranks' rows)."""
        with torch.no_grad():
            sse = float((self._central_mean(guide, Xva) - yva).pow(2).sum())
        return self.ranks_.mean_error(sse, yva.shape[0]) ** 0.5

    def _central_mean(self, guide, Xs):
        """The guide's central tree's predictions (early stopping)."""
        return tree_mean(guide.mean_tree(), Xs)

    # --------------------------------------------------------------- prediction
    _stack_posterior = staticmethod(stack_tree)

    def _posterior(self) -> PosteriorTrees:
        """The posterior trees behind every prediction (:class:`PosteriorTrees`), drawn
        once and kept in ``_tree_samples`` (``None``: drawn again, with the same seed)."""
        check_is_fitted(self, "guide_")
        if getattr(self, "_tree_samples", None) is None:
            self._tree_samples = PosteriorTrees.of(self)
        return self._tree_samples

    def _all_fit_leaves(self) -> list[dict]:
        """Each fit's own posterior trees (:meth:`PosteriorTrees.all_fit_leaves`)."""
        return self._posterior().all_fit_leaves()

    def _prepare(self, X) -> torch.Tensor:
        """New rows checked, standardised and clipped (``clip_margin``)."""
        return clip_to_training_range(self, self._validate_predict(X))

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

    def predict(self, X, return_std: bool = False):
        """Posterior predictive mean (eq. 32): the average over posterior trees of
        :math:`\\sum_i \\kappa_i P(x \\to i)\\, \\theta_i^\\top x`; shape ``(N,)``.

        :param bool return_std: also return the standard deviation of the posterior
            predictive (the Gaussian mixture over the ``num_samples`` trees and their
            leaves, calibrated noise included), ``(N,)``.
        """
        Xs = self._prepare(X)
        mean = self._outputs(self._posterior().function_draws(Xs)).mean(0)
        if not return_std:
            return mean
        return mean, self._output_scale(self._posterior().mixture_std(Xs))

    def sample_function(self, X, num_samples: int | None = None) -> np.ndarray:
        """Posterior draws of the regression function :math:`E[y \\mid x, T, \\Theta]`,
        one per posterior tree: shape ``(num_samples, N)`` (credible bands for means)."""
        Xs = self._prepare(X)
        draws = self._outputs(self._posterior().function_draws(Xs))
        return self._take(draws, num_samples)

    def sample(self, X, num_samples: int | None = None) -> np.ndarray:
        """Draws of the posterior predictive :math:`y^*` (eq. 32), ``(num_samples, N)``.

        Draw ``j`` comes from posterior tree ``j mod S``, with ``S`` the estimator's
        ``num_samples``: the first ``S`` draws are one per tree, and any further ones
        are more draws of :math:`y^*` from the same trees in rounds of ``S``, each
        round with its own fixed seed. Every draw thus follows the Gaussian mixture
        over the ``S`` trees whose quantiles ``predict_interval`` returns, ``n < S``
        draws are the first ``n`` of the ``S``, and repeated calls (also after
        pickling) return the same draws.

        :param num_samples: any number ``>= 1`` (default: the estimator's
            ``num_samples``).
        """
        Xs = self._prepare(X)
        per_round = int(self.num_samples)
        want = per_round if num_samples is None else int(num_samples)
        if want < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        # round r draws with seed seed_ + 3 + r, so the first round is the default call's
        rounds = [
            self._outputs(self._posterior().predictive(Xs, ("obs",), self._seed() + 3 + r)["obs"])
            for r in range(-(-want // per_round))
        ]
        return np.concatenate(rounds)[:want]

    def predict_interval(self, X, level: float = 0.9, *, method: str = "exact"):
        """Equal-tailed Bayesian predictive interval of probability ``level``.

        :param str method: ``"exact"`` (default): the quantiles
            :math:`(1 \\mp \\mathrm{level})/2` of the posterior predictive itself, the
            Gaussian mixture over the ``num_samples`` posterior trees and their leaves
            (eq. 32), solved per row by safeguarded Newton steps on its CDF (so a
            row is inside iff its :meth:`coverage_scores` at ``level`` is at most
            ``noise_factor_``, wherever the CDF at ``y`` moves monotonically toward
            1/2 as the noise grows). ``"draws"``: empirical quantiles of the
            ``num_samples`` draws of :meth:`sample` (one per tree; a Monte
            Carlo estimate of the same interval, slightly narrow on average).
        :returns: ``(lower, upper)``, each ``(N,)``.
        """
        level = check_level(level)
        if method == "draws":
            draws = self.sample(X)
            lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2], axis=0)
            return lo, hi
        if method != "exact":
            raise ValueError(f"method must be 'exact' or 'draws', got {method!r}")
        probs = ((1 - level) / 2, (1 + level) / 2)
        Xs = self._prepare(X)
        q = self._outputs(self._posterior().mixture_quantiles(Xs, probs))
        return q[0], q[1]

    @torch.no_grad()
    def coverage_scores(self, X, y, level: float | None = None) -> np.ndarray:
        """Each row's coverage score: the least noise factor (relative to the fitted
        leaf noise, before ``noise_factor_``) from which ``y`` lies inside the central
        ``level`` interval of the exact posterior predictive (the Gaussian mixture over
        the ``num_samples`` trees and their leaves) for every larger factor (log grid
        over :math:`[2^{-6}, 2^8]`, refined by bisection; ``inf`` beyond it).

        A row is inside the ``level`` interval of the calibrated predictive iff its
        score is at most ``noise_factor_``; ``calibrate="coverage"`` chooses the
        factor from these scores on the held-out rows
        (:func:`~pyro_trees.estimators.noise_factor_from_scores`). ``predict_interval``
        estimates the same interval from ``num_samples`` draws.

        :param X: ``(N, L)``.
        :param y: ``(N,)``.
        :param level: default ``calibration_level``.
        :returns: ``(N,)`` scores.
        """
        level = check_level(self.calibration_level if level is None else level)
        Xs = self._prepare(X)
        return self._standardised_scores(Xs, self._scaled_targets(y, Xs.shape[0]), level)

    def _standardised_scores(self, Xs: torch.Tensor, ys: torch.Tensor, level: float):
        """:meth:`coverage_scores` of standardised (and clipped) rows."""
        posterior = self._posterior()
        tree = posterior.raw_leaves()
        mixtures = ((yb, *_row_mixtures(tree, xb)) for xb, yb in posterior.batches(Xs, ys))
        return _mixture_scores(mixtures, level).cpu().numpy()

    # ------------------------------------------------------------ interpretation
    def sample_importances(self, X) -> np.ndarray:
        """The features' shares in the splits under each posterior tree (or forest):
        ``(num_samples, L)``, each row summing to one; their spread is the posterior
        uncertainty of ``feature_importances_``.

        Draw :math:`s` is one of the ``num_samples`` hard posterior trees behind
        ``predict``: :math:`\\sum_i \\psi_i |\\beta_{ij}| / \\sum_k |\\beta_{ik}|` over its
        internal nodes :math:`i` (:math:`\\psi_i` whether node :math:`i` exists and
        splits, :math:`\\beta_i` its split weights), each node weighted by the share of
        the rows ``X`` that reach it under the tree's soft routing.
        ``feature_importances_`` is the same sum with the guide's expected split
        indicators and mean weights, over the training rows.

        :param X: ``(N, L)`` rows that weight the nodes by their reach (the training
            rows, or any others).
        """
        Xs = self._prepare(X)[:4096]
        posterior = self._posterior()
        samples = posterior.samples
        if bool(torch.isnan(Xs).any()):  # rows with missing inputs: rho of every tree
            samples = {**samples, **posterior.prior_rho(samples)}
        return _importance_draws(samples, self.model_.site, self.guide_.depth, Xs)

    _one_tree = True  # export_text: subclasses of another kind (the forest) set False

    @available_if(_describes_one_tree)
    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The most probable tree under the guide
        (:meth:`~pyro_trees.guides.VaRTGuide.most_probable_structure`) as indented text in the style
        of ``sklearn.tree.export_text``.

        Splits are oblique (:math:`x` goes left iff :math:`\\tilde\\mu_i^\\top x > 0`); each
        is printed as its dominant feature (largest standardised weight, its share in
        brackets) with the threshold where the rule flips when the other inputs sit at
        their training means. Leaves (linear models) print their prediction at the
        training mean of the inputs, their noise scale and their three largest slopes.

        :param feature_names: ``L`` names of the inputs (default: the column names of a
            frame passed to ``fit``, else ``x_0``, ``x_1``, ...).
        :param int decimals: printed digits.
        """
        check_is_fitted(self, "guide_")
        names = self._feature_names(feature_names)
        return _export_text(self.guide_, self.x_scaler_, self.y_scaler_, names, decimals)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tree_samples"] = None  # drawn again with the same seed after loading
        state.pop("_leaf_cache", None)
        return state

    _pickled_defaults = {
        "min_calibration_rows": None,
        "refit": False,
        "init_split_prob": 0.9,
        "lr_decay": 1.0,
        "num_fits": 1,
        "dtype": "float32",
    }

    def __setstate__(self, state):
        state = dict(state)
        if "guide_" in state and "stopping_results_" not in state:  # fitted with one fit
            stop = state.get("stopping_result_")
            state["stopping_results_"] = [] if stop is None else [stop]
        super().__setstate__(state)
