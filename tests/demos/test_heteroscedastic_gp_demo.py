import math

from pyro_trees.demos import heteroscedastic_gp


def test_heteroscedastic_gp_demo_smoke(tmp_path):
    rows = heteroscedastic_gp.run(tmp_path, smoke=True)
    assert (tmp_path / "heteroscedastic_gp.png").exists()
    assert "log sigma" in (tmp_path / "heteroscedastic_gp_rules.txt").read_text()
    assert len(rows) == 1
    for r in rows:
        assert set(r) == {"model", "task", "metric", "paper", "ours", "seconds"}
        assert math.isfinite(r["ours"]) and r["ours"] >= 0
