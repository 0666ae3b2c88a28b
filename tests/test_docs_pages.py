"""The Sphinx pages render every public module's narrative docstring and every notebook."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

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


def test_the_pictures_of_the_estimators_guide_run(monkeypatch, tmp_path):
    """The user guide's plotting example runs as printed (with 10 training steps)."""
    import textwrap

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "guide" / "estimators.rst").read_text()
    section = text.split("Pictures of what was learnt\n")[1]
    block = re.search(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", section).group(1)
    fewer = ("random_state=0).fit", "random_state=0, num_steps=10).fit")
    code = textwrap.dedent(block).replace(*fewer)
    import matplotlib.pyplot as plt

    plt.close("all")  # figures other tests left open
    namespace = {"__name__": "guide_example"}
    exec(compile(code, "estimators.rst, pictures", "exec"), namespace)
    assert len(plt.get_fignums()) == 3  # the tree, the partial dependence, the importances
    plt.close("all")


def _expand(pattern: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd``; ``{a,...,f}`` (a range written out) -> ``*``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    options = ["*"] if "..." in m.group(1) else m.group(1).split(",")
    return [q for o in options for q in _expand(pattern[: m.start()] + o + pattern[m.end() :])]


def _cited_results(text: str) -> set[str]:
    """Result files cited in backticks: ``benchmarks/results/X``, ``variants/X`` or a bare
    ``NAME.md`` / ``NAME.json`` / ``NAME.png`` that names a benchmark's result."""
    found = set()
    for token in re.findall(r"`+([^`\s]+)`+", text):
        token = token.rstrip(".,;:")
        if "benchmarks/results/" in token:
            found.add(token.split("benchmarks/results/", 1)[1])
        elif token.startswith("variants/"):
            found.add(token)
        elif re.fullmatch(r"[a-z][a-z0-9_\-*{},.]*\.(md|json|png)", token):
            found.add(token)
    return found - {"", "NAME.{json,md}", "NAME.json", "NAME.md"}


ROOT = DOCS.parent
PAGES = ["README.md"] + [
    p.relative_to(ROOT).as_posix()
    for p in sorted(DOCS.glob("guide/*.rst")) + sorted(ROOT.glob("notebooks/make_*.py"))
]


@pytest.mark.parametrize("page", PAGES)
def test_cited_results_exist(page):
    root = ROOT
    results = root / "benchmarks" / "results"
    missing = []
    for cited in sorted(_cited_results((root / page).read_text())):
        if cited.endswith("/"):  # a folder
            if not (results / cited).is_dir():
                missing.append(cited)
            continue
        for pattern in _expand(cited):
            glob = pattern if re.search(r"\.(md|json|png)$", pattern) else pattern + ".*"
            if not list(results.glob(glob)):
                missing.append(pattern)
    assert not missing, f"{page} cites result files not in benchmarks/results/: {missing}"
