from pyro_trees.demos import vart


def test_vart_demo_smoke(tmp_path):
    rows = vart.run(tmp_path, smoke=True)
    assert (tmp_path / "vart_causal_toy.png").exists()
    assert {r["model"] for r in rows} == {"VaRT"}
    for r in rows:
        assert set(r) == {"model", "task", "metric", "paper", "ours", "seconds"}
        assert r["ours"] == r["ours"]  # finite, not NaN
