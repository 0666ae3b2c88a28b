"""Matplotlib figures of fitted models (imported lazily: matplotlib loads on first use).

:func:`plot_tree` draws the most probable tree of a VaRT or RNN-Tree model with the
uncertainty of its rules and leaves, :func:`plot_predictive` the predictive mean and
credible band along one input (a partial dependence), :func:`plot_importances` the
split-usage importances of a VaRT tree or forest with their posterior spread, and
:func:`plot_dgp_layers` the layers of deep GPs.
"""

from .dgp import plot_dgp_layers
from .importances import plot_importances
from .predictive import plot_predictive
from .tree import plot_tree

__all__ = ["plot_dgp_layers", "plot_importances", "plot_predictive", "plot_tree"]
