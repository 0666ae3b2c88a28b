"""Every public class shows how it is used, and the example runs.

Each class named in a public subpackage's ``__all__`` has an ``.. rubric:: Examples``
section with doctest lines (``>>>``), and every doctest in a public module passes
(``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` on; Pyro's seed and param store reset first).
Examples are small and quick: they say what a thing is for, not how well it does.
"""

import doctest
import importlib
import inspect
import pkgutil

import pyro
import pytest
import torch

import pyro_trees

SUBPACKAGES = [
    "distributions",
    "models",
    "guides",
    "infer",
    "estimators",
    "datasets",
    "topology",
    "trees",
    "gp",
    "validation",
    "plotting",
]


def _public_classes():
    seen = {}
    for sub in SUBPACKAGES:
        module = importlib.import_module(f"pyro_trees.{sub}")
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.isclass(obj) and obj.__module__.startswith("pyro_trees"):
                seen.setdefault(f"{obj.__module__}.{obj.__qualname__}", obj)
    return dict(sorted(seen.items()))


def _public_modules():
    names = []
    for info in pkgutil.walk_packages(pyro_trees.__path__, "pyro_trees."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


CLASSES = _public_classes()


@pytest.mark.parametrize("qualname", list(CLASSES))
def test_public_class_has_an_example(qualname):
    doc = inspect.getdoc(CLASSES[qualname]) or ""
    assert ".. rubric:: Examples" in doc and ">>>" in doc, f"{qualname} has no Examples"


@pytest.mark.parametrize("module_name", _public_modules())
def test_examples_run(module_name, monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    tests = [t for t in finder.find(module, module_name) if t.examples]
    # Only doctests defined in this module (not re-exported ones, run with their own).
    tests = [t for t in tests if t.name.startswith(module_name)]
    for test in tests:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        with torch.random.fork_rng():
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
