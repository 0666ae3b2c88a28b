r"""``HMEELBO``: :class:`~pyro_trees.infer.TreeELBO` of the HME in closed form.

For an :class:`~pyro_trees.models.HME` with the :class:`~pyro_trees.guides.RNNTreeGuide`
the routing site is the only latent variable and its guide is exact, so the sum that
:class:`~pyro_trees.infer.TreeELBO` enumerates through Pyro's traces can be written
directly over the ``2**D`` leaves:

.. math::

    \mathcal{L} = \frac{N}{B} \Big[\sum_n \sum_\ell q_{n\ell} \log p(y_n \mid \ell)
        - w_H \sum_n \mathrm{KL}(q_n \,\|\, \mathrm{Unif})\Big]
        + w_B\, \mathbb{E}_q[\log c(M)],

the same value and gradients (tested), without the tracing, which costs more than the
arithmetic on small data. With ``compile=True`` the step is one program under
``torch.compile`` (:mod:`pyro_trees.infer.compiled`): the parameters are read eagerly
(:meth:`~pyro_trees.guides.RNNTree.node_params`,
:meth:`~pyro_trees.models.HME.expert_params`) and the rows, routing, experts and
coupling run compiled.
"""

from __future__ import annotations

import math

import pyro.poutine as poutine
import torch

from pyro_trees.distributions.tree_balance import expected_log_coupling
from pyro_trees.guides.hme import RNNTreeGuide
from pyro_trees.guides.rnn_tree import RNNTree
from pyro_trees.infer._loss_elbo import DifferentiableLossELBO
from pyro_trees.infer.compiled import CompilesLoss, ScoresRows, plate_subsample
from pyro_trees.models.hme import HME

__all__ = ["HMEELBO", "hme_elbo"]


def _tree_elbo(log_q, loglik, depth: int, scale, balance_weight: float, entropy_weight: float):
    """The bound from the leaf log-probabilities ``log_q`` and the experts'
    log-likelihoods ``loglik`` (each ``(B, 2**D)``) of a batch standing for ``scale``
    times its rows."""
    q = log_q.exp()
    elbo = (q * loglik).sum()
    if entropy_weight:
        kl = (q * log_q).sum(-1) + depth * math.log(2.0)
        elbo = elbo - entropy_weight * kl.sum()
    elbo = scale * elbo
    if balance_weight:
        elbo = elbo + balance_weight * expected_log_coupling(log_q, depth, scale=scale)
    return elbo


def hme_elbo(
    model: HME,
    guide: RNNTreeGuide,
    x: torch.Tensor,
    y: torch.Tensor,
    subsample_size: int | None = None,
    *,
    subsample: torch.Tensor | None = None,
    num_rows=None,
    balance_weight: float = 1.0,
    entropy_weight: float = 1.0,
) -> torch.Tensor:
    """The ELBO that :class:`~pyro_trees.infer.TreeELBO` computes for
    ``model(x, y, subsample_size)`` and ``guide``, summed over the leaves (eager).

    :param subsample: indices of the minibatch; drawn like ``pyro.plate`` draws them
        (``torch.randperm(N)[:B]``) when ``None`` and ``subsample_size < N``.
    :param num_rows: the rows :math:`N` the minibatch (``subsample``, or without it all
        of ``x``) stands for (default ``x.shape[0]``; data-parallel training passes the
        rows of every rank).
    :param float balance_weight: :class:`~pyro_trees.infer.TreeELBO`'s.
    :param float entropy_weight: :class:`~pyro_trees.infer.TreeELBO`'s.
    :returns: the ELBO (a scalar tensor; maximise it).
    """
    n = x.shape[0]
    if subsample is None:
        subsample = plate_subsample(n, subsample_size, x.device)
    if subsample is not None:
        rows = n if num_rows is None else num_rows
        x, y, scale = x[subsample], y[subsample], rows / subsample.shape[0]
    else:
        scale = 1.0 if num_rows is None else num_rows / n
    log_q = guide.tree(x)  # (B, 2**D), normalised
    loglik = model.leaf_log_likelihood(x, y)
    return _tree_elbo(log_q, loglik, model.depth, scale, balance_weight, entropy_weight)


def _hme_program(model, tree_params, expert_params, xb, yb, scale, balance_weight, entropy_weight):
    """:func:`hme_elbo` of the complete batch ``(xb, yb)`` standing for ``scale`` times
    its rows (a 0-dim tensor), from parameters read eagerly: the part of a step that
    compiles."""
    log_q = RNNTree.leaf_log_probs_of(xb, tree_params)
    loglik = model.leaf_log_likelihood(xb, yb, expert_params)
    return _tree_elbo(log_q, loglik, model.depth, scale, balance_weight, entropy_weight)


class HMEELBO(ScoresRows, CompilesLoss, DifferentiableLossELBO):
    """Drop-in replacement of :class:`~pyro_trees.infer.TreeELBO` for
    :class:`~pyro_trees.models.HME` with :class:`~pyro_trees.guides.RNNTreeGuide`: the
    same bound (:func:`hme_elbo`), summed over the leaves in closed form.

    Use it as ``SVI(model, guide, optim, HMEELBO())`` or ``fit(..., loss=HMEELBO())``;
    it takes the model's arguments ``(x, y, subsample_size=None)``. A model and guide
    that have not run yet take their data-driven start at the first call, as under
    ``TreeELBO``.

    With ``compile=True`` each step's loss runs as one program compiled by
    ``torch.compile`` (:mod:`pyro_trees.infer.compiled`) for complete inputs under hard
    feedback (otherwise, and where compilation fails, eagerly); the value and gradients
    are the eager ones.

    :param float balance_weight: multiplies the tree-balance coupling (as in
        :class:`~pyro_trees.infer.TreeELBO`).
    :param float entropy_weight: multiplies the per-point KL to the uniform routing (as
        in :class:`~pyro_trees.infer.TreeELBO`).
    :param compile: ``False`` (default), ``True`` or a ``torch.compile`` backend name.
    :param str mode: ``torch.compile``'s ``mode`` (``"reduce-overhead"``: CUDA graphs).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import RNNTreeGuide
    >>> from pyro_trees.infer import HMEELBO, TreeELBO
    >>> from pyro_trees.models import HME
    >>> x, y = torch.randn(8, 1), torch.randn(8)
    >>> model, guide = HME(1, 2), RNNTreeGuide(1, 2, hidden_size=8)
    >>> a = HMEELBO().loss(model, guide, x, y)
    >>> b = TreeELBO().loss(model, guide, x, y)
    >>> abs(a - b) < 1e-4 * abs(b)
    True
    """

    _program = staticmethod(_hme_program)

    def __init__(
        self,
        *,
        balance_weight: float = 1.0,
        entropy_weight: float = 1.0,
        compile: bool | str = False,
        mode: str | None = None,
    ):
        super().__init__(compile=compile, mode=mode)
        self.balance_weight = float(balance_weight)
        self.entropy_weight = float(entropy_weight)

    def _check(self, model, guide, x, y) -> None:
        """The checks of every call; a model or guide that has not run yet takes its
        start (traced once each, as a first ``SVI`` step would)."""
        name = type(self).__name__
        if not isinstance(model, HME):
            raise ValueError(
                f"{name} needs an HME model, got {type(model).__name__}: it sums the bound "
                "over the leaves from the model object itself, so a model inside a Pyro "
                "handler (poutine.scale, mask, condition) or a function of your own trains "
                "with TreeELBO instead (the same value and gradients)"
            )
        if not isinstance(guide, RNNTreeGuide):
            raise ValueError(f"{name} needs an RNNTreeGuide, got {type(guide).__name__}")
        if y is None:
            raise ValueError(f"{name} needs the targets y")
        if x.dim() != 2 or x.shape[-1] != model.in_features:
            raise ValueError(f"{name}: x must be (N, {model.in_features}); got {tuple(x.shape)}")
        model.check_y(y, x.shape[0])
        if not (guide.initialised and model.initialised):
            with torch.no_grad():
                poutine.trace(guide).get_trace(x, y)
                poutine.trace(model).get_trace(x, y)

    def _elbo(self, model, guide, x, y, subsample_size=None, subsample=None, num_rows=None):
        """:func:`hme_elbo` with this loss's weights (eager)."""
        return hme_elbo(
            model,
            guide,
            x,
            y,
            subsample_size,
            subsample=subsample,
            num_rows=num_rows,
            balance_weight=self.balance_weight,
            entropy_weight=self.entropy_weight,
        )

    def _compiled_elbo(self, model, guide, x, y, subsample_size):
        """The ELBO through the compiled program, or ``None`` where it does not apply
        (not compiling, soft feedback, missing inputs)."""
        if self._compiled is None or guide.tree.feedback != "hard" or not self._complete(x):
            return None
        n = x.shape[0]
        scale = 1.0
        # the minibatch is gathered here, so that one program serves every data size
        subsample = plate_subsample(n, subsample_size, x.device)
        if subsample is not None:
            x, y, scale = x[subsample], y[subsample], n / subsample.shape[0]
        scale = torch.tensor(scale, dtype=x.dtype, device=x.device)
        tree_params = guide.tree.node_params(x.dtype)
        expert_params = model.expert_params()
        return self._compiled(
            model,
            tree_params,
            expert_params,
            x,
            y,
            scale,
            self.balance_weight,
            self.entropy_weight,
        )

    def differentiable_loss(self, model, guide, x, y=None, subsample_size=None) -> torch.Tensor:
        """Negative ELBO, differentiable in the model's and guide's parameters."""
        self._check(model, guide, x, y)
        value = self._compiled_elbo(model, guide, x, y, subsample_size)
        if value is None:
            value = self._elbo(model, guide, x, y, subsample_size)
        return -value
