"""Guide for :class:`~pyro_trees.models.HeteroscedasticGP`: an RNN-Tree over the noise leaves."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam

from pyro_trees.guides.rnn_tree import RNNTree

__all__ = ["HeteroscedasticGPGuide"]


class HeteroscedasticGPGuide(PyroModule):
    """The routing posterior of the noise tree, plus :math:`q(u)` for the sparse model.

    ``forward(x, y=None, subsample_size=None)`` has the model's signature. With
    ``num_inducing=M > 0`` it samples ``"u"`` from
    ``MultivariateNormal(u_loc, scale_tril=u_scale_tril)`` (whitened, ``(M,)``); then,
    inside the plate ``"data"``, the per-point site ``"leaf"`` from
    ``Categorical(logits=RNNTree(x))``, marked for parallel enumeration.

    :param int in_features: input dimension.
    :param int depth: tree depth; must match the model's.
    :param int num_inducing: ``M`` of the sparse model (0 for the exact model).
    :param str feedback: RNN-Tree feedback, ``"hard"`` (default: an exact soft tree,
        no sampling of the routing) or ``"soft"`` (the paper's noisy roll-out).
    :param kwargs: passed to :class:`~pyro_trees.guides.RNNTree` (``hidden_size``,
        ``noise``).
    """

    def __init__(
        self,
        in_features: int,
        depth: int = 2,
        *,
        num_inducing: int = 0,
        feedback: str = "hard",
        init_scale: float = 0.1,
        **kwargs,
    ):
        super().__init__()
        if isinstance(num_inducing, bool) or not isinstance(num_inducing, int) or num_inducing < 0:
            raise ValueError(f"num_inducing must be an integer >= 0, got {num_inducing!r}")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale}")
        kwargs.setdefault("hidden_size", 16)
        self.tree = RNNTree(in_features, depth, feedback=feedback, **kwargs)
        self.num_inducing = num_inducing
        if num_inducing:
            self.u_loc = PyroParam(torch.zeros(num_inducing))
            self.u_scale_tril = PyroParam(
                init_scale * torch.eye(num_inducing), constraint=constraints.lower_cholesky
            )

    @property
    def depth(self) -> int:
        """Depth of the routing tree."""
        return self.tree.depth

    def forward(self, x: torch.Tensor, y=None, subsample_size: int | None = None):
        """Sample ``"u"`` (sparse model only), then each point's ``"leaf"`` in ``"data"``.

        :param torch.Tensor x: inputs ``(N, L)``.
        :param y: ignored (the model's signature).
        :param int subsample_size: minibatch size of the ``"data"`` plate; must match the
            model's.
        """
        if self.num_inducing:
            loc = self.u_loc.to(x.dtype)
            pyro.sample("u", dist.MultivariateNormal(loc, scale_tril=self.u_scale_tril.to(x.dtype)))
        n = x.shape[0]
        with pyro.plate("data", n, subsample_size=subsample_size, dim=-1) as idx:
            logits = self.tree(x[idx])
            pyro.sample("leaf", dist.Categorical(logits=logits), infer={"enumerate": "parallel"})
