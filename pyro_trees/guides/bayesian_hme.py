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

:meth:`BayesianHMEGuide.init_from_data` gives a data-driven random start (random gates,
weighted least-squares experts); :meth:`BayesianHMEGuide.load_vb_state` copies a
closed-form solution into the guide.

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
from pyro.nn import PyroModule, PyroParam

__all__ = ["BayesianHMEGuide", "RestartPlate"]


class RestartPlate(PyroModule):
    """Runs a model inside a ``"restarts"`` plate at dim -2, so that independent restarts
    of a guide (one copy of ``q`` per plate slice, e.g.
    ``BayesianHMEGuide(model, num_restarts=R)``) train as one batch with plain
    :class:`~pyro.infer.SVI`: the ELBO is a sum of the restarts' ELBOs, and each restart's
    parameters get only its own gradient.

    :param model: the model (plates at dims -1 only).
    :param int num_restarts: the plate's size.
    """

    def __init__(self, model, num_restarts: int):
        super().__init__()
        if isinstance(num_restarts, bool) or not isinstance(num_restarts, int) or num_restarts < 1:
            raise ValueError(f"num_restarts must be an integer >= 1, got {num_restarts!r}")
        self.model = model
        self.num_restarts = num_restarts

    def forward(self, *args, **kwargs):
        """Call the model with the same arguments inside the ``"restarts"`` plate."""
        with pyro.plate("restarts", self.num_restarts, dim=-2):
            return self.model(*args, **kwargs)


class BayesianHMEGuide(PyroModule):
    """Full-covariance Gaussian weights and Gamma precisions for a Bayesian HME.

    :param model: the :class:`~pyro_trees.models.BayesianHME` to approximate.
    :param float init_scale: initial standard deviation of the Gaussian factors and of
        the random initial gate means (which break the symmetry between experts).
    :param float init_precision: initial mean of every Gamma factor (shape 1).
    :param int num_restarts: if given, every parameter gets a leading dim of this size:
        that many independent copies of ``q`` (restarts) trained as one batch. The guide
        then opens a ``"restarts"`` plate at dim -2 and must be paired with the model
        wrapped in :class:`RestartPlate` (:meth:`restart` takes one copy out).
    """

    def __init__(
        self,
        model,
        *,
        init_scale: float = 0.1,
        init_precision: float = 1.0,
        num_restarts: int | None = None,
    ):
        super().__init__()
        if not init_scale > 0 or not init_precision > 0:
            raise ValueError("init_scale and init_precision must be positive")
        if num_restarts is not None and (
            isinstance(num_restarts, bool) or not isinstance(num_restarts, int) or num_restarts < 1
        ):
            raise ValueError(f"num_restarts must be None or an integer >= 1, got {num_restarts!r}")
        g, e = model.num_gates, model.num_experts
        p, d = model.in_features + 1, model.out_features
        self.num_gates, self.num_experts = g, e
        self.num_restarts = num_restarts
        self.topology = model.topology
        opts = {"dtype": model.signs.dtype, "device": model.signs.device}
        r = () if num_restarts is None else (num_restarts,)
        eye = torch.eye(p, **opts)
        ones_g, ones_e = torch.ones(r + (g,), **opts), torch.ones(r + (e,), **opts)
        if g:
            self.v_loc = PyroParam(torch.randn(r + (g, p), **opts) * init_scale)
            self.v_scale_tril = PyroParam(
                eye.expand(r + (g, p, p)) * init_scale, constraint=constraints.lower_cholesky
            )
            self.beta_conc = PyroParam(ones_g.clone(), constraint=constraints.positive)
            self.beta_rate = PyroParam(ones_g / init_precision, constraint=constraints.positive)
        self.W_loc = PyroParam(torch.randn(r + (e, d, p), **opts) * init_scale)
        self.W_scale_tril = PyroParam(
            eye.expand(r + (e, p, p)) * init_scale, constraint=constraints.lower_cholesky
        )
        self.alpha_conc = PyroParam(ones_e.clone(), constraint=constraints.positive)
        self.alpha_rate = PyroParam(ones_e / init_precision, constraint=constraints.positive)
        self.tau_conc = PyroParam(ones_e.clone(), constraint=constraints.positive)
        self.tau_rate = PyroParam(ones_e / init_precision, constraint=constraints.positive)

    def forward(self, x, y=None, subsample_size=None):
        """Sample every global site of the model (the signature of the model)."""
        if self.num_restarts is None:
            return self._sample()
        with pyro.plate("restarts", self.num_restarts, dim=-2):
            return self._sample()

    def _sample(self):
        if self.num_gates:
            with pyro.plate("gates", self.num_gates, dim=-1):
                pyro.sample("beta", dist.Gamma(self.beta_conc, self.beta_rate))
                pyro.sample("v", dist.MultivariateNormal(self.v_loc, scale_tril=self.v_scale_tril))
        with pyro.plate("experts", self.num_experts, dim=-1):
            pyro.sample("alpha", dist.Gamma(self.alpha_conc, self.alpha_rate))
            pyro.sample("tau", dist.Gamma(self.tau_conc, self.tau_rate))
            q_w = dist.MultivariateNormal(self.W_loc, scale_tril=self.W_scale_tril.unsqueeze(-3))
            pyro.sample("W", q_w.to_event(1))

    @torch.no_grad()
    def median(self) -> dict:
        """Posterior modes of the weights and medians-by-mean of the precisions."""
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
        precision the inverse of its weighted residual variance. Nothing is fitted to the
        data beyond that one weighted regression, so different generators give
        different, data-sensible starts.

        :param x: inputs ``(N, L)``.
        :param y: targets ``(N,)`` or ``(N, D)``.
        """
        from pyro_trees.infer import bayesian_hme_vb as vb

        data = vb.VBData.build(x.double(), y.double(), self.topology)
        r = () if self.num_restarts is None else (self.num_restarts,)
        state = vb.init_state(data, r, gate_scale=gate_scale, generator=generator)
        state = vb.update_experts(data, state)
        state = vb.update_noise(data, state)
        like = self.W_loc
        if self.num_gates:
            self.v_loc = state.v_mean.to(like)
            self.v_scale_tril = torch.linalg.cholesky(state.v_cov).to(like)
        self.W_loc = state.w_mean.to(like)
        self.W_scale_tril = torch.linalg.cholesky(state.w_cov).to(like)
        self.tau_conc, self.tau_rate = state.tau_a.to(like), state.tau_b.to(like)
        return self

    _PARAMS = (
        "v_loc",
        "v_scale_tril",
        "beta_conc",
        "beta_rate",
        "W_loc",
        "W_scale_tril",
        "alpha_conc",
        "alpha_rate",
        "tau_conc",
        "tau_rate",
    )

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
        out = BayesianHMEGuide(model).to(self.W_loc.dtype)
        for name in self._PARAMS:
            if name.startswith(("v_", "beta_")) and not self.num_gates:
                continue
            setattr(out, name, getattr(self, name)[index].detach().clone())
        return out

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
        out = BayesianHMEGuide(model, num_restarts=len(idx))
        for name in self._PARAMS:
            if name.startswith(("v_", "beta_")) and not self.num_gates:
                continue
            setattr(out, name, getattr(self, name)[idx.to(self.W_loc.device)].detach().clone())
        return out.to(self.W_loc.dtype)

    @torch.no_grad()
    def load_vb_state(self, state) -> BayesianHMEGuide:
        """Copy a :class:`~pyro_trees.infer.bayesian_hme_vb.VBState` without batch dims."""
        if self.num_restarts is not None:
            raise ValueError("load_vb_state() needs a guide without num_restarts")
        if state.batch_shape != torch.Size():
            raise ValueError(f"expected a single state, got batch shape {tuple(state.batch_shape)}")
        if self.num_gates:
            self.v_loc = state.v_mean.detach().clone()
            self.v_scale_tril = torch.linalg.cholesky(state.v_cov)
            self.beta_conc, self.beta_rate = state.beta_a.clone(), state.beta_b.clone()
        self.W_loc = state.w_mean.detach().clone()
        self.W_scale_tril = torch.linalg.cholesky(state.w_cov)
        self.alpha_conc, self.alpha_rate = state.alpha_a.clone(), state.alpha_b.clone()
        self.tau_conc, self.tau_rate = state.tau_a.clone(), state.tau_b.clone()
        return self
