"""Reading committed result records (standard library only, so that
``benchmarks.results_readme`` can use it without importing torch)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def read_record(path) -> dict:
    """A result record, ``NAME.json`` or gzipped ``NAME.json.gz`` (the large per-row
    records are kept compressed)."""
    path = Path(path)
    if path.suffix == ".gz":
        return json.loads(gzip.decompress(path.read_bytes()))
    return json.loads(path.read_text())


def record_paths(pattern: str) -> list[Path]:
    """The result records matching ``pattern`` (a glob ending in ``.json``), plain or
    gzipped, sorted by name."""
    found = [*RESULTS.glob(pattern), *RESULTS.glob(pattern + ".gz")]
    return sorted(found, key=lambda p: p.name)
