"""Sphinx configuration for the pyro_trees API reference.

Build with ``make docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``).
The build needs no network. Links into the torch, Pyro, GPyTorch and NumPy docs
(intersphinx) download their inventories, so they are opt-in:
``PYRO_TREES_DOCS_INTERSPHINX=1 make docs``.
"""

import os
import shutil
import sys

sys.path.insert(0, os.path.abspath(".."))

import pyro_trees  # noqa: E402

project = "pyro_trees"
author = "the pyro_trees authors"
copyright = "the pyro_trees authors"
release = pyro_trees.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
]

# The teaching notebooks are rendered with the outputs committed beside them
# (``make notebooks`` executes them); the docs build never runs a notebook. They are
# copied from ../notebooks into docs/notebooks (not committed) at every build.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath"]
NOTEBOOKS = ("rnn_tree", "bayesian_hme", "vart", "heteroscedastic_gp", "dgp", "treevi")
_here = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(_here, "notebooks"), exist_ok=True)
for _name in NOTEBOOKS:
    shutil.copyfile(
        os.path.join(_here, "..", "notebooks", f"{_name}.ipynb"),
        os.path.join(_here, "notebooks", f"{_name}.ipynb"),
    )

if os.environ.get("PYRO_TREES_DOCS_INTERSPHINX"):
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "pyro": ("https://docs.pyro.ai/en/stable", None),
        "gpytorch": ("https://docs.gpytorch.ai/en/stable", None),
        "numpy": ("https://numpy.org/doc/stable", None),
    }

# Each API page is an ``automodule`` of a subpackage with ``:members:``: its ``__all__``
# decides what is documented, including the names it re-exports from its submodules
# (hence ``imported-members``). ``members`` is not set here: a default ``True`` would
# override a page's explicit ``:members: a, b`` list (Sphinx 8.2).
autodoc_default_options = {
    "imported-members": True,
    "show-inheritance": True,
}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = True

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "alabaster"
html_theme_options = {"description": "Tree-structured models and guides for Pyro"}


def _skip_sklearn_request_methods(app, what, name, obj, skip, options):
    """scikit-learn generates ``set_fit_request``-style methods on every estimator; their
    docstrings link into scikit-learn's own glossary, which this build cannot resolve."""
    if name.startswith("set_") and name.endswith("_request"):
        return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _skip_sklearn_request_methods)
