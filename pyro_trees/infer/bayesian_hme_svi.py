r"""SVI for the Bayesian HME, with many random restarts trained as one batch.

A convenience on top of plain Pyro: the model is :class:`~pyro_trees.models.BayesianHME`
wrapped in :class:`~pyro_trees.guides.RestartPlate` and the guide is
:class:`~pyro_trees.guides.BayesianHMEGuide` built with ``num_restarts=R``, so one
:class:`pyro.infer.SVI` step with :class:`~pyro.infer.Trace_ELBO` updates ``R``
independent copies of ``q`` (the batched ELBO is the sum of the restarts' ELBOs, and every
copy's parameters get only their own gradient). Each restart starts from its own
data-driven random point (:meth:`~pyro_trees.guides.BayesianHMEGuide.init_from_data`).

Like the closed-form path (:mod:`pyro_trees.infer.bayesian_hme_vb`), the likelihood can be
annealed: at step ``k`` the observation's log-density is scaled by ``1 / T_k`` (a
deterministic-annealing temperature; ``T = 1`` is the model itself).

Single-sample gradients find the right basin quickly but converge slowly in the
variance parameters of ``q`` (the gate covariances and the Gamma shapes have a weak
gradient against the sampling noise). So, like the pruning of the closed-form search,
the best ``keep`` restarts (by a Monte Carlo ELBO estimate) can go on for
``polish_steps`` more steps with ``polish_particles`` vectorised samples per step and a
small learning rate. At the end the ELBO of every restart is estimated with many
vectorised samples (:func:`~pyro_trees.infer.restart_elbos`) and the best restart is returned as a
plain, unbatched guide.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger

from pyro_trees.guides.bayesian_hme import BayesianHMEGuide, RestartPlate
from pyro_trees.infer.allocator import keep_freed_memory
from pyro_trees.infer.fit import isolated_params
from pyro_trees.models.bayesian_hme import BayesianHME

__all__ = ["SVIRestarts", "annealing_schedule", "fit_svi_restarts", "restart_elbos"]


class _LikelihoodTemperature(Messenger):
    """Scales the log-density of the site ``name`` by ``1 / temperature``."""

    def __init__(self, name: str = "obs"):
        super().__init__()
        self.name = name
        self.temperature = 1.0

    def _process_message(self, msg):
        if msg["name"] == self.name and self.temperature != 1.0:
            msg["scale"] = msg["scale"] / self.temperature


def _finite_grad(grad: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def restart_elbos(model, guide, *args, num_particles: int = 1000, chunk: int = 100, **kwargs):
    r"""Monte Carlo ELBO of every restart: ``E_q[log p(y, z) - log q(z)]``, ``(R,)``.

    ``model`` is wrapped in :class:`~pyro_trees.guides.RestartPlate` and ``guide`` batched
    over the restarts (every site's log-density has shape ``(R, plate size)``). The
    samples are drawn in vectorised chunks of ``chunk`` particles (a ``"particles"``
    plate at dim -3).
    """
    if num_particles < 1 or chunk < 1:
        raise ValueError("num_particles and chunk must be >= 1")
    total = 0.0
    for start in range(0, num_particles, chunk):
        k = min(chunk, num_particles - start)
        with pyro.plate("particles", k, dim=-3):
            g_tr = poutine.trace(guide).get_trace(*args, **kwargs)
            m_tr = poutine.trace(poutine.replay(model, trace=g_tr)).get_trace(*args, **kwargs)
        value = 0.0
        for tr, sign in ((m_tr, 1.0), (g_tr, -1.0)):
            for site in tr.nodes.values():
                if site["type"] == "sample":
                    lp = site["fn"].log_prob(site["value"])  # (k, R, plate)
                    value = value + sign * lp.sum(-1)
        total = total + value.sum(0)
    return total / num_particles


@dataclass
class SVIRestarts:
    """Output of :func:`fit_svi_restarts`.

    :ivar model: the :class:`~pyro_trees.models.BayesianHME` (it has no parameters).
    :ivar guide: the best restart as a plain :class:`~pyro_trees.guides.BayesianHMEGuide`.
    :ivar batched_guide: every restart (``num_restarts`` copies) before the polish.
    :ivar polished: indices of the restarts that were polished (empty without a polish).
    :ivar elbos: Monte Carlo ELBO of every restart at the end, ``(R,)`` (a restart left
        out of the polish keeps its estimate from before the polish).
    :ivar best: index of the best restart (highest ``elbos``).
    :ivar losses: the batched loss (sum over restarts of the negative ELBO) per step.
    :ivar seconds: wall-clock seconds, training and evaluation.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import fit_svi_restarts
    >>> from pyro_trees.topology import Topology
    >>> x = torch.linspace(-1, 1, 20).unsqueeze(-1)
    >>> y = x.squeeze(-1).abs()
    >>> fit = fit_svi_restarts(x, y, Topology.balanced(1), num_restarts=2, num_steps=2,
    ...                        eval_particles=10)
    >>> fit.elbos.shape, fit.best in (0, 1)
    (torch.Size([2]), True)
    """

    model: object
    guide: object
    batched_guide: object
    elbos: torch.Tensor
    best: int
    losses: list = field(default_factory=list)
    seconds: float = 0.0
    polished: list = field(default_factory=list)

    @property
    def elbo(self) -> float:
        """The best restart's ELBO estimate: ``elbos[best]``."""
        return float(self.elbos[self.best])


def annealing_schedule(num_steps: int, start: float = 5.85, rate: float = 0.97, every: int = 1):
    """Temperatures ``max(1, start * rate**(k // every))`` for ``k < num_steps``."""
    return [max(1.0, start * rate ** (k // every)) for k in range(num_steps)]


def fit_svi_restarts(
    x: torch.Tensor,
    y: torch.Tensor,
    topology,
    *,
    num_restarts: int = 100,
    num_steps: int = 3000,
    lr: float = 0.1,
    final_lr: float = 0.002,
    temperatures: Sequence[float] | None = None,
    num_particles: int = 1,
    eval_particles: int = 1000,
    keep: int = 5,
    polish_steps: int = 0,
    polish_particles: int = 32,
    polish_lr: float = 0.02,
    polish_final_lr: float = 0.001,
    select_particles: int = 200,
    gate_scale: float = 2.0,
    prior_a: float = 1e-3,
    prior_b: float = 1e-3,
    generator: torch.Generator | None = None,
    seed: int | None = 0,
) -> SVIRestarts:
    r"""Train ``num_restarts`` SVI restarts of a Bayesian HME as one batch.

    Plain :class:`pyro.infer.SVI` with :class:`~pyro.infer.Trace_ELBO` (``num_particles``
    vectorised samples per step) and ClippedAdam whose learning rate decays geometrically
    from ``lr`` to ``final_lr`` over the run.

    :param x: inputs ``(N, L)``; its dtype is the dtype of the fit.
    :param y: targets ``(N,)`` or ``(N, D)``.
    :param topology: a :class:`~pyro_trees.topology.Topology`.
    :param temperatures: likelihood temperature of every step (deterministic annealing;
        padded with 1 to ``num_steps``); default: none.
    :param eval_particles: samples of the final ELBO estimate of every restart.
    :param keep: with ``polish_steps > 0``, how many restarts (the best by a
        ``select_particles``-sample ELBO estimate) are polished.
    :param polish_steps: steps of the polish (0: none), with ``polish_particles``
        vectorised samples per step and a fresh ClippedAdam whose learning rate decays
        from ``polish_lr`` to ``polish_final_lr``.
    :param seed: seeds Pyro's RNG (the sampling during training) when not ``None``.
    :returns: an :class:`SVIRestarts`.
    """
    for name, value in (
        ("num_restarts", num_restarts),
        ("num_steps", num_steps),
        ("num_particles", num_particles),
        ("eval_particles", eval_particles),
        ("keep", keep),
        ("polish_particles", polish_particles),
        ("select_particles", select_particles),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(polish_steps, bool) or not isinstance(polish_steps, int) or polish_steps < 0:
        raise ValueError(f"polish_steps must be an integer >= 0, got {polish_steps!r}")
    if not (lr > 0 and final_lr > 0 and polish_lr > 0 and polish_final_lr > 0):
        raise ValueError("learning rates must be positive")
    x = torch.as_tensor(x)
    y = torch.as_tensor(y, dtype=x.dtype, device=x.device)
    if y.dim() == 1:
        y = y.unsqueeze(-1)
    temps = list(temperatures) if temperatures is not None else []
    temps = (temps + [1.0] * num_steps)[:num_steps]
    if any(not (t > 0 and math.isfinite(t)) for t in temps):
        raise ValueError("temperatures must be positive and finite")
    if seed is not None:
        pyro.set_rng_seed(seed)
    keep_freed_memory()
    start = time.perf_counter()
    with isolated_params():
        model = BayesianHME(
            x.shape[-1], y.shape[-1], topology, prior_a=prior_a, prior_b=prior_b
        ).to(x.dtype)
        guide = BayesianHMEGuide(model, num_restarts=num_restarts)
        guide.init_from_data(x, y, gate_scale=gate_scale, generator=generator)
        wrapped = RestartPlate(model, num_restarts)
        tempering = _LikelihoodTemperature("obs")
        losses = _train(wrapped, guide, x, y, temps, lr, final_lr, num_particles, tempering)
        polished = []
        if polish_steps:
            elbos = restart_elbos(wrapped, guide, x, y, num_particles=select_particles)
            k = min(keep, num_restarts)
            polished = elbos.nan_to_num(-math.inf).topk(k).indices.tolist()
            few = guide.subset(polished, model)
            few_wrapped = RestartPlate(model, k)
            with isolated_params():
                losses += _train(
                    few_wrapped,
                    few,
                    x,
                    y,
                    [1.0] * polish_steps,
                    polish_lr,
                    polish_final_lr,
                    polish_particles,
                    None,
                )
                few_elbos = restart_elbos(few_wrapped, few, x, y, num_particles=eval_particles)
            elbos[polished] = few_elbos
        else:
            elbos = restart_elbos(wrapped, guide, x, y, num_particles=eval_particles)
    elbos = elbos.nan_to_num(-math.inf)
    best = int(elbos.argmax())
    if best in polished:
        chosen = few.restart(polished.index(best), model)
    else:
        chosen = guide.restart(best, model)
    return SVIRestarts(
        model=model,
        guide=chosen,
        batched_guide=guide,
        elbos=elbos,
        best=best,
        losses=losses,
        seconds=time.perf_counter() - start,
        polished=polished,
    )


def _train(wrapped, guide, x, y, temps, lr, final_lr, num_particles, tempering):
    """Plain SVI steps on a restart-batched model and guide; the losses."""
    model = wrapped if tempering is None else tempering(wrapped)
    steps = len(temps)
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": (final_lr / lr) ** (1 / steps)})
    loss = pyro.infer.Trace_ELBO(
        num_particles=num_particles, vectorize_particles=num_particles > 1, max_plate_nesting=2
    )
    svi = pyro.infer.SVI(model, guide, optim, loss)
    # register the guide's parameters, then zero non-finite gradient entries: a restart
    # whose expert dies has q(tau) near the broad prior, whose reparameterised Gamma
    # gradients can overflow; that must not poison the other restarts of the batch
    poutine.trace(guide).get_trace(x, y)
    for _, param in pyro.get_param_store().named_parameters():
        param.register_hook(_finite_grad)
    losses = []
    for temp in temps:
        if tempering is not None:
            tempering.temperature = temp
        losses.append(svi.step(x, y))
    return losses
