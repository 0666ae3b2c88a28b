"""examples/svi_lightning.py: a user's Pyro model with a pyro_trees guide trains under
PyTorch Lightning (skipped without Lightning, an optional extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parents[1]


def test_svi_lightning_example_learns_the_function():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "svi_lightning.py"), "--epochs", "5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rmse = float(re.search(r"RMSE of the fitted function: ([0-9.]+)", out.stdout).group(1))
    assert rmse < 0.8  # the function's standard deviation is 1.1: it learnt something
