"""The truncated variational family of VaRT (Sec. 2.4, eqs. 11-12, 17-29).

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023.
* E. Jang, S. Gu, B. Poole, *Categorical reparameterization with Gumbel-softmax*, 2017.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide import AutoGuide
from pyro.nn import PyroParam
from torch.distributions import constraints
from torch.distributions.utils import clamp_probs

from pyro_trees import trees
from pyro_trees.distributions.split_indicator import RelaxedSplitIndicator
from pyro_trees.guides.base import TreeGuide
from pyro_trees.models.vart import VaRT, node_weights, weighted

__all__ = ["TemperatureSchedule", "VaRTGuide"]


@dataclass(frozen=True)
class TemperatureSchedule:
    """Geometric annealing of the Gumbel-softmax temperature towards zero.

    .. math:: \\tau_t = \\tau_0 (\\tau_\\infty / \\tau_0)^{\\min(t / T, 1)}

    :param float start: :math:`\\tau_0` (default 1).
    :param float end: :math:`\\tau_\\infty > 0` reached after ``num_steps`` (default 0.1).
    :param int num_steps: :math:`T`.

    Drive it from a training loop with ``guide.temperature = schedule(step)``, or pass
    ``schedule.callback(guide)`` as ``callback`` of :func:`~pyro_trees.infer.fit`.

    .. rubric:: Examples

    >>> from pyro_trees.guides import TemperatureSchedule
    >>> schedule = TemperatureSchedule(100, start=1.0, end=0.1)
    >>> schedule(0), round(schedule(50), 4), schedule(100)
    (1.0, 0.3162, 0.1)
    """

    num_steps: int
    start: float = 1.0
    end: float = 0.1

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not (self.start > 0 and self.end > 0):
            raise ValueError(f"temperatures must be > 0, got {self.start} and {self.end}")

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0) / self.num_steps, 1.0)
        return self.start * (self.end / self.start) ** frac

    def callback(self, guide: VaRTGuide):
        """A ``fit`` callback setting ``guide.temperature`` after every step (it reads
        no loss: ``reads_loss = False``, so ``fit`` need not read one every step)."""

        def _cb(step: int, loss: float | None) -> None:
            guide.temperature = self(step + 1)

        _cb.reads_loss = False
        return _cb


class RelaxedSplitGuide:
    """What the guides over VaRT trees (:class:`VaRTGuide`, one tree;
    :class:`~pyro_trees.guides.VaRTForestGuide`, a sum of trees) share: the temperature of
    their relaxed split indicators, pickling that keeps the model, and the lazy start at
    the first call (parameters already in Pyro's store win; otherwise the guide follows
    the data's dtype and device and, with ``init="data"``, places its splits among the
    rows, :meth:`init_splits_from_data`). A subclass names its parameters in ``_PARAMS``,
    has ``init`` and a ``model`` whose ``check`` checks inputs.
    """

    def __getstate__(self):
        # AutoGuide's drops the model; keep it (only the weak reference to a master goes)
        state = dict(super(AutoGuide, self).__getstate__())
        state["master"] = None
        return state

    @property
    def temperature(self) -> float:
        """The relaxation temperature of the split indicators (``0``: hard trees)."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        value = float(value)
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"temperature must be a finite number >= 0, got {value}")
        self._temperature = value

    @contextlib.contextmanager
    def temperature_set_to(self, value: float):
        """Temporarily set the temperature (``0`` for hard trees at prediction time)."""
        old = self.temperature
        self.temperature = value
        try:
            yield self
        finally:
            self.temperature = old

    def _ensure_started(self, x: torch.Tensor) -> None:
        """The lazy start of the class docstring, once (inputs ``x`` ``(N, L)``)."""
        if self._started:
            return
        self._started = True
        if not pyro.settings.get("module_local_params"):
            store = pyro.get_param_store()
            prefix = f"{self._pyro_name}." if self._pyro_name else ""
            if any(prefix + k in store for k in self._PARAMS):
                return  # parameters from the store win
        self.to(dtype=x.dtype, device=x.device)
        if self.init == "data":
            self.init_splits_from_data(x)

    def params(self, x: torch.Tensor) -> dict:
        """Every (constrained) parameter, read once, in ``x``'s dtype and device (the
        lazy start, from ``x``, first), keyed by name and, with missing inputs,
        ``rho_a``, ``rho_b`` the Beta concentrations of ``rho`` (a leading dimension
        of trees in a forest). Read through the module's Pyro context, so that plain
        ``SVI`` with a loss that calls it trains them."""
        opts = {"dtype": x.dtype, "device": x.device}
        with self._pyro_context:
            self._ensure_started(x)
            q = {k: getattr(self, k).to(**opts) for k in self._PARAMS}
            if getattr(self, "missing", False):
                q["rho_a"], q["rho_b"] = rho_concentrations(
                    self.rho_logits, self.rho_concentration, opts
                )
        return self._read_params(q)

    def _read_params(self, q: dict) -> dict:
        """The parameters as :meth:`params` returns them, from the constrained values of
        ``_PARAMS`` (a family that stores one on another scale rescales it here)."""
        return q

    def rsample(self, x: torch.Tensor, params: dict | None = None) -> dict:
        """One reparameterised draw of every latent site, keyed like the sites of the
        guide's ``forward`` (a leading dimension of trees in a forest): what the VaRT
        ELBOs (:func:`~pyro_trees.infer.vart_elbo.vart_elbo`,
        :func:`~pyro_trees.infer.vart_forest_elbo.vart_forest_elbo`) score, without
        Pyro's bookkeeping. ``params``: the guide's ``params(x)``, when already read;
        ``x`` only fixes dtype and device. The same as
        ``sites(params, noise(params), temperature)``."""
        q = self.params(x) if params is None else params
        return self.sites(q, self.noise(q), self.temperature)

    @staticmethod
    def relaxed(params: dict, noise: dict, temperature) -> tuple:
        """The draw of every node at once from parameters ``params`` (:meth:`params`),
        draws ``noise`` (:meth:`noise`) and the relaxation ``temperature``:
        ``(split, beta, theta, log_sigma)``, heap-ordered and unsliced, ``split``
        ``(2**D - 1,)``, ``beta`` ``(2**D - 1, L + 1)``, ``theta`` ``(2**(D+1) - 1, L + 1)``
        and ``log_sigma`` ``(2**(D+1) - 1,)`` for a tree, with a leading dimension of trees
        in a forest (``log_sigma`` then ``()``): what :meth:`sites` slices into its sites."""
        q = params
        split = RelaxedSplitIndicator.relax(q["split_logits"], noise["split"], temperature)
        beta = q["beta_loc"] + q["beta_scale"] * noise["beta"]
        theta = q["theta_loc"] + q["theta_scale"] * noise["theta"]
        log_sigma = q["log_sigma_loc"] + q["log_sigma_scale"] * noise["log_sigma"]
        return split, beta, theta, log_sigma

    def noise(self, params: dict) -> dict:
        """The random draws behind one ``rsample`` from parameters ``params`` (the
        guide's ``params(x)``), in the order it draws them, each of its parameter's
        shape (a leading dimension of trees in a forest): ``"split"`` clamped uniforms,
        ``"beta"``, ``"theta"`` and ``"log_sigma"`` standard normals and, with missing
        inputs, ``"rho"`` (a reparameterised Beta draw)."""
        q = params
        out = {
            "split": clamp_probs(torch.rand_like(q["split_logits"])),
            "beta": torch.randn_like(q["beta_loc"]),
            "theta": torch.randn_like(q["theta_loc"]),
            "log_sigma": torch.randn_like(q["log_sigma_loc"]),
        }
        if "rho_a" in q:  # where a missing input goes, drawn last
            out["rho"] = dist.Beta(q["rho_a"], q["rho_b"]).rsample()
        return out

    @torch.no_grad()
    def init_splits_from_data(
        self, x: torch.Tensor, sharpness: float = 1.0, generator: torch.Generator | None = None
    ) -> RelaxedSplitGuide:
        """Data-driven start of the split weights :math:`\\tilde\\mu_i`.

        Each internal node (of every tree) gets an (almost) axis-aligned rule through a
        data point: a feature :math:`j` and a row :math:`r` drawn at random, weight
        ``sharpness`` on :math:`j`, small random weights (standard deviation ``0.1 * sharpness /
        sqrt(L)``) on the others, and the intercept chosen so that the boundary
        :math:`\\tilde\\mu_i^\\top x = 0` passes through :math:`x_r`. Every rule then cuts
        the data somewhere inside its range, unlike random hyperplanes through the
        origin, which in many dimensions all cut the data near its centre. With missing
        values (NaN) the chosen feature's value is taken from the first row at or after
        :math:`r` (cyclically) that has it, and the other missing inputs are read as 0.

        :param x: (standardised) training inputs ``(N, L)``.
        :param float sharpness: slope of the logistic rule along the chosen feature.
        :returns: ``self``.
        """
        self.model.check(x, None)
        if not sharpness > 0:
            raise ValueError(f"sharpness must be > 0, got {sharpness}")
        shape = self.beta_loc.shape  # (..., M_int, L + 1): a leading dim of trees or none
        num, L = shape[:-1].numel(), shape[-1] - 1
        rows = torch.randint(x.shape[0], (num,), generator=generator)
        feats = torch.randint(L, (num,), generator=generator)
        w = torch.randn(num, L, generator=generator) * (0.1 * sharpness / math.sqrt(L))
        sign = torch.randint(2, (num,), generator=generator) * 2.0 - 1.0
        w[torch.arange(num), feats] = sharpness * sign
        xr = split_points(x, rows, feats).to(dtype=w.dtype)
        loc = torch.cat([w, -(w * xr).sum(-1, keepdim=True)], dim=-1).reshape(shape)
        self.beta_loc = loc.to(dtype=self.beta_loc.dtype, device=self.beta_loc.device)
        self._started = True
        return self


class VaRTGuide(RelaxedSplitGuide, TreeGuide, AutoGuide):
    r"""Variational family over trees truncated at depth ``depth`` (Sec. 2.4).

    For every internal position :math:`i < 2^D` (heap order),
    :math:`s_i \sim \mathrm{RelaxedBernoulli}(\tilde\gamma_i, \tau)` (eqs. 20-22, see
    :class:`~pyro_trees.distributions.RelaxedSplitIndicator`) and
    :math:`\beta_i \sim \mathcal N(\tilde\mu_i, \tilde S_i)`; for every node
    :math:`i < 2^{D+1}`, :math:`\theta_i \sim \mathcal N(\tilde\zeta_i, \tilde\Psi_i)` and
    :math:`\log\sigma_i \sim \mathcal N(\tilde m_i, \tilde v_i)` (eqs. 17-19, diagonal
    covariances). Nodes at depth :math:`D` are leaves with probability one (their
    ``split_D`` site is a ``Delta`` at zero): this is the truncation. The log-density
    terms are weighted as in eqs. 25-26 (:math:`A_i` on ``split``, :math:`\psi_i` on
    ``beta``, :math:`\kappa_i` on the leaf parameters) and scaled by the model's ``kl_weight``,
    mirroring :meth:`~pyro_trees.models.VaRT.sample_tree`, so plain ``SVI(model, guide,
    optim, Trace_ELBO())`` maximises the :math:`\lambda`-weighted ELBO of eq. 4. The
    sites are the model's (:meth:`~pyro_trees.models.VaRT.site`), so the guide serves any
    model that draws its tree with ``sample_tree``, and it is an
    :class:`~pyro.infer.autoguide.AutoGuide` that works inside
    :class:`~pyro.infer.autoguide.AutoGuideList` beside autoguides for other sites.
    Building it raises the model's ``site_depth`` to ``depth``.

    **Missing inputs.** For a model with ``missing=True`` every internal position also
    has :math:`\rho_i \sim \mathrm{Beta}(\tilde\pi_i \tilde c_i, (1 - \tilde\pi_i)
    \tilde c_i)`, the probability that a missing input goes right there, weighted by
    :math:`\psi_i` (parameters ``rho_logits``, :math:`\tilde\pi_i =
    \sigma(\cdot)`, starting at 1/2, and ``rho_concentration``, starting at the
    prior's :math:`2c`: the guide starts at the prior).

    **Lazy start.** At the first call the parameters move to the inputs' dtype and
    device and, with ``init="data"``, the split rules start through training points
    (:meth:`init_splits_from_data`); neither happens when the parameter store already
    holds this guide's parameters (a loaded store), nor after an explicit
    :meth:`init_splits_from_data`.

    **Temperature.** :math:`\tau` is the attribute ``temperature`` (a float, saved with
    the module); anneal it with :class:`TemperatureSchedule` or leave it fixed.
    ``Predictive`` draws trees at the current temperature; ``temperature = 0`` draws the
    hard trees of eq. 20
    (:meth:`~pyro_trees.guides.vart.RelaxedSplitGuide.temperature_set_to` sets it for a
    block).

    :param model: the :class:`~pyro_trees.models.VaRT` model (its ``kl_weight``, input size
        and site names are read from it; it is not registered as a submodule).
    :param int depth: truncation depth :math:`D \ge 1` (default 3).
    :param float temperature: initial :math:`\tau` (default 0.5).
    :param str init: ``"data"`` (default): split rules through training points at the
        first call; ``"random"``: random hyperplanes through the origin.
    :param float init_split_prob: initial :math:`\tilde\gamma_i` (default 0.9).
    :param float init_scale: initial standard deviations of every Gaussian (default 0.05).
    :param float init_noise: initial mean noise scale :math:`e^{\tilde m_i}` (default 0.5).
    :param generator: optional ``torch.Generator`` for the random split directions.
    :param str name: prefix of the parameters in Pyro's parameter store (default none).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import VaRTGuide
    >>> from pyro_trees.models import VaRT
    >>> x = torch.randn(5, 2)
    >>> guide = VaRTGuide(VaRT(2), depth=2)
    >>> sorted(guide(x))[:4]
    ['beta_0', 'beta_1', 'log_sigma_0', 'log_sigma_1']
    >>> guide.split_probs().shape  # one per internal node
    torch.Size([3])
    """

    def __init__(
        self,
        model: VaRT,
        depth: int = 3,
        *,
        temperature: float = 0.5,
        init: str = "data",
        init_split_prob: float = 0.9,
        init_scale: float = 0.05,
        init_noise: float = 0.5,
        generator: torch.Generator | None = None,
        name: str | None = None,
    ):
        if not isinstance(model, VaRT):
            raise ValueError(f"model must be a VaRT, got {type(model).__name__}")
        super().__init__(model)
        self._pyro_name = "" if name is None else str(name)
        depth = trees.check_depth(depth)
        itemsize = torch.empty(()).element_size()
        trees.require_memory(
            float(self.num_parameters(depth, model.in_features)) * itemsize,
            f"the guide's parameters for {model.in_features:,} inputs",
            "Use a smaller depth.",
            head=f"depth {depth} means 2**{depth + 1} - 1 = {2 ** (depth + 1) - 1:,} nodes; ",
        )
        if init not in ("data", "random"):
            raise ValueError(f"init must be 'data' or 'random', got {init!r}")
        if not 0 < init_split_prob < 1:
            raise ValueError(f"init_split_prob must lie in (0, 1), got {init_split_prob}")
        if not init_scale > 0 or not init_noise > 0:
            raise ValueError("init_scale and init_noise must be > 0")
        model.site_depth = max(model.site_depth, depth)
        self.depth = depth
        self.temperature = float(temperature)
        self.init = init
        self._started = False
        width = model.in_features + 1
        n_int, n_all = trees.num_internal(depth), trees.num_internal(depth + 1)
        logit = math.log(init_split_prob) - math.log1p(-init_split_prob)
        self.split_logits = PyroParam(torch.full((n_int,), logit))
        loc = torch.randn(n_int, width, generator=generator) / math.sqrt(width)
        self.beta_loc = PyroParam(loc)
        self.beta_scale = PyroParam(torch.full((n_int, width), init_scale), constraints.positive)
        leaf = model.leaf_width
        self.theta_loc = PyroParam(torch.zeros(n_all, leaf))
        self.theta_scale = PyroParam(torch.full((n_all, leaf), init_scale), constraints.positive)
        self.log_sigma_loc = PyroParam(torch.full((n_all,), math.log(init_noise)))
        self.log_sigma_scale = PyroParam(torch.full((n_all,), init_scale), constraints.positive)
        self.missing = bool(getattr(model, "missing", False))
        if self.missing:  # where a missing input goes: the guide starts at the prior
            self.rho_logits = PyroParam(torch.zeros(n_int))
            conc = torch.full((n_int,), 2.0 * model.missing_concentration)
            self.rho_concentration = PyroParam(conc, constraints.positive)

    missing = False  # guides pickled before missing inputs existed

    _PARAMS = (
        "split_logits",
        "beta_loc",
        "beta_scale",
        "theta_loc",
        "theta_scale",
        "log_sigma_loc",
        "log_sigma_scale",
    )

    @staticmethod
    def num_parameters(depth: int, in_features: int) -> int:
        """The number of entries of the guide's parameters at truncation depth ``depth``
        with ``in_features`` inputs ``L``, counted before anything is allocated: split
        logits and the split weights' locations and scales on the :math:`2^D - 1` internal
        positions, the leaf weights' and log noise scales' locations and scales on all
        :math:`2^{D+1} - 1` nodes (a guide of missing inputs holds two more per internal
        position, ``rho_logits`` and ``rho_concentration``, not counted here).

        :param int depth: ``D``.
        :param int in_features: ``L``.
        :returns: :math:`(2^D - 1)(1 + 2(L + 1)) + (2^{D+1} - 1)(2(L + 1) + 2)`.
        """
        width = in_features + 1
        n_int, n_all = trees.num_internal(depth), trees.num_internal(depth + 1)
        return n_int * (1 + 2 * width) + n_all * (2 * width + 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Sample a truncated tree; the arguments only fix dtype and device.

        :returns: dict of the sampled values by site name.
        """
        model = self.model
        model.check(x, y)
        q = self.params(x)  # each (constrained) parameter read once, sliced level by level
        plates = self._create_plates(x, y, subsample_size)
        opts = {"dtype": x.dtype, "device": x.device}
        out = {}
        split_logits, beta_loc, beta_scale = q["split_logits"], q["beta_loc"], q["beta_scale"]
        theta_loc, theta_scale = q["theta_loc"], q["theta_scale"]
        ls_loc, ls_scale = q["log_sigma_loc"], q["log_sigma_scale"]
        rho_a, rho_b = q.get("rho_a"), q.get("rho_b")
        with poutine.scale(scale=model.kl_weight):
            exist = torch.ones(1, **opts)
            for d in range(self.depth + 1):
                n = 1 << d
                sl = slice(n - 1, 2 * n - 1)
                plate_name = model.site(f"nodes_{d}")
                # inside an AutoGuideList the plates exist already (its master made them)
                plate = plates[plate_name] if plate_name in plates else None
                with plate or pyro.plate(plate_name, n, dim=-1):
                    name = model.site(f"split_{d}")
                    if d < self.depth:
                        with weighted(exist):
                            split = pyro.sample(
                                name, RelaxedSplitIndicator(split_logits[sl], self.temperature)
                            )
                    else:
                        split = pyro.sample(name, dist.Delta(torch.zeros(n, **opts)))
                    out[name] = split
                    psi, kappa, child_exist = node_weights(exist, split)
                    if d < self.depth:
                        name = model.site(f"beta_{d}")
                        with weighted(psi):
                            out[name] = pyro.sample(
                                name, dist.Normal(beta_loc[sl], beta_scale[sl]).to_event(1)
                            )
                            if rho_a is not None:
                                name = model.site(f"rho_{d}")
                                out[name] = pyro.sample(name, dist.Beta(rho_a[sl], rho_b[sl]))
                    with weighted(kappa):
                        name = model.site(f"theta_{d}")
                        out[name] = pyro.sample(
                            name, dist.Normal(theta_loc[sl], theta_scale[sl]).to_event(1)
                        )
                        name = model.site(f"log_sigma_{d}")
                        out[name] = pyro.sample(name, dist.Normal(ls_loc[sl], ls_scale[sl]))
                exist = child_exist
        return out

    def sites(self, params: dict, noise: dict, temperature) -> dict:
        """The sites of :meth:`rsample` from parameters ``params``, draws ``noise``
        (:meth:`noise`) and the relaxation ``temperature`` (a number or a 0-dim
        tensor): plain tensor code, the part of a draw a compiled loss traces."""
        depth, model = self.depth, self.model
        split, beta, theta, log_sigma = self.relaxed(params, noise, temperature)
        rho = noise.get("rho")
        out = {}
        for d in range(depth + 1):
            n = 1 << d
            sl = slice(n - 1, 2 * n - 1)
            if d < depth:
                out[model.site(f"split_{d}")] = split[sl]
                out[model.site(f"beta_{d}")] = beta[sl]
                if rho is not None:
                    out[model.site(f"rho_{d}")] = rho[sl]
            else:
                out[model.site(f"split_{d}")] = split.new_zeros(n)
            out[model.site(f"theta_{d}")] = theta[sl]
            out[model.site(f"log_sigma_{d}")] = log_sigma[sl]
        return out

    @torch.no_grad()
    def median(self, *args, **kwargs) -> dict:
        """The central tree of :meth:`mean_tree` by site name (``split_d``: hard
        indicators :math:`\\tilde\\gamma_i > 1/2`, the others their locations), as
        :meth:`pyro.infer.autoguide.AutoGuideList.median` asks of its parts."""
        tree = self.mean_tree()
        out = {}
        for d in range(self.depth + 1):
            sl = slice((1 << d) - 1, (2 << d) - 1)
            out[self.model.site(f"split_{d}")] = tree["split"][sl]
            if d < self.depth:
                out[self.model.site(f"beta_{d}")] = tree["beta"][sl]
                if "rho" in tree:
                    out[self.model.site(f"rho_{d}")] = tree["rho"][sl]
            out[self.model.site(f"theta_{d}")] = tree["theta"][sl]
            out[self.model.site(f"log_sigma_{d}")] = tree["log_sigma"][sl]
        return out

    @torch.no_grad()
    def mean_tree(self) -> dict:
        """The guide's central tree in the format of :meth:`~pyro_trees.models.VaRT.sample_tree`:
        hard split indicators :math:`\\tilde\\gamma_i > 1/2` (all leaves at depth ``D``) and the
        locations of the Gaussians (and the mean of each :math:`\\rho_i`); feed it to
        :func:`~pyro_trees.models.tree_mean` (or :func:`~pyro_trees.models.mixture_params`)
        for a fast point prediction (used for early stopping)."""
        split = torch.cat(
            [
                (self.split_logits > 0).to(self.theta_loc.dtype),
                self.theta_loc.new_zeros(1 << self.depth),
            ]
        )
        exist = torch.ones(1, dtype=split.dtype, device=split.device)
        log_exist = torch.zeros(1, dtype=split.dtype, device=split.device)
        out = []
        for d in range(self.depth + 1):
            n = 1 << d
            s = split[n - 1 : 2 * n - 1]
            out.append(log_exist)
            _, _, exist = node_weights(exist, s)
            log_exist = exist.log()
        tree = {
            "split": split,
            "log_exist": torch.cat(out),
            "beta": self.beta_loc.detach(),
            "theta": self.theta_loc.detach(),
            "log_sigma": self.log_sigma_loc.detach(),
        }
        if self.missing:
            tree["rho"] = self.rho_mean()
        return tree

    @torch.no_grad()
    def rho_mean(self) -> torch.Tensor | None:
        """The mean :math:`\\tilde\\pi_i` of each internal position's :math:`\\rho_i`
        (where a missing input goes), ``(2**D - 1,)``; ``None`` without ``missing``."""
        if not getattr(self, "missing", False):
            return None
        return torch.sigmoid(self.rho_logits.detach())

    @torch.no_grad()
    def split_probs(self) -> torch.Tensor:
        """:math:`\\tilde\\gamma_i` of the internal positions, ``(2**D - 1,)``."""
        return torch.sigmoid(self.split_logits)

    @torch.no_grad()
    def node_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Under hard indicators: ``(P(node i internal), P(node i leaf))`` for every node
        ``i < 2**(D+1)`` in heap order (the expectations of :math:`\\psi_i, \\kappa_i`)."""
        gamma = torch.cat([self.split_probs(), self.split_logits.new_zeros(1 << self.depth)])
        exist = torch.ones(1, dtype=gamma.dtype, device=gamma.device)
        psi_all, kappa_all = [], []
        for d in range(self.depth + 1):
            n = 1 << d
            psi, kappa, exist = node_weights(exist, gamma[n - 1 : 2 * n - 1])
            psi_all.append(psi)
            kappa_all.append(kappa)
        return torch.cat(psi_all), torch.cat(kappa_all)

    @torch.no_grad()
    def most_probable_structure(self) -> torch.Tensor:
        """The tree structure of highest probability under the guide.

        Exact dynamic programme over subtrees: the best probability of the subtree at
        ``i`` is :math:`\\max(1 - \\tilde\\gamma_i,\\ \\tilde\\gamma_i\\, b_{2i} b_{2i+1})`.

        :returns: bool ``(2**D - 1,)``: whether each internal position splits (only
            meaningful where all its ancestors split).
        """
        gamma = self.split_probs().double()
        n_int = gamma.shape[0]
        best = torch.ones(2 * n_int + 1, dtype=torch.float64)
        split = torch.zeros(n_int, dtype=torch.bool)
        for j in range(n_int - 1, -1, -1):  # heap node j + 1, children 2j + 1, 2j + 2
            leaf = 1 - gamma[j]
            inner = gamma[j] * best[2 * j + 1] * best[2 * j + 2]
            split[j] = inner > leaf
            best[j] = torch.maximum(leaf, inner)
        return split

    def extra_repr(self) -> str:
        """Depth, input size and temperature, for ``repr``."""
        return (
            f"depth={self.depth}, in_features={self.model.in_features}, "
            f"temperature={self.temperature:.4g}"
        )


def rho_concentrations(logits: torch.Tensor, concentration: torch.Tensor, opts: dict):
    """The Beta concentrations :math:`(\\tilde\\pi \\tilde c, (1 - \\tilde\\pi) \\tilde c)`
    of the guides' ``rho`` from the parameters ``rho_logits`` and ``rho_concentration``."""
    logits, conc = logits.to(**opts), concentration.to(**opts)
    return torch.sigmoid(logits) * conc, torch.sigmoid(-logits) * conc


def split_points(x: torch.Tensor, rows: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """The rows ``x[rows]`` ``(n, L)`` on the CPU through which the data-driven start
    puts its split rules, each for its feature ``feats``: without missing values
    (NaN) exactly ``x[rows]``; with them, a rule whose row lacks its feature moves to
    the first row after it (cyclically) that has it, and the other missing inputs read
    0 (the standardised mean; 0 too where no row has the feature)."""
    x = x.detach()
    missing = torch.isnan(x)
    if not bool(missing.any()):
        return x[rows].to("cpu")
    x, missing = x.to("cpu"), missing.to("cpu")
    n = x.shape[0]
    has = ~missing[:, feats].T  # (num, n): rows that have each rule's feature
    offset = (torch.arange(n).unsqueeze(0) - rows.unsqueeze(1)) % n  # steps after the row
    offset = torch.where(has, offset, n)
    picked = torch.where(has.any(-1), (rows + offset.min(-1).values) % n, rows)
    return torch.where(missing[picked], torch.zeros((), dtype=x.dtype), x[picked])
