r"""Autoregressive hierarchical mixture of experts with the tree-balance prior.

Antorán et al., *Amortised Variational Inference for Hierarchical Mixture Models*,
Secs. 3 and 5. Generative story for :math:`N` inputs :math:`x_n \in \mathbb{R}^L`:

.. math::

    M = (\ell_1, \dots, \ell_N) &\sim \mathrm{TreeBalance}(D, N)
        \qquad \text{(routing of every point to one of } 2^D \text{ leaves; eqs. 3-6)} \\
    y_n \mid \ell_n, x_n &\sim \mathrm{expert}_{\ell_n}(x_n)

Experts (the paper's choice is ``experts="constant"``; eq. in Sec. 5):

* regression: :math:`\mathcal{N}(\mu_\ell, \sigma^2)` with :math:`\sigma` learnt
  (``noise_scale=None``, the default) or fixed, as the paper's :math:`\sigma = 1`
  (``noise_scale=1.0``);
* classification: :math:`\mathrm{Categorical}(\mathrm{softmax}(\tau_\ell))`;
* ``experts="linear"``: the mean (or the logits) is :math:`W_\ell^\top x + b_\ell`.

The expert parameters are point estimates (the paper's hyperparameters
:math:`\theta`). The routing site ``"leaf"`` sits inside the plate ``"data"`` with the
per-point marginal of the prior, :class:`~pyro_trees.distributions.BalancedLeaf`;
:class:`~pyro_trees.infer.TreeELBO` adds the coupling that makes it the joint
:class:`~pyro_trees.distributions.TreeBalance`.

**Shapes.** ``x``: ``(N, L)``. ``y``: ``(N,)`` for a single regression output and
for class labels (long, in ``[0, num_classes)``); ``(N, num_outputs)`` otherwise. The
plate ``"data"`` (``dim=-1``) is owned by this class and by the guide.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam
from pyro.ops.indexing import Vindex

from pyro_trees import trees
from pyro_trees._param_store import adopt_param_store, follow_data
from pyro_trees._tree_start import balanced_start, check_init, input_scaling
from pyro_trees.distributions.tree_balance import BalancedLeaf

__all__ = ["HME"]


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
# the first call's start (the Pyro path) puts the learnt noise scale at least at this
# share of y's standard deviation: the guide's soft start routes the points near each
# cut to both neighbouring experts, a residual the hard start's leaf means do not see.
# On noise-free data (the pulse) the hard residual is ~0 and a start at it left the
# first loss at ~56,000 nats a point and the predictive covering none of the points
# after 600 steps (the noise grows ~1 % a step under Adam at 0.01)
_LAZY_NOISE_FLOOR = 0.05


class HME(PyroModule):
    """Hierarchical mixture of experts with the tree-balance prior on routing.

    :param int in_features: input dimension :math:`L`.
    :param int depth: tree depth :math:`D` (``2**D`` experts).
    :param str likelihood: ``"gaussian"`` (regression) or ``"categorical"``.
    :param int num_outputs: regression outputs (``"gaussian"``).
    :param int num_classes: classes (``"categorical"``).
    :param str experts: ``"constant"`` (the paper) or ``"linear"``.
    :param noise_scale: ``None`` (default): one observation noise scale per output,
        learnt (a point estimate, like the experts), starting at the residual standard
        deviation of the start tree; or a fixed scale, e.g. the paper's ``1.0``. A fixed
        scale sets how much a point's fit pays for confident routing: far above the
        data's noise, the exact bound keeps the routing soft and the experts blurred
        towards each other (on step functions the snippet's predictive got worse as it
        trained, ``benchmarks/pyro_path``); the learnt one follows the data's units.
    :param str init: the start the experts take at the first call with ``y``:
        ``"balanced"`` (default) or ``"greedy"``, the tree that
        :class:`~pyro_trees.guides.RNNTreeGuide` with the same ``init`` starts from (one
        M-step on its hard routing, :meth:`init_experts`); ``None``: no data-dependent
        start. Parameters already in the param store under this model's names are
        used instead, never overwritten.
    :param str name: parameter-store prefix, e.g. ``"hme"`` gives ``"hme.leaf_loc"``;
        two models in one store need different names.

    At its first call the model also moves to the dtype and device of ``x``.

    .. rubric:: Examples

    >>> import torch, pyro
    >>> from pyro.infer import SVI
    >>> from pyro_trees.guides import RNNTreeGuide
    >>> from pyro_trees.infer import TreeELBO
    >>> from pyro_trees.models import HME
    >>> x = torch.linspace(-1, 1, 16).unsqueeze(-1)
    >>> y = (x[:, 0] > 0).float()
    >>> model, guide = HME(1, 2), RNNTreeGuide(1, 2)
    >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TreeELBO())
    >>> loss = svi.step(x, y)
    >>> model.leaf_loc.shape
    torch.Size([4, 1])
    """

    def __init__(
        self,
        in_features: int,
        depth: int,
        *,
        likelihood: str = "gaussian",
        num_outputs: int = 1,
        num_classes: int | None = None,
        experts: str = "constant",
        noise_scale: float | None = None,
        init: str | None = "balanced",
        name: str | None = None,
    ):
        super().__init__(name=name or "")
        check_init(init)
        self.init = init
        self._init_state = "fresh"
        if likelihood not in ("gaussian", "categorical"):
            raise ValueError(f"likelihood must be 'gaussian' or 'categorical', got {likelihood!r}")
        if experts not in ("constant", "linear"):
            raise ValueError(f"experts must be 'constant' or 'linear', got {experts!r}")
        if in_features < 1:
            raise ValueError(f"in_features must be >= 1, got {in_features}")
        self.in_features = int(in_features)
        self.likelihood = likelihood
        self.experts = experts
        if likelihood == "gaussian":
            if num_outputs < 1:
                raise ValueError(f"num_outputs must be >= 1, got {num_outputs}")
            self.num_outputs = int(num_outputs)
            width = self.num_outputs
            if noise_scale is None:
                self.noise_scale = PyroParam(torch.ones(width), constraint=constraints.positive)
                self.learn_noise = True
            else:
                if not noise_scale > 0:
                    raise ValueError(f"noise_scale must be positive or None, got {noise_scale}")
                self.register_buffer("fixed_noise_scale", torch.full((width,), float(noise_scale)))
                self.learn_noise = False
        else:
            if num_classes is None or num_classes < 2:
                raise ValueError(f"num_classes must be >= 2 for 'categorical', got {num_classes}")
            self.num_classes = int(num_classes)
            width = self.num_classes
            self.learn_noise = False
        self.width = width
        # Per leaf: width values (constant experts), (1 + L) * width (linear experts).
        per_leaf = width * (1 + self.in_features if experts == "linear" else 1)
        self.depth = trees.check_depth(
            depth,
            width=per_leaf,
            dtype=torch.get_default_dtype(),
            what=(
                f"the experts' parameters ({per_leaf:,} values per leaf, with gradients "
                "and optimiser state)"
            ),
        )
        leaves = trees.num_leaves(self.depth)
        self.leaf_loc = PyroParam(0.1 * torch.randn(leaves, width))
        if experts == "linear":
            self.leaf_weight = PyroParam(torch.zeros(leaves, self.in_features, width))

    @property
    def initialised(self) -> bool:
        """Whether the first-call initialisation has happened (or was adopted)."""
        return self._init_state == "done"

    @torch.no_grad()
    def _lazy_init(self, x: torch.Tensor, y) -> None:
        if self._init_state == "fresh":
            self._init_state = "pending"
            if adopt_param_store(self):
                self._init_state = "done"
                return
            follow_data(self, x)
        if self.init is None:
            self._init_state = "done"
            return
        if y is None:
            return  # initialised at the first call with targets
        loc, scale = input_scaling(x)
        _, leaf = balanced_start((x - loc) / scale, y, self.depth, cuts=self.init)
        one_hot = torch.nn.functional.one_hot(leaf, self.num_leaves)
        self.init_experts(x, y, one_hot, noise_floor=_LAZY_NOISE_FLOOR)
        self._init_state = "done"

    @property
    def num_leaves(self) -> int:
        """Number of leaves (experts), ``2**depth``."""
        return trees.num_leaves(self.depth)

    def scale(self) -> torch.Tensor:
        """Observation noise scale ``(num_outputs,)`` (regression only)."""
        return self.noise_scale if self.learn_noise else self.fixed_noise_scale

    def leaf_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's mean (or logits) for every input: ``(N, 2**D, width)``. A
        linear expert reads a missing input (NaN) as 0 (the estimators standardise their
        inputs, so 0 is the training mean there)."""
        loc = self.leaf_loc.to(x.dtype)
        if self.experts == "constant":
            return loc.expand(x.shape[0], -1, -1)
        missing = torch.isnan(x)
        if bool(missing.any()):
            x = torch.where(missing, torch.zeros_like(x), x)
        return torch.einsum("nf,lfo->nlo", x, self.leaf_weight.to(x.dtype)) + loc

    def expert(self, x: torch.Tensor, leaf: torch.Tensor) -> dist.Distribution:
        """Distribution of ``y`` given the leaf; ``leaf`` broadcasts against ``(N,)``
        (a sampled ``(N,)`` or an enumerated ``(2**D, 1)`` value)."""
        batch_shape = torch.broadcast_shapes(leaf.shape, x.shape[:1])
        if self.experts == "constant":
            # index the (2**D, width) leaf values by the leaf alone, then expand (no
            # copy): an enumerated leaf normalises 2**D logits, not 2**D x N
            out = self.leaf_loc.to(x.dtype)[leaf]
        else:
            out = Vindex(self.leaf_outputs(x))[torch.arange(x.shape[0], device=x.device), leaf]
        if self.likelihood == "categorical":
            return dist.Categorical(logits=out).expand(batch_shape)
        scale = self.scale().to(x.dtype)
        if self.num_outputs == 1:
            return dist.Normal(out[..., 0], scale[0]).expand(batch_shape)
        return dist.Normal(out, scale).to_event(1).expand(batch_shape)

    def expert_params(self) -> dict:
        """Every learnt tensor of the experts, read once: ``leaf_loc`` ``(2**D, width)``,
        ``leaf_weight`` ``(2**D, L, width)`` (linear experts) and the noise ``scale``
        ``(num_outputs,)`` (regression). A compiled loss takes them as inputs
        (:meth:`leaf_log_likelihood`), so that the program reads no module."""
        with self._pyro_context:  # through Pyro's store, so that plain SVI trains them
            params = {"leaf_loc": self.leaf_loc}
            if self.experts == "linear":
                params["leaf_weight"] = self.leaf_weight
            if self.likelihood == "gaussian":
                params["scale"] = self.scale()
        return params

    def leaf_log_likelihood(self, x: torch.Tensor, y: torch.Tensor, params=None) -> torch.Tensor:
        """``log p(y_n | leaf l)`` for every row and leaf, ``(N, 2**D)``: the log-densities
        of :meth:`expert` at every leaf, as plain tensor operations.

        :param x: ``(N, L)`` inputs (a linear expert reads a missing value as 0).
        :param y: targets as in :meth:`forward`.
        :param dict params: :meth:`expert_params` (default: read them now).
        """
        params = self.expert_params() if params is None else params
        loc = params["leaf_loc"].to(x.dtype)  # (2**D, width)
        if self.experts == "linear":
            x0 = torch.where(torch.isnan(x), torch.zeros_like(x), x)
            out = torch.einsum("nf,lfo->nlo", x0, params["leaf_weight"].to(x.dtype)) + loc
        else:
            out = loc.unsqueeze(0)  # (1, 2**D, width)
        if self.likelihood == "categorical":
            log_p = out.log_softmax(-1).expand(y.shape[0], -1, -1)  # (N, 2**D, K)
            index = y.long().reshape(-1, 1, 1).expand(-1, log_p.shape[1], 1)
            return log_p.gather(-1, index).squeeze(-1)
        scale = params["scale"].to(x.dtype)
        z = (y.reshape(y.shape[0], 1, -1).to(x.dtype) - out) / scale
        return (-0.5 * z * z - scale.log() - _HALF_LOG_2PI).sum(-1)

    @torch.no_grad()
    def expert_m_step(
        self, x: torch.Tensor, y: torch.Tensor, leaf_probs: torch.Tensor, reduce=None
    ):
        """The constant experts' M-step for a routing, without setting anything.

        Regression: the ``leaf_probs``-weighted means of ``y``. Classification: the log
        of the weighted class frequencies, with one pseudo-count per class.

        :param x: ``(N, L)``; ``y``: targets as in :meth:`forward`;
        :param leaf_probs: ``(N, 2**D)`` routing probabilities (or a hard one-hot).
        :param reduce: applied to the sums over rows (counts, weighted sums, masses)
            before they are combined, e.g. a sum over the ranks of a data-parallel fit.
        :returns: ``(loc, mass)``: leaf values ``(2**D, width)`` and the routed mass of
            each leaf ``(2**D,)`` (a leaf of mass 0 has no meaningful mean).
        """
        reduce = (lambda t: t) if reduce is None else reduce
        w = leaf_probs.to(x.dtype)
        mass = reduce(w.sum(0))  # (2**D,)
        if self.likelihood == "categorical":
            counts = w.T @ torch.nn.functional.one_hot(y.long(), self.num_classes).to(x.dtype)
            counts = reduce(counts)
            logits = torch.log(counts + 1.0) - torch.log(mass + self.num_classes).unsqueeze(-1)
            return logits, mass
        y2 = y.reshape(y.shape[0], -1).to(x.dtype)  # (N, out)
        return reduce(w.T @ y2) / mass.clamp_min(1e-12).unsqueeze(-1), mass

    @torch.no_grad()
    def init_experts(
        self, x: torch.Tensor, y: torch.Tensor, leaf_probs: torch.Tensor, noise_floor: float = 1e-3
    ) -> None:
        """One M-step from a routing: experts fit the points each leaf receives.

        Leaf values from :meth:`expert_m_step` (linear experts start with zero slopes;
        an empty regression leaf takes the mean of ``y``) and a learnt noise scale the
        weighted residual standard deviation, at least ``noise_floor`` times ``y``'s
        standard deviation (the first call's start uses 0.05: a hard routing's residual
        misses what the guide's soft start leaves near the cuts).

        :param x: ``(N, L)``; ``y``: targets as in :meth:`forward`;
        :param leaf_probs: ``(N, 2**D)`` routing probabilities (e.g. from the guide).
        :param float noise_floor: the least start noise scale, as a share of ``y``'s
            standard deviation.
        """
        loc, mass = self.expert_m_step(x, y, leaf_probs)
        if self.likelihood == "categorical":
            self.leaf_loc = loc
            return
        w = leaf_probs.to(x.dtype)
        y2 = y.reshape(y.shape[0], -1).to(x.dtype)  # (N, out)
        empty = mass < 1e-6
        loc[empty] = y2.mean(0)
        self.leaf_loc = loc
        if self.learn_noise:
            resid = (w.unsqueeze(-1) * (y2.unsqueeze(1) - loc) ** 2).sum((0, 1)) / y2.shape[0]
            floor = float(noise_floor) * y2.std(0).clamp_min(1e-12)
            self.noise_scale = resid.sqrt().clamp_min(floor)

    def check_y(self, y: torch.Tensor, n: int) -> None:
        """Check that the targets ``y`` have the shape of the module's docstring for ``n``
        rows: ``(n,)`` for class labels and one regression output, else
        ``(n, num_outputs)``.

        :raises ValueError: naming the shape expected and the shape given.
        """
        one = self.likelihood == "categorical" or self.num_outputs == 1
        want = (n,) if one else (n, self.num_outputs)
        if tuple(y.shape) != want:
            what = "class labels" if self.likelihood == "categorical" else "targets"
            raise ValueError(
                f"y must hold the {what} of x's {n} rows with shape {want}; got {tuple(y.shape)}"
            )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Sample (or condition on) ``y`` for inputs ``x``; returns ``y``'s sample."""
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (N, {self.in_features}); got {tuple(x.shape)}")
        n = x.shape[0]
        if y is not None:
            self.check_y(y, n)
        if self._init_state != "done":
            self._lazy_init(x, y)
        with pyro.plate("data", n, subsample_size=subsample_size, dim=-1) as idx:
            leaf = pyro.sample("leaf", BalancedLeaf(self.depth, n, dtype=x.dtype, device=x.device))
            return pyro.sample("obs", self.expert(x[idx], leaf), obs=None if y is None else y[idx])
