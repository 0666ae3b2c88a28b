"""One name per idea: every public signature of ``pyro_trees`` against the vocabulary table
of ``docs/guide/estimators.rst`` (its ``csv-table:: Vocabulary``).

Checked: a parameter name that two public callables share is a row of the table; every
parameter of an estimator's constructor and public methods is a row; a retired name
appears in no public signature; every row is still used. A name that one callable alone
uses cannot drift and is documented by that callable's docstring."""

import collections
import csv
import importlib
import inspect
import io
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "estimators.rst"
SUBPACKAGES = [
    "pyro_trees",
    "pyro_trees.models",
    "pyro_trees.guides",
    "pyro_trees.infer",
    "pyro_trees.estimators",
    "pyro_trees.distributions",
    "pyro_trees.datasets",
    "pyro_trees.plotting",
    "pyro_trees.trees",
    "pyro_trees.topology",
    "pyro_trees.validation",
    "pyro_trees.gp",
]
SKIP = {"self", "cls", "args", "kwargs"}


def _table():
    text = PAGE.read_text()
    start = text.index(".. csv-table:: Vocabulary")
    lines = text[start:].splitlines()[1:]
    rows = []
    for line in lines:
        if line.strip().startswith(":") or not line.strip():
            if rows and not line.strip():
                break
            continue
        if not line.startswith("   "):
            break
        rows.append(line.strip())
    table = {}
    for name, meaning, retired in csv.reader(io.StringIO("\n".join(rows)), skipinitialspace=True):
        assert name not in table, f"{name} has two rows"
        table[name] = (meaning, [r.strip() for r in retired.split(",") if r.strip()])
    return table


def _public_signatures():
    """``{parameter name: {callable's qualified name}}`` and the estimators' names."""
    uses, estimator_names, seen = collections.defaultdict(set), set(), set()
    for modname in SUBPACKAGES:
        module = importlib.import_module(modname)
        names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
        for n in names:
            obj = getattr(module, n, None)
            if obj is None or id(obj) in seen or inspect.ismodule(obj):
                continue
            seen.add(id(obj))
            if not (getattr(obj, "__module__", "") or "").startswith("pyro_trees"):
                continue
            if inspect.isclass(obj):
                members = [("__init__", obj.__init__)]
                members += [
                    (k, v)
                    for k, v in vars(obj).items()
                    if not k.startswith("_")
                    and (callable(v) or isinstance(v, classmethod | staticmethod))
                ]
                targets = [(f"{n}.{k}", getattr(v, "__func__", v)) for k, v in members]
                is_estimator = obj.__module__.startswith("pyro_trees.estimators")
            elif callable(obj):
                targets, is_estimator = [(n, obj)], False
            else:
                continue
            for qual, fn in targets:
                try:
                    params = inspect.signature(fn).parameters
                except (TypeError, ValueError):
                    continue
                for p in params:
                    if p in SKIP:
                        continue
                    uses[p].add(qual)
                    if is_estimator:
                        estimator_names.add(p)
    return uses, estimator_names


TABLE = _table()
USES, ESTIMATOR_NAMES = _public_signatures()


def test_the_table_parses():
    assert len(TABLE) > 100
    assert all(meaning for meaning, _ in TABLE.values())


def test_shared_names_are_in_the_table():
    shared = {p for p, where in USES.items() if len(where) >= 2}
    missing = sorted(shared - set(TABLE))
    assert not missing, {p: sorted(USES[p]) for p in missing}


def test_every_estimator_parameter_is_in_the_table():
    missing = sorted(ESTIMATOR_NAMES - set(TABLE))
    assert not missing, {p: sorted(USES[p]) for p in missing}


def test_retired_names_are_gone():
    retired = {r: name for name, (_, rs) in TABLE.items() for r in rs}
    found = {r: sorted(USES[r]) for r in retired if r in USES}
    assert not found, found


def test_every_row_is_used():
    unused = sorted(set(TABLE) - set(USES))
    assert not unused


@pytest.mark.parametrize("retired", ["lam", "n_fits", "n_trees", "n_iter", "calibrate_noise"])
def test_the_check_sees_a_retired_name(retired):
    """The table lists the renames this check guards."""
    assert any(retired in rs for _, rs in TABLE.values())
