"""``make demo``'s entry point runs every demo in smoke mode and prints the table."""

import pytest

from pyro_trees.demo import main


@pytest.mark.slow
def test_demo_smoke(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "paper" in out and "ours" in out
    assert (tmp_path / "hme" / "hme_pulse_rules.txt").exists()
