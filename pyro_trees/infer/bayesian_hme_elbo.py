"""``BayesianHMEELBO``: ``Trace_ELBO`` of the Bayesian HME's SVI path as one tensor program.

:class:`pyro.infer.Trace_ELBO` on a :class:`~pyro_trees.models.BayesianHME` (in a
:class:`~pyro_trees.guides.RestartPlate` for a batch of restarts) and its
:class:`~pyro_trees.guides.BayesianHMEGuide` records the gate, expert and noise sites of
every restart and the mixture likelihood through a poutine stack. :class:`BayesianHMEELBO`
computes the same single-draw estimator as plain tensor code: the guide's Gamma draws are
taken eagerly (torch's implicitly reparameterised sampler, in the guide's order), as is
the standard noise behind its Gaussian draws; the Gaussian sites, every prior and guide
log-density and the likelihood with the assignment summed out are then one program, so
on the same draws the two agree in value and gradients (tested), and with
``compile=True`` the program runs under ``torch.compile``
(:mod:`pyro_trees.infer.compiled`).
"""

from __future__ import annotations

import math

import torch
from pyro.infer import Trace_ELBO

from pyro_trees.guides.bayesian_hme import BayesianHMEGuide, RestartPlate
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import (
    CompilesLoss,
    check_subsample_size,
    plate_subsample,
    xy_call,
)
from pyro_trees.models.bayesian_hme import BayesianHME
from pyro_trees.topology import expert_log_probs
from pyro_trees.validation import check_finite

__all__ = ["BayesianHMEELBO", "bayesian_hme_elbo_of"]

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _gamma_lp(value, conc, rate):
    """``Gamma(conc, rate).log_prob(value)`` elementwise."""
    return (
        torch.xlogy(conc, rate) + torch.xlogy(conc - 1, value) - rate * value - torch.lgamma(conc)
    )


def _gaussian_lp(eps, tril):
    """``log N(loc + tril eps; loc, tril tril^T)`` from the noise ``eps`` ``(..., P)``: the
    change of variables, per Gaussian (summed over ``P``)."""
    log_det = tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    return -0.5 * eps.pow(2).sum(-1) - log_det - eps.shape[-1] * _HALF_LOG_2PI


def _normal_lp(value, precision):
    """``Normal(0, precision ** -0.5).log_prob(value)`` as the model scores it."""
    scale = precision.rsqrt()
    return -0.5 * (value / scale).pow(2) - scale.log() - _HALF_LOG_2PI


def _check_data(x: torch.Tensor, y: torch.Tensor) -> None:
    check_finite(x, "x")
    check_finite(y, "y")


def bayesian_hme_elbo_of(q: dict, prior: dict, draws: dict, x, y, scale):
    """The single-draw ELBO of a Bayesian HME (summed over restarts) from its tensors.

    :param dict q: :meth:`~pyro_trees.guides.BayesianHMEGuide.site_params`.
    :param dict prior: ``{"a", "b"}`` (the Gamma prior's shape and rate, 0-dim tensors)
        and ``"signs"`` (the topology's path signs ``(G, E)``).
    :param dict draws: the Gamma draws ``beta`` ``batch + (G,)``, ``alpha``, ``tau``
        ``batch + (E,)`` (with their graphs to ``q``) and the standard noise ``eps_v``
        ``batch + (G, P)``, ``eps_W`` ``batch + (E, D, P)`` behind the Gaussian sites.
    :param x: the rows of the step ``(B, L)``; ``y`` their targets ``(B, D)``.
    :param scale: the likelihood's scale (the rows the step stands for over ``B``).
    :returns: the ELBO estimate, a scalar.
    """
    a, b = prior["a"], prior["b"]
    xb = torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], -1)  # (B, P)
    total = 0.0
    if "beta" in draws:
        beta, eps_v = draws["beta"], draws["eps_v"]
        v = q["v_loc"] + (q["v_tril"] @ eps_v.unsqueeze(-1)).squeeze(-1)
        total = (
            total + (_gamma_lp(beta, a, b) - _gamma_lp(beta, q["beta_conc"], q["beta_rate"])).sum()
        )
        log_p_v = _normal_lp(v, beta.unsqueeze(-1)).sum(-1)
        total = total + (log_p_v - _gaussian_lp(eps_v, q["v_tril"])).sum()
        logits = xb @ v.transpose(-1, -2)  # (..., B, G)
        log_pi = expert_log_probs(logits, prior["signs"])
    else:
        log_pi = xb.new_zeros(xb.shape[:-1] + (1,))
    alpha, tau, eps_w = draws["alpha"], draws["tau"], draws["eps_W"]
    W = q["W_loc"] + (q["W_tril"] @ eps_w.unsqueeze(-1)).squeeze(-1)  # (..., E, D, P)
    total = (
        total + (_gamma_lp(alpha, a, b) - _gamma_lp(alpha, q["alpha_conc"], q["alpha_rate"])).sum()
    )
    total = total + (_gamma_lp(tau, a, b) - _gamma_lp(tau, q["tau_conc"], q["tau_rate"])).sum()
    log_p_w = _normal_lp(W, alpha[..., None, None]).sum((-2, -1))
    total = total + (log_p_w - _gaussian_lp(eps_w, q["W_tril"]).sum(-1)).sum()
    # the likelihood, with the assignment summed out (BayesianHME.mixture)
    means = torch.einsum("np,...jdp->...njd", xb, W)  # (..., B, E, D)
    tau = tau.clamp_min(torch.finfo(tau.dtype).tiny ** 0.25)
    sd = tau.rsqrt()[..., None, :, None]
    comp = (-0.5 * ((y.unsqueeze(-2) - means) / sd).pow(2) - sd.log() - _HALF_LOG_2PI).sum(-1)
    log_lik = (comp + log_pi.log_softmax(-1)).logsumexp(-1)  # (..., B)
    return total + log_lik.sum() * scale


class BayesianHMEELBO(CompilesLoss, DifferentiableLossELBO):
    """``Trace_ELBO`` of a :class:`~pyro_trees.models.BayesianHME` (alone, or in a
    :class:`~pyro_trees.guides.RestartPlate` with as many restarts as the guide) and its
    :class:`~pyro_trees.guides.BayesianHMEGuide`, called as ``model(x, y)`` or
    ``model(x, y, subsample_size=B)``, as one tensor program: equal values and gradients
    on the same draws (tested). The guide's first call with data (its start) and any
    other model, guide or call train with ``Trace_ELBO`` (the latter after one warning
    that says why); a guide whose number of restarts is not the model's
    ``RestartPlate``'s raises. The data are checked once per pair of tensors (finite
    values), and ``subsample_size`` at every call.

    :param compile: ``False`` (eager), ``True`` or a ``torch.compile`` backend name.
    :param mode: ``torch.compile``'s ``mode``.

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import BayesianHMEGuide, RestartPlate
    >>> from pyro_trees.infer import BayesianHMEELBO
    >>> from pyro_trees.models import BayesianHME
    >>> x, y = torch.randn(20, 1), torch.randn(20)
    >>> model = BayesianHME(1)
    >>> guide = BayesianHMEGuide(model, init="random", num_restarts=3)
    >>> svi = pyro.infer.SVI(RestartPlate(model, 3), guide, pyro.optim.Adam({"lr": 0.01}),
    ...                      BayesianHMEELBO())
    >>> isinstance(svi.step(x, y), float)
    True
    """

    _program = staticmethod(bayesian_hme_elbo_of)

    def __init__(self, *, compile: bool | str = False, mode: str | None = None):
        super().__init__(num_particles=1, max_plate_nesting=2, compile=compile, mode=mode)

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("BayesianHMEELBO scores the ELBO without traces")

    @staticmethod
    def unsupported(model, guide, args, kwargs) -> str | None:
        """Why the program does not apply to this model, guide and call, or ``None``."""
        inner = model.model if isinstance(model, RestartPlate) else model
        if type(inner) is not BayesianHME:
            return f"the model is not a BayesianHME (got {type(inner).__name__})"
        if type(guide) is not BayesianHMEGuide:
            return f"the guide is not a BayesianHMEGuide (got {type(guide).__name__})"
        if guide.master is not None:
            return "the guide is part of an AutoGuideList"
        x, y, extra = xy_call(args, kwargs, ("subsample_size",))
        if x is None or y is None or extra:
            return "the model is not called as model(x, y) (with subsample_size)"
        return None

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Minus the ELBO estimate, differentiable in the guide's parameters."""
        why = self.unsupported(model, guide, args, kwargs)
        if why is not None or guide.awaiting_data:
            if why is not None:
                self._fall_back("Trace_ELBO", why)
            loss = Trace_ELBO(max_plate_nesting=2)
            return loss.differentiable_loss(model, guide, *args, **kwargs)
        self.fallback = None
        inner = model.model if isinstance(model, RestartPlate) else model
        restarts = model.num_restarts if isinstance(model, RestartPlate) else None
        if guide.num_restarts != restarts:
            raise ValueError(
                f"the guide has {guide.num_restarts} restarts but the model's RestartPlate "
                f"{restarts}: give both the same number (None: no RestartPlate)"
            )
        x, y, _ = xy_call(args, kwargs, ("subsample_size",))
        y = inner._check(x, y)
        # the values Pyro's validation would refuse, once per pair of tensors and model
        self._once("data", (x, y), lambda: _check_data(x, y), owner=inner)
        check_subsample_size(kwargs.get("subsample_size"), x.shape[0])
        q = guide.site_params()
        # the draws, in the guide's order (Gamma draws eagerly: torch's sampler)
        draws = {}
        gamma = torch.distributions.Gamma
        if guide.num_gates:
            draws["beta"] = gamma(q["beta_conc"], q["beta_rate"], validate_args=False).rsample()
            draws["eps_v"] = torch.randn_like(q["v_loc"])
        draws["alpha"] = gamma(q["alpha_conc"], q["alpha_rate"], validate_args=False).rsample()
        draws["tau"] = gamma(q["tau_conc"], q["tau_rate"], validate_args=False).rsample()
        draws["eps_W"] = torch.randn_like(q["W_loc"])
        n, scale = x.shape[0], 1.0
        idx = plate_subsample(n, kwargs.get("subsample_size"), x.device)
        if idx is not None:
            x, y, scale = x[idx], y[idx], n / idx.shape[0]
        like = {"dtype": x.dtype, "device": x.device}
        prior = {
            "a": torch.tensor(inner.prior_a, **like),
            "b": torch.tensor(inner.prior_b, **like),
            "signs": inner.signs.to(**like),
        }
        program = self._compiled if self._compiled is not None else bayesian_hme_elbo_of
        return -program(q, prior, draws, x, y, torch.tensor(scale, **like))
