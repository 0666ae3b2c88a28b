"""Write ``benchmarks/results/README.md`` from the result files committed beside it.

Run from the repository root: ``python -m benchmarks.results_readme`` (``--check`` only
says whether the committed README is current). Nothing in the README is written by hand:
one section per benchmark script with a current result (``results/NAME.json``, ``NAME``
the script's name), in the order of :data:`ORDER`, each with what the script measures (its
docstring's first paragraph), the command that writes the file (the script with the
arguments the file records that differ from the parser's defaults today; options the
record lacks are named, since they did not exist when it ran), the date, machine, versions
and device of the run (the file's environment record), and the table the benchmark wrote
into its ``.md``. Then every variant of the benchmark (``results/variants/``, and any
other record of it in ``results/``), each with its command, date, machine, torch version
and device. ``tests/test_results_readme.py`` keeps the README equal to what this script
writes.

Standard library only: it reads the scripts' source and the result files, and imports
neither the scripts nor torch.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
import sys
from pathlib import Path

from benchmarks._common import RESULTS, VARIANTS, read_record

HERE = Path(__file__).resolve().parent

README = RESULTS / "README.md"


# section order; a script not listed comes after these, alphabetically
ORDER = (
    "hme_pulse",
    "hme_pulse_floor",
    "hme_table1",
    "hme_parity",
    "bhme_toy",
    "bhme_robot_arm",
    "bhme_kin8nm",
    "bhme_kin8nm_schedules",
    "vart_uci",
    "vart_calibration_rules",
    "vart_held_out_bias",
    "vart_causal",
    "vart_speed",
    "dgp_composition",
    "dgp_joint_warm",
    "dgp_uci",
    "hgp_noise",
    "treevi_synthetic",
    "treevi_graph",
    "treevi_clustering",
    "treevi_gmm_starts",
    "treevi_cost",
    "defaults",
    "missing",
    "pyro_path",
)
_NO_DEFAULT = object()


def scripts() -> dict[str, Path]:
    """Benchmark name -> the file holding its docstring and argument parser."""
    found = {p.stem: p for p in HERE.glob("*.py") if not p.stem.startswith("_")}
    found.pop("results_readme", None)
    for pkg in HERE.iterdir():
        if (pkg / "__main__.py").is_file() and (pkg / "__init__.py").is_file():
            found[pkg.name] = pkg / "__init__.py"
    rank = {n: i for i, n in enumerate(ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))


def _rst_to_md(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: "`" + m.group(1).split(".")[-1] + "`", text)
    return text.replace("``", "`")


def description(path: Path) -> str:
    """The first paragraph of the script's docstring, on one line, in markdown."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return _rst_to_md(" ".join(doc.split("\n\n")[0].split()))


def _options(path: Path) -> dict[str, dict]:
    """dest -> {"flag", "action", "default"} of the ``add_argument("--x", ...)`` calls in
    the source of ``path`` (and of ``__main__.py`` beside a package's ``__init__.py``)."""
    sources = [path] + ([path.with_name("__main__.py")] if path.name == "__init__.py" else [])
    out = {}
    for src in sources:
        tree = ast.parse(src.read_text())
        constants = {**_constants(ast.parse((HERE / "_common.py").read_text())), **_constants(tree)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                continue
            flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
            longs = [f for f in flags if isinstance(f, str) and f.startswith("--")]
            if not longs:
                continue
            kw = {k.arg: k.value for k in node.keywords}
            dest = kw["dest"].value if "dest" in kw else longs[0][2:].replace("-", "_")
            action = kw["action"] if "action" in kw else None
            if isinstance(action, ast.Constant):
                action = action.value
            elif isinstance(action, ast.Attribute):
                action = action.attr
            default = _evaluate(kw["default"], constants) if "default" in kw else None
            if action == "store_true" and "default" not in kw:
                default = False
            if action == "store_false" and "default" not in kw:
                default = True
            out[dest] = {"flag": longs[0], "action": action, "default": default}
    return out


def _constants(tree: ast.Module) -> dict:
    """The module's top-level ``NAME = <literal>`` assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    out[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


_BUILTINS = {"list": list, "map": map, "range": range, "sorted": sorted, "str": str, "tuple": tuple}


def _evaluate(node: ast.expr, constants: dict):
    """A default's value from its source (literals, the module's literal constants, a few
    builtins), or ``_NO_DEFAULT`` where that is not enough."""
    try:
        code = compile(ast.Expression(node), "<default>", "eval")
        return eval(code, {"__builtins__": _BUILTINS}, dict(constants))  # noqa: S307
    except Exception:  # noqa: BLE001 - anything else the source computes at run time
        return _NO_DEFAULT


def command(module: str, path: Path, stem: str, record: dict) -> str:
    """The command that writes result ``stem``: the script with every argument the record
    holds that differs from the parser's default (none recorded: the bare script)."""
    parts = ["python", "-m", f"benchmarks.{module}"]
    args = record.get("args")
    if not isinstance(args, dict):
        return " ".join(parts)
    options = _options(path)
    env, positional = [], []
    for key, value in args.items():
        opt = options.get(key)
        if opt is None and key.isupper():  # an environment variable the script reads
            env.append(f"{key}={shlex.quote(_text(value))}")
            continue
        if opt is None and isinstance(value, list):  # positional arguments
            default = _constants(ast.parse(path.read_text())).get("DEFAULT_" + key.upper())
            if default is None or list(default) != value:
                positional += [shlex.quote(_text(v)) for v in value]
            continue
        if opt is None or value is None:
            continue
        if isinstance(value, str) and value.endswith("results/" + stem):  # an output path
            if stem != module:
                parts += [opt["flag"], f"benchmarks/results/{stem}"]
            continue
        default = opt["default"]
        if default is not _NO_DEFAULT and _same(value, default):
            continue
        if opt["action"] in ("store_true", "store_false"):
            parts.append(opt["flag"])
        elif opt["action"] == "BooleanOptionalAction":
            parts.append(opt["flag"] if value else "--no-" + opt["flag"][2:])
        elif isinstance(value, list):
            parts += [opt["flag"], *(shlex.quote(_text(v)) for v in value)]
        else:
            parts += [opt["flag"], shlex.quote(_text(value))]
    return " ".join(env + parts + positional)


def newer_options(path: Path, record: dict) -> list[str]:
    """The script's options that a record with arguments lacks (added after it ran: their
    defaults today need not be what that run did)."""
    args = record.get("args")
    if not isinstance(args, dict):
        return []
    return [opt["flag"] for dest, opt in _options(path).items() if dest not in args]


def _command_text(module: str, path: Path, stem: str, record: dict) -> str:
    """The command in backticks, with what the record cannot tell about it."""
    text = f"`{command(module, path, stem, record)}`"
    if not isinstance(record.get("args"), dict):
        if stem != module:
            return "arguments not recorded (its .md states its settings)"
        if not _options(path) and "os.environ.get(" not in path.read_text():
            return text + " (the script takes no arguments)"
        return text + " (the file records no arguments: the defaults of its day)"
    if record.get("args_recovered"):  # written after the run: the rest at their defaults
        return text + f" (arguments recovered {record['args_recovered']})"
    newer = newer_options(path, record)
    if newer:
        text += " (options newer than the record: " + ", ".join(f"`{f}`" for f in newer) + ")"
    return text


def _same(value, default) -> bool:
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return len(value) == len(default) and all(map(_same, value, default))
    if isinstance(default, (int, float)) and isinstance(value, (int, float)):
        return float(value) == float(default)
    return value == default


def _text(v) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def environment_line(env: dict) -> str:
    date = env.get("date", "?").replace("T", " ").replace("+00:00", " UTC")
    return (
        f"{date} · {env.get('machine', '?')} · {env.get('cpu_count', '?')} CPUs "
        f"({env.get('torch_threads', '?')} torch threads) · torch {env.get('torch', '?')} · "
        f"pyro {env.get('pyro', '?')} · device {env.get('device', '?')}"
    )


def body(md_path: Path) -> str:
    """The ``.md`` a benchmark wrote, less its title and environment line, headings moved
    two levels down so that they sit inside the section."""
    text = md_path.read_text()
    lines = text.split("\n")
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
        while lines and not lines[0].strip():
            lines = lines[1:]
        if lines and " · device " in lines[0]:  # write_results' environment line
            lines = lines[1:]
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,4} ", line):
            line = "##" + line
        out.append(line)
    return "\n".join(out).strip() + "\n"


def owner(stem: str, record: dict, names) -> str | None:
    """The benchmark that wrote result ``stem``: the script its record names, else the
    one whose name is the longest prefix of ``stem``."""
    if record.get("script") in names:
        return record["script"]
    hits = [n for n in names if stem == n or stem.startswith(n + "_")]
    return max(hits, key=len) if hits else None


def records() -> dict[str, Path]:
    """Relative path (to ``results/``) without extension -> record file, for every result
    in ``results/`` and ``results/variants/``."""
    found = {}
    for folder in (RESULTS, VARIANTS):
        for p in sorted(folder.glob("*.json*")):
            if p.name.endswith((".json", ".json.gz")):
                rel = p.relative_to(RESULTS).as_posix()
                found[rel.removesuffix(".gz").removesuffix(".json")] = p
    return found


def _variant_line(module: str, path: Path, rel: str, record_file: Path, record: dict) -> str:
    stem = rel.split("/")[-1]
    env = record.get("environment", {})
    data = record_file.relative_to(RESULTS).as_posix()
    return (
        f"* [{stem}]({rel}.md) ([record]({data})): "
        f"{_command_text(module, path, stem, record)}; ran {environment_line(env)}"
    )


def generate() -> str:
    table = scripts()
    found = records()
    loaded = {rel: read_record(p) for rel, p in found.items()}
    by_owner: dict[str, list[str]] = {}
    for rel, rec in loaded.items():
        by_owner.setdefault(owner(rel.split("/")[-1], rec, table), []).append(rel)
    figures: dict[str, list[str]] = {}
    for folder in (RESULTS, VARIANTS):
        for png in sorted(folder.glob("*.png")):
            rel = png.relative_to(RESULTS).as_posix()
            rec_rel = rel.removesuffix(".png")
            name = owner(png.stem, loaded.get(rec_rel, {}), table)
            figures.setdefault(name, []).append(rel)

    index, sections = [], []
    for name, path in table.items():
        if name not in loaded:
            continue  # no current result yet
        record = loaded[name]
        env = record.get("environment", {})
        what = description(path)
        others = [r for r in by_owner.get(name, []) if r != name]
        index.append(
            f"| [{name}](#{name}) | {what} | {env.get('date', '?')[:10]} "
            f"| {env.get('device', '?')} | {len(others)} |"
        )
        sec = [f"## {name}", "", what, ""]
        sec.append(f"* Command: {_command_text(name, path, name, record)}")
        sec.append(f"* Ran: {environment_line(env)}")
        files = [f"[{name}.md]({name}.md)", f"[{found[name].name}]({found[name].name})"]
        sec += [f"* Files: {', '.join(files)}", "", body(RESULTS / f"{name}.md")]
        if others:
            sec += ["Variants (other arguments; the guide pages cite them):", ""]
            sec += [_variant_line(name, path, r, found[r], loaded[r]) for r in others]
            sec.append("")
        shown = (RESULTS / f"{name}.md").read_text()  # the one body the README embeds
        unlinked = [f for f in figures.get(name, []) if f"]({f})" not in shown]
        if unlinked:
            sec += ["Figures: " + ", ".join(f"[{f.split('/')[-1]}]({f})" for f in unlinked), ""]
        sections.append("\n".join(sec))

    head = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.results_readme` from the result files in this "
        "folder; do not edit it by hand (`tests/test_results_readme.py` fails when it is "
        "out of date). One section per benchmark script with its current result: what it "
        "measures (the script's docstring), the command that wrote the file, where it ran, "
        "and the table the benchmark wrote, with the paper's figure and the peers beside "
        "ours where the benchmark has them; then the benchmark's variants kept in "
        "`variants/` (runs with other arguments that a guide page or the README cites), "
        "each with its command, date, machine, torch version and device. Each benchmark "
        "writes `NAME.json` (the full record: its environment and arguments) and `NAME.md`, "
        "a variant under `variants/`; older runs are in git history.",
        "",
        "| benchmark | what it measures | date | device | variants |",
        "|---|---|---|---|---|",
        *index,
        "",
    ]
    return "\n".join(head) + "\n" + "\n".join(sections).rstrip("\n") + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is not current")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        current = README.is_file() and README.read_text() == text
        print("README.md is current" if current else "README.md is out of date")
        return 0 if current else 1
    README.write_text(text)
    print(f"wrote {README} ({len(text)} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
