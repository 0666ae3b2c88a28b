"""The wheel and the sdist build, and hold what a user and a packager need.

The sdist and the wheel (built from the sdist, as ``python -m build`` does) are built
once, without build isolation (the ``build`` and ``setuptools`` of the test extra): the
wheel holds every file of the package and metadata whose links work away from the
repository; the sdist holds the tests, the docs, the notebooks and the set-up files, so
that its tests run. ``tests/test_install.py`` installs them into a fresh environment.
"""

import configparser
import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import pyro_trees

ROOT = Path(__file__).resolve().parents[1]
CONFIG = configparser.ConfigParser()
CONFIG.read(ROOT / "setup.cfg")


def _setup_module():
    """setup.py as a module (its ``setup()`` runs only as ``__main__``)."""
    spec = importlib.util.spec_from_file_location("pyro_trees_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_dists(out: Path) -> tuple[Path, Path]:
    """Build the sdist, then the wheel from it, into ``out``: ``(wheel, sdist)``."""
    pytest.importorskip("build", reason="building needs the build package (the test extra)")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warnings = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if "warning" in line.lower() and "byte-compiling is disabled" not in line
    ]
    assert not warnings, "the build warns:\n" + "\n".join(warnings)
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    return build_dists(tmp_path_factory.mktemp("dist"))


def _package_files() -> set[str]:
    """The files a wheel must hold: every module and data file of the package."""
    files = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "pyro_trees").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    return {f for f in files if not f.endswith((".pyc", ".pyo"))}


def test_the_version_has_one_source():
    assert CONFIG["metadata"]["version"] == "attr: pyro_trees.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", pyro_trees.__version__)
    assert pyro_trees.__version__ not in (ROOT / "setup.cfg").read_text()


def test_readme_links_become_absolute_against_the_source_url():
    setup = _setup_module()
    base = setup.source_url()
    text = "[a](docs/guide/vart.rst) [b](notebooks/) [c](x.md#part) [d](https://pyro.ai) [e](#top)"
    assert setup.absolute_links(text, base) == (
        f"[a]({base}/blob/main/docs/guide/vart.rst) [b]({base}/tree/main/notebooks/) "
        f"[c]({base}/blob/main/x.md#part) [d](https://pyro.ai) [e](#top)"
    )
    urls = dict(
        (k.strip(), v.strip())
        for k, _, v in (
            line.partition("=") for line in CONFIG["metadata"]["project_urls"].splitlines()
        )
        if k.strip()
    )
    assert set(urls) == {"Source", "Documentation", "Issues"}
    assert all(u.startswith(base) for u in urls.values())


def test_the_license_and_the_python_versions_are_declared():
    meta = CONFIG["metadata"]
    assert meta["license"] == "MIT" and "MIT License" in (ROOT / "LICENSE").read_text()
    classifiers = meta["classifiers"].split("\n")
    tested = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"Programming Language :: Python :: {tested}" in classifiers
    low = CONFIG["options"]["python_requires"].removeprefix(">=")
    claimed = [c.rsplit(" ", 1)[1] for c in classifiers if re.search(r"Python :: 3\.\d+$", c)]
    assert min(claimed, key=lambda v: tuple(map(int, v.split(".")))) == low


def test_the_wheel_holds_every_package_file(dists):
    wheel, _ = dists
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = _package_files() - names
    assert not missing, f"the wheel lacks {sorted(missing)}"
    assert "pyro_trees/datasets/registry.csv" in names and "pyro_trees/py.typed" in names
    assert not [n for n in names if not n.startswith(("pyro_trees/", "pyro_trees-"))]


def test_the_wheel_metadata(dists):
    wheel, _ = dists
    with zipfile.ZipFile(wheel) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(info).decode())
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    assert meta["Version"] == pyro_trees.__version__
    assert meta["Requires-Python"] == ">=3.11" and meta["Author"]
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} == {
        "Source",
        "Documentation",
        "Issues",
    }
    description = meta.get_payload()
    assert "make demo" in description
    targets = re.findall(r"\]\(([^)\s]+)\)", description)
    relative = [t for t in targets if not re.match(r"^(https?:|mailto:|#)", t)]
    assert targets and not relative, f"relative links in the long description: {relative}"


def test_the_sdist_holds_what_its_tests_and_docs_need(dists):
    _, sdist = dists
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = {"LICENSE", "README.md", "Makefile", "constraints.txt", "setup.cfg", "setup.py"}
    needed |= {"pyproject.toml", "tests/conftest.py", "docs/conf.py", "examples/svi_lightning.py"}
    found = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").rglob("*.rst")]
    found += [*(ROOT / "notebooks").glob("*.py"), *(ROOT / "notebooks").glob("*.ipynb")]
    needed |= {
        p.relative_to(ROOT).as_posix()
        for p in found
        if "__pycache__" not in p.parts and "_build" not in p.parts
    }
    missing = needed - names
    assert not missing, f"the sdist lacks {sorted(missing)}"
    assert _package_files() <= names
