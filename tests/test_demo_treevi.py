import math

from pyro_trees.demos import treevi


def test_treevi_demo_smoke(tmp_path):
    rows = treevi.run(tmp_path, smoke=True)
    assert [r["model"] for r in rows] == ["mean-field", "TreeVI (T2)", "MTreeVI (T1, T2)"]
    for r in rows:
        assert set(r) == {"model", "task", "metric", "paper", "ours", "seconds"}
        assert math.isfinite(r["ours"]) and r["paper"] is not None
    assert (tmp_path / "treevi_elbo.png").exists()
