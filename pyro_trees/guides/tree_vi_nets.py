"""The networks of the TreeVI guides: per-instance and per-group encoders ``x -> (loc,
scale)`` and the edge correlation network ``(x_i, x_j) -> rho_ij`` (Xiao & Su 2024, eq. 12).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GaussianEncoder", "GroupEncoder", "PairNet"]


_ACTIVATIONS = {"softplus": nn.Softplus, "relu": nn.ReLU}


def _mlp(sizes, activation: str = "softplus"):
    """Linear layers of ``sizes`` with ``activation`` between them (none after the last)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}; got {activation!r}")
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), _ACTIVATIONS[activation]()]
    return nn.Sequential(*layers[:-1])


class GaussianEncoder(nn.Module):
    """Per-instance encoder ``x -> (loc, scale)``; ``(..., F) -> (..., D), (..., D)``.

    :param int in_features: ``F``.
    :param int latent_dim: ``D``.
    :param hidden_sizes: sizes of the hidden layers (``()`` for an affine encoder).
    :param str activation: ``"softplus"`` or ``"relu"`` (VaDE's and DC-GMM's
        ``784-500-500-2000-10`` encoder), between the layers.

    The last layer gives ``loc`` and, through a softplus, ``scale``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import GaussianEncoder
    >>> enc = GaussianEncoder(5, 2, hidden_sizes=(8,))
    >>> loc, scale = enc(torch.randn(10, 5))
    >>> loc.shape, bool((scale > 0).all())
    (torch.Size([10, 2]), True)
    """

    def __init__(
        self, in_features: int, latent_dim: int, hidden_sizes=(64,), activation="softplus"
    ):
        super().__init__()
        self.net = _mlp([in_features, *hidden_sizes, 2 * latent_dim], activation)
        self.latent_dim = latent_dim

    def forward(self, x):
        """``(loc, scale)`` of ``q(z | x)``: ``(..., F) -> (..., D), (..., D)``."""
        out = self.net(x)
        loc, s = out.split(self.latent_dim, dim=-1)
        return loc, nn.functional.softplus(s) + 1e-4


class GroupEncoder(nn.Module):
    """Encoder of a whole group of instances: ``(..., N, F) -> (..., N, D), (..., N, D)``.

    The means are an affine map of the group's flattened data (the exact posterior mean
    of a linear-Gaussian group model, such as Sec. 4.1's, is affine in it); the scales
    are free per-node, per-dimension parameters that do not depend on ``x``.

    :param int num_nodes: ``N``, instances per group.
    :param int in_features: ``F``.
    :param int latent_dim: ``D``.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import GroupEncoder
    >>> enc = GroupEncoder(num_nodes=4, in_features=3, latent_dim=2)
    >>> loc, scale = enc(torch.randn(7, 4, 3))  # 7 groups of 4 instances
    >>> loc.shape, scale.shape
    (torch.Size([7, 4, 2]), torch.Size([7, 4, 2]))
    """

    def __init__(self, num_nodes: int, in_features: int, latent_dim: int):
        super().__init__()
        self.n, self.d = num_nodes, latent_dim
        self.lin = nn.Linear(num_nodes * in_features, num_nodes * latent_dim)
        self.log_scale = nn.Parameter(torch.full((num_nodes, latent_dim), -0.5))

    def forward(self, x):
        """``(loc, scale)`` of each instance: ``(..., N, F) -> (..., N, D), (..., N, D)``."""
        loc = self.lin(x.flatten(-2)).unflatten(-1, (self.n, self.d))
        return loc, self.log_scale.exp().expand_as(loc)


class PairNet(nn.Module):
    """Edge correlation network :math:`\\rho_{ij} = f(x_i, x_j)` (eq. 12), symmetric in
    its arguments: an MLP of ``[x_i + x_j, x_i * x_j]`` followed by ``max_rho * tanh``.
    ``(..., F), (..., F) -> (..., D)``.

    With ``edge_features=E`` it also takes per-edge side information ``e_ij`` of shape
    ``(..., E)`` (for instance whether the edge is a must-link constraint), appended to
    the MLP's input: :math:`\\rho_{ij} = f(x_i, x_j, e_{ij})`. The data of two instances
    rarely tell which edges the model's prior couples; the edge's own features do.

    With ``num_nodes=N`` it adds a learnt per-edge offset before the ``tanh``,
    :math:`\\rho_{ij} = \\rho_{\\max}\\tanh(f(x_i, x_j) + b_i)`, indexed by the child
    ``i`` of the edge (in a tree each non-root node has exactly one parent edge), ``b`` of
    shape ``(N, D)``. Use it when the inputs carry no clue to which edge they sit on
    (e.g. groups of ``N`` exchangeable-looking instances with a fixed tree, the synthetic
    model of Sec. 4.1): without it every edge of a tree gets the same function of
    ``(x_i, x_j)``, hence nearly the same correlation. It needs every call to see all
    ``N`` nodes in order on dim -2 (a plate over groups; not ``idx`` minibatches), and
    cannot score all pairs (structure learning): ``offsets="pair"`` can.

    With ``num_nodes=N`` and ``offsets="pair"`` the learnt offset belongs to the ordered
    pair instead, :math:`\\rho_{ij} = \\rho_{\\max}\\tanh(f(x_i, x_j) + b_{ij})` with ``b``
    of shape ``(N, N, D)`` (child, parent, dimension; the diagonal is never used), so the
    same network scores any pair: the edges of a fixed tree (``b[i, parents[i]]``), the
    edges a minibatch keeps, and all ``N^2`` candidate edges of the structure learning of
    eq. 17 (:func:`~pyro_trees.infer.learn_guide_tree`). The caller then says which nodes each pair
    joins with ``nodes=(child, parent)``, integer tensors broadcastable to the output's
    batch shape (:class:`~pyro_trees.guides.TreeVIGuide` does). The offset of ``(i, j)``
    is not that of ``(j, i)``: ``rho`` is symmetric in ``(x_i, x_j)`` but not in the node
    identities.

    With ``zero_init=True`` the last layer starts at zero, so every :math:`\\rho` starts
    at 0: the guide starts as the mean-field guide and moves away from it only where
    the ELBO's gradient asks (random initial correlations otherwise perturb the early
    steps, which matters when a large pairwise prior weight amplifies them).

    :param int edge_features: ``E``, size of the per-edge features (0: none).
    :param int num_nodes: ``N`` for per-edge offsets, or ``None`` (default).
    :param str offsets: with ``num_nodes``, ``"child"`` (default: one offset per child,
        ``(N, D)``, for a fixed tree) or ``"pair"`` (one per ordered pair, ``(N, N, D)``).
    :param bool zero_init: start with :math:`\\rho = 0` on every edge.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import PairNet
    >>> net = PairNet(3, 2, hidden_sizes=(8,))
    >>> x = torch.randn(5, 3)
    >>> rho = net(x[:, None], x[None, :])  # every ordered pair
    >>> rho.shape, bool((rho.abs() < 1).all())
    (torch.Size([5, 5, 2]), True)
    >>> torch.allclose(rho, rho.transpose(0, 1))  # symmetric in (x_i, x_j)
    True
    """

    def __init__(
        self,
        in_features: int,
        latent_dim: int,
        hidden_sizes=(64,),
        max_rho: float = 0.999,
        num_nodes: int | None = None,
        edge_features: int = 0,
        zero_init: bool = False,
        offsets: str = "child",
    ):
        super().__init__()
        if not 0 < max_rho < 1:
            raise ValueError(f"max_rho must lie in (0, 1), got {max_rho}")
        if num_nodes is not None and num_nodes < 1:
            raise ValueError(f"num_nodes must be a positive int, got {num_nodes}")
        if offsets not in ("child", "pair"):
            raise ValueError(f"offsets must be 'child' or 'pair', got {offsets!r}")
        if offsets == "pair" and num_nodes is None:
            raise ValueError("offsets='pair' needs num_nodes (the size of the offset table)")
        if edge_features < 0:
            raise ValueError(f"edge_features must be >= 0, got {edge_features}")
        self.net = _mlp([2 * in_features + edge_features, *hidden_sizes, latent_dim])
        if zero_init:
            nn.init.zeros_(self.net[-1].weight)
            nn.init.zeros_(self.net[-1].bias)
        self.max_rho = max_rho
        self.edge_features = edge_features
        pair = offsets == "pair"
        self.edge_bias = (
            None if num_nodes is None or pair else nn.Parameter(torch.zeros(num_nodes, latent_dim))
        )
        self.pair_bias = (
            nn.Parameter(torch.zeros(num_nodes, num_nodes, latent_dim)) if pair else None
        )

    @property
    def offsets(self) -> str | None:
        """``"child"``, ``"pair"`` or ``None``: which learnt offsets the network adds."""
        if getattr(self, "pair_bias", None) is not None:
            return "pair"
        return "child" if self.edge_bias is not None else None

    def forward(self, xi, xj, edge=None, *, nodes=None):
        """Correlations of the pairs ``(x_i, x_j)``.

        :param torch.Tensor xi: child inputs ``(..., F)``.
        :param torch.Tensor xj: parent inputs ``(..., F)``, broadcast together with ``xi``
            (e.g. ``x[:, None]`` and ``x[None, :]`` for all pairs).
        :param edge: per-edge features ``(..., E)`` with ``edge_features=E``.
        :param nodes: ``(child, parent)`` integer node indices of each pair, broadcastable
            to the output's batch shape; required with ``offsets="pair"`` (ignored
            otherwise).
        :returns: ``rho`` of shape ``broadcast(xi, xj).shape[:-1] + (D,)``.
        """
        h = torch.cat([xi + xj, xi * xj], dim=-1)
        if self.edge_features:
            if edge is None or edge.shape[-1] != self.edge_features:
                got = None if edge is None else tuple(edge.shape)
                raise ValueError(
                    f"PairNet(edge_features={self.edge_features}) needs edge features of "
                    f"last size {self.edge_features}, got {got}"
                )
            h = torch.cat([h, edge.to(h.dtype).expand(h.shape[:-1] + edge.shape[-1:])], -1)
        elif edge is not None:
            raise ValueError("edge features given to a PairNet built with edge_features=0")
        h = self.net(h)
        if self.edge_bias is not None:
            if xi.dim() < 2 or xi.shape[-2] != self.edge_bias.shape[0]:
                raise ValueError(
                    f"PairNet(num_nodes={self.edge_bias.shape[0]}) needs all "
                    f"{self.edge_bias.shape[0]} nodes on dim -2, got input {tuple(xi.shape)}"
                )
            h = h + self.edge_bias
        elif self.offsets == "pair":
            h = h + self._pair_offsets(nodes, h.shape[:-1])
        return self.max_rho * torch.tanh(h)

    def _pair_offsets(self, nodes, batch_shape):
        n = self.pair_bias.shape[0]
        if nodes is None or len(nodes) != 2:
            raise ValueError(
                "PairNet(offsets='pair') needs nodes=(child, parent): the node indices of "
                "each pair, to look up its offset"
            )
        child, parent = (torch.as_tensor(t, device=self.pair_bias.device) for t in nodes)
        if child.is_floating_point() or parent.is_floating_point():
            raise ValueError("nodes must be integer tensors (child, parent)")
        try:
            shape = torch.broadcast_shapes(child.shape, parent.shape)
            torch.broadcast_shapes(shape, batch_shape)
        except RuntimeError:
            raise ValueError(
                f"nodes of shapes {tuple(child.shape)} and {tuple(parent.shape)} do not "
                f"broadcast with the pairs' batch shape {tuple(batch_shape)}"
            ) from None
        for name, t in (("child", child), ("parent", parent)):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
                raise ValueError(f"{name} node index out of range [0, {n - 1}]")
        return self.pair_bias[child.long(), parent.long()]
