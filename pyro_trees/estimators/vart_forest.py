"""``VaRTForestRegressor``: a sum of VaRT trees (Bayesian additive VaRT) with intervals.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* H. A. Chipman, E. I. George, R. E. McCulloch, *BART: Bayesian additive regression
  trees*, Ann. Appl. Stat. 2010.
"""

from __future__ import annotations

from pyro_trees.estimators._constraints import Integer
from pyro_trees.estimators._distributed import RankVaRTForestELBO
from pyro_trees.estimators.vart import VaRTRegressor
from pyro_trees.guides.vart_forest import VaRTForestGuide
from pyro_trees.infer.vart_forest_elbo import VaRTForestELBO
from pyro_trees.models.vart_forest import VaRTForest, forest_mean, forest_tree

__all__ = ["VaRTForestRegressor"]


def stack_forest(samples: dict, model, depth: int) -> dict:
    """The posterior forests: trees of batch shape ``(S, K)`` and ``log_sigma`` ``(S,)``
    (the format :func:`~pyro_trees.models.leaf_mixtures` reads), from
    the draws by site (``rho`` included)."""
    site = model.site
    forest = forest_tree(
        [samples[site(f"split_{d}")] for d in range(depth)],
        [samples[site(f"beta_{d}")] for d in range(depth)],
        [samples[site(f"theta_{d}")] for d in range(depth + 1)],
        [samples[site(f"rho_{d}")] for d in range(depth)],
    )
    return {"forest": forest, "log_sigma": samples[site("log_sigma")].reshape(-1)}


class VaRTForestRegressor(VaRTRegressor):
    """A forest of ``num_trees`` VaRT trees under one prior, with Bayesian intervals.

    Fits :class:`~pyro_trees.models.VaRTForest` (the sum of the trees' soft regression
    functions plus one Gaussian noise; each tree's leaf scale shrunk by
    :math:`1/\\sqrt K` so that the sum's prior variance does not grow with ``num_trees``)
    with :class:`~pyro_trees.guides.VaRTForestGuide` (the truncated VaRT family per tree,
    all trees in one batched computation) by :class:`~pyro_trees.infer.VaRTForestELBO`.
    Everything else is :class:`~pyro_trees.estimators.VaRTRegressor`'s: standardised
    inputs and targets, the held-out split for early stopping, ``refit``, the noise
    calibration (the factor multiplies the forest's noise scale), the
    ``num_samples`` posterior forests drawn once with hard splits, exact predictive
    quantiles (here a Gaussian mixture with one component per posterior forest), pickling
    that reproduces predictions exactly, the ``clip_margin`` of new rows, and missing
    values (NaN) in ``X``, each split of each tree learning where they go
    (:class:`~pyro_trees.models.VaRTForest` with ``missing=True``).

    A separate class rather than ``VaRTRegressor(num_trees=...)``: the forest's
    likelihood is one Gaussian around the sum of the trees, not the single tree's
    mixture of leaves with their own noise, so ``num_trees=1`` would not give
    ``VaRTRegressor``; and its defaults differ (below).

    :param int num_trees: :math:`K`, trees in the sum.
    :param int depth: the depth of every tree.
    :param float kl_weight: weight of the KL term (1: the ELBO; the default ``1e-3``, as the
        single tree's: at 1 the mean-field guide of a sum stalls, see the VaRT guide page).
    :param float lr_decay: the learning rate falls geometrically to ``lr * lr_decay``
        over ``num_steps`` (default 0.05; a constant rate leaves the held-out error of the
        central forest jumping from one evaluation to the next).
    :param int num_fits: fits pooled by the predictive, each holding out its own fold of
        rows for early stopping and calibration (default 3: on the 18 UCI sets of
        ``benchmarks/vart_forest.py``, ten splits, three such fits have a lower RMSE
        than three refits sharing one held-out split on 16 sets, 3.4 % lower on the
        geometric mean, for the same total training time; on splits 0-2, 6 % lower
        than one fit, for three times its training time; five fits are 1.7 % lower
        than three for 1.74 times the training; prediction costs what one fit's does,
        as the ``num_samples`` posterior forests are shared out among the fits). Up to
        ``stack_max_rows`` training rows (a class attribute, 1,024) the fits train as
        one program (:class:`~pyro_trees.guides.StackedGuides`): each with its own
        fold, start, stopping and best state, as alone, but every step draws and
        scores all of them at once, which at a few hundred rows costs about what one
        fit's step does; the program runs until the last fit stops. Above it (or with
        ``refit``, ``batch_size`` below the rows, missing values, several processes,
        or a compiled loss) they train one after another. The two ways draw their
        random numbers in different orders, so their fits differ as two seeds do.
    :param bool refit: default ``False`` (``VaRTRegressor``'s is ``True``): with
        ``num_fits`` fits on their own folds a refit of each costs twice the training
        for the same accuracy.
    :param int patience: evaluations without improvement before early stopping (default
        10: the held-out error of a forest keeps improving slowly for hundreds of steps).
    :param float leaf_scale: prior scale of the sum's leaf weights (each tree's is
        ``leaf_scale / sqrt(num_trees)``).

    The other parameters are :class:`~pyro_trees.estimators.VaRTRegressor`'s (its
    ``elbo="vectorised"`` is :class:`~pyro_trees.infer.VaRTForestELBO`); ``export_text``
    describes a single tree and is not offered. How the defaults were chosen is in the
    VaRT guide page (``benchmarks/results/vart_forest_defaults.md``).

    .. rubric:: Examples

    >>> import numpy as np
    >>> from pyro_trees.estimators import VaRTForestRegressor
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> est = VaRTForestRegressor(num_trees=5, num_steps=3, num_samples=5, random_state=0)
    >>> lower, upper = est.fit(X, X[:, 0]).predict_interval(X[:3], level=0.9)
    >>> est.predict(X[:3]).shape, bool((lower <= upper).all())
    ((3,), True)
    """

    _label = "VaRT forest"
    _parameter_constraints = {**VaRTRegressor._parameter_constraints, "num_trees": Integer(1)}

    def __init__(
        self,
        num_trees: int = 20,
        depth: int = 3,
        kl_weight: float = 1e-3,
        *,
        num_steps: int = 1000,
        lr: float = 0.03,
        lr_decay: float = 0.05,
        num_fits: int = 3,
        batch_size: int | None = None,
        temperature_start: float = 1.0,
        temperature_end: float = 0.1,
        num_samples: int = 50,
        validation_fraction: float = 0.1,
        patience: int | None = 10,
        eval_every: int = 20,
        calibrate: str | bool | None = "coverage",
        calibration_level: float = 0.9,
        min_calibration_rows: int | None = None,
        refit: bool = False,
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
        self.num_trees = num_trees
        super().__init__(
            depth,
            kl_weight,
            num_steps=num_steps,
            lr=lr,
            lr_decay=lr_decay,
            num_fits=num_fits,
            batch_size=batch_size,
            temperature_start=temperature_start,
            temperature_end=temperature_end,
            num_samples=num_samples,
            validation_fraction=validation_fraction,
            patience=patience,
            eval_every=eval_every,
            calibrate=calibrate,
            calibration_level=calibration_level,
            min_calibration_rows=min_calibration_rows,
            refit=refit,
            init=init,
            init_split_prob=init_split_prob,
            elbo=elbo,
            clip_margin=clip_margin,
            split_alpha=split_alpha,
            split_beta=split_beta,
            split_scale=split_scale,
            leaf_scale=leaf_scale,
            random_state=random_state,
            device=device,
            dtype=dtype,
            progress=progress,
        )

    _guide_cls = VaRTForestGuide
    _stack_posterior = staticmethod(stack_forest)

    def _guide_args(self, depth: int) -> tuple:
        return ()  # the model holds the depth

    def _model(self, num_features: int, depth: int):
        keys = ("kl_weight", "split_alpha", "split_beta", "split_scale", "leaf_scale")
        return VaRTForest(
            num_features,
            num_trees=int(self.num_trees),
            depth=depth,
            missing=self._fit_missing(),
            **{k: getattr(self, k) for k in keys},
        )

    def _central_mean(self, guide, Xs):
        return forest_mean(guide.mean_tree(), Xs)

    _losses = (VaRTForestELBO, RankVaRTForestELBO)
    stack_max_rows = 1024

    _one_tree = False  # no export_text: a forest is not one readable tree
