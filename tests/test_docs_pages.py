"""The Sphinx pages render every public module's narrative docstring and every notebook."""

import importlib
import pkgutil
import re
from pathlib import Path

import pyro_trees

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _public_modules():
    for info in pkgutil.walk_packages(pyro_trees.__path__, "pyro_trees."):
        parts = info.name.split(".")[1:]
        if any(p.startswith("_") for p in parts) or parts[0] in ("demo", "demos"):
            continue
        yield info.name


def test_every_public_module_docstring_is_rendered():
    rendered = set()
    for page in (DOCS / "api").glob("*.rst"):
        rendered |= set(re.findall(r"automodule:: (\S+)", page.read_text()))
    missing = [
        name
        for name in _public_modules()
        if name not in rendered and importlib.import_module(name).__doc__
    ]
    assert not missing, f"add these to a docs/api page's 'Module notes': {missing}"


def test_every_notebook_is_in_the_docs():
    notebooks = sorted(p.stem for p in (DOCS.parent / "notebooks").glob("*.ipynb"))
    toc = (DOCS / "notebooks.rst").read_text()
    conf = (DOCS / "conf.py").read_text()
    for name in notebooks:
        assert f"notebooks/{name}\n" in toc, name
        assert f'"{name}"' in conf, name
