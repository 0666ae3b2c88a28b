"""Node split indicators of a stochastic tree: hard in the prior, relaxed in the guide.

VaRT (Salazar, 2023) scores a split indicator :math:`s \\in [0, 1]` of a node with the
Bernoulli log-mass extended linearly to the unit interval,

.. math:: \\ell(s; \\gamma) = s \\log\\gamma + (1 - s)\\log(1 - \\gamma),

which is the Bernoulli log-mass at :math:`s \\in \\{0, 1\\}` and the paper's term for a
relaxed (Gumbel-softmax) indicator (eqs. 23 and 25 with :math:`\\psi_i = A_i s_i` and
:math:`\\kappa_i = A_i (1 - s_i)`). :class:`SplitIndicator` samples hard Bernoulli draws
(the prior); :class:`RelaxedSplitIndicator` samples the binary Gumbel-softmax relaxation
of eqs. 20-22 by reparameterisation (the guide). Both share :math:`\\ell`.

Note that :math:`\\ell` is not a normalised density on ``(0, 1)``: it is the surrogate
the paper optimises, exact in the zero-temperature limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.utils import broadcast_all, clamp_probs

__all__ = ["RelaxedSplitIndicator", "SplitIndicator"]

_EMPTY = torch.Size()


class SplitIndicator(TorchDistribution):
    """Split indicator ``s ~ Bernoulli(probs)`` scored by the linear extension of its
    log-mass to ``[0, 1]`` (see the module docstring).

    :param probs: split probabilities :math:`\\gamma`, any batch shape.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import SplitIndicator
    >>> d = SplitIndicator(torch.tensor([0.2, 0.9]))
    >>> d.sample().shape
    torch.Size([2])
    >>> d.log_prob(torch.tensor([0.5, 1.0]))  # linear in s: relaxed values score too
    tensor([-0.9163, -0.1054])
    """

    arg_constraints = {"probs": constraints.unit_interval}
    support = constraints.unit_interval
    has_rsample = False

    def __init__(self, probs, validate_args=None):
        (self.probs,) = broadcast_all(probs)
        super().__init__(self.probs.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(SplitIndicator, _instance)
        new.probs = self.probs.expand(torch.Size(batch_shape))
        super(SplitIndicator, new).__init__(new.probs.shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def mean(self):
        return self.probs

    @property
    def variance(self):
        return self.probs * (1 - self.probs)

    def sample(self, sample_shape=_EMPTY):
        shape = self._extended_shape(sample_shape)
        with torch.no_grad():
            return torch.bernoulli(self.probs.expand(shape))

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        p = clamp_probs(self.probs)
        return value * p.log() + (1 - value) * (-p).log1p()


class RelaxedSplitIndicator(TorchDistribution):
    """Binary Gumbel-softmax (concrete) relaxation of a split indicator, eqs. 20-22.

    ``rsample`` draws :math:`s = \\mathrm{softmax}((g_1 + \\log\\gamma, g_2 +
    \\log(1-\\gamma)) / \\tau)_1 = \\sigma((\\mathrm{logit}\\,\\gamma + g_1 - g_2)/\\tau)`
    with :math:`g_1, g_2 \\sim \\mathrm{Gumbel}(0, 1)`, clamped into the open unit
    interval so that logarithms stay finite. At ``temperature == 0`` it returns the hard
    argmax of eq. 20 (exact Bernoulli draws, no gradient). ``log_prob`` is the linear
    extension of the Bernoulli log-mass shared with :class:`SplitIndicator`.

    :param logits: log-odds :math:`\\mathrm{logit}\\,\\tilde\\gamma` of splitting.
    :param float temperature: :math:`\\tau \\ge 0`.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.distributions import RelaxedSplitIndicator
    >>> d = RelaxedSplitIndicator(torch.tensor([0.0, 2.0]), temperature=0.5)
    >>> s = d.rsample()
    >>> s.shape, bool(((s > 0) & (s < 1)).all())
    (torch.Size([2]), True)
    >>> d.probs
    tensor([0.5000, 0.8808])
    """

    arg_constraints = {"logits": constraints.real}
    support = constraints.unit_interval
    has_rsample = True

    def __init__(self, logits, temperature: float, validate_args=None):
        temperature = float(temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        (self.logits,) = broadcast_all(logits)
        self.temperature = temperature
        super().__init__(self.logits.shape, validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(RelaxedSplitIndicator, _instance)
        new.logits = self.logits.expand(torch.Size(batch_shape))
        new.temperature = self.temperature
        super(RelaxedSplitIndicator, new).__init__(new.logits.shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @property
    def probs(self):
        """The split probabilities ``sigmoid(logits)``, shape ``batch_shape``."""
        return torch.sigmoid(self.logits)

    def rsample(self, sample_shape=_EMPTY):
        shape = self._extended_shape(sample_shape)
        u = clamp_probs(torch.rand(shape, dtype=self.logits.dtype, device=self.logits.device))
        return self.relax(self.logits.expand(shape), u, self.temperature)

    @staticmethod
    def relax(logits: torch.Tensor, uniform: torch.Tensor, temperature) -> torch.Tensor:
        """The draw :meth:`rsample` makes from uniform noise ``u``: ``sigmoid((logits +
        g) / temperature)`` with ``g = log u - log(1 - u)`` ~ Logistic(0, 1), clamped
        into (0, 1); hard indicators ``1[logits + g > 0]`` at ``temperature == 0``.

        :param logits: ``(...)`` split logits.
        :param uniform: ``(...)`` draws in (0, 1) (clamped, as :meth:`rsample` draws them).
        :param temperature: a number ``>= 0`` or a 0-dim tensor ``> 0`` (so that a
            compiled program takes every temperature without recompiling).
        """
        z = logits + (uniform.log() - (-uniform).log1p())
        if not isinstance(temperature, torch.Tensor) and temperature == 0:
            return (z > 0).to(logits.dtype).detach()
        return clamp_probs(torch.sigmoid(z / temperature))

    def log_prob(self, value):
        if self._validate_args:
            self._validate_sample(value)
        return value * F.logsigmoid(self.logits) + (1 - value) * F.logsigmoid(-self.logits)
