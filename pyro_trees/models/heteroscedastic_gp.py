r"""A GP whose noise is an RNN-Tree (Antorán et al., Sec. 5.2, App. E): over 600 lines, one class.

One model class with its bound in two forms (through GPyTorch, and as plain tensors for a
compiled loss), its start from data and its predictive.

Generative story for inputs :math:`x_n \in \mathbb{R}^L`, :math:`n = 1..N`:

.. math::

    M = (\ell_1, \dots, \ell_N) &\sim \mathrm{TreeBalance}(D, N)
        \qquad \text{(routing of every point to one of } 2^D \text{ leaves)} \\
    f &\sim \mathcal{GP}(c, k) \qquad \text{(a GPyTorch kernel } k
        \text{, a learnt constant mean } c) \\
    y_n \mid f, \ell_n &\sim \mathcal{N}\big(f(x_n),\; e^{2 s_{\ell_n}}\big),

with one log noise scale :math:`s_\ell` per leaf (point estimates, the paper's
:math:`T_\theta`). The routing posterior :math:`q(\ell_n \mid x_n)` is an
:class:`~pyro_trees.guides.RNNTree` (amortised over :math:`x`), held by
:class:`~pyro_trees.guides.HeteroscedasticGPGuide`.

**Training and prediction.** Build the guide from the model,
``HeteroscedasticGPGuide(model)``, and train with ``Trace_ELBO`` (class Examples); at the
first step on data the pair moves to the data's dtype and device and starts balanced
(:meth:`HeteroscedasticGP.init_from_data`). The routing expectation is exact, never
sampled. The exact form (App. E) scores the collapsed bound, the sparse form
(``inducing_points=Z``) the SVGP terms given :math:`u`; what each integrates out and how
``Predictive`` and :meth:`HeteroscedasticGP.predict` use the guide is on the user guide's
page of this model (``docs/guide/heteroscedastic_gp.rst``).

**Shapes.** ``x``: ``(N, L)``; ``y``: ``(N,)``. The plate ``"data"`` (``dim=-1``) is
owned by this class and its guide; site ``"leaf"`` is ``(N,)`` long, ``"u"`` is
``(M,)`` and ``"f"`` is ``(N,)`` (sampled when ``y`` is None); sites broadcast over
batch dimensions on the left of the plate. Under :class:`pyro.infer.Predictive` the
exact model's ``"f"``, drawn jointly outside the plate, comes back ``(S, 1, N)`` (Pyro
pads a site outside the plates with one dimension per plate), ``"leaf"`` and ``"obs"``
``(S, N)``.

The recipe for an RNN-Tree partition inside your own Pyro model is in the module
docstring of :mod:`pyro_trees.guides.rnn_tree`.

**References**

[1] J. Antorán, J. Yao, W. Pan, J. M. Hernández-Lobato, F. Doshi-Velez, *Amortised
Variational Inference for Hierarchical Mixture Models*, Sec. 5.2 and App. E.

[2] M. Lázaro-Gredilla, M. Titsias, *Variational heteroscedastic Gaussian process
regression*, ICML 2011.

[3] J. Hensman, N. Fusi, N. Lawrence, *Gaussian processes for big data*, UAI 2013.
"""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule, PyroParam
from pyro.nn.module import pyro_method
from pyro.params.param_store import param_with_module_name

from pyro_trees import trees
from pyro_trees._param_store import adopt_param_store
from pyro_trees.distributions.tree_balance import BalancedLeaf
from pyro_trees.gp import (
    TensorKernel,
    check_kernel_memory,
    cholesky,
    conditional,
    import_gpytorch,
    kernel_matrix,
)
from pyro_trees.models._hgp_maths import (
    collapsed_bound,
    exact_f_joint,
    exact_f_marginals,
    fit_noise_level,
    homoscedastic_residuals,
    optimal_whitened_q_u,
    sparse_evidence,
    sparse_expected_log_lik,
    sparse_f_marginals,
    whitened_mean_at,
)
from pyro_trees.models.hgp_prediction import HGPPrediction

__all__ = ["HeteroscedasticGP"]


class HeteroscedasticGP(PyroModule):
    """GP regression with an RNN-Tree noise model and the tree-balance prior (module docs).

    :param int in_features: input dimension :math:`L`.
    :param int depth: depth :math:`D` of the noise tree (``2**D`` noise levels).
    :param kernel: a :class:`gpytorch.kernels.Kernel`; default
        ``ScaleKernel(RBFKernel(ard_num_dims=in_features))``, a scaled RBF kernel with
        one lengthscale per input feature (ARD), so that a feature that does not matter
        can get a long lengthscale without stretching the others.
    :param inducing_points: ``(M, L)`` inducing inputs (learnt) for the sparse,
        uncollapsed model; ``None`` for the exact GP trained with the collapsed bound.
    :param float init_log_scale: initial :math:`s_\\ell` of every leaf.
    :param float jitter: added to kernel diagonals before Cholesky factorisations
        (retried with 10x as much up to three times).
    :param str name: parameter-store prefix (``"<name>.leaf_log_scale"``,
        ``"<name>.kernel$$$..."``); the guide built from the model takes it too.

    With its guide, ``HeteroscedasticGPGuide(model)``, it trains by the plain SVI loop
    (module docs); at the first call on data it moves to the data's dtype and device
    and starts with :meth:`init_from_data`.

    .. rubric:: Examples

    >>> import torch, pyro
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro_trees.guides import HeteroscedasticGPGuide
    >>> from pyro_trees.models import HeteroscedasticGP
    >>> x = torch.linspace(-1, 1, 12).unsqueeze(-1)
    >>> y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(12)
    >>> model = HeteroscedasticGP(in_features=1, depth=1)
    >>> guide = HeteroscedasticGPGuide(model, hidden_size=4)
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), Trace_ELBO())
    >>> loss = svi.step(x, y)
    >>> pred = model.predict(torch.zeros(3, 1), guide)
    >>> pred.mean.shape, pred.leaf_probs.shape
    (torch.Size([3]), torch.Size([3, 2]))
    """

    def __init__(
        self,
        in_features: int,
        depth: int = 2,
        *,
        kernel=None,
        inducing_points: torch.Tensor | None = None,
        init_log_scale: float = 0.0,
        jitter: float = 1e-6,
        name: str | None = None,
    ):
        super().__init__(name=name or "")
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features must be an integer >= 1, got {in_features!r}")
        self.in_features = in_features
        # one log noise scale per leaf, with its gradient and optimiser state
        self.depth = trees.check_depth(
            depth,
            dtype=torch.get_default_dtype(),
            what="the per-leaf noise scales (1 value per leaf, with gradients and optimiser state)",
        )
        if not math.isfinite(float(init_log_scale)):
            raise ValueError(f"init_log_scale must be finite, got {init_log_scale}")
        if not jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {jitter}")
        self.jitter = float(jitter)
        gpytorch = import_gpytorch()
        if kernel is None:
            kernel = gpytorch.kernels.ScaleKernel(
                gpytorch.kernels.RBFKernel(ard_num_dims=in_features)
            )
        if not isinstance(kernel, gpytorch.kernels.Kernel):
            raise ValueError(f"kernel must be a gpytorch.kernels.Kernel, got {type(kernel)}")
        self.kernel = kernel
        self.mean_constant = PyroParam(torch.zeros(()))
        self.leaf_log_scale = PyroParam(
            torch.full((trees.num_leaves(self.depth),), float(init_log_scale))
        )
        if inducing_points is not None:
            z = torch.as_tensor(inducing_points)
            if z.dim() != 2 or z.shape[-1] != in_features or z.shape[0] < 1:
                raise ValueError(
                    f"inducing_points must have shape (M, {in_features}) with M >= 1; "
                    f"got {tuple(z.shape)}"
                )
            if not bool(torch.isfinite(z).all()):
                raise ValueError("inducing_points contain NaN or infinite values")
            check_kernel_memory(z.shape[0], 0, dtype=z.dtype)
            self.inducing_points = PyroParam(z.clone())
            self.sparse = True
        else:
            self.sparse = False
        self.__dict__["_guide"] = None
        self._started = False

    @property
    def num_leaves(self) -> int:
        """Number of leaves (experts), ``2**depth``."""
        return trees.num_leaves(self.depth)

    @property
    def num_inducing(self) -> int:
        """``M`` (0 for the exact model)."""
        return int(self.inducing_points.shape[0]) if self.sparse else 0

    @property
    def guide(self):
        """The :class:`~pyro_trees.guides.HeteroscedasticGPGuide` built from this model, or
        ``None``."""
        return self.__dict__["_guide"]

    # -- the collapsed bound (App. E) ----------------------------------------------------
    @pyro_method
    def collapsed_bound(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        leaf_logits: torch.Tensor,
        *,
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
    ) -> torch.Tensor:
        r""":math:`\mathcal{L}_2(q(M))` of App. E for the exact GP, or its sparse collapsed
        form (Titsias' bound) for the sparse model (module docs).

        :param x: ``(N, L)``.
        :param y: ``(N,)``.
        :param leaf_logits: ``(N, 2**D)`` routing posterior :math:`q(\ell_n)` (logits).
        :param float balance_weight: weight of the tree-balance coupling (1: the bound).
        :param float entropy_weight: weight of
            :math:`\sum_n \mathrm{KL}(q(\ell_n)\,\|\,\mathrm{Unif})` (1: the bound; see
            :class:`~pyro_trees.infer.TreeELBO`).
        :returns: a scalar.
        """
        self.check(x, y)
        log_q = self._check_logits(x, leaf_logits)
        self._kernel()
        self._note_collapsed_step()
        return self._bound(x, y, log_q, float(balance_weight), float(entropy_weight))

    def _bound(self, x, y, log_q, balance_weight: float, entropy_weight: float) -> torch.Tensor:
        """:meth:`collapsed_bound` at normalised leaf log-probabilities ``log_q`` ``(N, 2**D)``."""
        s = self.leaf_log_scale.to(x.dtype)
        resid = y - self.mean_constant.to(x.dtype)
        return collapsed_bound(
            self.kernel,
            x,
            resid,
            log_q,
            s,
            self.depth,
            z=self.inducing_points.to(x.dtype) if self.sparse else None,
            jitter=self.jitter,
            balance_weight=balance_weight,
            entropy_weight=entropy_weight,
        )

    @pyro_method
    def bound_params(self, dtype=None) -> dict | None:
        """Every tensor of the model that :meth:`collapsed_bound` reads, read once through
        Pyro's store (so that plain ``SVI`` trains them), for a loss that scores the bound
        as plain tensor code (:meth:`bound_of`, :class:`~pyro_trees.infer.CollapsedELBO`);
        ``None`` for a kernel other than an RBF or Matérn kernel, optionally inside a
        ``ScaleKernel`` (:class:`~pyro_trees.gp.TensorKernel`). Like
        :meth:`collapsed_bound`, it marks a sparse model's :math:`q(u)` as not set (see
        :meth:`warn_if_q_u_stale`).

        :param dtype: the dtype of the returned tensors (default: the parameters').
        :returns: ``{"lengthscale": (L,) or (1,), "outputscale": () or None, "nu": None
            or a float, "log_scale": (2**D,), "mean": (), "z": (M, L) or None}``.
        """
        kernel = TensorKernel.of(self._kernel())
        if kernel is None:
            return None
        self._note_collapsed_step()  # the bound integrates q(u) out (sparse model)
        dtype = self.leaf_log_scale.dtype if dtype is None else dtype
        scale = kernel.outputscale
        return {
            "lengthscale": kernel.lengthscale.to(dtype),
            "outputscale": None if scale is None else scale.to(dtype),
            "nu": kernel.nu,
            "log_scale": self.leaf_log_scale.to(dtype),
            "mean": self.mean_constant.to(dtype),
            "z": self.inducing_points.to(dtype) if self.sparse else None,
        }

    @staticmethod
    def bound_of(
        params: dict,
        x: torch.Tensor,
        y: torch.Tensor,
        log_q: torch.Tensor,
        *,
        jitter: float,
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        chol=cholesky,
    ) -> torch.Tensor:
        """:meth:`collapsed_bound` as plain tensor code, from the tensors of
        :meth:`bound_params` and the routing's normalised leaf log-probabilities
        ``log_q`` ``(N, 2**D)`` at complete rows ``x`` ``(N, L)``, ``y`` ``(N,)`` (a loss
        computes the routing, :meth:`~pyro_trees.guides.RNNTree.leaf_log_probs_of`).

        :param float jitter: the model's ``jitter``.
        :param chol: the Cholesky factorisation ``chol(K, jitter)`` (default
            :func:`~pyro_trees.gp.cholesky`, which retries with more jitter).
        :returns: a scalar.
        """
        kernel = TensorKernel(params["lengthscale"], params["outputscale"], params["nu"])
        return collapsed_bound(
            kernel,
            x,
            y - params["mean"],
            log_q,
            params["log_scale"],
            log_q.shape[-1].bit_length() - 1,
            z=params["z"],
            jitter=jitter,
            balance_weight=balance_weight,
            entropy_weight=entropy_weight,
            chol=chol,
        )

    def _note_collapsed_step(self) -> None:
        """A collapsed step moved what the optimal :math:`q(u)` depends on: the guide's
        :math:`q(u)` is stale until :meth:`set_optimal_inducing_posterior`."""
        if self.sparse:
            self.__dict__["_q_u_stale"] = True

    def warn_if_q_u_stale(self) -> None:
        """Warn when the sparse model was trained by the collapsed bound (which integrates
        :math:`q(u)` out) and the guide's :math:`q(u)` was not set since: predictions
        and ``Predictive`` draws then come from the guide's start.
        :meth:`set_optimal_inducing_posterior` sets it (the estimator calls it)."""
        if self.__dict__.get("_q_u_stale", False):
            warnings.warn(
                "this sparse HeteroscedasticGP was trained by the collapsed bound, which "
                "integrates q(u) out, and its guide's q(u) is still where it started: call "
                "model.set_optimal_inducing_posterior(x, y, guide) on the training data "
                "before predicting",
                UserWarning,
                stacklevel=3,
            )

    @torch.no_grad()
    def set_optimal_inducing_posterior(self, x: torch.Tensor, y: torch.Tensor, guide) -> None:
        """Set the guide's whitened :math:`q(u)` to the optimum of the collapsed bound.

        For the sparse model trained with :meth:`collapsed_bound` (which integrates
        :math:`u` out): after it, :meth:`predict` needs no training data.

        :param x: training inputs ``(N, L)``.
        :param y: training targets ``(N,)``.
        :param guide: the :class:`~pyro_trees.guides.HeteroscedasticGPGuide` (with
            ``num_inducing`` equal to the model's).
        """
        if not self.sparse or getattr(guide, "num_inducing", 0) != self.num_inducing:
            raise ValueError("set_optimal_inducing_posterior needs the sparse model and guide")
        self.check(x, y)
        s = self.leaf_log_scale.to(x.dtype)
        q = guide.tree.leaf_probs(x).to(x.dtype)
        log_prec = torch.logsumexp(q.clamp_min(1e-300).log() - 2 * s, dim=-1)
        resid = y - self.mean_constant.to(x.dtype)
        z = self.inducing_points.to(x.dtype)
        _, LB, c = sparse_evidence(self.kernel, z, x, resid, log_prec, self.jitter)
        guide.u_loc, guide.u_scale_tril = optimal_whitened_q_u(LB, c)
        self.__dict__["_q_u_stale"] = False

    # -- the Pyro model -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """The Pyro model: condition on ``y`` ``(N,)`` at inputs ``x`` ``(N, L)``, or sample it.

        *Exact model, ``y`` given* (training): the function and the routing are integrated
        out exactly, so the model scores the collapsed bound of App. E at the routing of
        its guide's RNN-Tree (``pyro.factor("collapsed_bound")``); the site ``"leaf"`` is
        recorded, masked (its expectation is inside the bound). Needs the guide built as
        ``HeteroscedasticGPGuide(model)``; plain ``Trace_ELBO`` then maximises the bound.

        *Exact model, ``y=None``*: ``"f"`` ``(N,)`` jointly from the GP prior (the guide
        replaces it by its posterior given the training data, so ``Predictive`` with the
        guide is the posterior predictive), then ``"leaf"`` and ``"obs"`` in the plate
        ``"data"``.

        *Sparse model*: ``"u"`` (whitened inducing outputs), then in ``"data"`` ``"leaf"``,
        ``"f_var"`` (a factor, when ``y`` is given) or ``"f"`` (when it is not) and
        ``"obs"``; trained with :class:`~pyro_trees.infer.TreeELBO`.

        A guide built from the model starts the fit at the first call on data
        (:meth:`init_from_data`, unless the param store already holds the model's
        parameters). Sites broadcast over batch dimensions on the left of the plate
        (``Predictive(..., parallel=True)``).
        """
        self.check(x, y)
        if subsample_size is not None and not self.sparse:
            raise ValueError("subsample_size needs the sparse model (inducing_points)")
        if y is not None:
            self.start_once(x, y)
        kernel = self._kernel()
        n = x.shape[0]
        mean = self.mean_constant.to(x.dtype)
        s_all = self.leaf_log_scale.to(x.dtype)
        leaf_prior = BalancedLeaf(self.depth, n, dtype=x.dtype, device=x.device)
        if not self.sparse and y is not None:
            log_q = self._check_logits(x, self._require_guide().tree(x))
            with pyro.plate("data", n, dim=-1):
                pyro.sample("leaf", leaf_prior.mask(False))
            pyro.factor("collapsed_bound", self._bound(x, y, log_q, 1.0, 1.0))
            return y
        if self.sparse:
            z = self.inducing_points.to(x.dtype)
            u = pyro.sample(
                "u", dist.Normal(torch.zeros_like(z[:, 0]), torch.ones_like(z[:, 0])).to_event(1)
            )
            u = _drop_data_dim(u)
            if y is not None and self.guide is not None:
                tree = self.guide.tree

                def log_q(x_batch):
                    return self._check_logits(x_batch, tree(x_batch))

                return sparse_expected_log_lik(
                    kernel, log_q, x, y, z, u, mean, s_all, self.depth, self.jitter, subsample_size
                )
        else:
            K = kernel_matrix(kernel, x)[..., 0, :, :]
            f_all = pyro.sample(
                "f",
                dist.MultivariateNormal(
                    mean.expand(n), scale_tril=cholesky(K, max(self.jitter, 1e-6))
                ),
            )
            f_all = _drop_data_dim(f_all)
        with pyro.plate("data", n, subsample_size=subsample_size, dim=-1) as idx:
            leaf = pyro.sample("leaf", leaf_prior)
            s = s_all[leaf]
            if self.sparse:
                loc, var = conditional(
                    kernel, x[idx], z, u.unsqueeze(-2), whiten=True, jitter=self.jitter
                )
                loc, var = loc[..., 0, :] + mean, var[..., 0, :]
                if y is None:
                    f = pyro.sample("f", dist.Normal(loc, var.clamp_min(1e-12).sqrt()))
                else:
                    f = loc
                    pyro.factor("f_var", -0.5 * var * torch.exp(-2 * s))
            else:
                f = f_all[..., idx]
            return pyro.sample(
                "obs", dist.Normal(f, torch.exp(s)), obs=None if y is None else y[idx]
            )

    @pyro_method
    def posterior_f(self, x_new: torch.Tensor, x: torch.Tensor, y: torch.Tensor, guide):
        """The exact model's posterior of ``f`` at ``x_new`` ``(N*, L)`` given the training
        data ``x`` ``(N, L)``, ``y`` ``(N,)``: :math:`q^*(f)` of the collapsed bound (noise
        :math:`R` from the guide's routing at ``x``), a joint
        :class:`~pyro.distributions.MultivariateNormal` over ``(N*,)``.
        """
        dtype = x_new.dtype
        kernel = self._kernel()
        s = self.leaf_log_scale.to(dtype)
        mean_c = self.mean_constant.to(dtype)
        r = 1.0 / (guide.tree.leaf_probs(x).to(dtype) @ torch.exp(-2 * s))
        loc, cov = exact_f_joint(kernel, x, y - mean_c, r, x_new, self.jitter)
        scale_tril = cholesky(cov, max(self.jitter, 1e-6))
        return dist.MultivariateNormal(loc + mean_c, scale_tril=scale_tril)

    # -- initialisation -------------------------------------------------------------------
    def fit_homoscedastic(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        num_steps: int = 60,
        lr: float = 0.05,
        max_points: int = 400,
        loo: bool = True,
    ) -> torch.Tensor:
        """Fit kernel, mean and one shared noise level by the exact GP evidence.

        Uses at most ``max_points`` evenly spaced points; sets every :math:`s_\\ell` to the
        fitted level (and, for the sparse model, nothing else: inducing inputs stay).

        :param bool loo: at the fitted points, return the leave-one-out residuals
            (``y_i - E[f(x_i) | y_{-i}]``) instead of the in-sample ones.
        :returns: the residuals ``y - E[f(x) | y]`` at all ``x``, ``(N,)``.
        """
        self.check(x, y)
        sub = torch.linspace(0, x.shape[0] - 1, min(max_points, x.shape[0])).round().long()
        with torch.no_grad():
            self.mean_constant = y[sub].mean()
        log_noise = fit_noise_level(
            self.kernel, x[sub], y[sub], jitter=self.jitter, num_steps=num_steps, lr=lr
        )
        with torch.no_grad():
            self.leaf_log_scale = torch.full_like(self.leaf_log_scale, float(log_noise))
        return homoscedastic_residuals(
            self.kernel, x, y, sub, log_noise, jitter=self.jitter, loo=loo
        )

    @torch.no_grad()
    def init_from_data(
        self, x: torch.Tensor, y: torch.Tensor, guide, *, sharpness: float = 100.0, **kwargs
    ) -> None:
        """Balanced start: a homoscedastic GP fit, then a balanced tree and per-leaf scales.

        1. :meth:`fit_homoscedastic` (``kwargs`` go there) gives residuals :math:`r_n`;
        2. ``guide.tree.init_balanced(x, log r**2, sharpness=sharpness)``: median cuts,
           each node's dimension chosen where it best separates the log squared
           residuals; sigmoid slopes ``sharpness / std`` (sharp: soft boundaries let
           points of a noisy region raise a quiet leaf's scale);
        3. :math:`s_\\ell = \\tfrac12 \\log` of the routing-weighted mean of :math:`r^2`;
        4. for the sparse model, the guide's :math:`q(u)` mean is set to the whitened
           fitted mean at the inducing inputs (interpolated from at most 400 points, so
           the start costs no :math:`O(N^3)`).

        Use it: from random network weights the exact bound can collapse the noise tree
        to one or two noise levels (the user guide's page on this model has the figures).
        A guide built from the model (``HeteroscedasticGPGuide(model)``) runs this at the
        first call on data. The model and the guide move to ``x``'s dtype and device first.
        """
        self._started = True
        self.to(device=x.device, dtype=x.dtype)
        guide.to(device=x.device, dtype=x.dtype)
        with torch.enable_grad():
            resid = self.fit_homoscedastic(x, y, **kwargs)
        r2 = resid.pow(2).clamp_min(1e-12)
        guide.tree.init_balanced(x, r2.log(), sharpness=sharpness)
        q = guide.tree.leaf_probs(x).to(x.dtype)
        mass = q.sum(0)
        level = (q.T @ r2) / mass.clamp_min(1e-12)
        level = torch.where(mass > 1e-6, level, r2.mean())
        self.leaf_log_scale = 0.5 * level.log()
        if self.sparse and getattr(guide, "num_inducing", 0):
            z = self.inducing_points.to(x.dtype)
            guide.u_loc = whitened_mean_at(
                self.kernel, x, y - resid, z, self.mean_constant, self.jitter
            )

    # -- prediction -----------------------------------------------------------------------
    @torch.no_grad()
    def predict(
        self,
        x_new: torch.Tensor,
        guide,
        x: torch.Tensor | None = None,
        y: torch.Tensor | None = None,
        *,
        routing: str = "hard",
        num_samples: int = 32,
    ) -> HGPPrediction:
        """Predictive distribution at ``x_new`` ``(N*, L)``.

        :param guide: the trained :class:`~pyro_trees.guides.HeteroscedasticGPGuide`.
        :param x: training inputs ``(N, L)`` (exact model only; default the data the
            guide built from this model trained on).
        :param y: training targets ``(N,)`` (exact model only; same default).
        :param str routing: ``"hard"``: the noise of each new input is its leaf's in the
            most likely tree (App. E); ``"posterior"``: the full routing posterior
            (a mixture over leaves, averaged over ``num_samples`` noisy roll-outs with
            soft feedback).
        :returns: :class:`HGPPrediction`.

        The function's posterior is :math:`q^*(f)` of the collapsed bound, whose noise
        at the training points is :math:`R` from the routing posterior there (the
        distribution the bound was optimised for), whichever ``routing`` is chosen.
        """
        if routing not in ("hard", "posterior"):
            raise ValueError(f"routing must be 'hard' or 'posterior', got {routing!r}")
        self.check(x_new)
        if not self._started:  # fresh objects over a loaded store
            self._adopt(guide)
        dtype = x_new.dtype
        s = self.leaf_log_scale.to(dtype)
        mean_c = self.mean_constant.to(dtype)
        if self.sparse:
            self.warn_if_q_u_stale()
            z = self.inducing_points.to(dtype)
            u_loc, u_scale_tril = guide.u_loc.to(dtype), guide.u_scale_tril.to(dtype)
            mean, f_var = sparse_f_marginals(
                self.kernel, x_new, z, u_loc, u_scale_tril, self.jitter
            )
            mean = mean + mean_c
        else:
            if x is None or y is None:
                if getattr(guide, "model", None) is not self:
                    raise ValueError(
                        "the exact model predicts from the training data: pass x and y"
                    )
                x, y = guide.training_data()
            self.check(x, y)
            q = guide.tree.leaf_probs(x, num_samples=num_samples).to(dtype)
            r = 1.0 / (q @ torch.exp(-2 * s))
            mean, f_var = exact_f_marginals(self.kernel, x, y - mean_c, r, x_new, self.jitter)
            mean = mean + mean_c
        if routing == "hard":
            leaf = guide.tree.hard_leaf(x_new)
            probs = torch.nn.functional.one_hot(leaf, self.num_leaves).to(dtype)
        else:
            probs = guide.tree.leaf_probs(x_new, num_samples=num_samples).to(dtype)
        return HGPPrediction(mean, f_var, probs, s.detach().clone())

    @torch.no_grad()
    def noise_rules(self, guide, *, decimals: int = 3) -> trees.DecisionRules:
        """The noise function as rules: the most likely tree with each leaf's noise level.

        Leaf labels read ``"log sigma = s (sigma = e^s)"``; use
        ``.export_text(feature_names=...)`` to print and ``.route(x)`` to apply.
        """
        if not self._started:  # fresh objects over a loaded store
            self._adopt(guide)
        labels = [
            f"log sigma = {v:.{decimals}f} (sigma = {math.exp(v):.{decimals}g})"
            for v in self.leaf_log_scale.tolist()
        ]
        return guide.tree.rules(leaf_values=labels)

    # -- checks ------------------------------------------------------------------------
    def check(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Raise a ``ValueError`` unless ``x`` is a finite ``(N, L)`` tensor with at least
        one row and ``y`` (if given) a finite ``(N,)`` tensor: what every method that
        takes data checks first (a loss that scores the bound without calling
        :meth:`collapsed_bound` checks its data with it)."""
        if not torch.is_tensor(x) or x.dim() != 2 or x.shape[-1] != self.in_features:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (N, {self.in_features}); got {shape}")
        if x.shape[0] < 1:
            raise ValueError("x has no rows")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("x contains NaN or infinite values")
        if y is not None:
            if not torch.is_tensor(y) or y.dim() != 1 or y.shape[0] != x.shape[0]:
                shape = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
                raise ValueError(f"y must be a tensor of shape ({x.shape[0]},); got {shape}")
            if not bool(torch.isfinite(y).all()):
                raise ValueError("y contains NaN or infinite values")

    def _check_logits(self, x: torch.Tensor, leaf_logits: torch.Tensor) -> torch.Tensor:
        if leaf_logits.shape != (x.shape[0], self.num_leaves):
            raise ValueError(
                f"leaf_logits must have shape ({x.shape[0]}, {self.num_leaves}); "
                f"got {tuple(leaf_logits.shape)}"
            )
        return leaf_logits - leaf_logits.logsumexp(-1, keepdim=True)

    # -- names, the guide and the lazy start --------------------------------------------
    def _fullname(self, name: str) -> str:
        prefix = self.__dict__["_pyro_name"]
        return f"{prefix}.{name}" if prefix else name

    def _kernel(self):
        """The kernel, registered as ``"<name>.kernel"`` with its values from the param store."""
        return pyro.module(self._fullname("kernel"), self.kernel, update_module_params=True)

    def bind(self, guide) -> None:
        """Make ``guide`` (a :class:`~pyro_trees.guides.HeteroscedasticGPGuide` built with
        this model) the model's guide, whose routing the exact model's collapsed bound
        reads; a model takes one guide.

        :raises ValueError: when the model already has another guide.
        """
        if self.__dict__["_guide"] is not None and self.__dict__["_guide"] is not guide:
            raise ValueError(
                "this HeteroscedasticGP already has a guide; build one guide per model"
            )
        self.__dict__["_guide"] = guide

    def _adopt(self, guide) -> None:
        """Model, kernel and guide use the tensors the param store holds under their names
        (a loaded store), registering nothing new."""
        adopt_param_store(self)
        adopt_param_store(guide)
        store = pyro.get_param_store()
        prefix = self._fullname("kernel")
        for name, own in list(self.kernel.named_parameters()):
            stored = store._params.get(param_with_module_name(prefix, name))
            if stored is not None and stored is not own and stored.shape == own.shape:
                owner, _, leaf = name.rpartition(".")
                self.kernel.get_submodule(owner)._parameters[leaf] = stored

    def _require_guide(self):
        guide = self.__dict__["_guide"]
        if guide is None:
            raise ValueError(
                "the exact HeteroscedasticGP conditioned on y scores the collapsed bound at "
                "its guide's routing: build the guide as HeteroscedasticGPGuide(model), or "
                "train with CollapsedELBO"
            )
        return guide

    def start_once(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """:meth:`init_from_data` at the first call on data, when the model has a guide and
        the param store does not hold its parameters yet (trained or loaded ones stay);
        later calls do nothing (after a start that raised, the next call starts again).
        The model calls it itself; a guide or loss that scores the model without running
        it calls it first.

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N,)``.
        """
        guide = self.__dict__["_guide"]
        if guide is None or self._started:
            return
        self._started = True
        if self._fullname("leaf_log_scale") in pyro.get_param_store():
            return
        try:
            self.to(device=x.device, dtype=x.dtype)
            guide.to(device=x.device, dtype=x.dtype)
            with poutine.block():
                self.init_from_data(x, y, guide)
        except BaseException:
            self._started = False  # a failed start (bad data) runs again at the next call
            raise


def _drop_data_dim(value: torch.Tensor) -> torch.Tensor:
    """A global site's value ``batch + (1, E)`` without the size-1 slot of the data plate
    (``dim=-1``), so that it lines up with per-point values ``batch + (N,)``; ``(E,)`` as is."""
    return value.squeeze(-2) if value.dim() > 1 else value
