"""What every notebook builder shares.

Each teaching notebook has one source: its builder ``notebooks/make_<name>.py``, which
defines a module-level list ``cells`` and ends with ``if __name__ == "__main__": save(...)``.
``python notebooks/make_<name>.py`` writes ``<name>.ipynb`` without outputs;
``python notebooks/build.py <name>`` (``make notebooks`` for all) writes it and executes it
in full mode, so the committed notebook carries the outputs of its own source.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

__all__ = ["code", "md", "notebook", "save"]

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def md(source: str) -> nbformat.NotebookNode:
    """A markdown cell."""
    return nbformat.v4.new_markdown_cell(source.strip("\n"))


def code(source: str) -> nbformat.NotebookNode:
    """A code cell."""
    return nbformat.v4.new_code_cell(source.strip("\n"))


def notebook(cells) -> nbformat.NotebookNode:
    """A notebook of ``cells`` with the project's kernelspec and cell ids that depend only
    on the cell's position (so rebuilding a notebook changes no id)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.from_dict(dict(c)) for c in cells])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
    return nb


def save(builder: str, cells) -> Path:
    """Write the notebook of builder file ``builder`` (``make_<name>.py``) next to it, with
    no outputs; returns its path."""
    path = Path(builder).resolve()
    out = path.with_name(path.stem.removeprefix("make_") + ".ipynb")
    nbformat.write(notebook(cells), out)
    return out
