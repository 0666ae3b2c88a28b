import math

import pytest

from pyro_trees.demos import bayesian_hme


@pytest.mark.slow
def test_demo_smoke(tmp_path):
    rows = bayesian_hme.run(tmp_path, smoke=True)
    assert (tmp_path / "bayesian_hme_toy.png").exists()
    assert (tmp_path / "bayesian_hme_robot_arm.png").exists()
    keys = {"model", "task", "metric", "paper", "ours", "seconds"}
    assert all(set(r) == keys and math.isfinite(r["ours"]) for r in rows)
