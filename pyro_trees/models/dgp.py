"""Deep Gaussian processes: compositions of GPs with inducing points, sampled layer by layer.

The model is :math:`f = f_L \\circ \\dots \\circ f_1` with
:math:`f_i \\sim \\mathcal{GP}(\\mu_i, k_i)` and :math:`y \\mid f_L \\sim N(f_L, \\sigma^2)`.
Each GP is augmented with inducing outputs, in one of two ways (``inducing=``):

* ``"layer"`` (Salimbeni & Deisenroth): free inducing inputs :math:`Z_i` per layer
  and inducing outputs ``u_i`` of shape ``(P_i, M_i)``, with prior :math:`N(0, K_{Z_i Z_i})`
  (or :math:`N(0, I)` when whitened); these are the latent sites of eq. (2) of
  Ustyuzhaninov et al.
* ``"propagated"`` (Ustyuzhaninov et al., eq. 3): one set of inducing inputs
  :math:`Z` in the input space, and the outputs of every layer at them,
  ``f_z_i`` = :math:`F_i^Z` of shape ``(P_i, M)``, with prior
  :math:`p(F_i^Z \\mid F_{i-1}^Z) = N(\\mu_i(F_{i-1}^Z), K_i(F_{i-1}^Z) )` and
  :math:`F_0^Z = Z`; layer ``i`` uses :math:`F_{i-1}^Z` as its inducing inputs.

Given the inducing sites, the layer outputs at the data are drawn by the doubly
stochastic sampler: :math:`F_i \\sim p(F_i \\mid F_{i-1}, \\text{inducing})`, a
reparameterised draw from the GP posterior (diagonal across data points) computed by
:func:`pyro_trees.gp.conditional`. These draws integrate the :math:`F_i` out of the
bound by Monte Carlo, exactly as the :math:`F_i` factors cancel between eq. (3) and
eq. (4); they are recorded as deterministic sites ``f_1 ... f_L`` (shape
``batch + (N, P_i)``). The last layer is integrated analytically against the Gaussian
likelihood: with observed ``y`` the site ``obs`` scores :math:`N(y; \\mu_L, \\sigma^2)`
and a factor ``obs_var`` adds :math:`-v_L / (2\\sigma^2)`, which together equal
:math:`E_{N(f; \\mu_L, v_L)} \\log N(y; f, \\sigma^2)`; without ``y``, ``obs`` draws
:math:`y \\sim N(\\mu_L, v_L + \\sigma^2)`, the same marginal. ``f_loc`` and ``f_var``
record :math:`\\mu_L, v_L`.

Plates: ``"data"`` (``dim=-1``) over the rows of ``x``; the inducing sites sit outside
it. Guides in :mod:`pyro_trees.guides.dgp` only define the distribution of the
inducing sites; the map to the layer outputs is this model's, shared by all.

**References**

[1] I. Ustyuzhaninov, I. Kazlauskaite, M. Kaiser, E. Bodin, N. Campbell, C. H. Ek,
*Compositional uncertainty in deep Gaussian processes*, UAI 2020.

[2] H. Salimbeni, M. Deisenroth, *Doubly stochastic variational inference for deep
Gaussian processes*, NeurIPS 2017.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from ..gp import TensorKernel, check_kernel_memory, cholesky, conditional, kernel_matrix
from ..validation import as_tensor, check_finite, check_X

__all__ = ["DeepGP"]

_MEANS = ("identity", "zero")
# GPyTorch's variational_cholesky_jitter and min_variance per dtype
_JITTER = {torch.float32: 1e-4, torch.float64: 1e-6}
_MIN_VARIANCE = {torch.float32: 1e-6, torch.float64: 1e-10}

# per model, weak references to the last (x, y) that passed validation unchanged, with
# their version counters: a minibatched fit passes the full data at every step, and
# checking 10^5 rows for NaNs each time costs a few percent of a step
_VALIDATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _same_inputs(entry, x, y) -> bool:
    xr, xv, yr, yv = entry
    if xr() is not x or x._version != xv:
        return False
    if y is None:
        return yr is None
    return yr is not None and yr() is y and y._version == yv


def _module_local() -> bool:
    try:
        from pyro.nn.module import _is_module_local_param_enabled

        return _is_module_local_param_enabled()
    except ImportError:  # pragma: no cover - older Pyro
        return False


class DeepGP(PyroModule):
    """A deep GP with ``L`` layers of GPyTorch kernels and a Gaussian likelihood.

    :param kernels: one :class:`gpytorch.kernels.Kernel` per layer (e.g. a scaled RBF
        then a periodic kernel), shared by the layer's outputs or batched over them
        (``batch_shape=(P_i,)``). Their hyperparameters are learnt; they are moved to
        the dtype and device of the inducing inputs.
    :param inducing_points: with ``inducing="layer"``, one tensor ``(M_i, D_{i-1})``
        per layer (``D_0`` = input dimension, ``D_i = P_i``), or one tensor that starts
        every layer whose input width matches it; with ``inducing="propagated"``, a
        single tensor ``(M, D_0)``. Learnt. Their dtype (float32 or float64) and
        device are the model's.
    :param output_dims: widths ``P_1, ..., P_L`` of the layers; ``P_L`` must be 1.
        Default: the input dimension for the inner layers, 1 for the last.
    :param mean_functions: per layer, ``"identity"`` (needs ``P_i = D_{i-1}``),
        ``"zero"``, or a :class:`torch.nn.Module` mapping ``(..., N, D_{i-1})`` to
        ``(..., N, P_i)`` (e.g. ``torch.nn.Linear``). Default identity for the inner
        layers and zero for the last.
    :param float noise: initial likelihood standard deviation :math:`\\sigma` (learnt);
        a small start keeps the fit from explaining the data as noise.
    :param bool whiten: whitened inducing outputs (``inducing="layer"`` only).
    :param str inducing: ``"layer"`` or ``"propagated"`` (see the module docstring).
    :param float jitter: added to the diagonal of the inducing kernel matrices; default
        ``1e-6`` in float64 and ``1e-4`` in float32 (GPyTorch's variational jitters).
        Conditional variances are floored at ``1e-10`` (float64) or ``1e-6`` (float32)
        before their square roots, as GPyTorch's ``min_variance``.
    :param str name: prefix of the model's names in Pyro's parameter store
        (``"<name>.z_1"``, ``"<name>.kernels$$$0.raw_outputscale"``), so that several
        deep GPs share one store.

    Train it with a guide of :mod:`pyro_trees.guides.dgp` and
    :class:`~pyro.infer.Trace_ELBO` (or :class:`~pyro.infer.TraceMeanField_ELBO` for
    closed-form KLs); :class:`~pyro.infer.Predictive` called with ``x`` alone returns
    draws of ``obs`` (``y``), of the inner layers' outputs ``f_1 ... f_{L-1}`` and of
    ``f_loc`` / ``f_var``.

    .. rubric:: Examples

    >>> import gpytorch
    >>> import torch
    >>> from pyro_trees.models import DeepGP
    >>> x = torch.linspace(-1, 1, 8, dtype=torch.float64).unsqueeze(-1)
    >>> kernels = [gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) for _ in range(2)]
    >>> model = DeepGP(kernels, x[::2])  # two layers, 4 inducing inputs each
    >>> model.site_names(), model.site_shapes()
    (['u_1', 'u_2'], [(1, 4), (1, 4)])
    >>> model(x).shape  # a prior draw of the last layer's mean at x
    torch.Size([8])
    """

    def __init__(
        self,
        kernels: Sequence,
        inducing_points,
        *,
        output_dims: Sequence[int] | None = None,
        mean_functions: Sequence | None = None,
        noise: float = 0.03,
        whiten: bool = True,
        inducing: str = "layer",
        jitter: float | None = None,
        name: str = "",
    ):
        super().__init__(name=name)
        kernels = list(kernels)
        L = len(kernels)
        if L == 0:
            raise ValueError("kernels must hold at least one GPyTorch kernel (one per layer)")
        if inducing not in ("layer", "propagated"):
            raise ValueError(f"inducing must be 'layer' or 'propagated', got {inducing!r}")
        if inducing == "layer":
            if not isinstance(inducing_points, (list, tuple)):
                inducing_points = [inducing_points] * L
            if inducing_points is None or len(inducing_points) != L:
                raise ValueError(
                    f"inducing='layer' needs one inducing-input tensor per layer ({L})"
                )
            zs = [as_tensor(z, f"inducing_points[{i}]") for i, z in enumerate(inducing_points)]
        else:
            z = inducing_points
            if not isinstance(z, torch.Tensor):
                z = as_tensor(z, "inducing_points")
            zs = [z]
        for i, z in enumerate(zs):
            if z.dim() != 2 or z.shape[0] == 0:
                raise ValueError(f"inducing_points[{i}] must be 2-D (M, D); got {tuple(z.shape)}")
            check_finite(z, f"inducing_points[{i}]")
        in_dim = zs[0].shape[-1]
        if output_dims is None:
            output_dims = [in_dim] * (L - 1) + [1]
        output_dims = [int(p) for p in output_dims]
        if len(output_dims) != L or output_dims[-1] != 1 or min(output_dims) < 1:
            raise ValueError(
                f"output_dims must list {L} positive widths ending in 1; got {output_dims}"
            )
        dims = [in_dim, *output_dims]
        if inducing == "layer":
            for i, z in enumerate(zs):
                if z.shape[-1] != dims[i]:
                    raise ValueError(
                        f"inducing_points[{i}] has {z.shape[-1]} columns but layer {i + 1} "
                        f"takes {dims[i]} inputs"
                    )
        if mean_functions is None:
            mean_functions = ["identity"] * (L - 1) + ["zero"]
        mean_functions = list(mean_functions)
        if len(mean_functions) != L:
            raise ValueError(f"mean_functions must have one entry per layer ({L})")
        for i, m in enumerate(mean_functions):
            if isinstance(m, str):
                if m not in _MEANS:
                    raise ValueError(f"mean_functions[{i}] must be one of {_MEANS} or a module")
                if m == "identity" and dims[i] != dims[i + 1]:
                    raise ValueError(
                        f"mean_functions[{i}] is 'identity' but layer {i + 1} maps "
                        f"{dims[i]} inputs to {dims[i + 1]} outputs; use a torch.nn.Linear"
                    )
            elif not isinstance(m, torch.nn.Module):
                raise ValueError(
                    f"mean_functions[{i}] must be 'identity', 'zero' or a torch.nn.Module, got "
                    f"{type(m).__name__} (wrap a function of your own in a torch.nn.Module, so "
                    "that the model moves, saves and trains it)"
                )
        for z in zs:
            check_kernel_memory(z.shape[0], 0, num_outputs=max(dims[1:]), dtype=z.dtype)
        if not zs[0].is_floating_point() or zs[0].dtype not in _MIN_VARIANCE:
            raise ValueError(
                f"inducing_points must be float32 or float64 (the model's dtype); got {zs[0].dtype}"
            )
        zs = [z.to(zs[0].dtype) for z in zs]
        kernels = [k.to(dtype=zs[0].dtype, device=zs[0].device) for k in kernels]

        self.num_layers = L
        self.dims = dims
        self.inducing = inducing
        self.whiten = bool(whiten) and inducing == "layer"
        self.jitter = float(_JITTER[zs[0].dtype] if jitter is None else jitter)
        self.min_variance = _MIN_VARIANCE[zs[0].dtype]
        self.kernels = torch.nn.ModuleList(kernels)
        self._mean_names = [m if isinstance(m, str) else None for m in mean_functions]
        self.mean_modules = torch.nn.ModuleList(
            [m if isinstance(m, torch.nn.Module) else torch.nn.Identity() for m in mean_functions]
        )
        self._num_z = len(zs)
        for i, z in enumerate(zs):
            setattr(self, f"z_{i + 1}", PyroParam(z.clone()))
        z0 = zs[0]
        self.noise = PyroParam(
            torch.as_tensor(float(noise), dtype=z0.dtype, device=z0.device),
            constraint=constraints.positive,
        )

    @property
    def inducing_inputs(self) -> list[torch.Tensor]:
        """Inducing inputs: ``Z_i`` per layer, or the single ``Z`` when propagated."""
        return [getattr(self, f"z_{i + 1}") for i in range(self._num_z)]

    def _sync_modules(self):
        """Register the kernels and mean modules in Pyro's store (global mode); values
        already there (a loaded store) replace the modules' own."""
        if _module_local():
            return
        for attr in ("kernels", "mean_modules"):
            module = getattr(self, attr)
            if any(True for _ in module.parameters()):
                pyro.module(self._pyro_get_fullname(attr), module, update_module_params=True)

    @contextlib.contextmanager
    def store_params(self):
        """Read the model's parameters from Pyro's store outside :meth:`forward` (for a
        guide or a plot that uses the model's kernels and inducing inputs)."""
        with self._pyro_context:
            self._sync_modules()
            yield

    # ------------------------------------------------------------------ shapes
    def site_names(self) -> list[str]:
        """Names of the inducing sites, layer by layer (``u_i`` or ``f_z_i``)."""
        prefix = "u" if self.inducing == "layer" else "f_z"
        return [f"{prefix}_{i + 1}" for i in range(self.num_layers)]

    def site_shapes(self, zs=None) -> list[tuple[int, int]]:
        """Event shapes ``(P_i, M_i)`` of the inducing sites."""
        zs = self.inducing_inputs if zs is None else zs
        if self.inducing == "layer":
            return [(self.dims[i + 1], z.shape[0]) for i, z in enumerate(zs)]
        M = zs[0].shape[0]
        return [(self.dims[i + 1], M) for i in range(self.num_layers)]

    def mean(self, i: int, f: torch.Tensor) -> torch.Tensor:
        """Mean function of layer ``i`` (0-based) at inputs ``(..., N, D_i)``: ``(..., N, P)``."""
        name = self._mean_names[i]
        if name == "identity":
            return f
        if name == "zero":
            return f.new_zeros(*f.shape[:-1], self.dims[i + 1])
        return self.mean_modules[i](f)

    # ------------------------------------------------------------------ priors
    def inducing_prior(self, i: int, f_z_prev: torch.Tensor | None = None, *, zs=None):
        """Prior of the inducing site of layer ``i`` (0-based).

        :param f_z_prev: with ``inducing="propagated"``, :math:`F_{i-1}^Z` as
            ``batch + (P_{i-1}, M)`` (ignored for the first layer).
        :param zs: :attr:`inducing_inputs`, when the caller already holds them.
        :returns: a :class:`~pyro.distributions.MultivariateNormal` with event dim 2
            (``(P_i, M)``).
        """
        zs = self.inducing_inputs if zs is None else zs
        P, M = self.site_shapes(zs)[i]
        z = zs[i if self.inducing == "layer" else 0]
        if self.inducing == "layer":
            if self.whiten:
                eye = torch.eye(M, dtype=z.dtype, device=z.device)
                return dist.MultivariateNormal(z.new_zeros(P, M), scale_tril=eye).to_event(1)
            Lzz = cholesky(kernel_matrix(self.kernels[i], z), self.jitter)
            return dist.MultivariateNormal(
                z.new_zeros(P, M), scale_tril=Lzz.expand(P, M, M)
            ).to_event(1)
        zin = z if i == 0 else f_z_prev.mT  # (..., M, D_{i})
        Lzz = cholesky(kernel_matrix(self.kernels[i], zin), self.jitter)
        loc = self.mean(i, zin).mT  # (..., P, M)
        return dist.MultivariateNormal(loc, scale_tril=Lzz.expand(*loc.shape, M)).to_event(1)

    # ------------------------------------------------------------------ layers
    def layer(
        self,
        i: int,
        f_prev: torch.Tensor,
        site: torch.Tensor,
        f_z_prev=None,
        *,
        full_cov=False,
        zs=None,
    ):
        """Conditional of layer ``i`` (0-based) at inputs ``f_prev`` given its inducing site.

        :param f_prev: ``batch + (N, D_i)``.
        :param site: the value of the inducing site, ``batch + (P_i, M)``.
        :param f_z_prev: :math:`F_{i-1}^Z` (``inducing="propagated"``, ``i > 0``).
        :param zs: :attr:`inducing_inputs`, when the caller already holds them.
        :returns: ``(loc, var)`` of shape ``batch + (N, P_i)`` (or with ``full_cov`` a
            covariance ``batch + (P_i, N, N)``), mean function included.
        """
        zs = self.inducing_inputs if zs is None else zs
        if self.inducing == "layer":
            z, u, whiten = zs[i], site, self.whiten
        else:
            z = zs[0] if i == 0 else f_z_prev.mT
            u, whiten = site - self.mean(i, z).mT, False
        loc, cov = conditional(
            self.kernels[i], f_prev, z, u, whiten=whiten, full_cov=full_cov, jitter=self.jitter
        )
        loc = loc.mT + self.mean(i, f_prev)
        return loc, (cov if full_cov else cov.mT.clamp_min(getattr(self, "min_variance", 0.0)))

    def _sample_inducing(self, zs):
        sites, prev = [], None
        for i, name in enumerate(self.site_names()):
            value = pyro.sample(name, self.inducing_prior(i, prev, zs=zs))
            prev = value
            # drop the slot of the data plate (batch dims of a site outside it end in 1)
            sites.append(value.squeeze(-3) if value.dim() > 2 else value)
        return sites

    def _check_x(self, x, zs=None):
        z = (self.inducing_inputs if zs is None else zs)[0]
        return check_X(x, n_features=self.dims[0], dtype=z.dtype).to(z.device)

    def checked_data(self, x, y=None, *, num_data=None, subsample_size=None, zs=None):
        """``x`` ``(N, D_0)`` and ``y`` ``(N,)`` (or ``None``) checked and converted as
        :meth:`forward` takes them (the model's dtype and device, finite values), and the
        memory of a step's kernel matrices checked. A tensor that needs no conversion is
        remembered with its version counter and not scanned again (a fit passes the same
        tensors at every step).

        :raises ValueError: as :meth:`forward`.
        """
        zs = self.inducing_inputs if zs is None else zs
        entry = _VALIDATED.get(self)
        z = zs[0]
        if not (
            entry is not None
            and isinstance(x, torch.Tensor)
            and x.dtype == z.dtype
            and x.device == z.device
            and _same_inputs(entry, x, y)
        ):
            x_in, y_in = x, y
            x = self._check_x(x, zs)
            if y is not None:
                y = check_finite(as_tensor(y, "y", dtype=x.dtype, device=x.device), "y")
                if y.dim() == 2 and y.shape[1] == 1:
                    y = y.squeeze(-1)
                if y.shape != (x.shape[0],):
                    raise ValueError(
                        f"y must have shape ({x.shape[0]},) to match x; got {tuple(y.shape)}"
                    )
            if x is x_in and y is y_in:  # no conversion: remember them as checked
                _VALIDATED[self] = (
                    weakref.ref(x),
                    x._version,
                    None if y is None else weakref.ref(y),
                    None if y is None else y._version,
                )
        N = x.shape[0]
        batch = N if subsample_size is None or num_data is not None else int(subsample_size)
        check_kernel_memory(
            max(z.shape[0] for z in zs),
            batch,
            num_outputs=max(self.dims[1:]),
            dtype=x.dtype,
            device=x.device,
        )
        return x, y

    # -- the ELBO's model part as plain tensor code, for a loss that compiles it --------
    def program_parts(self) -> dict | None:
        """The model's tensors, read once through Pyro's store (so that plain ``SVI``
        trains them), for :func:`~pyro_trees.infer.dgp_elbo.dgp_elbo_of`: ``inducing``,
        the inducing inputs ``zs`` (one per layer, or the propagated ``Z``), the kernels
        as :class:`~pyro_trees.gp.TensorKernel` (batched over outputs where the layer's
        kernel is), the mean functions (``"identity"``,
        ``"zero"`` or the module), the noise scale and the numerical settings. ``None``
        for a model the tensor program does not cover (a kernel other than an RBF or
        Matérn kernel, optionally in a ``ScaleKernel``)."""
        with self.store_params():
            zs = self.inducing_inputs
            noise = self.noise
            kernels = [TensorKernel.of(k, batched=True) for k in self.kernels]
        if any(k is None for k in kernels):
            return None
        means = tuple(
            name if name is not None else self.mean_modules[i]
            for i, name in enumerate(self._mean_names)
        )
        return {
            "inducing": self.inducing,
            "zs": zs,
            "kernels": kernels,
            "means": means,
            "dims": tuple(self.dims),
            "noise": noise,
            "whiten": self.whiten,
            "jitter": self.jitter,
            "min_variance": getattr(self, "min_variance", 0.0),
        }

    def forward(self, x, y=None, *, num_data: int | None = None, subsample_size=None):
        """Sample the deep GP at ``x``; condition on ``y`` when given.

        :param x: inputs ``(N, D_0)``.
        :param y: targets ``(N,)`` or ``None``.
        :param int num_data: size of the full data set when ``x`` is already a
            minibatch (scales the likelihood by ``num_data / N``).
        :param int subsample_size: draw a minibatch of this size inside the data plate.
        :returns: ``f_loc``, the mean of the last layer, ``batch + (N,)``.
        """
        # read the inducing inputs once: each read of a PyroParam goes through Pyro
        zs = self.inducing_inputs
        x, y = self.checked_data(x, y, num_data=num_data, subsample_size=subsample_size, zs=zs)
        N = x.shape[0]
        self._sync_modules()
        sites = self._sample_inducing(zs)
        if num_data is not None:
            plate = pyro.plate(
                "data", int(num_data), subsample=torch.arange(N, device=x.device), dim=-1
            )
        else:
            plate = pyro.plate("data", N, subsample_size=subsample_size, dim=-1)
        with plate as idx:
            f = x if num_data is not None else x[idx]
            f_z_prev = None
            for i in range(self.num_layers):
                loc, var = self.layer(i, f, sites[i], f_z_prev, zs=zs)
                f_z_prev = sites[i]
                if i < self.num_layers - 1:
                    f = loc + var.sqrt() * torch.randn_like(loc)
                    pyro.deterministic(f"f_{i + 1}", f, event_dim=1)
            f_loc, f_var = loc.squeeze(-1), var.squeeze(-1)
            pyro.deterministic("f_loc", f_loc)
            pyro.deterministic("f_var", f_var)
            noise = self.noise
            if y is None:
                pyro.sample("obs", dist.Normal(f_loc, (f_var + noise**2).sqrt()))
            else:
                yb = y if num_data is not None else y[idx]
                pyro.sample("obs", dist.Normal(f_loc, noise), obs=yb)
                pyro.factor("obs_var", -0.5 * f_var / noise**2)
        return f_loc
