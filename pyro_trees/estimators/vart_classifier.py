"""``VaRTClassifier``: scikit-learn style variational tree classifier (probit or softmax).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* J. H. Albert, S. Chib, *Bayesian analysis of binary and polychotomous response data*,
  JASA 1993.
"""

from __future__ import annotations

import numpy as np
import pyro
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils.validation import check_is_fitted

from pyro_trees.estimators._constraints import Boolean, Checked, OneOf
from pyro_trees.estimators._temperature import TemperatureScaling
from pyro_trees.estimators._template import HeldOut
from pyro_trees.estimators._vart_export import _export_text, _importance_draws
from pyro_trees.estimators._vart_fit import VART_CONSTRAINTS, VaRTFits, clip_to_training_range
from pyro_trees.estimators._vart_posterior import (
    MISSING_SEED,
    fitted_guides,
    pooled_guide_draws,
    prior_rho_sites,
)
from pyro_trees.estimators.vart_memory import PREDICT_BYTES
from pyro_trees.models import stack_trees as _stack_trees
from pyro_trees.models.vart_classification import (
    VaRTClassification,
    base_rate_offset,
    class_logits,
)
from pyro_trees.validation import resolve_dtype

__all__ = ["VaRTClassifier"]


class VaRTClassifier(ClassifierMixin, VaRTFits):
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
    :param float kl_weight: :math:`\\lambda` of eq. 4. The default 0.3 lies between the
        regressor's 1e-3, which relies on its held-out noise calibration (a classifier has
        no analogue: at 1e-3 the linear probit or softmax leaves of a depth-5 tree
        separate their training rows and the held-out log loss rises within a hundred
        steps), and the plain ELBO's 1, the default before, which underfits: 0.3 has the
        lower test error on five of ``benchmarks/vart_classification.py``'s seven sets
        (higher on binarised concrete, 0.136 against 0.125). The VaRT guide page has the
        comparison.
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
        is their mean. Up to ``stack_max_rows`` training rows (a class attribute, 2,048:
        every full batch) the fits train as one program
        (:class:`~pyro_trees.guides.StackedGuides`), each with its own start, stopping
        and best state, in about 40-70 % of the time of one fit after another at 100 to
        2,000 rows (``benchmarks/results/stacked_fits.md``); they then differ from
        sequential fits as fits of other seeds do. The default 3: on the seven sets
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
    :param dtype: ``"float32"`` (default) or ``"float64"`` (a string or a torch dtype):
        the precision of training and prediction.
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
        kl_weight: float = 0.3,
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
        dtype="float32",
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
        self.dtype = dtype
        self.progress = progress

    _parameter_constraints = {
        "dtype": Checked(resolve_dtype),
        **VART_CONSTRAINTS,
        "link": OneOf("probit", "softmax", None),
        "calibrate": Boolean(),
        "base_rate": Boolean(),
    }
    _label = "VaRT classifier"
    #: the ``calibrate`` rule
    _temperature = TemperatureScaling()

    # ------------------------------------------------------------------ fitting
    def _member_fold(self, j: int, split: HeldOut) -> int:
        """Every fit holds out the same rows (fold 0)."""
        return 0

    def _before_fits(self, X, y, split: HeldOut) -> None:
        """The model every fit shares, its leaves' prior mean at the class frequencies
        of the training rows (``base_rate``; every rank's)."""
        ytr = y[split.fold(0)[1]]
        with pyro.settings.context(module_local_params=True), pyro.validation_enabled(False):
            self.model_ = VaRTClassification(
                X.shape[1],
                self.n_classes_,
                link=self.link,
                kl_weight=self.kl_weight,
                split_alpha=self.split_alpha,
                split_beta=self.split_beta,
                split_scale=self.split_scale,
                leaf_scale=self.leaf_scale,
                missing=self._fit_missing(),
            )
            if self.base_rate:
                counts = self.ranks_.sum(torch.bincount(ytr, minlength=self.n_classes_).double())
                self.model_.offset = base_rate_offset(counts.cpu(), self.model_.link)

    def _memory_width(self, num_features: int) -> int:
        return self.model_.leaf_width - 1  # the memory checks count L + 1 weights

    def _model(self, num_features: int, depth: int):
        """The model every fit shares (:meth:`_before_fits`)."""
        return self.model_

    def _held_out_score(self, guide, Xva, yva) -> float:
        """The held-out log loss of the guide's central tree (all ranks' rows)."""
        with torch.no_grad():
            logp = self.model_.class_log_probs(guide.mean_tree(), Xva)
            total = float(-logp.gather(-1, yva.unsqueeze(-1)).sum())
        return self.ranks_.mean_error(total, yva.shape[0])

    def _after_fit(self, X, y, split: HeldOut, fits: list) -> None:
        """The pool of fits, its posterior trees, drawn once, and the temperature of
        ``calibrate`` on the held-out rows."""
        held = self._pool(fits)
        self.trees_ = self._draw_trees()
        self.temperature_ = 1.0
        if split.n_val and self.calibrate:
            self.temperature_ = self._fit_temperature(*held[0])

    def _fit_temperature(self, Xs: torch.Tensor, y: torch.Tensor) -> float:
        """The temperature of the held-out rows ``Xs`` ``(n, L)``, ``y`` ``(n,)``
        (:class:`~pyro_trees.estimators._temperature.TemperatureScaling`)."""
        with torch.no_grad():
            probs = self._tree_probs_std(Xs)
        return self._temperature.fit(probs, y, classes=self.classes_, ranks=self.ranks_)

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

    @torch.no_grad()
    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The most probable tree under the guide as indented text in the style of
        ``sklearn.tree.export_text``: the splits as
        :meth:`VaRTRegressor.export_text <pyro_trees.estimators.VaRTRegressor.export_text>`
        prints them (oblique splits by their dominant feature and the threshold where
        the other inputs sit at their training means), and each leaf's most probable
        class with its probability at the training means of the inputs (the leaf's
        mean weights, the base rate and ``temperature_`` applied as in
        :meth:`predict_proba`). With ``num_fits > 1`` it is the first fit's tree, as
        :func:`~pyro_trees.plotting.plot_tree` draws.

        :param feature_names: ``L`` names of the inputs (default: the column names of a
            frame passed to ``fit``, else ``x_0``, ``x_1``, ...).
        :param int decimals: printed digits of thresholds.
        """
        check_is_fitted(self, "guide_")
        names = self._feature_names(feature_names)
        model, guide = self.model_, self.guide_
        width = model.in_features + 1
        theta = guide.theta_loc.detach().double().cpu()
        offset = model.offset
        temperature = float(getattr(self, "temperature_", 1.0))

        def leaf(i: int) -> str:
            scores = theta[i - 1].reshape(model.num_outputs, width)[:, -1]
            if offset is not None:
                scores = scores + offset.double().cpu()
            log_p = class_logits(scores, model.link)
            probs = (log_p / temperature).softmax(-1)
            k = int(probs.argmax())
            return f"class: {self.classes_[k]} (p = {float(probs[k]):.2f})"

        return _export_text(guide, self.x_scaler_, None, names, decimals, leaf_text=leaf)

    def predict(self, X) -> np.ndarray:
        """The most probable class of each row under :meth:`predict_proba`, ``(N,)``."""
        probs = self.predict_proba(X)  # raises NotFittedError before fit
        return self.classes_[probs.argmax(1)]

    _pickled_defaults = {"num_fits": 1, "base_rate": False, "dtype": "float32"}
