"""The deep-GP demo hook runs in smoke mode and returns well-formed rows."""

import math

from pyro_trees.demos import dgp


def test_demo_smoke(tmp_path):
    rows = dgp.run(tmp_path, smoke=True)
    assert len(rows) == 4
    for row in rows:
        assert set(row) == {"model", "task", "metric", "paper", "ours", "seconds"}
        assert math.isfinite(row["ours"])
    assert (tmp_path / "dgp_layers.png").exists()
