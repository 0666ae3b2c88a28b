r"""Variational guide over the global parameters of :class:`~pyro_trees.models.BayesianHME`.

The family is the one of the paper's (and :mod:`pyro_trees.infer.bayesian_hme_vb`'s)
closed-form variational Bayes, without its local Jaakkola-Jordan bound:

.. math:: q = \prod_g N(v_g \mid m_g, L_g L_g^\top)\, \mathrm{Gamma}(\beta_g)
          \prod_j \Big[\prod_{k=1}^{D} N(w_{jk} \mid m_{jk}, C_j C_j^\top)\Big]
          \mathrm{Gamma}(\alpha_j)\, \mathrm{Gamma}(\tau_j),

full-covariance Gaussians for every gate and every expert (the ``D`` rows of an expert
share one covariance, as in the exact coordinate update) and Gamma precisions. The
assignment is summed out in the model, so no local factor is needed, and the ELBO
:class:`~pyro.infer.Trace_ELBO` estimates is at least the closed-form bound of the same
global factors (it uses the exact log-sigmoid and the exact posterior over experts).
Each Cholesky factor is a positive scale per row times a unit lower-triangular matrix
(as in :class:`~pyro.infer.autoguide.AutoMultivariateNormal`), so Adam's steps on the
off-diagonal entries are relative to the scale.

Every Gamma shape is kept above the prior's shape ``a0`` (``prior_a``). The family loses
nothing: each optimal factor has shape ``a0`` plus a non-negative count (``a0 + P/2`` for
``beta``, ``a0 + DP/2`` for ``alpha``, ``a0 + (D/2) sum_n r_nj`` for ``tau_j``). Without
the floor, SVI ran away on an expert that receives no data: once the shape of its
``q(tau)`` falls below about ``1e-2`` most reparameterised draws underflow and are clamped
to ``finfo.tiny``, where the single-sample ELBO reads a spurious gain that grows without
bound as the shape falls (about 2.3 nats per decade); Adam followed it until the shape's
gradient overflowed (shape ~1e-30 in float32) and the next step raised on a NaN
concentration.

The posterior is multimodal (experts can swap roles or share a branch), so the guide
initialises itself at its first call on data, like Pyro's autoguides: by default
(``init="vb"``) it runs the closed-form coordinate ascent from ``init_restarts`` random
starts for at most ``init_cycles`` cycles and starts from the best bound. Parameters that
the parameter store already holds (e.g. after ``pyro.get_param_store().load(...)``) are
never overwritten. :meth:`BayesianHMEGuide.init_from_data` (one data-driven random start)
and :meth:`BayesianHMEGuide.load_vb_state` set the parameters explicitly instead.

Random restarts as a batch dimension: ``BayesianHMEGuide(model, num_restarts=R)`` holds
``R`` independent copies of ``q`` and :class:`RestartPlate` runs the model inside the
matching ``"restarts"`` plate, so plain :class:`~pyro.infer.SVI` trains all of them at
once (:func:`pyro_trees.infer.fit_svi_restarts` wraps this);
:meth:`BayesianHMEGuide.restart` and :meth:`BayesianHMEGuide.subset` take copies out.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroModule, PyroParam

from pyro_trees.guides.base import TreeGuide
from pyro_trees.models.bayesian_hme_vb_run import init_state, run_vb
from pyro_trees.models.bayesian_hme_vb_updates import VBData, update_experts, update_noise

__all__ = ["BayesianHMEGuide", "RestartPlate"]

_INITS = ("vb", "data", "random")


def _check_count(name: str, value, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be {'None or ' if allow_none else ''}an integer >= 1, got {value!r}"
        )


class RestartPlate(PyroModule):
    """Runs a model inside a ``"restarts"`` plate at dim -2, so that independent restarts
    of a guide (one copy of ``q`` per plate slice, e.g.
    ``BayesianHMEGuide(model, num_restarts=R)``) train as one batch with plain
    :class:`~pyro.infer.SVI`: the ELBO is a sum of the restarts' ELBOs, and each restart's
    parameters get only its own gradient. ``Predictive`` (sequential or parallel) then
    returns draws of every site with a restart dim, e.g. ``obs`` ``(S, R, N, D)``.

    :param model: the model (plates at dims -1 only).
    :param int num_restarts: the plate's size.
    :param str name: parameter-store prefix (the wrapper has no parameters of its own).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro.optim import Adam
    >>> from pyro_trees.guides import BayesianHMEGuide, RestartPlate
    >>> from pyro_trees.models import BayesianHME
    >>> x, y = torch.randn(20, 1), torch.randn(20)
    >>> model = BayesianHME(1)
    >>> guide = BayesianHMEGuide(model, init="random", num_restarts=3)
    >>> svi = SVI(RestartPlate(model, 3), guide, Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(x, y)
    >>> guide.W_loc.shape
    torch.Size([3, 2, 1, 2])
    >>> guide.restart(0, model).W_loc.shape
    torch.Size([2, 1, 2])
    """

    def __init__(self, model, num_restarts: int, *, name: str = ""):
        super().__init__(name=name)
        _check_count("num_restarts", num_restarts)
        self.model = model
        self.num_restarts = num_restarts

    def forward(self, *args, **kwargs):
        """Call the model with the same arguments inside the ``"restarts"`` plate."""
        with pyro.plate("restarts", self.num_restarts, dim=-2):
            return self.model(*args, **kwargs)


class BayesianHMEGuide(TreeGuide, AutoGuide):
    """Full-covariance Gaussian weights and Gamma precisions for a Bayesian HME.

    An :class:`~pyro.infer.autoguide.AutoGuide` (so it composes in
    :class:`~pyro.infer.autoguide.AutoGuideList`, sharing its plates) with a fixed
    family; a call returns the sampled sites as a dict.

    Parameters (``R`` leading restarts with ``num_restarts``; ``G`` gates, ``E`` experts,
    ``P = L + 1`` inputs with the bias, ``D`` outputs): ``v_loc`` ``(G, P)``,
    ``v_scale`` ``(G, P)``, ``v_scale_tril`` ``(G, P, P)`` (unit lower-triangular),
    ``beta_conc``, ``beta_rate`` ``(G,)``; ``W_loc`` ``(E, D, P)``, ``W_scale`` ``(E, P)``,
    ``W_scale_tril`` ``(E, P, P)``, ``alpha_conc``, ``alpha_rate``, ``tau_conc``,
    ``tau_rate`` ``(E,)``. They are created at the first call, in the dtype and on the
    device of ``x`` (or by :meth:`init_from_data` / :meth:`load_vb_state`).

    :param model: the :class:`~pyro_trees.models.BayesianHME` to approximate.
    :param str init: how the first call on data ``(x, y)`` initialises ``q``: ``"vb"``
        (default) runs the closed-form variational Bayes of
        :mod:`~pyro_trees.infer.bayesian_hme_vb` from ``init_restarts`` random starts
        for at most ``init_cycles`` cycles and takes the best bound (per copy of ``q``);
        ``"data"`` is one data-driven random start (:meth:`init_from_data`);
        ``"random"`` draws the gate and expert means from ``N(0, init_scale**2)``. A call
        without ``y`` (e.g. ``Predictive`` before training) uses ``"random"`` values
        until the first call with ``y``.
    :param int init_restarts: random starts of ``init="vb"``.
    :param int init_cycles: most coordinate-ascent cycles of ``init="vb"``.
    :param float init_scale: with ``init="random"``, the standard deviation of the
        Gaussian factors and of the initial means.
    :param float init_precision: with ``init="random"``, the initial mean of every Gamma
        factor (shape 1, or ``prior_a + 1`` when the prior's shape is 1 or more); with
        ``init="data"``, of ``alpha`` and ``beta``.
    :param int num_restarts: if given, every parameter gets a leading dim of this size:
        that many independent copies of ``q`` (restarts) trained as one batch. The guide
        then opens a ``"restarts"`` plate at dim -2 and must be paired with the model
        wrapped in :class:`RestartPlate` (:meth:`restart` takes one copy out).
    :param str name: parameter-store prefix (parameters are ``"<name>.W_loc"`` etc.);
        default: the model's name, or ``"BayesianHMEGuide"`` when it has none.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro.infer import SVI, Trace_ELBO
    >>> from pyro.optim import Adam
    >>> from pyro_trees.guides import BayesianHMEGuide
    >>> from pyro_trees.models import BayesianHME
    >>> x, y = torch.randn(20, 1), torch.randn(20)
    >>> model = BayesianHME(1)
    >>> guide = BayesianHMEGuide(model, init_restarts=2, init_cycles=5)
    >>> svi = SVI(model, guide, Adam({"lr": 0.01}), Trace_ELBO())
    >>> loss = svi.step(x, y)
    >>> guide.median()["W"].shape
    torch.Size([2, 1, 2])
    """

    _PARAMS = (
        "v_loc",
        "v_scale",
        "v_scale_tril",
        "beta_conc",
        "beta_rate",
        "W_loc",
        "W_scale",
        "W_scale_tril",
        "alpha_conc",
        "alpha_rate",
        "tau_conc",
        "tau_rate",
    )
    _CONSTRAINTS = {
        "v_scale": constraints.positive,
        "v_scale_tril": constraints.unit_lower_cholesky,
        "beta_rate": constraints.positive,
        "W_scale": constraints.positive,
        "W_scale_tril": constraints.unit_lower_cholesky,
        "alpha_rate": constraints.positive,
        "tau_rate": constraints.positive,
    }
    #: Gamma shapes: constrained above the prior's shape (see the module docstring).
    _SHAPES = ("beta_conc", "alpha_conc", "tau_conc")

    def __init__(
        self,
        model,
        *,
        init: str = "vb",
        init_restarts: int = 20,
        init_cycles: int = 100,
        init_scale: float = 0.1,
        init_precision: float = 1.0,
        num_restarts: int | None = None,
        name: str | None = None,
    ):
        super().__init__(model)
        if name is None:
            name = getattr(model, "name", "") or type(self).__name__
        self._pyro_name = name
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got {init!r}")
        if not init_scale > 0 or not init_precision > 0:
            raise ValueError("init_scale and init_precision must be positive")
        _check_count("init_restarts", init_restarts)
        _check_count("init_cycles", init_cycles)
        _check_count("num_restarts", num_restarts, allow_none=True)
        self.num_gates, self.num_experts = model.num_gates, model.num_experts
        self.in_features, self.out_features = model.in_features, model.out_features
        self.topology = model.topology
        self.prior_a, self.prior_b = model.prior_a, model.prior_b
        self.num_restarts = num_restarts
        self.init = init
        self.init_restarts = init_restarts
        self.init_cycles = init_cycles
        self.init_scale = float(init_scale)
        self.init_precision = float(init_precision)
        self._awaiting_data = False

    def _names(self):
        return [n for n in self._PARAMS if self.num_gates or not n.startswith(("v_", "beta_"))]

    @property
    def initialised(self) -> bool:
        """Whether the parameters exist (after the first call or an explicit init)."""
        return "W_loc" in self._pyro_params

    @property
    def awaiting_data(self) -> bool:
        """Whether the next call with data (``x``, ``y``) initialises ``q`` (no
        parameters yet, or placeholders from a call without ``y``)."""
        return not self.initialised or self._awaiting_data

    def site_params(self) -> dict:
        """The constrained parameters, read once through Pyro's store (so that plain
        ``SVI`` trains them), with the Cholesky factors of the Gaussian factors:
        ``v_tril`` ``batch + (G, P, P)`` and ``W_tril`` ``batch + (E, 1, P, P)``, for a
        loss that draws the sites as plain tensor code."""
        with self._pyro_context:
            out = {key: getattr(self, key) for key in self._names()}
        if self.num_gates:
            out["v_tril"] = out["v_scale"].unsqueeze(-1) * out["v_scale_tril"]
        out["W_tril"] = (out["W_scale"].unsqueeze(-1) * out["W_scale_tril"]).unsqueeze(-3)
        return out

    def _constraint(self, key: str):
        if key in self._SHAPES:
            return constraints.greater_than(self.prior_a)
        return self._CONSTRAINTS.get(key, constraints.real)

    def _set(self, values: dict) -> BayesianHMEGuide:
        self._awaiting_data = False
        for key in self._names():
            value = values[key].detach().clone()
            if key in self._SHAPES:
                # strictly inside the constraint (a VB shape of an unused expert may
                # round to a0 itself)
                value = value.clamp_min(self.prior_a * (1.0 + 1e-4))
            setattr(self, key, PyroParam(value, constraint=self._constraint(key)))
        return self

    def _batch(self) -> tuple:
        return () if self.num_restarts is None else (self.num_restarts,)

    def forward(self, x, y=None, subsample_size=None):
        """Sample every global site of the model (the signature of the model).

        :param x: inputs ``(N, L)``; at the first call they (and ``y``) initialise ``q``.
        :param y: targets ``(N, D)`` or ``(N,)``, or ``None``.
        :returns: the sampled sites, ``{"beta", "v", "alpha", "tau", "W"}``.
        """
        if not self.initialised or (self._awaiting_data and y is not None):
            self._initialise(x, y)
        if self.num_restarts is None:
            return self._sample()
        with self._plate("restarts", self.num_restarts, -2):
            return self._sample()

    def _plate(self, name: str, size: int, dim: int):
        # inside an AutoGuideList the list has created the model's plates; reuse them
        shared = self.master().plates if self.master is not None else {}
        return shared[name] if name in shared else pyro.plate(name, size, dim=dim)

    def _sample(self) -> dict:
        out = {}
        if self.num_gates:
            with self._plate("gates", self.num_gates, -1):
                out["beta"] = pyro.sample("beta", dist.Gamma(self.beta_conc, self.beta_rate))
                tril = self.v_scale.unsqueeze(-1) * self.v_scale_tril
                out["v"] = pyro.sample("v", dist.MultivariateNormal(self.v_loc, scale_tril=tril))
        with self._plate("experts", self.num_experts, -1):
            out["alpha"] = pyro.sample("alpha", dist.Gamma(self.alpha_conc, self.alpha_rate))
            out["tau"] = pyro.sample("tau", dist.Gamma(self.tau_conc, self.tau_rate))
            tril = (self.W_scale.unsqueeze(-1) * self.W_scale_tril).unsqueeze(-3)
            q_w = dist.MultivariateNormal(self.W_loc, scale_tril=tril).to_event(1)
            out["W"] = pyro.sample("W", q_w)
        return out

    @torch.no_grad()
    def _initialise(self, x: torch.Tensor, y) -> None:
        stored = False
        if self._pyro_context.active and not pyro.settings.get("module_local_params"):
            stored = self._pyro_get_fullname("W_loc") in pyro.get_param_store()
            stored = stored and not self._awaiting_data
        if stored or y is None or self.init == "random":
            # parameters already in the store win over these values (pyro.param semantics);
            # placeholders draw no random numbers, so a loaded store predicts as it was saved
            self._set(self._random_values(x, draw=not stored))
            self._awaiting_data = not stored and y is None and self.init != "random"
        elif self.init == "data":
            self.init_from_data(x, y)
        else:
            self._init_vb(x, y)

    def _random_values(self, like: torch.Tensor, draw: bool = True) -> dict:
        g, e = self.num_gates, self.num_experts
        p, d = self.in_features + 1, self.out_features
        opts = {"dtype": like.dtype, "device": like.device}
        r, s = self._batch(), self.init_scale
        eye = torch.eye(p, **opts)
        # shape 1, strictly above the prior's shape (the floor of every Gamma shape)
        shape = 1.0 if self.prior_a < 1.0 else self.prior_a + 1.0
        conc_g, conc_e = torch.full(r + (g,), shape, **opts), torch.full(r + (e,), shape, **opts)
        noise = torch.randn if draw else torch.zeros
        return {
            "v_loc": noise(r + (g, p), **opts) * s,
            "v_scale": torch.full(r + (g, p), s, **opts),
            "v_scale_tril": eye.expand(r + (g, p, p)),
            "beta_conc": conc_g,
            "beta_rate": conc_g / self.init_precision,
            "W_loc": noise(r + (e, d, p), **opts) * s,
            "W_scale": torch.full(r + (e, p), s, **opts),
            "W_scale_tril": eye.expand(r + (e, p, p)),
            "alpha_conc": conc_e,
            "alpha_rate": conc_e / self.init_precision,
            "tau_conc": conc_e,
            "tau_rate": conc_e / self.init_precision,
        }

    def _init_vb(self, x: torch.Tensor, y: torch.Tensor) -> None:
        data = self._vb_data(x, y)
        r = self._batch()
        k = self.init_restarts
        state = init_state(data, r + (k,))
        res = run_vb(data, state, num_cycles=self.init_cycles)
        best = res.bound.nan_to_num(-float("inf")).argmax(-1)
        pick = (torch.arange(r[0], device=best.device), best) if r else int(best)
        self._set(self._from_state(res.state.index(pick), like=x))

    def _vb_data(self, x: torch.Tensor, y: torch.Tensor):
        return VBData.build(
            x.detach().double(),
            y.detach().double(),
            self.topology,
            prior_a=self.prior_a,
            prior_b=self.prior_b,
        )

    def _from_state(self, state, like: torch.Tensor) -> dict:
        """The guide's parameters from a VB state (every factor)."""
        opts = {"dtype": like.dtype, "device": like.device}
        out = {}
        for key, mean, cov in (("v", state.v_mean, state.v_cov), ("W", state.w_mean, state.w_cov)):
            tril = torch.linalg.cholesky(cov)
            scale = tril.diagonal(dim1=-2, dim2=-1)
            out[f"{key}_loc"] = mean.to(**opts)
            out[f"{key}_scale"] = scale.to(**opts)
            out[f"{key}_scale_tril"] = (tril / scale.unsqueeze(-1)).to(**opts)
        for key, a, b in (
            ("beta", state.beta_a, state.beta_b),
            ("alpha", state.alpha_a, state.alpha_b),
            ("tau", state.tau_a, state.tau_b),
        ):
            out[f"{key}_conc"], out[f"{key}_rate"] = a.to(**opts), b.to(**opts)
        return out

    def _require_params(self, what: str) -> None:
        if not self.initialised:
            raise ValueError(
                f"{what} needs the guide's parameters: call the guide (or SVI) on data "
                "first, or set them with init_from_data() / load_vb_state()"
            )

    @torch.no_grad()
    def scale_trils(self) -> tuple:
        """Cholesky factors of the Gaussian factors' covariances: ``(v, W)``, shapes
        ``(G, P, P)`` (``None`` without gates) and ``(E, P, P)``."""
        self._require_params("scale_trils()")
        w = self.W_scale.unsqueeze(-1) * self.W_scale_tril
        if not self.num_gates:
            return None, w.detach()
        return (self.v_scale.unsqueeze(-1) * self.v_scale_tril).detach(), w.detach()

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict:
        """Posterior modes of the weights and means of the precisions."""
        self._require_params("median()")
        out = {
            "W": self.W_loc.detach().clone(),
            "alpha": (self.alpha_conc / self.alpha_rate).detach(),
            "tau": (self.tau_conc / self.tau_rate).detach(),
        }
        if self.num_gates:
            out["v"] = self.v_loc.detach().clone()
            out["beta"] = (self.beta_conc / self.beta_rate).detach()
        return out

    @torch.no_grad()
    def init_from_data(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        gate_scale: float = 2.0,
        generator: torch.Generator | None = None,
    ) -> BayesianHMEGuide:
        """A data-driven random start (the one of the closed-form VB's restarts).

        Gate means are drawn from ``N(0, gate_scale**2 / P)`` (with covariance
        ``0.01 I``); every expert's weights are then the responsibility-weighted,
        lightly regularised least-squares fit under those random gates, and its noise
        precision the inverse of its weighted residual variance; ``alpha`` and ``beta``
        get shape 1 and mean ``init_precision``. Nothing is fitted to the data beyond
        that one weighted regression, so different generators give different,
        data-sensible starts. The parameters take the dtype and device of ``x``.

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N,)`` or ``(N, D)``.
        """
        data = self._vb_data(x, y)
        state = init_state(data, self._batch(), gate_scale=gate_scale, generator=generator)
        state = update_experts(data, state)
        state = update_noise(data, state)
        values = self._random_values(x, draw=False)
        fitted = self._from_state(state, like=x)
        for key in ("v_loc", "v_scale", "v_scale_tril", "W_loc", "W_scale", "W_scale_tril"):
            values[key] = fitted[key]
        values["tau_conc"], values["tau_rate"] = fitted["tau_conc"], fitted["tau_rate"]
        return self._set(values)

    @torch.no_grad()
    def load_vb_state(self, state) -> BayesianHMEGuide:
        """Copy a :class:`~pyro_trees.infer.bayesian_hme_vb.VBState` without batch dims
        (its dtype and device)."""
        if self.num_restarts is not None:
            raise ValueError("load_vb_state() needs a guide without num_restarts")
        if state.batch_shape != torch.Size():
            raise ValueError(f"expected a single state, got batch shape {tuple(state.batch_shape)}")
        return self._set(self._from_state(state, like=state.w_mean))

    @torch.no_grad()
    def restart(self, index: int, model) -> BayesianHMEGuide:
        """A plain guide (no restart dim) holding copy ``index`` of a batched guide.

        :param int index: which restart.
        :param model: the (unwrapped) :class:`~pyro_trees.models.BayesianHME`.
        """
        if self.num_restarts is None:
            raise ValueError("restart() needs a guide built with num_restarts")
        if not -self.num_restarts <= index < self.num_restarts:
            raise ValueError(f"index {index} out of range for {self.num_restarts} restarts")
        self._require_params("restart()")
        out = BayesianHMEGuide(model, name=self._pyro_name)
        return out._set({k: getattr(self, k)[index] for k in self._names()})

    @torch.no_grad()
    def subset(self, indices, model) -> BayesianHMEGuide:
        """A batched guide holding the restarts ``indices`` (in that order).

        :param indices: a sequence or 1-d tensor of restart indices.
        :param model: the (unwrapped) :class:`~pyro_trees.models.BayesianHME`.
        """
        if self.num_restarts is None:
            raise ValueError("subset() needs a guide built with num_restarts")
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if not len(idx) or bool((idx < 0).any() | (idx >= self.num_restarts).any()):
            raise ValueError(f"indices must be in [0, {self.num_restarts}), got {idx.tolist()}")
        self._require_params("subset()")
        out = BayesianHMEGuide(model, num_restarts=len(idx), name=self._pyro_name)
        idx = idx.to(self.W_loc.device)
        return out._set({k: getattr(self, k)[idx] for k in self._names()})
