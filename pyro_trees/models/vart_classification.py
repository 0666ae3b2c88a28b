"""VaRT for classification: the VaRT tree prior with a probit or softmax link on the
leaves' values.

References

* S. Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023 (the tree prior; other
  likelihoods are its future work).
* J. H. Albert, S. Chib, *Bayesian analysis of binary and polychotomous response data*,
  JASA 1993 (the probit link of Bayesian trees, as in BART's classifier).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from pyro_trees.models.vart import VaRT
from pyro_trees.models.vart_mixture import log_leaf_weights, observed, with_bias

__all__ = ["VaRTClassification", "base_rate_offset", "class_logits", "tree_scores"]


def tree_scores(tree: dict, x: torch.Tensor, num_outputs: int) -> torch.Tensor:
    r"""The leaves' values of ``tree`` at the rows of ``x``, one per output:
    :math:`f_k(x) = \sum_i \kappa_i P(x \to i)\, \theta_{ik}^\top x`.

    :param tree: output of :meth:`~pyro_trees.models.VaRT.sample_tree` (batch shape
        ``B``) whose ``theta`` holds ``num_outputs`` blocks of ``L + 1`` weights per node.
    :param x: inputs ``(N, L)`` (NaN where missing, see
        :func:`~pyro_trees.models.mixture_params`).
    :returns: ``B + (N, num_outputs)``.
    """
    x1 = with_bias(x)
    weights = log_leaf_weights(tree, x1).softmax(-1)  # B + (N, M)
    x1, _ = observed(x1)  # a missing input (routed by the tree's rho) reads 0 in the leaves
    return _mixed_scores(weights, x1, tree["theta"], num_outputs)


def _mixed_scores(weights, x1, theta, num_outputs: int) -> torch.Tensor:
    """The leaf functions' values mixed by the nodes' ``weights`` ``B + (N, M)``: with
    ``theta`` ``B + (M, num_outputs (L + 1))`` and inputs ``x1`` ``(N, L + 1)``,
    ``B + (N, num_outputs)``. Two matrix products: every node's leaf functions at every
    row, ``B + (N, M K)``, laid out as ``(N, M, K)``, then their mixture (an ``einsum``
    of the three operands permuted a ``B + (K, M, N)`` block)."""
    width, nodes = x1.shape[-1], theta.shape[-2]
    if num_outputs == 1:
        return (weights * (x1 @ theta.transpose(-1, -2))).sum(-1, keepdim=True)
    theta = theta.reshape(theta.shape[:-2] + (nodes * num_outputs, width))
    values = x1 @ theta.transpose(-1, -2)
    values = values.reshape(values.shape[:-1] + (nodes, num_outputs))  # B + (N, M, K)
    return (weights.unsqueeze(-2) @ values).squeeze(-2)  # B + (N, K)


def class_logits(scores: torch.Tensor, link: str) -> torch.Tensor:
    """Normalised log class probabilities from the leaves' values ``scores``
    ``(..., K')``: probit ``[log Phi(-f), log Phi(f)]`` (``K' = 1``, two classes) or
    ``log_softmax`` (``K' = K``). Returns ``(..., K)``."""
    if link == "probit":
        f = scores[..., 0]
        return torch.stack([torch.special.log_ndtr(-f), torch.special.log_ndtr(f)], -1)
    return scores.log_softmax(-1)


def base_rate_offset(counts: torch.Tensor, link: str) -> torch.Tensor:
    r"""The offset that puts a leaf value of 0 at the class frequencies of ``counts``
    ``(K,)``: :math:`\Phi^{-1}(\pi_1)` ``(1,)`` for ``"probit"`` (two classes; BART's
    probit offset), :math:`\log \pi_k` centred ``(K,)`` for ``"softmax"``, with
    :math:`\pi_k = (c_k + 1/2) / (N + K/2)` (half a row added to every class, so that a
    class without rows stays finite).

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models.vart_classification import base_rate_offset
    >>> base_rate_offset(torch.tensor([50.0, 50.0]), "probit")
    tensor([0.])
    >>> torch.special.ndtr(base_rate_offset(torch.tensor([395.5, 3.5]), "probit"))
    tensor([0.0100])
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    freq = (counts + 0.5) / (counts.sum() + 0.5 * counts.numel())
    if link == "probit":
        if counts.numel() != 2:
            raise ValueError("the probit link needs two classes")
        return torch.special.ndtri(freq[1:]).to(torch.get_default_dtype())
    log_freq = freq.log()
    return (log_freq - log_freq.mean()).to(torch.get_default_dtype())


class VaRTClassification(VaRT):
    r"""VaRT's stochastic tree with a categorical likelihood.

    The tree prior, the sample sites and their weighting are those of
    :class:`~pyro_trees.models.VaRT` (:meth:`~pyro_trees.models.VaRT.sample_tree`);
    only the leaves and the likelihood differ. Each node carries ``K'`` linear leaf
    functions :math:`\theta_{ik}^\top x` (its ``theta`` site has ``K' (L + 1)``
    entries, output-major), and the tree's value for output :math:`k` is the
    routing-weighted sum of its leaves,
    :math:`f_k(x) = \sum_i \kappa_i P(x \to i)\,\theta_{ik}^\top x`. The link:

    * ``"probit"`` (two classes, ``K' = 1``): :math:`P(y = 1 \mid x) = \Phi(f(x) + b)`;
    * ``"softmax"`` (``K' = K`` classes):
      :math:`P(y = k \mid x) = \mathrm{softmax}_k (f(x) + b)`,

    with a fixed ``offset`` :math:`b` (default 0; :func:`base_rate_offset` puts a leaf
    value of 0, the prior mean, at the training class frequencies, as BART's probit
    does: without it the prior pulls every leaf towards equal probabilities, and a
    rare class's probability up).

    The site ``obs`` is ``Categorical`` over the class indices ``0..K-1`` and the site
    ``probs`` records the class probabilities ``(N, K)`` of the drawn tree, inside the
    plate ``data`` (``dim=-1``). The ``log_sigma`` sites of VaRT stay (the guide draws
    them), but no likelihood reads them: their posterior is their prior.

    :param int in_features: number of inputs :math:`L`.
    :param int num_classes: :math:`K \ge 2` (default 2).
    :param str link: ``"probit"`` or ``"softmax"``; default probit for two classes,
        softmax for more (probit needs two classes).
    :param float leaf_scale: :math:`s_\theta` of the leaf weights (default 1: a leaf's
        value at the inputs' mean has prior standard deviation 1 on the probit or logit
        scale).
    :param offset: :math:`b`, ``(K',)`` values added to the tree's values before the
        link (e.g. :func:`base_rate_offset`); ``None`` for zeros.
    :param kwargs: ``kl_weight``, ``split_alpha``, ``split_beta``, ``split_scale``,
        ``site_depth``, ``name``, ``node_split_prob``, ``node_split_loc``,
        ``node_split_scale``, as in :class:`~pyro_trees.models.VaRT`.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.models import VaRTClassification
    >>> model = VaRTClassification(2, num_classes=3)
    >>> model.leaf_width  # 3 classes times (2 inputs + intercept)
    9
    >>> model(torch.randn(5, 2)).shape  # one class index per row
    torch.Size([5])
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int = 2,
        *,
        link: str | None = None,
        leaf_scale: float = 1.0,
        offset: torch.Tensor | None = None,
        **kwargs,
    ):
        for bad in ("node_leaf_loc", "node_leaf_scale", "noise_prior_loc", "noise_prior_scale"):
            if bad in kwargs:
                raise ValueError(f"VaRTClassification does not take {bad}")
        super().__init__(in_features, leaf_scale=leaf_scale, **kwargs)
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        self.num_classes = int(num_classes)
        link = ("probit" if self.num_classes == 2 else "softmax") if link is None else link
        if link not in ("probit", "softmax"):
            raise ValueError(f"link must be 'probit' or 'softmax', got {link!r}")
        if link == "probit" and self.num_classes != 2:
            raise ValueError("the probit link needs num_classes=2; use link='softmax'")
        self.link = link
        self.offset = offset

    @property
    def offset(self) -> torch.Tensor | None:
        """:math:`b`, ``(K',)`` or ``None`` (zeros)."""
        return self.__dict__.get("_offset")

    @offset.setter
    def offset(self, value) -> None:
        if value is not None:
            value = torch.as_tensor(value, dtype=torch.get_default_dtype()).detach().clone()
            if value.shape != (self.num_outputs,) or not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"offset must be {self.num_outputs} finite values, got {tuple(value.shape)}"
                )
        self.__dict__["_offset"] = value

    def _link(self, scores: torch.Tensor) -> torch.Tensor:
        """Normalised log class probabilities from the tree's values ``(..., K')``."""
        b = self.offset
        return class_logits(scores if b is None else scores + b.to(scores), self.link)

    @property
    def num_outputs(self) -> int:
        """:math:`K'`, leaf functions per node: 1 (probit) or ``num_classes``."""
        return 1 if self.link == "probit" else self.num_classes

    @property
    def leaf_width(self) -> int:
        """``num_outputs * (in_features + 1)`` leaf weights per node."""
        return self.num_outputs * (self.in_features + 1)

    def check(self, x: torch.Tensor, y=None, complete: bool | None = None) -> None:
        """:meth:`VaRT.check <pyro_trees.models.VaRT.check>`, and class indices in ``y``
        (an integer tensor, each in ``[0, num_classes)``: :meth:`check_labels`, which a
        caller that passes ``complete`` runs once itself)."""
        super().check(x, y, complete)
        if y is not None and (y.is_floating_point() or y.is_complex()):
            raise ValueError("y must hold class indices (an integer tensor)")
        if y is not None and complete is None:  # a caller that checks values once passes it
            self.check_labels(y)

    def check_labels(self, y: torch.Tensor) -> None:
        """Raise :class:`ValueError` unless every class index of ``y`` is in
        ``[0, num_classes)`` (the probit link would score any other value as one of the
        two classes). Reads ``y`` back from its device.

        :param y: class indices, an integer tensor.
        """
        bad = (y < 0) | (y >= self.num_classes)
        if bool(bad.any()):
            raise ValueError(
                f"y must hold class indices in [0, {self.num_classes}); got "
                f"{sorted({int(v) for v in y[bad][:10].tolist()})}"
            )

    def class_log_probs(self, tree: dict, x: torch.Tensor) -> torch.Tensor:
        """Log class probabilities ``B + (N, K)`` of the rows ``x`` under ``tree``."""
        return self._link(tree_scores(tree, x, self.num_outputs))

    def obs_log_lik(self, mix_logits, x1, theta, log_sigma, y) -> torch.Tensor:
        """The categorical log-likelihood of each class index of ``y`` ``(B,)``,
        ``T + (B,)`` (the vectorised ELBO's hook, see :meth:`VaRT.obs_log_lik`). The
        probit link scores ``log Phi(+-(f + b))``, the sign of ``y``'s class."""
        scores = _mixed_scores(mix_logits.softmax(-1), x1, theta, self.num_outputs)
        if self.link == "probit":
            f = scores[..., 0]
            if self.offset is not None:
                f = f + self.offset.to(f)[0]
            return torch.special.log_ndtr((2 * y - 1).to(f.dtype) * f)
        logp = self._link(scores)
        index = y.long().expand(logp.shape[:-1]).unsqueeze(-1)
        return logp.gather(-1, index).squeeze(-1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, subsample_size=None):
        """Draw a tree, then the class ``obs`` of each point in ``data``.

        :param x: inputs ``(N, L)``.
        :param y: class indices ``(N,)`` in ``0..K-1`` or ``None``.
        :param int subsample_size: minibatch size of the plate ``data`` (default all).
        :returns: the ``obs`` values of the (sub)sampled points, ``B + (N_b,)``.
        """
        self.check(x, y)
        batch = x.shape[0] if subsample_size is None else min(int(subsample_size), x.shape[0])
        tree = self.sample_tree(batch, like=x)
        with pyro.plate(
            self.site("data"), x.shape[0], subsample_size=subsample_size, dim=-1
        ) as idx:
            xb = x[idx]
            yb = None if y is None else y[idx]
            logp = self.class_log_probs(tree, xb)
            pyro.deterministic(self.site("probs"), logp.exp(), event_dim=1)
            return pyro.sample(self.site("obs"), dist.Categorical(logits=logp), obs=yb)
