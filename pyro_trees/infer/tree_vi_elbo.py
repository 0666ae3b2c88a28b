"""ELBO estimators for the TreeVI guides: the ELBO as one tensor program (which
compiles), MTreeVI's stratified mixture ELBO and a Rao-Blackwellised ELBO for models
with one pairwise factor (Xiao & Su 2024)."""

from __future__ import annotations

import pyro
import torch
from pyro import poutine
from pyro.infer import Trace_ELBO
from torch import nn

from pyro_trees.guides.tree_vi import TreeVIGuide
from pyro_trees.guides.tree_vi_mixture import TreeVIMixtureGuide
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesLoss
from pyro_trees.validation import as_tensor

__all__ = ["MixtureTreeELBO", "PairwiseELBO", "TreeVIELBO"]


def _treevi_program(guide_parts, model_parts, guide_inputs, model_inputs, eps, log_joint_of):
    """The single-draw ELBO of an instance-level model and a :class:`TreeVIGuide` from
    the draw's noise ``eps``: the guide's draw and density
    (:meth:`~pyro_trees.guides.TreeVIGuide.draw_of`) and the model's log-joint
    (``log_joint_of``), a pure function of tensors and modules: the part of a step that
    compiles."""
    z, log_q = TreeVIGuide.draw_of(guide_parts, guide_inputs, eps)
    return log_joint_of(model_parts, model_inputs, z) - log_q


def _passes(check, x) -> bool:
    try:
        check(x)
    except ValueError:
        return False
    return True


class TreeVIELBO(CompilesLoss, DifferentiableLossELBO):
    """``Trace_ELBO``'s single-draw ELBO of an instance-level model with a
    :class:`~pyro_trees.guides.TreeVIGuide`, as one tensor program: no poutine stack, no
    read back from the device inside a step, and with ``compile=True`` one program under
    ``torch.compile`` (:mod:`pyro_trees.infer.compiled`).

    A step draws the guide's noise eagerly, from torch's generator in the order
    ``Trace_ELBO`` draws it, so its value and gradients equal ``Trace_ELBO``'s on the
    same draws (tested) and a seeded fit draws the same numbers either way. The rest is
    plain code: the guide's encoder and pair network, the tree's ancestral recursion by
    pointer jumping (one program whatever the forest a minibatch induces, up to the
    number of jumps, about ``log2`` of its height), the draw's density by the change of
    variables, and the model's log-joint.

    It applies to a :class:`~pyro_trees.guides.TreeVIGuide` (a tree or mean-field,
    without a group ``plate``) with a model that has ``program_parts(x)``,
    ``step_inputs(x, idx, check=...)``, ``check(x)`` and a static ``log_joint_of(parts,
    inputs, z)``, as :class:`~pyro_trees.models.GraphPriorVAE` and
    :class:`~pyro_trees.models.ConstrainedClusteringVAE` have, called as ``model(x)`` or
    ``model(x, idx=idx)``. Anything else trains with ``Trace_ELBO``, after one warning
    that says why (:class:`MixtureTreeELBO` is the loss of a mixture guide).

    The data's rows are checked once per tensor and model (finite; in ``[0, 1]`` for the
    clustering model; 0 or 1 for the graph model's Bernoulli likelihood while Pyro's
    validation is on) instead of once per step, so a full-batch step reads nothing back
    from the device (a minibatch's index checks still do); a tensor that fails the check
    is then checked batch by batch, as the model does, so the same batches raise. An
    edit that torch's version counter does not see (through ``.data``, or the NumPy
    array under ``torch.from_numpy``) is not checked again.

    The step does not validate the networks' outputs (Pyro's distributions do, under
    ``Trace_ELBO``): a parameter that became NaN gives a NaN loss, which
    :func:`~pyro_trees.infer.fit` reports at its next read of the loss.

    With ``compile=True`` a program is compiled per batch size (a full batch: one; a
    last, smaller minibatch: a second, with a symbolic size) and per number of
    constraints inside a batch being 0, 1 or more; compiling costs 10-50 s on a CPU.

    :param compile: ``False`` (eager), ``True`` or a ``torch.compile`` backend name.
    :param mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide
    >>> from pyro_trees.infer import TreeVIELBO
    >>> from pyro_trees.models import GraphPriorVAE
    >>> adjacency = torch.tensor([[0, 1], [1, 2], [2, 3]])
    >>> model = GraphPriorVAE(adjacency, 3, num_nodes=4, latent_dim=2, hidden_sizes=(8,))
    >>> guide = TreeVIGuide(GaussianEncoder(3, 2, hidden_sizes=(8,)), [-1, 0, 1, 2],
    ...                     pair_net=PairNet(3, 2, hidden_sizes=(8,)))
    >>> x = torch.rand(4, 3).round()
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TreeVIELBO())
    >>> isinstance(svi.step(x), float)
    True
    """

    _program = staticmethod(_treevi_program)

    def __init__(self, *, compile: bool | str = False, mode: str | None = None):
        super().__init__(num_particles=1, compile=compile, mode=mode)

    def _get_trace(self, model, guide, args, kwargs):  # pragma: no cover - not used
        raise NotImplementedError("TreeVIELBO scores the ELBO without traces")

    @staticmethod
    def unsupported(model, guide, args, kwargs) -> str | None:
        """Why the program does not apply to this model, guide and call, or ``None``."""
        if isinstance(guide, TreeVIMixtureGuide):
            return "the guide is a TreeVIMixtureGuide (its loss is MixtureTreeELBO)"
        if not isinstance(guide, TreeVIGuide):
            return f"the guide is not a TreeVIGuide (got {type(guide).__name__})"
        if type(guide).forward is not TreeVIGuide.forward:
            return f"the guide's class {type(guide).__name__} overrides forward"
        if guide.plate is not None:
            return "the guide has a group plate"
        needed = ("program_parts", "step_inputs", "check", "log_joint_of")
        missing = [name for name in needed if not callable(getattr(model, name, None))]
        if missing:
            return f"the model {type(model).__name__} has no {', '.join(missing)}"
        # the log-joint is written for the forward of the class that defines it
        owner = next(c for c in type(model).__mro__ if "log_joint_of" in vars(c))
        if type(model).forward is not owner.forward:
            return (
                f"the model's class {type(model).__name__} overrides the forward of "
                f"{owner.__name__}, whose log_joint_of it would not follow"
            )
        if len(args) != 1 or set(kwargs) - {"idx"}:
            return "the model is called with arguments other than x and idx"
        if guide.site != "z":
            return f"the guide's site is {guide.site!r}; the models' latent site is 'z'"
        return None

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """Minus the ELBO estimate (one draw), differentiable in the parameters of both."""
        why = self.unsupported(model, guide, args, kwargs)
        if why is not None:
            self._fall_back("Trace_ELBO", why)
            return Trace_ELBO().differentiable_loss(model, guide, *args, **kwargs)
        self.fallback = None
        x, idx = as_tensor(args[0], "x"), kwargs.get("idx")
        checked = self._once("rows", (x,), lambda: _passes(model.check, x), owner=model)
        guide_inputs = guide.step_inputs(x, idx, check=not checked)  # builds a default pair_net
        guide_parts = guide.program_parts()
        model_parts = model.program_parts(x)
        model_inputs = model.step_inputs(x, idx, check=not checked)
        xb = guide_inputs["x"]
        eps = torch.randn(xb.shape[:-1] + (model.latent_dim,), dtype=xb.dtype, device=xb.device)
        args = (guide_parts, model_parts, guide_inputs, model_inputs, eps, model.log_joint_of)
        program = self._compiled if self._compiled is not None else _treevi_program
        return -program(*args)


class MixtureTreeELBO(Trace_ELBO):
    """Trace ELBO for :class:`~pyro_trees.guides.TreeVIMixtureGuide`: model and guide run
    inside a plate ``"tree_components"`` of size ``M`` (at the guide's ``component_dim``)
    scaled by the
    mixture weights, so the loss is :math:`-\\sum_m \\pi_m (\\log p(x, z^{(m)}) - \\log
    q(z^{(m)}))` with one reparameterised draw :math:`z^{(m)}` per tree.

    The model must broadcast over that extra batch dim (models whose likelihood is a
    single site without plates, or a site inside a plate at dim -1, do). The guide may
    be an ``AutoGuideList`` holding the mixture guide: its other parts then draw once
    per component as well (an unbiased, stratified estimate of the same ELBO).

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import GroupEncoder, PairNet, TreeVIMixtureGuide
    >>> from pyro_trees.infer import MixtureTreeELBO
    >>> from pyro_trees.models import SyntheticGraphVAE
    >>> model = SyntheticGraphVAE()
    >>> x = model.generate(6)
    >>> guide = TreeVIMixtureGuide(GroupEncoder(4, 4, 4), [[-1, 0, 0, 1], [-1, 0, 1, 0]],
    ...                            pair_net=PairNet(4, 4, num_nodes=4), plate="groups")
    >>> loss = MixtureTreeELBO().differentiable_loss(model, guide, x)
    >>> loss.shape, loss.requires_grad
    (torch.Size([]), True)
    """

    @staticmethod
    def _mixture(guide):
        if isinstance(guide, TreeVIMixtureGuide):
            return guide
        for part in guide if isinstance(guide, nn.ModuleList) else ():
            inner = getattr(part, "_guide", part)
            if isinstance(inner, TreeVIMixtureGuide):
                return inner
        raise ValueError(
            "MixtureTreeELBO needs a TreeVIMixtureGuide (alone or in an AutoGuideList)"
        )

    def _wrap(self, fn, guide):
        guide = self._mixture(guide)

        def wrapped(*args, **kwargs):
            m = guide.num_trees
            shape = (m,) + (1,) * (-guide.component_dim - 1)
            with (
                guide.stratified(),
                pyro.plate("tree_components", m, dim=guide.component_dim),
                poutine.scale(scale=guide.tree_probs().reshape(shape)),
            ):
                return fn(*args, **kwargs)

        return wrapped

    def _check(self, guide):
        self._mixture(guide)

    def loss(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().loss(self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().differentiable_loss(
            self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs
        )

    def loss_and_grads(self, model, guide, *args, **kwargs):
        self._check(guide)
        return super().loss_and_grads(
            self._wrap(model, guide), self._wrap(guide, guide), *args, **kwargs
        )


class PairwiseELBO(DifferentiableLossELBO):
    """Rao-Blackwellised ELBO estimator for models whose instances interact only through
    one pairwise factor (e.g. the constraints of
    :class:`~pyro_trees.models.ConstrainedClusteringVAE`), for :class:`TreeVIGuide`
    (tree or mean-field). With ``q`` the guide's posterior over the latent site and
    ``q_i`` its marginals,

    .. math::

        \\mathcal L = \\mathbb E_{\\prod_i q_i}\\Big[\\sum_i \\log p(x_i, z_i)\\Big]
        + \\mathbb E_q\\big[\\log f(z)\\big] + H[q],

    which is the ELBO of ``q`` exactly: the per-instance terms only see the marginals,
    which a tree shares with its mean-field counterpart, so they are estimated with
    *independent* draws ``z_i = loc_i + scale_i eps_i`` (one draw, as for mean-field);
    the pairwise log-factor ``log f`` (the model's ``pairwise_log_factor(z, idx=None)``,
    site ``pair_site``) is averaged over ``num_pair_particles`` draws of ``q``; the
    entropy is exact. The edge correlations then receive gradient only from the terms
    they change in expectation (the pairwise factor and the entropy): with
    :class:`~pyro.infer.Trace_ELBO`, every per-instance term (e.g. a 784-pixel
    likelihood) adds zero-mean noise to it through ``dz / drho``. For a mean-field guide
    the estimator differs from ``Trace_ELBO`` only by the exact entropy and the
    ``num_pair_particles`` draws of the pairwise term.

    :param int num_pair_particles: draws of ``q`` for the pairwise term.
    :param str site: the latent site.
    :param str pair_site: the model's pairwise factor.

    .. rubric:: Examples

    >>> import pyro, torch
    >>> from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide
    >>> from pyro_trees.infer import PairwiseELBO
    >>> from pyro_trees.models import ConstrainedClusteringVAE
    >>> model = ConstrainedClusteringVAE(3, 2, latent_dim=2, hidden_sizes=(8,),
    ...                                  constraints=[[0, 1], [2, 3]], weights=[1.0, -1.0])
    >>> guide = TreeVIGuide(GaussianEncoder(3, 2, hidden_sizes=(8,)), [-1, 0, 1, 2],
    ...                     pair_net=PairNet(3, 2, hidden_sizes=(8,)))
    >>> x = torch.rand(4, 3).round()  # binary data (Bernoulli likelihood)
    >>> svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), PairwiseELBO(2))
    >>> isinstance(svi.step(x), float)
    True
    """

    def __init__(self, num_pair_particles: int = 8, *, site: str = "z", pair_site="constraints"):
        if int(num_pair_particles) < 1:
            raise ValueError(f"num_pair_particles must be >= 1, got {num_pair_particles}")
        super().__init__()
        self.num_pair_particles = int(num_pair_particles)
        self.site, self.pair_site = site, pair_site

    def _posterior(self, guide, *args, **kwargs):
        if isinstance(guide, TreeVIMixtureGuide) or not isinstance(guide, TreeVIGuide):
            raise ValueError("PairwiseELBO needs a TreeVIGuide (tree or mean-field)")
        if guide.plate is not None:
            raise ValueError("PairwiseELBO does not support a guide with a group plate")
        # run the guide under a trace so that its parameters register with SVI
        return poutine.trace(guide).get_trace(*args, **kwargs).nodes[self.site]["fn"]

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """``-L`` (one estimate), differentiable in the parameters of both."""
        if not callable(getattr(model, "pairwise_log_factor", None)):
            raise ValueError("PairwiseELBO needs a model with a pairwise_log_factor(z, idx)")
        q = self._posterior(guide, *args, **kwargs)
        loc, scale = q.mean, q.stddev
        z = loc + scale * torch.randn_like(loc)  # independent draws of the marginals
        unary = poutine.block(poutine.condition(model, data={self.site: z}), hide=[self.pair_site])
        log_unary = poutine.trace(unary).get_trace(*args, **kwargs).log_prob_sum()
        zk = q.rsample((self.num_pair_particles,))
        log_pair = model.pairwise_log_factor(zk, idx=kwargs.get("idx")).mean(0)
        return -(log_unary + log_pair + q.entropy())

    def _get_trace(self, model, guide, args, kwargs):  # abstract in ELBO; not used
        raise NotImplementedError
