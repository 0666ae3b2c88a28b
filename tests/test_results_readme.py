"""``benchmarks/results/README.md`` is generated: it equals what its generator writes, and
every file it links is in the folder."""

import re

import pytest

results_readme = pytest.importorskip(
    "benchmarks.results_readme", reason="the benchmarks folder is not importable here"
)


def test_committed_readme_is_generated():
    if not results_readme.README.is_file():
        pytest.fail("benchmarks/results/README.md is missing: python -m benchmarks.results_readme")
    assert results_readme.README.read_text() == results_readme.generate(), (
        "benchmarks/results/README.md is out of date: run python -m benchmarks.results_readme"
    )


def test_every_link_resolves():
    text = results_readme.generate()
    links = set(re.findall(r"\]\(([^)#]+)\)", text))
    assert links, "the README links no result file"
    missing = sorted(f for f in links if not (results_readme.RESULTS / f).is_file())
    assert not missing


def test_command_keeps_only_arguments_off_the_default():
    scripts = results_readme.scripts()
    record = {"args": {"datasets": "autompg", "splits": "0", "lr": 0.03, "name": "vart_uci_x"}}
    cmd = results_readme.command("vart_uci", scripts["vart_uci"], "vart_uci_x", record)
    assert cmd.startswith("python -m benchmarks.vart_uci --datasets autompg --splits 0")
    assert "--lr" not in cmd  # 0.03 is the parser's default
    assert cmd.endswith("--name vart_uci_x")
    assert results_readme.command("dgp_uci", scripts["dgp_uci"], "dgp_uci_concrete", {}) == (
        "python -m benchmarks.dgp_uci"
    )
