"""``make demo``'s entry point runs every demo in smoke mode and prints the table."""

import pytest

from pyro_trees.demo import main


@pytest.mark.slow
def test_demo_smoke(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "paper" in out and "ours" in out
    assert (tmp_path / "hme" / "hme_pulse_rules.txt").exists()


def test_usage_names_the_module_and_the_valid_demos(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m pyro_trees.demo ")
    assert "hme, treevi, vart" in " ".join(out.split())
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
