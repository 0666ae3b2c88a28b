"""Learning a TreeVI guide's tree from a Pyro model (Xiao & Su 2024, eqs. 16-17).

:func:`soft_tree_elbo` is the ELBO of the relaxed family
(:class:`~pyro_trees.distributions.SoftTreeNormal`) as a function of the soft parents,
:func:`model_log_joint` turns a Pyro model into its log joint in one latent site, and
:func:`learn_guide_tree` drives :func:`~pyro_trees.infer.learn_tree_structure` on them
for an amortised :class:`~pyro_trees.guides.TreeVIGuide` and installs the learned tree.
"""

from __future__ import annotations

from collections.abc import Callable

import pyro
import torch
from pyro import poutine
from pyro.poutine.util import site_is_subsample
from torch import nn

from pyro_trees.distributions.soft_tree_normal import SoftTreeNormal
from pyro_trees.guides.tree_vi_mixture import TreeVIMixtureGuide
from pyro_trees.infer.tree_structure import learn_tree_structure, parents_to_probs
from pyro_trees.trees import require_memory
from pyro_trees.validation import as_tensor

__all__ = ["learn_guide_tree", "model_log_joint", "soft_tree_elbo"]


def soft_tree_elbo(
    log_joint: Callable[[torch.Tensor], torch.Tensor],
    loc: torch.Tensor,
    scale: torch.Tensor,
    rho: torch.Tensor,
    probs: torch.Tensor,
    num_particles: int = 1,
) -> torch.Tensor:
    r"""TreeVI ELBO of the relaxed family as a function of the soft parents (eq. 17).

    .. math::

        \mathcal L(P) = \frac1S \sum_{s=1}^S \log p(x, z_s) + H[q_P],
        \qquad z_s = \mathrm{loc} + \mathrm{scale} \odot (I - B)^{-1}
        \operatorname{diag}(c)\, \varepsilon_s,

    with :math:`q_P` the :class:`~pyro_trees.distributions.SoftTreeNormal` of ``loc``,
    ``scale``, ``probs`` and ``rho``: reparameterised samples and the exact entropy, so
    the estimate is unbiased and differentiable in ``probs``, ``loc``, ``scale`` and
    ``rho``. At one-hot ``probs`` it is the ELBO of the hard tree's
    :class:`~pyro_trees.distributions.TreeNormal` guide; at soft ``probs`` it is still a
    valid lower bound (``q_P`` is a proper Gaussian). Pass it as the objective of
    :func:`learn_tree_structure`, with the raw variational parameters as ``params``::

        def objective(p):
            rho = 0.99 * torch.tanh(raw_rho)  # (N, N, D)
            return soft_tree_elbo(log_joint, loc, softplus(raw_scale), rho, p, 8)

        res = learn_tree_structure(objective, N, params=[loc, raw_scale, raw_rho])

    For a Pyro model, ``log_joint = model_log_joint(model, "z", x)``
    (:func:`model_log_joint`); for a minibatch of a larger data set it must carry the
    same likelihood scaling as the ELBO being estimated (this function adds nothing but
    the entropy).

    :param log_joint: callable mapping ``z`` of shape
        ``(num_particles,) + batch_shape + (N, D)`` to :math:`\log p(x, z)` of shape
        ``(num_particles,)`` (or ``(num_particles, ...)``, summed over the rest).
    :param torch.Tensor loc: ``batch_shape + (N, D)``.
    :param torch.Tensor scale: positive, broadcastable with ``loc``.
    :param torch.Tensor rho: per-edge correlations ``(..., N, N, D)`` in ``(-1, 1)``
        (child, parent, dimension).
    :param torch.Tensor probs: soft parents ``(..., N, N + 1)`` (last column: root).
    :param int num_particles: Monte Carlo samples ``S``.
    :returns: scalar tensor (summed over ``batch_shape``).
    """
    if not isinstance(num_particles, int) or num_particles < 1:
        raise ValueError(f"num_particles must be a positive int, got {num_particles!r}")
    q = SoftTreeNormal(loc, scale, probs, rho)
    z = q.rsample((num_particles,))
    lp = log_joint(z)
    if not isinstance(lp, torch.Tensor) or lp.dim() < 1 or lp.shape[0] != num_particles:
        got = tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__
        raise ValueError(
            f"log_joint must return a tensor of shape (num_particles={num_particles}, ...), "
            f"got {got}"
        )
    return lp.reshape(num_particles, -1).sum(-1).mean() + q.entropy().sum()


def model_log_joint(model: Callable, site: str, *args, **kwargs) -> Callable:
    r"""The log joint :math:`\log p(x, z)` of a Pyro model as a function of one latent site.

    Returns ``log_joint(z)`` for :func:`soft_tree_elbo`: for each particle ``z[s]`` the
    model is run with ``site`` conditioned on it and its trace's ``log_prob_sum()`` is
    taken (observed sites, factors and ``site`` itself, with the scales of subsampled
    plates), so the ELBO is that of a guide with a single site ``site``. Particles run in
    a Python loop (:math:`O(S)` model calls).

    :param model: a Pyro model whose only latent sample site is ``site``; its value must
        have the guide's shape ``batch_shape + (N, D)``.
    :param str site: name of the latent site.
    :param args: model arguments (e.g. the data).
    :returns: callable ``(S,) + batch_shape + (N, D) -> (S,)``.
    :raises ValueError: (when called) if the model has other latent sites, or lacks
        ``site``.
    """

    def log_joint(z: torch.Tensor) -> torch.Tensor:
        out = []
        for zs in z:
            conditioned = poutine.condition(model, data={site: zs})
            tr = poutine.trace(conditioned).get_trace(*args, **kwargs)
            if site not in tr.nodes:
                raise ValueError(f"the model has no sample site named {site!r}")
            latent = [
                name
                for name, node in tr.nodes.items()
                if node["type"] == "sample"
                and not node["is_observed"]
                and not site_is_subsample(node)  # plates record a subsample site
            ]
            if latent:
                raise ValueError(
                    f"the model has latent sites other than {site!r}: {latent}; "
                    "model_log_joint covers single-site guides"
                )
            out.append(tr.log_prob_sum())
        return torch.stack(out)

    return log_joint


def learn_guide_tree(
    guide,
    model,
    x,
    *args,
    subsample_size: int | None = None,
    num_particles: int = 2,
    num_restarts: int = 1,
    init_parents=None,
    init_strength: float = 2.0,
    temperature: float = 0.3,
    max_outer: int = 15,
    inner_steps: int = 100,
    lr: float = 0.1,
    param_lr: float = 0.01,
    eval_particles: int = 16,
    refine_steps: int = 100,
    single_root: bool = True,
    generator: torch.Generator | None = None,
    **kwargs,
):
    r"""Learn the guide's tree jointly with its parameters (eq. 17) and install it.

    The relaxed family of the guide's
    :meth:`~pyro_trees.guides.TreeVIGuide.soft_distribution` (the encoder's means and scales,
    the pair network on all ordered pairs, soft parents ``P``) is trained by
    :func:`~pyro_trees.infer.learn_tree_structure` on its ELBO
    (:func:`~pyro_trees.infer.soft_tree_elbo` with
    :func:`~pyro_trees.infer.model_log_joint`), jointly over ``P`` and every
    parameter of the guide (encoder and pair network), under the acyclicity
    constraint :math:`h(A) = 0` (augmented Lagrangian). The hard tree (the most
    probable root and every other node's most probable parent, cycles cut) then
    becomes the guide's ``parents`` (cached batch plans are dropped) and the guide
    keeps the jointly learnt parameters, so plain ``SVI`` continues from there on the
    learned tree. The model's own parameters are held
    fixed. With ``num_restarts > 1`` each restart starts from the guide's parameters as
    they were and from fresh random logits; its hard tree's parameters are refined
    (``refine_steps``) and the hard tree with the best Monte Carlo ELBO
    (``eval_particles`` draws over every group) wins, with its parameters.

    **The objective.** For ``x`` of shape ``(N, F)`` (one tree over all instances)
    it is the ELBO of the whole data. With a group plate (``x`` of shape
    ``(G, N, F)``, ``plate`` set) each inner step draws ``B`` groups
    (``subsample_size``, else the guide's, else all ``G``) and the model runs with its
    plate conditioned on those groups, as ``SVI`` replays a guide's subsample; the
    log joint keeps the plate's scale :math:`G / B` and the entropy gets the same
    scale, so the estimate is unbiased for the full-data ELBO of the relaxed guide.
    The solver sees it divided by the number of trees (:math:`G`, or 1): the ELBO
    *per tree*, whose size does not grow with the data, so that the Lagrangian's
    penalty schedule behaves alike on any data size.

    **Why a function of the guide.** It trains (a solver, restarts, an optimiser), so it
    lives in :mod:`pyro_trees.infer`, above the guides; the guide supplies the pieces
    (its encoder, the pair network's all-pairs evaluation, its plate and site) and
    installs the result (:meth:`~pyro_trees.guides.TreeVIGuide.set_tree`, which drops
    the cached batch plans); the solver stays generic
    (:func:`~pyro_trees.infer.learn_tree_structure`).

    Cost per inner step: ``num_particles`` model calls and a dense ``N x N`` solve
    per tree and latent dimension, :math:`O(B D N^3)`: meant for trees of up to a few
    hundred nodes (a memory check raises before an oversized problem starts). The
    oriented relaxation has local optima (see
    :func:`~pyro_trees.infer.learn_tree_structure`): use a few ``num_restarts``.

    :param TreeVIGuide guide: the guide whose tree is learnt (not a mixture guide).
    :param model: the Pyro model; its only latent site must be the guide's ``site``,
        of the shape the guide draws (``(N, D)``, or ``(B, N, D)`` under the plate).
    :param torch.Tensor x: the data, ``(N, F)`` or ``(G, N, F)`` with a group plate.
    :param args: further model arguments (the model is called as
        ``model(x, *args, **kwargs)``, like ``SVI`` calls it).
    :param int subsample_size: groups per inner step (group plate only).
    :param int num_particles: draws of the relaxed guide per inner step.
    :param int num_restarts: independent runs; the best hard tree is kept.
    :param init_parents: parent array ``(N,)`` to start from (default: near-uniform
        logits); ``init_strength``, ``temperature``, ``max_outer``, ``inner_steps``,
        ``lr`` (logits) and ``param_lr`` (guide parameters) are passed to
        :func:`~pyro_trees.infer.learn_tree_structure`.
    :param int refine_steps: Adam steps (``param_lr``) on the guide's parameters
        with the hard tree fixed, after each restart and before its ELBO is taken:
        the parameters learnt at soft parents are not yet those of the hard tree, and
        ranking restarts by unrefitted ELBOs picked wrong trees (0 to skip).
    :param int eval_particles: draws for the ELBO that ranks the restarts.
    :param bool single_root: learn a spanning tree (one unit of root mass, see
        :func:`~pyro_trees.infer.learn_tree_structure`; default) rather than a
        forest: with free root options the solver tends to the empty forest when the
        posterior's correlations are weak, and a spanning tree loses nothing since
        its correlations are learnt (an edge with ``rho = 0`` is a missing edge).
    :param torch.Generator generator: seeds the restarts' logits and the groups drawn.
    :param kwargs: further keyword arguments of the model (not ``idx``: the tree is
        learnt over all ``N`` instances).
    :returns: the winning :class:`~pyro_trees.infer.LearnedTree`, with ``elbo`` its
        per-tree Monte Carlo ELBO on the hard tree.
    :raises ValueError: for a mixture guide, a guide whose pair network cannot score
        all pairs, a model with other latent sites or a site of another shape, a
        missing plate, or data of the wrong shape.
    """
    if isinstance(guide, TreeVIMixtureGuide):
        raise ValueError(
            "learn_guide_tree learns a single tree; for a mixture learn each tree with a "
            "TreeVIGuide and pass the parent arrays to TreeVIMixtureGuide"
        )
    if kwargs.get("idx") is not None:
        raise ValueError(
            "learn_guide_tree learns the tree over all N instances; idx minibatches are not "
            "supported (the tree of a minibatch is not the tree of the data)"
        )
    for name, v in (("num_particles", num_particles), ("num_restarts", num_restarts)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(eval_particles, int) or eval_particles < 1:
        raise ValueError(f"eval_particles must be a positive int, got {eval_particles!r}")
    if not isinstance(refine_steps, int) or refine_steps < 0:
        raise ValueError(f"refine_steps must be a non-negative int, got {refine_steps!r}")
    x = as_tensor(x, "x")
    if guide.plate is not None and x.dim() != 3:
        raise ValueError(
            f"with the group plate {guide.plate!r}, x must have shape (G, N, F), got "
            f"{tuple(x.shape)}"
        )
    xall = guide.checked_rows(x)  # shape and finiteness of all rows, once
    table = getattr(guide.pair_net, "pair_bias", None)
    if table is not None and table.shape[0] != xall.shape[-2]:
        raise ValueError(
            f"the pair network's offset table is for {table.shape[0]} nodes but x has "
            f"{xall.shape[-2]} instances on dim -2"
        )
    n = xall.shape[-2]
    with torch.no_grad():
        x1 = xall[:1] if guide.plate is not None else xall
        loc0, scale0 = guide.encoder(x1)
    d = loc0.shape[-1]
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    if guide.plate is not None:
        num_groups = x.shape[0]
        size = subsample_size if subsample_size is not None else guide.subsample_size
        size = num_groups if size is None else min(int(size), num_groups)
        if size < 1:
            raise ValueError(f"subsample_size must be positive, got {size}")
    else:
        if subsample_size is not None:
            raise ValueError("subsample_size needs a guide with a group plate")
        num_groups = size = 1
    # rho (N, N, D), B = I - P * rho, its inverse and their gradients, per tree
    need = 12.0 * size * n * n * d * xall.element_size() * max(num_particles, 2)
    require_memory(
        need,
        f"learning a {n}-node tree on {size} tree(s) at a time",
        "Use a smaller subsample_size or fewer instances per tree.",
        device=xall.device,
    )
    with torch.no_grad():  # fails early for a pair network that cannot score all pairs
        guide.pair_rho(x1, loc0, scale0)

    def draw():
        if guide.plate is None:
            return None
        if size >= num_groups:
            return torch.arange(num_groups, device=x.device)
        return torch.randperm(num_groups, generator=gen)[:size].to(x.device)

    def conditioned(sel):
        if sel is None:
            return model
        return poutine.condition(model, data={guide.plate: sel})

    def site_scale(sel, z):
        cond = poutine.condition(conditioned(sel), data={guide.site: z})
        tr = poutine.trace(cond).get_trace(x, *args, **kwargs)
        node = tr.nodes.get(guide.site)
        if node is None or node["type"] != "sample":
            raise ValueError(f"the model has no sample site named {guide.site!r}")
        if guide.plate is not None and guide.plate not in tr.nodes:
            raise ValueError(
                f"the model has no plate named {guide.plate!r} (the guide's group plate)"
            )
        shape = node["fn"].shape()
        if tuple(shape) != tuple(z.shape):
            raise ValueError(
                f"the model's site {guide.site!r} has shape {tuple(shape)} but the guide "
                f"draws {tuple(z.shape)}"
            )
        s = node["scale"]
        return float(s) if not isinstance(s, torch.Tensor) else float(s.reshape(-1)[0])

    def elbo_per_tree(p, sel, particles, scale_):
        xb = xall if sel is None else xall.index_select(0, sel)
        loc, scale = guide.encoder(xb)
        rho = guide.pair_rho(xb, loc, scale)
        log_joint = model_log_joint(conditioned(sel), guide.site, x, *args, **kwargs)
        elbo = soft_tree_elbo(
            lambda z: log_joint(z) / scale_, loc, scale, rho, p.to(loc), particles
        )
        return elbo / max(1, loc.shape[:-2].numel())

    probe = None if guide.plate is None else torch.arange(size, device=x.device)
    with torch.no_grad():
        z0 = guide.encoder(xall if probe is None else xall.index_select(0, probe))[0]
        site_scale_ = site_scale(probe, z0)
        # the other latent sites are named by model_log_joint's check
        model_log_joint(conditioned(probe), guide.site, x, *args, **kwargs)(z0.unsqueeze(0))

    def objective(p):
        return elbo_per_tree(p, draw(), num_particles, site_scale_)

    def evaluate(p):
        """Per-tree ELBO over every group (in chunks of the step's size)."""
        if guide.plate is None:
            return float(elbo_per_tree(p, None, eval_particles, site_scale_))
        total = 0.0
        for sel in torch.arange(num_groups, device=x.device).split(size):
            chunk_scale = site_scale_ * size / sel.numel()
            total += sel.numel() * float(elbo_per_tree(p, sel, eval_particles, chunk_scale))
        return total / num_groups

    params = [q for q in guide.parameters() if q.requires_grad]
    start = [q.detach().clone() for q in params]
    best, best_state = None, None
    for _ in range(num_restarts):
        with torch.no_grad():
            for q, q0 in zip(params, start, strict=True):
                q.copy_(q0)
        seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
        res = learn_tree_structure(
            objective,
            n,
            init_parents=init_parents,
            init_strength=init_strength,
            temperature=temperature,
            max_outer=max_outer,
            inner_steps=inner_steps,
            lr=lr,
            params=params,
            param_lr=param_lr,
            single_root=single_root,
            generator=torch.Generator().manual_seed(seed),
        )
        hard = parents_to_probs(res.parents, n)
        if refine_steps and params:  # fit the hard tree's parameters before ranking
            opt = torch.optim.Adam(params, lr=param_lr)
            for _ in range(refine_steps):
                opt.zero_grad()
                (-objective(hard)).backward()
                opt.step()
        with torch.no_grad():
            res.elbo = evaluate(hard)
        if best is None or res.elbo > best.elbo:
            best, best_state = res, [q.detach().clone() for q in params]
    with torch.no_grad():
        for q, q1 in zip(params, best_state, strict=True):
            q.copy_(q1)
    _clear_grads(model, params)
    device = params[0].device if params else x.device
    guide.set_tree(best.parents.to(device))
    return best


def _clear_grads(model, params):
    """Drop the gradients the solver left (SVI accumulates onto existing ones)."""
    for q in params:
        q.grad = None
    if isinstance(model, nn.Module):
        for q in model.parameters():
            q.grad = None
    for _, q in pyro.get_param_store().named_parameters():
        q.grad = None
