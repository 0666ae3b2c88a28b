"""Scikit-learn style RNN-Tree estimators: an HME with the tree-balance prior and the
RNN-Tree guide, trained by :func:`~pyro_trees.infer.fit` with :class:`~pyro_trees.infer.TreeELBO`.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.base import ClassifierMixin, RegressorMixin
from sklearn.utils.validation import check_is_fitted

from pyro_trees import trees
from pyro_trees.estimators._base import TabularEstimator
from pyro_trees.estimators._rng import local_seed
from pyro_trees.guides.rnn_tree import RNNTreeGuide
from pyro_trees.infer.fit import fit as _fit
from pyro_trees.infer.fit import isolated_params
from pyro_trees.infer.tree_elbo import TreeELBO
from pyro_trees.models.hme import HME

__all__ = ["RNNTreeClassifier", "RNNTreeRegressor"]

_ROUTINGS = ("hard", "posterior")


class _RNNTreeBase(TabularEstimator):
    _likelihood = "gaussian"

    def __init__(
        self,
        depth: int = 3,
        *,
        hidden_size: int = 32,
        feedback: str = "hard",
        experts: str = "constant",
        init: str = "balanced",
        num_steps: int = 600,
        lr: float = 0.03,
        lr_decay: float = 0.1,
        optim: str = "adam",
        batch_size: int | None = None,
        validation_fraction: float = 0.0,
        patience: int | None = None,
        eval_every: int = 20,
        routing: str = "hard",
        num_noise_samples: int = 32,
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        refit_leaves: bool | str = "auto",
        random_state: int | None = None,
        device=None,
        dtype: str = "float32",
        progress: bool = False,
    ):
        self.depth = depth
        self.hidden_size = hidden_size
        self.feedback = feedback
        self.experts = experts
        self.init = init
        self.num_steps = num_steps
        self.lr = lr
        self.lr_decay = lr_decay
        self.optim = optim
        self.batch_size = batch_size
        self.validation_fraction = validation_fraction
        self.patience = patience
        self.eval_every = eval_every
        self.routing = routing
        self.num_noise_samples = num_noise_samples
        self.balance_weight = balance_weight
        self.entropy_weight = entropy_weight
        self.refit_leaves = refit_leaves
        self.random_state = random_state
        self.device = device
        self.dtype = dtype
        self.progress = progress

    # -- hooks for the two subclasses ---------------------------------------------------
    def _model_kwargs(self) -> dict:
        raise NotImplementedError

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        raise NotImplementedError

    # -- validation --------------------------------------------------------------------
    def _check_options(self) -> None:
        if self.init not in ("balanced", "greedy", "random"):
            raise ValueError(f"init must be 'balanced', 'greedy' or 'random', got {self.init!r}")
        if self.refit_leaves not in (True, False, "auto"):
            raise ValueError(
                f"refit_leaves must be True, False or 'auto', got {self.refit_leaves!r}"
            )
        if self.routing not in _ROUTINGS:
            raise ValueError(f"routing must be one of {_ROUTINGS}, got {self.routing!r}")
        self._check_early_stopping_options()
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")

    # -- fitting -------------------------------------------------------------------------
    def fit(self, X, y):
        """Fit the HME and its RNN-Tree routing posterior.

        ``X`` (and the regressor's ``y``) are standardised inside; predictions are in
        the units of ``y``. With an integer ``random_state`` the fit is reproducible and
        leaves the global random streams (Python, NumPy, torch) as it found them; with
        ``None`` it draws from them.

        :param X: ``(N, L)`` array-like or pandas DataFrame of numeric or bool columns.
        :param y: ``(N,)`` class labels (classifier) or targets (regressor; ``(N, K)``
            for several outputs).
        :returns: ``self``.
        :raises ValueError: naming the cause, for invalid options or data.
        """
        self._check_options()
        Xs, y = self._validate_fit(X, y)
        with local_seed(self.random_state, self.device_):
            self._fit_seeded(Xs, y)
        return self

    def _fit_seeded(self, Xs: torch.Tensor, y: torch.Tensor) -> None:
        n, n_features = Xs.shape
        width = getattr(self, "n_classes_", None) or getattr(self, "n_outputs_", 1)
        depth = trees.check_depth(
            self.depth,
            num_points=min(n, self.batch_size or n),
            width=max(width, n_features),
            dtype=Xs.dtype,
            device=Xs.device,
        )

        X_val = y_val = None
        split = self._held_out_split(n)
        if split is not None:
            val, train = (torch.as_tensor(i, device=Xs.device) for i in split)
            X_val, y_val = Xs[val], y[val]
            Xs, y = Xs[train], y[train]

        model = HME(n_features, depth, experts=self.experts, **self._model_kwargs())
        guide = RNNTreeGuide(
            n_features, depth, hidden_size=self.hidden_size, feedback=self.feedback
        )
        model.to(device=Xs.device, dtype=Xs.dtype)
        guide.to(device=Xs.device, dtype=Xs.dtype)
        with isolated_params():
            if self.init in ("balanced", "greedy"):
                guide.tree.init_balanced(Xs, y, cuts=self.init)
                # One M-step on the initial tree's hard routing: soft routing would
                # smear every expert towards the global mean.
                leaf = guide.tree.hard_leaf(Xs)
                model.init_experts(Xs, y, torch.nn.functional.one_hot(leaf, 2**depth))
        self.model_, self.guide_ = model, guide
        self._rules = None
        self.hard_leaf_loc_ = None

        val_metric = None
        if X_val is not None:

            def val_metric():
                self._rules = None
                self.hard_leaf_loc_ = None
                if self.refit_leaves is True:
                    self._refit_hard_leaves(Xs, y)
                return self._error(X_val, y_val)

        gamma = float(self.lr_decay) ** (1.0 / max(1, self.num_steps))
        self.fit_result_ = _fit(
            model,
            guide,
            Xs,
            y,
            loss=TreeELBO(balance_weight=self.balance_weight, entropy_weight=self.entropy_weight),
            num_steps=self.num_steps,
            optim=self.optim,
            lr=self.lr,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma),
            val_metric=val_metric,
            eval_every=self.eval_every,
            patience=self.patience,
            progress=self.progress,
            desc=type(self).__name__,
            subsample_size=self.batch_size,
        )
        model.eval()
        guide.eval()
        self._rules = None
        self.hard_leaf_loc_ = None
        if self.refit_leaves is True:
            self._refit_hard_leaves(Xs, y)
        elif self.refit_leaves == "auto" and X_val is not None:
            # keep the refit only where it lowers the held-out error of the hard tree
            trained = self._error(X_val, y_val)
            self._refit_hard_leaves(Xs, y)
            if self.hard_leaf_loc_ is not None and not self._error(X_val, y_val) < trained:
                self.hard_leaf_loc_ = None
                self._rules = None
        self._rules = None
        _ = self.rules_  # the hard tree, made here once: predicting changes no attribute

    @torch.no_grad()
    def _refit_hard_leaves(self, Xs: torch.Tensor, y: torch.Tensor) -> None:
        """One exact M-step of the constant experts on the most likely tree's partition.

        The experts are trained under soft routing, in which the points near a cut pull
        each leaf towards its neighbour's value; the hard tree predicts best with the
        values its own partition of the training points gives (leaf means, or class
        frequencies with one pseudo-count per class: :meth:`HME.expert_m_step`).
        Leaves that receive no training point keep the trained expert. Sets
        ``hard_leaf_loc_`` ``(2**D, width)``; posterior routing keeps the trained
        experts.
        """
        if self.experts != "constant":
            return
        with isolated_params():
            loc = self.model_.leaf_loc.detach().clone()
            self._rules = None
            leaf = self.guide_.tree.hard_leaf(Xs)
        onehot = torch.nn.functional.one_hot(leaf, loc.shape[0]).to(loc.dtype)
        new, mass = self.model_.expert_m_step(Xs.to(loc.dtype), y, onehot)
        self.hard_leaf_loc_ = torch.where((mass > 0).unsqueeze(-1), new, loc)
        self._rules = None

    # -- routing -----------------------------------------------------------------------------
    @property
    def rules_(self) -> trees.DecisionRules:
        """The single most likely tree (thresholds in standardised units)."""
        check_is_fitted(self, "model_")
        if self._rules is None:
            with isolated_params():
                self._rules = self.guide_.tree.rules(self._leaf_labels())
        return self._rules

    def _leaf_probs(self, Xs: torch.Tensor, routing: str | None) -> torch.Tensor:
        routing = self.routing if routing is None else routing
        if routing not in _ROUTINGS:
            raise ValueError(f"routing must be one of {_ROUTINGS}, got {routing!r}")
        if routing == "hard":
            leaf = self.rules_.route(Xs)
            return torch.nn.functional.one_hot(leaf, trees.num_leaves(self.model_.depth)).to(
                Xs.dtype
            )
        gen = torch.Generator().manual_seed(0 if self.random_state is None else self.random_state)
        with isolated_params(), torch.no_grad():
            return self.guide_.tree.leaf_probs(
                Xs, num_samples=self.num_noise_samples, generator=gen
            )

    def _leaf_outputs(self, Xs: torch.Tensor, routing: str | None = None) -> torch.Tensor:
        routing = self.routing if routing is None else routing
        hard_loc = getattr(self, "hard_leaf_loc_", None)
        if routing == "hard" and hard_loc is not None:
            return hard_loc.to(Xs.dtype).expand(Xs.shape[0], -1, -1)
        with isolated_params(), torch.no_grad():
            return self.model_.leaf_outputs(Xs).detach()  # (N, 2**D, width)

    def _leaf_loc(self) -> torch.Tensor:
        """The hard tree's leaf values ``(2**D, width)`` (for rules and export)."""
        hard_loc = getattr(self, "hard_leaf_loc_", None)
        if hard_loc is not None:
            return hard_loc.detach().cpu()
        with isolated_params(), torch.no_grad():
            return self.model_.leaf_loc.detach().cpu()

    def apply(self, X) -> np.ndarray:
        """Leaf index ``(N,)`` of each input under the most likely tree."""
        return self.rules_.route(self._validate_predict(X)).cpu().numpy()

    def predict_leaf_proba(self, X) -> np.ndarray:
        """The routing posterior ``q(leaf | x)`` of each input, ``(N, 2**depth)``."""
        return self._leaf_probs(self._validate_predict(X), "posterior").cpu().numpy()

    def export_text(self, feature_names=None, decimals: int = 3) -> str:
        """The most likely tree as text (thresholds in the units of ``X``)."""
        rules = self.rules_
        f = rules.feature.cpu()
        mean = torch.as_tensor(self.x_scaler_.mean)[f].to(rules.threshold.dtype)
        scale = torch.as_tensor(self.x_scaler_.scale)[f].to(rules.threshold.dtype)
        raw = trees.DecisionRules(
            f, rules.threshold.cpu() * scale + mean, rules.greater.cpu(), rules.leaf_values
        )
        return raw.export_text(feature_names=feature_names, decimals=decimals)


class RNNTreeRegressor(RegressorMixin, _RNNTreeBase):
    """Regression with an HME of constant (or linear) Gaussian experts, the tree-balance
    prior and the RNN-Tree guide (Antorán et al.).

    :param int depth: tree depth (``2**depth`` experts).
    :param int hidden_size: GRU width of the RNN-Tree.
    :param str feedback: ``"hard"`` (per-node GRU states; default) or ``"soft"`` (the
        paper's single roll-out with quantisation noise, eq. 14).
    :param str experts: ``"constant"`` (the paper) or ``"linear"``.
    :param str init: ``"balanced"`` (:meth:`~pyro_trees.guides.RNNTree.init_balanced`: median cuts,
        split dimensions chosen with the targets), ``"greedy"`` (the start CART would grow:
        impurity-reducing cuts), each followed by one M-step for the experts, or ``"random"``.
    :param noise_scale: fixed observation noise, or ``None`` (default) to learn it.
    :param int num_steps: gradient steps; ``lr``, ``lr_decay`` (total factor over the
        run, exponential), ``optim`` (``"adam"``, ``"radam"``, ``"clipped_adam"``...).
    :param batch_size: minibatch size (``None``: full batch).
    :param float validation_fraction: held out for early stopping on the hard tree's
        error, with ``patience`` evaluations every ``eval_every`` steps.
    :param str routing: ``"hard"`` (the single most likely tree, as the paper) or
        ``"posterior"`` (average over the routing posterior) for predictions.
    :param refit_leaves: give the hard tree's leaves the values its own partition of
        the training points gives them (one exact M-step of the constant experts under
        hard routing, which makes the hard tree exact on noise-free data; the trained
        experts, fitted under soft routing, are pulled towards their neighbours near
        every cut). ``True``: always, early-stopping checks included; ``False``: never
        (the paper); ``"auto"`` (default): after training, only where it lowers the
        error on the validation split (never without one). Posterior routing always
        uses the trained experts.
    :param random_state: seed; fits and predictions are then reproducible.
    :param device: where to fit (``"cuda"``...); default: the CPU.
    :param str dtype: ``"float32"`` (default) or ``"float64"`` computation.
    :param bool progress: show a progress bar with the loss.
    """

    _multi_output = True

    def __init__(
        self,
        depth: int = 3,
        *,
        noise_scale: float | None = None,
        hidden_size: int = 32,
        feedback: str = "hard",
        experts: str = "constant",
        init: str = "balanced",
        num_steps: int = 600,
        lr: float = 0.03,
        lr_decay: float = 0.1,
        optim: str = "adam",
        batch_size: int | None = None,
        validation_fraction: float = 0.0,
        patience: int | None = None,
        eval_every: int = 20,
        routing: str = "hard",
        num_noise_samples: int = 32,
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        refit_leaves: bool | str = "auto",
        random_state: int | None = None,
        device=None,
        dtype: str = "float32",
        progress: bool = False,
    ):
        super().__init__(
            depth,
            hidden_size=hidden_size,
            feedback=feedback,
            experts=experts,
            init=init,
            num_steps=num_steps,
            lr=lr,
            lr_decay=lr_decay,
            optim=optim,
            batch_size=batch_size,
            validation_fraction=validation_fraction,
            patience=patience,
            eval_every=eval_every,
            routing=routing,
            num_noise_samples=num_noise_samples,
            balance_weight=balance_weight,
            entropy_weight=entropy_weight,
            refit_leaves=refit_leaves,
            random_state=random_state,
            device=device,
            dtype=dtype,
            progress=progress,
        )
        self.noise_scale = noise_scale

    def _model_kwargs(self) -> dict:
        return {
            "likelihood": "gaussian",
            "num_outputs": self.n_outputs_,
            "noise_scale": self.noise_scale,
        }

    def _leaf_labels(self) -> list[str]:
        loc = self._leaf_loc()
        if self.experts == "linear":
            return [f"value: linear expert {i}" for i in range(loc.shape[0])]
        return ["value: " + ", ".join(f"{v:.3f}" for v in row.tolist()) for row in loc]

    def _predict_std(self, Xs: torch.Tensor, routing=None) -> torch.Tensor:
        probs = self._leaf_probs(Xs, routing)  # (N, 2**D)
        out = self._leaf_outputs(Xs, routing)  # (N, 2**D, K)
        return (probs.unsqueeze(-1) * out).sum(-2)

    def predict(self, X, routing: str | None = None) -> np.ndarray:
        """Predicted mean ``(N,)`` (``(N, K)`` for multi-output).

        :param routing: ``"hard"`` or ``"posterior"``; default: the ``routing`` option.
        """
        pred = self._outputs(self._predict_std(self._validate_predict(X), routing))
        return pred[:, 0] if self.n_outputs_ == 1 else pred

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        pred = self._predict_std(X, "hard")
        return float(((pred - y.reshape(pred.shape)) ** 2).mean().sqrt())


class RNNTreeClassifier(ClassifierMixin, _RNNTreeBase):
    """Classification with an HME of categorical experts, the tree-balance prior and the
    RNN-Tree guide (Antorán et al.). Options as :class:`RNNTreeRegressor`, without
    ``noise_scale``; ``classes_`` holds the sorted class labels.
    """

    def _model_kwargs(self) -> dict:
        return {"likelihood": "categorical", "num_classes": self.n_classes_}

    def _leaf_labels(self) -> list[str]:
        probs = self._leaf_loc().softmax(-1)
        out = []
        for row in probs:
            k = int(row.argmax())
            out.append(f"class: {self.classes_[k]} (p = {float(row[k]):.2f})")
        return out

    def _proba(self, Xs: torch.Tensor, routing=None) -> torch.Tensor:
        probs = self._leaf_probs(Xs, routing)
        leaf_p = self._leaf_outputs(Xs, routing).softmax(-1)  # (N, 2**D, C)
        return (probs.unsqueeze(-1) * leaf_p).sum(-2)

    def predict_proba(self, X, routing: str | None = None) -> np.ndarray:
        """Class probabilities ``(N, n_classes)`` in the order of ``classes_``."""
        proba = self._proba(self._validate_predict(X), routing)
        return proba.to("cpu", torch.float64).numpy()

    def predict(self, X, routing: str | None = None) -> np.ndarray:
        """Predicted class labels ``(N,)``."""
        proba = self.predict_proba(X, routing)
        return self.classes_[proba.argmax(-1)]

    def _error(self, X: torch.Tensor, y: torch.Tensor) -> float:
        pred = self._proba(X, "hard").argmax(-1)
        return float((pred != y).to(torch.float64).mean())
