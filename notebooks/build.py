"""Rebuild and execute the teaching notebooks from their builders.

``python notebooks/build.py``            every notebook, full mode, outputs written in place
``python notebooks/build.py vart dgp``   only these
``python notebooks/build.py --smoke``    smoke mode (``PYRO_TREES_SMOKE=1``), outputs discarded

Each notebook is generated from ``notebooks/make_<name>.py``, executed top to bottom in a
fresh kernel in a scratch directory, and (full mode) written back with its outputs and the
seconds it took in ``metadata["pyro_trees"]``. A notebook that raises, or that runs longer
than ``--max-seconds`` (default 180, the lecture budget), fails the build and is not written.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _nb import notebook  # noqa: E402

MAX_SECONDS = 180.0


class NotebookError(RuntimeError):
    """A notebook raised, or ran over its time budget."""


def builders() -> dict[str, Path]:
    """``name -> builder path`` for every ``make_<name>.py`` here."""
    return {p.stem.removeprefix("make_"): p for p in sorted(HERE.glob("make_*.py"))}


def load_cells(path: Path) -> list:
    """The ``cells`` list a builder defines (the builder is imported, not run as main)."""
    spec = importlib.util.spec_from_file_location(f"_nb_builder_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cells


def execute(nb, *, smoke: bool, timeout: int = 900) -> float:
    """Run ``nb`` in place in a fresh kernel; returns the wall-clock seconds."""
    # tqdm.auto warns in a kernel without ipywidgets; the bars still print as text
    env = dict(
        os.environ,
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        PYTHONWARNINGS="ignore:IProgress not found",
    )
    env.pop("PYRO_TREES_SMOKE", None)
    if smoke:
        env["PYRO_TREES_SMOKE"] = "1"
    with tempfile.TemporaryDirectory() as scratch:
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": scratch}}
        )
        start = time.perf_counter()
        client.execute(env=env)
        return time.perf_counter() - start


def _clean(nb) -> None:
    """Drop what changes from run to run without meaning anything (execution timestamps)."""
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)


def build(name: str, *, smoke: bool = False, max_seconds: float = MAX_SECONDS) -> float:
    nb = notebook(load_cells(builders()[name]))
    try:
        seconds = execute(nb, smoke=smoke)
    except nbclient.exceptions.CellExecutionError as err:
        raise NotebookError(f"{name}: a cell raised\n{err}") from None
    if smoke:
        return seconds
    if seconds > max_seconds:
        raise NotebookError(f"{name}: {seconds:.0f} s in full mode, over the {max_seconds:.0f} s budget")
    _clean(nb)
    import torch

    nb.metadata["pyro_trees"] = {
        "seconds": round(seconds, 1),
        "executed": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
    }
    nbformat.write(nb, HERE / f"{name}.ipynb")
    return seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    parser.add_argument("--smoke", action="store_true", help="smoke mode; nothing is written")
    parser.add_argument("--max-seconds", type=float, default=MAX_SECONDS)
    args = parser.parse_args(argv)
    names = args.names or list(builders())
    unknown = sorted(set(names) - set(builders()))
    if unknown:
        parser.error(f"no builder for {unknown}; have {sorted(builders())}")
    for name in names:
        try:
            seconds = build(name, smoke=args.smoke, max_seconds=args.max_seconds)
        except NotebookError as err:
            raise SystemExit(str(err)) from None
        print(f"{name}: {seconds:.1f} s ({'smoke' if args.smoke else 'full, written'})", flush=True)


if __name__ == "__main__":
    main()
