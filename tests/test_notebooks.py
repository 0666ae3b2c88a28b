"""The teaching notebooks: each is built from its one source, ``notebooks/make_<name>.py``;
the committed ``<name>.ipynb`` carries that source's full-mode outputs (``make notebooks``),
and every notebook runs top to bottom in smoke mode (``PYRO_TREES_SMOKE=1``)."""

import importlib.util
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

HERE = Path(__file__).resolve().parents[1] / "notebooks"
BUILDERS = sorted(HERE.glob("make_*.py"))
NAMES = [p.stem.removeprefix("make_") for p in BUILDERS]
MAX_SECONDS = 180  # the lecture budget: a class runs a notebook in at most 3 minutes


def _build():
    spec = importlib.util.spec_from_file_location("_notebooks_build", HERE / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(HERE))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(HERE))
    return module


build = _build()


def test_every_notebook_has_a_builder():
    assert sorted(p.stem for p in HERE.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_is_its_builders_full_run(name):
    committed = nbformat.read(HERE / f"{name}.ipynb", as_version=4)
    source = build.notebook(build.load_cells(HERE / f"make_{name}.py"))
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in source.cells
    ], f"notebooks/{name}.ipynb is stale: run `python notebooks/build.py {name}`"
    meta = committed.metadata.get("pyro_trees", {})
    assert "seconds" in meta, f"{name}.ipynb was not executed by notebooks/build.py"
    assert meta["seconds"] <= MAX_SECONDS
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "a code cell never ran"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure is committed"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_in_smoke_mode(name):
    build.build(name, smoke=True)
