"""A new user's install, end to end: the wheel into a fresh virtual environment.

Builds the sdist and the wheel (:func:`tests.test_packaging.build_dists`), creates a
virtual environment without the repository on its path, installs the wheel there with
torch pinned by ``constraints.txt`` (an unpinned torch pulls the CUDA build), and from a
folder outside the repository: imports every public module, runs the README's Python
examples as printed (each fits a model or an estimator) and the demo's smoke mode of one
system; then runs tests from the unpacked sdist with that environment's Python, and
uninstalls, leaving no file of the package behind.

It takes about two minutes and needs the package index, so it runs only when asked:
``PYRO_TREES_INSTALL_TEST=1`` (``make install-test``; CI runs it after ``make test``).
"""

import os
import re
import subprocess
import sys
import tarfile

import pytest

from tests.test_packaging import ROOT, build_dists

pytestmark = [
    pytest.mark.install,
    pytest.mark.skipif(
        os.environ.get("PYRO_TREES_INSTALL_TEST") != "1",
        reason="the install test runs with PYRO_TREES_INSTALL_TEST=1 (make install-test)",
    ),
]

#: the sdist's tests run against the fresh environment (quick ones, no optional package)
SDIST_TESTS = ["tests/test_trees.py", "tests/test_topology.py", "tests/plotting/test_tree.py"]

IMPORT_ALL = """
import importlib, pkgutil, sys
import pyro_trees
assert pyro_trees.__file__.startswith(sys.prefix), pyro_trees.__file__
names = [m.name for m in pkgutil.walk_packages(pyro_trees.__path__, "pyro_trees.")
         if not any(p.startswith("_") for p in m.name.split("."))]
for name in names:
    importlib.import_module(name)
from importlib import metadata, resources
assert metadata.version("pyro-trees") == pyro_trees.__version__
assert resources.files("pyro_trees.datasets").joinpath("registry.csv").is_file()
assert resources.files("pyro_trees").joinpath("py.typed").is_file()
print(len(names), "public modules")
"""


def _run(cmd, cwd, env, timeout=600):
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_a_new_user_installs_runs_and_uninstalls(tmp_path):
    wheel, sdist = build_dists(tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    work = tmp_path / "work"  # outside the repository
    work.mkdir()
    pin = ["-c", str(ROOT / "constraints.txt")]
    _run([python, "-m", "pip", "install", "-q", *pin, str(wheel), "pytest"], work, env)

    assert "public modules" in _run([python, "-c", IMPORT_ALL], work, env)
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == 3
    for k, code in enumerate(blocks, 1):  # as printed: the full step counts
        (work / f"readme_{k}.py").write_text(code)
        assert _run([python, f"readme_{k}.py"], work, env).strip(), f"example {k} prints nothing"
    demo = [python, "-m", "pyro_trees.demo", "--smoke", "--only", "vart", "--out", "demo"]
    assert "VaRT" in _run(demo, work, env)

    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "sdist", filter="data")
    (unpacked,) = (tmp_path / "sdist").iterdir()
    tests = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SDIST_TESTS]
    assert " passed" in _run(tests, unpacked, env)

    _run([python, "-m", "pip", "uninstall", "-y", "-q", "pyro-trees"], work, env)
    (site,) = venv.glob("lib/python*/site-packages")
    assert not list(site.glob("pyro_trees*")), "the uninstall left files behind"
