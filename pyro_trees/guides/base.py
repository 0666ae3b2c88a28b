"""What every guide family of pyro_trees offers beside its ``forward``.

:class:`TreeGuide` is a mixin, as :class:`~pyro.infer.autoguide.AutoGuide` is the base of
Pyro's autoguides: the guides derive from it together with ``PyroModule`` (or with
``AutoGuide`` where they are autoguides), and so share

* posterior draws of every latent site the guide samples (:meth:`TreeGuide.sample_posterior`)
  and their quantiles (:meth:`TreeGuide.quantiles`), with the guide's own signature;
* the device and dtype rule (:meth:`TreeGuide.follow`): parameters follow the data;
* the ``name`` prefix of their parameters in Pyro's store (:attr:`TreeGuide.prefix`).
"""

from __future__ import annotations

import torch
from pyro.infer import Predictive

from pyro_trees._param_store import follow_data

__all__ = ["TreeGuide"]


class TreeGuide:
    """Mixin of every pyro_trees guide: posterior draws, quantiles, device rule, name.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.guides import RNNTreeGuide, TreeGuide
    >>> guide = RNNTreeGuide(1, 2, name="tree")
    >>> isinstance(guide, TreeGuide), guide.prefix
    (True, 'tree')
    >>> x, y = torch.linspace(-1, 1, 8).unsqueeze(-1), torch.linspace(-1, 1, 8)
    >>> draws = guide.sample_posterior(x, y, num_samples=5)
    >>> draws["leaf"].shape
    torch.Size([5, 8])
    """

    @property
    def prefix(self) -> str:
        """The ``name`` prefix of the guide's parameters in Pyro's store (``""``: none)."""
        return self.__dict__.get("_pyro_name", "")

    def follow(self, x: torch.Tensor) -> None:
        """Move the guide's floating parameters and buffers to ``x``'s dtype and device."""
        follow_data(self, x)

    def sample_posterior(self, *args, num_samples: int = 100, parallel: bool = False, **kwargs):
        """Draws from the guide of every latent site it samples.

        :param args: the guide's (and its model's) arguments, e.g. ``x, y``.
        :param int num_samples: number of draws ``S``.
        :param bool parallel: draw them in one vectorised pass (as
            ``Predictive(parallel=True)``) instead of a loop.
        :returns: ``{site: tensor}``, each of shape ``(S,) + site shape``.
        """
        with torch.no_grad():
            return Predictive(self, num_samples=num_samples, parallel=parallel)(*args, **kwargs)

    def quantiles(self, quantiles, *args, num_samples: int = 1000, **kwargs):
        """Monte Carlo quantiles of every latent site, from :meth:`sample_posterior`.

        :param quantiles: levels in ``[0, 1]``, a sequence of ``Q`` floats.
        :returns: ``{site: tensor}``, each of shape ``(Q,) + site shape`` (in the site's
            floating dtype, or float64 for integer sites).
        """
        draws = self.sample_posterior(*args, num_samples=num_samples, **kwargs)
        out = {}
        for site, value in draws.items():
            value = value if value.is_floating_point() else value.double()
            q = torch.as_tensor(quantiles, dtype=value.dtype, device=value.device)
            out[site] = torch.quantile(value, q, dim=0)
        return out
