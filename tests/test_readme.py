"""The README's Python examples run as printed (with fewer SVI steps)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_its_three_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    code = re.sub(r"for step in range\(\d+\):", "for step in range(5):", BLOCKS[index])
    namespace = {"__name__": "readme_example"}
    exec(compile(code, f"README.md example {index + 1}", "exec"), namespace)
