"""``VaRTClassifier``: scikit-learn style variational tree classifier (probit or softmax).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* J. H. Albert, S. Chib, *Bayesian analysis of binary and polychotomous response data*,
  JASA 1993.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyro
import torch
from pyro.infer import Trace_ELBO
from sklearn.base import ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from pyro_trees.estimators._base import TabularEstimator
from pyro_trees.estimators._distributed import RankRows, RankVaRTELBO, fit_args, rank_fit
from pyro_trees.estimators._missing import MissingInputs
from pyro_trees.estimators._rng import MEMBER_SEED, local_seed
from pyro_trees.estimators._vart_export import _importance_draws, _split_importances
from pyro_trees.estimators._vart_posterior import (
    MISSING_SEED,
    check_n_fits,
    clip_to_training_range,
    fitted_guides,
    pooled_guide_draws,
    prior_rho_sites,
    training_range,
)
from pyro_trees.estimators.vart_memory import PREDICT_BYTES
from pyro_trees.estimators.vart_memory import check_prediction_memory as _check_prediction_memory
from pyro_trees.estimators.vart_memory import check_training_memory as _check_training_memory
from pyro_trees.guides.vart import TemperatureSchedule, VaRTGuide
from pyro_trees.infer.fit import EarlyStopping, fit
from pyro_trees.infer.vart_elbo import VaRTELBO
from pyro_trees.models import stack_trees as _stack_trees
from pyro_trees.models.vart_classification import VaRTClassification, base_rate_offset

__all__ = ["VaRTClassifier"]


class VaRTClassifier(MissingInputs, ClassifierMixin, TabularEstimator):
    """A variational tree classifier: VaRT's tree prior with a probit (two classes) or
    softmax (more classes) link on the leaves' values.

    Fits :class:`~pyro_trees.models.VaRTClassification` with the truncated guide
    :class:`~pyro_trees.guides.VaRTGuide` by maximising the :math:`\\lambda`-weighted ELBO
    (eq. 4 of the VaRT paper, the categorical likelihood in place of eq. 27) with
    ClippedAdam through :func:`~pyro_trees.infer.fit`, annealing the Gumbel-softmax
    temperature geometrically from ``temperature_start`` to ``temperature_end``. Inputs
    are standardised inside. Each node has one linear leaf function per output (one for
    probit, one per class for softmax); a tree's value for a row is the routing-weighted
    sum of its leaves' values.

    ``predict_proba`` averages the class probabilities of ``num_samples`` posterior trees
    drawn once, at the end of ``fit``, from the guide with hard split indicators
    (temperature 0) and a fixed seed: the posterior predictive
    :math:`P(y = k \\mid x) = E_q[P(y = k \\mid x, T, \\Theta)]`. Predictions are
    deterministic and identical after pickling.

    ``X`` may hold missing values (NaN), at fit, at prediction or both, as for
    :class:`~pyro_trees.estimators.VaRTRegressor`: with missing training values each
    split learns where a missing input goes (:class:`~pyro_trees.models.VaRTClassification`
    with ``missing=True``); a fit without any is the fit it always was, and routes rows
    with NaN by the prior of that probability. ``missing_fraction_`` records the share
    of training rows missing each feature.

    :param int depth: truncation depth :math:`D` of the guide.
    :param float kl_weight: :math:`\\lambda` of eq. 4. The default 1 is the plain ELBO (the
        regressor's 1e-3 relies on its held-out noise calibration, which a classifier
        has no analogue of): at 1e-3 the linear probit or softmax leaves of a depth-5
        tree separate their training rows and the held-out log loss rises within a
        hundred steps (test error 0.180 against 0.136 at 1 on binarised concrete,
        0.049 against 0.039 on breast cancer; two splits, ``benchmarks/vart_classification.py``
        seeds 0 and 1, not those of its recorded run).
    :param int num_steps: gradient steps (at most; early stopping may stop sooner).
    :param float lr: ClippedAdam learning rate.
    :param batch_size: minibatch size; ``None`` uses full batches up to 2048 rows.
    :param float temperature_start: initial Gumbel-softmax temperature.
    :param float temperature_end: final temperature.
    :param int num_samples: posterior trees averaged by ``predict_proba``.
    :param int num_fits: fits pooled by ``predict_proba``: each trains like the first (its
        own seed, early-stopped on the same held-out rows) and gives its share of the
        ``num_samples`` posterior trees (``num_samples // num_fits``, one more for the
        first ``num_samples % num_fits``), so prediction costs do not grow with it; the
        temperature of ``calibrate`` is fitted on the pooled trees. Guides in ``guides_``
        (``guide_`` is the first), results in ``fit_results_``; ``feature_importances_``
        is their mean. Training costs ``num_fits`` fits. The default 3: on the seven sets
        of ``benchmarks/vart_classification.py`` the pool of three has a lower Brier
        score than one fit on all seven and a lower ECE on six, and its error is nowhere
        higher (VaRT guide page).
    :param float validation_fraction: share of the training rows held out (at random,
        seeded by ``seed_``) for early stopping on their log loss under the guide's
        central tree; ``0`` trains every row for ``num_steps`` steps. At least
        ``min(10, N // 5)`` rows are held out; none when that is below 4.
    :param patience: early stopping: evaluations without improvement before training
        stops (the best parameters are kept); ``None`` trains all ``num_steps`` and keeps
        the best. The held-out log loss of the central tree is noisy from one evaluation
        to the next; 20 evaluations (400 steps) keep training through that noise (5
        stopped binarised concrete at about 120 steps, test error 0.161 against 0.136).
    :param int eval_every: steps between held-out evaluations.
    :param link: ``"probit"``, ``"softmax"`` or ``None`` (default: probit for two
        classes, softmax for more).
    :param bool calibrate: temperature-scale the posterior predictive on the held-out
        rows: :math:`p_k \\propto \\bar p_k^{1/T}` with :math:`\\bar p` the mean over the
        posterior trees and :math:`T` (``temperature_``, a log grid over
        :math:`[1/4, 4]`) minimising the held-out log loss (Guo et al., 2017). One number,
        read off rows that chose only the stopping step; without held-out rows
        :math:`T = 1`. The calibration never goes by rows it cannot be checked on:
        with a class that has no held-out row (a rare class: sharpening would shrink
        its probabilities towards 0 unopposed) :math:`T = 1` with a warning, and
        :math:`T` is kept only when it lowers the held-out log loss out of sample
        (leave-one-out: each held-out row scored at the temperature fitted on the
        others), else :math:`T = 1` (with a warning when the least log loss was at
        the grid's edge). A :math:`T` at the edge that passes the check is kept: on
        separable rows the log loss falls without end as :math:`T \\to 0`.
    :param bool base_rate: put the prior mean of every leaf at the training rows' class
        frequencies: the link reads :math:`f(x) + b` with :math:`b` fixed at
        :func:`~pyro_trees.models.vart_classification.base_rate_offset` of their class
        counts (:math:`\\Phi^{-1}(\\pi_1)` for probit, as BART's probit; centred
        :math:`\\log \\pi_k` for softmax). ``False``: :math:`b = 0`, every leaf's prior
        mean at equal class probabilities, which pulls a rare class's probabilities up
        (400 rows of noise features, 1 % positives: mean P(1) 0.015-0.040 on new rows
        at ``False``, 0.008-0.016 at ``True``, four data sets). Balanced classes give
        :math:`b \\approx 0` either way.
    :param str init: ``"data"`` (default) starts the split rules through random training
        points; ``"random"`` uses random hyperplanes through the origin.
    :param float init_split_prob: initial split probability of every internal node of
        the guide (0.99: start from the full tree of depth ``depth``).
    :param str elbo: ``"vectorised"`` (default, :class:`~pyro_trees.infer.VaRTELBO`) or
        ``"trace"`` (:class:`pyro.infer.Trace_ELBO`): the same estimator.
    :param clip_margin: clip each input of a new row to its training range widened by
        ``clip_margin`` times its width on each side (linear leaves extrapolate without
        bound); ``None`` never clips.
    :param float split_alpha: prior split probability at the root.
    :param float split_beta: depth decay of the prior split probability.
    :param float split_scale: prior standard deviation of the split weights.
    :param float leaf_scale: prior standard deviation of the leaf weights (on the probit
        or logit scale).
    :param random_state: an int seeds initialisation, training and the posterior trees;
        ``None`` draws a seed from torch's global stream (kept as ``seed_``). The global
        random streams are left as they were.
    :param device: torch device (default CPU).
    :param bool progress: show a progress bar.

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTClassifier
    >>> X = np.random.default_rng(0).normal(size=(60, 2))
    >>> y = np.where(X[:, 0] > 0, "yes", "no")
    >>> clf = VaRTClassifier(depth=2, num_steps=30, num_samples=5, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:3]).shape, clf.classes_.tolist()
    ((3, 2), ['no', 'yes'])
    >>> bool(np.allclose(clf.predict_proba(X).sum(1), 1.0))
    True
    """

    def __init__(
        self,
        depth: int = 5,
        kl_weight: float = 1.0,
        *,
        num_steps: int = 1000,
        lr: float = 0.03,
        batch_size: int | None = None,
        temperature_start: float = 1.0,
        temperature_end: float = 0.1,
        num_samples: int = 50,
        num_fits: int = 3,
        validation_fraction: float = 0.1,
        patience: int | None = 20,
        eval_every: int = 20,
        link: str | None = None,
        calibrate: bool = True,
        base_rate: bool = True,
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
        progress: bool = False,
    ):
        self.depth = depth
        self.kl_weight = kl_weight
        self.num_steps = num_steps
        self.lr = lr
        self.batch_size = batch_size
        self.temperature_start = temperature_start
        self.temperature_end = temperature_end
        self.num_samples = num_samples
        self.num_fits = num_fits
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.link = link
        self.calibrate = calibrate
        self.base_rate = base_rate
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
        self.progress = progress

    # ------------------------------------------------------------------ fitting
    def _check_options(self) -> None:
        if int(self.num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie in [0, 1), got {self.validation_fraction}"
            )
        if self.clip_margin is not None and not float(self.clip_margin) >= 0:
            raise ValueError(f"clip_margin must be >= 0 or None, got {self.clip_margin}")
        if self.init not in ("data", "random"):
            raise ValueError(f"init must be 'data' or 'random', got {self.init!r}")
        if self.elbo not in ("vectorised", "trace"):
            raise ValueError(f"elbo must be 'vectorised' or 'trace', got {self.elbo!r}")
        if int(self.eval_every) < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        self._n_fits()

    def fit(self, X, y, *, sharded: bool = False):
        """Fit the variational posterior on ``X`` ``(N, L)`` and labels ``y`` ``(N,)``.

        Under ``torchrun`` the fit is data-parallel, as
        :meth:`VaRTRegressor.fit <pyro_trees.estimators.VaRTRegressor.fit>` is (see the
        guide's "Estimators on several processes"); the fitted estimator is the same on
        every rank.

        :param X: ``(N, L)`` array-like or pandas DataFrame of numeric or bool columns.
        :param y: ``(N,)`` class labels (any hashable values, at least two classes).
        :param bool sharded: under ``torchrun``, each rank passes only its own rows
            (default: every rank passes all of them). The scaler, the classes, the
            clipping range, the held-out log loss and the temperature of ``calibrate``
            then use every rank's rows (all-reduced); each rank holds out
            ``validation_fraction`` of its own rows, and ``init="data"`` picks its split
            points among rank 0's rows (broadcast).
        :returns: ``self``.
        :raises ValueError: naming the cause, for invalid options or data.
        """
        self._check_options()
        if sharded and self.elbo == "trace":
            raise ValueError("sharded=True needs elbo='vectorised' (the default)")
        X, y = self._validate_fit(X, y, sharded=sharded)
        self._note_missing(X)
        ranks = self.ranks_
        n, num_features = X.shape
        if self.random_state is None:  # unseeded: rank 0's draw, shared
            self.seed_ = ranks.shared(int(torch.randint(2**31, ()).item()))
        else:
            self.seed_ = int(self.random_state)
        gen = torch.Generator().manual_seed(self.seed_)
        n_val = 0
        if self.validation_fraction > 0:
            n_val = max(int(round(self.validation_fraction * n)), min(10, n // 5))
            n_val = 0 if n_val < 4 else n_val
        if ranks.spread and not ranks.min(n_val):  # every shard holds out rows, or none
            n_val = 0
        perm = torch.randperm(n, generator=gen) if n_val else torch.arange(n)
        perm = perm.to(X.device)
        Xtr, ytr = X[perm[n_val:]], y[perm[n_val:]]
        n_train = ranks.count(n - n_val)  # over every rank's rows
        batch = min(n_train, 2048) if self.batch_size is None else int(self.batch_size)
        if batch < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        batch = min(batch, n_train)
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            self.model_ = VaRTClassification(
                num_features,
                self.n_classes_,
                link=self.link,
                kl_weight=self.kl_weight,
                split_alpha=self.split_alpha,
                split_beta=self.split_beta,
                split_scale=self.split_scale,
                leaf_scale=self.leaf_scale,
                missing=self._fit_missing(),
            )
            if self.base_rate:  # the training rows' class frequencies (every rank's)
                counts = ranks.sum(torch.bincount(ytr, minlength=self.n_classes_).double())
                self.model_.offset = base_rate_offset(counts.cpu(), self.model_.link)
            width = self.model_.leaf_width - 1  # the memory checks count L + 1 weights
            depth = _check_training_memory(self.depth, batch, width, X.device)
            _check_prediction_memory(depth, int(self.num_samples), width, X.device)
            self.x_min_, self.x_max_ = training_range(ranks, Xtr)
            Xva, yva = self._clip(X[perm[:n_val]]), y[perm[:n_val]]
        guides, results, importances = [], [], []
        for j in range(self._n_fits()):
            seed = self.seed_ + j * MEMBER_SEED
            gen_j = gen if j == 0 else torch.Generator().manual_seed(seed)
            guide, result = self._fit_member(
                depth, Xtr, ytr, Xva, yva, gen_j, seed, batch, n_train, X.device
            )
            guides.append(guide)
            results.append(result)
            importances.append(_split_importances(guide, Xtr[:4096], ranks))
        self.guides_, self.fit_results_ = guides, results
        self.guide_, self.fit_result_ = guides[0], results[0]
        self.feature_importances_ = np.mean(importances, axis=0)
        self.trees_ = self._draw_trees()
        self.temperature_ = 1.0
        if n_val and self.calibrate:
            self.temperature_ = self._fit_temperature(Xva, yva)
        return self

    def _fit_member(self, depth, Xtr, ytr, Xva, yva, gen, seed, batch, n_train, device):
        """One fit of ``num_fits``: a guide initialised from ``gen`` and trained on ``Xtr``,
        ``ytr`` with the draws of ``seed``, early-stopped on the held-out ``Xva``, ``yva``
        (none held out: all ``num_steps``). Returns the guide and its
        :class:`~pyro_trees.infer.FitResult`."""
        ranks, model, n_val = self.ranks_, self.model_, Xva.shape[0]
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            guide = VaRTGuide(
                model,
                depth,
                temperature=self.temperature_start,
                init="random",  # the data-driven start follows, from ``gen``
                init_split_prob=self.init_split_prob,
                generator=gen,
            )
            if self.init == "data":
                guide.init_splits_from_data(Xtr, generator=gen)
            ranks.broadcast_modules(guide)  # sharded: rank 0's start
            guide.to(device)
            schedule = TemperatureSchedule(
                max(int(self.num_steps), 1), self.temperature_start, self.temperature_end
            )
            # under torchrun the batch is split across the ranks (subsample_size per rank)
            per_rank = max(batch // ranks.size, 1)
            kwargs = {} if batch >= n_train else {"subsample_size": per_rank}
            if n_val:

                def val_log_loss() -> float:
                    with torch.no_grad():
                        logp = model.class_log_probs(guide.mean_tree(), Xva)
                        total = float(-logp.gather(-1, yva.unsqueeze(-1)).sum())
                        return ranks.mean_error(total, n_val)

                kwargs["early_stopping"] = EarlyStopping(
                    val_log_loss, eval_every=int(self.eval_every), patience=self.patience
                )
            if self.elbo != "vectorised":
                loss = Trace_ELBO()
            elif ranks.size > 1:  # this rank's rows of each batch
                loss = RankVaRTELBO(RankRows(ranks, seed), data=(Xtr, ytr))
            else:
                loss = VaRTELBO()
            with local_seed(seed, device), rank_fit(ranks):
                result = fit(
                    model,
                    guide,
                    *fit_args(ranks, Xtr, ytr),
                    num_steps=int(self.num_steps),
                    loss=loss,
                    optim="clipped_adam",
                    lr=self.lr,
                    progress=self.progress and "VaRT classifier",
                    callback=schedule.callback(guide),
                    **kwargs,
                )
        return guide, result

    def _n_fits(self) -> int:
        """``num_fits`` checked (also against ``num_samples``, which the fits share)."""
        return check_n_fits(self.num_fits, self.num_samples)

    @torch.no_grad()
    def _fit_temperature(self, Xs: torch.Tensor, y: torch.Tensor) -> float:
        """The temperature of the held-out rows ``Xs`` ``(n, L)``, ``y`` ``(n,)`` (see
        ``calibrate``): the least log loss on a log grid over [1/4, 4], kept only when
        every class has a held-out row and the leave-one-out check beats ``T = 1``;
        else 1. Sharded, every rank's held-out rows count (the sums all-reduced)."""
        ranks = self.ranks_
        counts = ranks.sum(torch.bincount(y, minlength=self.n_classes_).double())
        if bool((counts == 0).any()):
            missing = [self.classes_[k] for k in (counts == 0).nonzero().flatten().tolist()]
            warnings.warn(
                f"VaRTClassifier: no held-out row of class {', '.join(map(str, missing))} "
                f"(of {int(counts.sum())} held-out rows); a temperature would move that "
                "class's probabilities with no row to check them on, so calibration is "
                "skipped (temperature_ = 1). Hold out more rows (validation_fraction) to "
                "calibrate.",
                UserWarning,
                stacklevel=4,  # the caller of fit (through torch.no_grad)
            )
            return 1.0
        log_p = self._tree_probs_std(Xs).double().mean(0).clamp_min(1e-300).log()
        grid = torch.logspace(-2, 2, 41, base=2.0, dtype=torch.float64)
        # per-row log loss at each temperature, (n, 41), and at T = 1, (n,)
        scaled = (log_p.unsqueeze(-1) / grid).log_softmax(-2)  # (n, K, 41)
        rows = -scaled.gather(-2, y.view(-1, 1, 1).expand(-1, 1, grid.numel())).squeeze(-2)
        raw = -log_p.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        nll = ranks.sum(rows.sum(0))  # (41,)
        best = int(torch.argmin(nll))
        # leave-one-out: each row scored at the temperature fitted without it; the
        # calibration must beat no calibration on rows that did not choose it
        loo = (nll - rows).argmin(-1, keepdim=True)  # (n, 1)
        crossed = ranks.sum(rows.gather(-1, loo).sum())
        if bool(crossed < ranks.sum(raw.sum())):
            return float(grid[best])
        if best in (0, grid.numel() - 1):  # the signature of too few rows of a class
            warnings.warn(
                f"VaRTClassifier: the held-out log loss is least at the edge of the "
                f"temperature grid [1/4, 4] (T = {float(grid[best]):g}), but that "
                "temperature scores worse than none on held-out rows that did not choose "
                "it (leave-one-out; a class with few held-out rows); calibration is "
                "skipped (temperature_ = 1).",
                UserWarning,
                stacklevel=4,  # the caller of fit (through torch.no_grad)
            )
        return 1.0

    def _draw_trees(self) -> dict:
        """``num_samples`` hard posterior trees, stacked (batch ``(S,)``), drawn once."""
        return _stack_trees(self._draws(), self.guide_.depth)

    def _draws(self) -> dict:
        """The ``num_samples`` hard posterior draws by site (seeded ``seed_ + 1``)."""
        dummy = torch.zeros(1, self.n_features_in_, dtype=self.dtype_, device=self.device_)
        return pooled_guide_draws(fitted_guides(self), int(self.num_samples), dummy, self.seed_ + 1)

    def _prior_rho(self, samples: dict) -> dict:
        """``rho_d`` sites from the prior for the posterior draws ``samples`` of a fit
        without missing values (seeded ``seed_ + MISSING_SEED``; empty for a fit with
        some)."""
        return prior_rho_sites(self.model_, samples, self.guide_.depth, self.seed_ + MISSING_SEED)

    def _clip(self, Xs: torch.Tensor) -> torch.Tensor:
        return clip_to_training_range(self, Xs)

    # --------------------------------------------------------------- prediction
    @torch.no_grad()
    def _tree_probs(self, X) -> torch.Tensor:
        """Class probabilities under each posterior tree, ``(S, N, K)``."""
        check_is_fitted(self, "trees_")
        return self._tree_probs_std(self._clip(self._validate_predict(X)))

    def _tree_probs_std(self, Xs: torch.Tensor) -> torch.Tensor:
        S = int(self.num_samples)
        nodes = self.trees_["split"].shape[-1]
        per_row = 4 * S * nodes * max(self.model_.num_outputs, 2) * 3
        rows = max(1, PREDICT_BYTES // per_row)
        tree = self.trees_
        if tree.get("rho") is None and bool(torch.isnan(Xs).any()):  # rho from its prior
            draws = self._draws()
            tree = _stack_trees({**draws, **self._prior_rho(draws)}, self.guide_.depth)
        out = [
            self.model_.class_log_probs(tree, Xs[i : i + rows]).exp()
            for i in range(0, Xs.shape[0], rows)
        ]
        return torch.cat(out, -2)

    def predict_proba(self, X) -> np.ndarray:
        """Posterior predictive class probabilities, ``(N, K)`` (columns in the order of
        ``classes_``; rows sum to one): the mean over the posterior trees, raised to
        ``1 / temperature_`` and renormalised (``calibrate``)."""
        probs = self._tree_probs(X).double().mean(0)
        temperature = float(getattr(self, "temperature_", 1.0))
        if temperature != 1.0:
            probs = (probs.clamp_min(1e-300).log() / temperature).softmax(-1)
        probs = probs / probs.sum(-1, keepdim=True)
        return probs.cpu().numpy()

    def predict_log_proba(self, X) -> np.ndarray:
        """``log(predict_proba(X))``, ``(N, K)``."""
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))

    def sample_proba(self, X, num_samples: int | None = None) -> np.ndarray:
        """Class probabilities under each posterior tree, ``(num_samples, N, K)``
        (their spread is the posterior uncertainty of the probabilities; their mean is
        ``predict_proba`` before the temperature of ``calibrate``)."""
        draws = self._tree_probs(X).double().cpu().numpy()
        if num_samples is not None:
            if not 1 <= int(num_samples) <= draws.shape[0]:
                raise ValueError(
                    f"num_samples must lie in [1, {draws.shape[0]}], got {num_samples}"
                )
            draws = draws[: int(num_samples)]
        return draws

    def sample_importances(self, X) -> np.ndarray:
        """The features' shares in the splits under each of the ``num_samples``
        posterior trees behind ``predict_proba``: ``(num_samples, L)``, rows summing to
        one (:meth:`VaRTRegressor.sample_importances
        <pyro_trees.estimators.VaRTRegressor.sample_importances>`; their mean is close to
        ``feature_importances_``, which plugs in the guide's expectations).

        :param X: ``(N, L)`` rows that weight the nodes by their reach.
        """
        check_is_fitted(self, "trees_")
        Xs = self._clip(self._validate_predict(X))[:4096]
        samples = self._draws()
        if bool(torch.isnan(Xs).any()):  # rows with missing inputs: rho of every tree
            samples = {**samples, **self._prior_rho(samples)}
        return _importance_draws(samples, self.model_.site, self.guide_.depth, Xs)

    def predict(self, X) -> np.ndarray:
        """The most probable class of each row under :meth:`predict_proba`, ``(N,)``."""
        probs = self.predict_proba(X)  # raises NotFittedError before fit
        return self.classes_[probs.argmax(1)]

    def __setstate__(self, state):
        # a parameter added after an estimator was pickled: the behaviour it was fitted with
        self.__dict__.update({"num_fits": 1, "base_rate": False, **state})
