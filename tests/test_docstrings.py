"""Every public docstring is valid reST, as Sphinx's autodoc would read it.

For each public module (no component starting with ``_``), its docstring and every name
in its ``__all__`` are checked; for each public class, also every public method and
property it defines. A docstring is taken as autodoc takes it (``inspect.getdoc``:
dedented, inherited from the parent where the override has none) and parsed by docutils
inside a directive body, where Sphinx puts it, so a section title is an error there as it
is in the built docs. Sphinx's roles (``:math:``, ``:class:``, ...) and directives
(``.. seealso::``, ...) are registered as inert stand-ins. Any message of level >= 2
(warning) fails the test, as does a public callable without a docstring.
"""

import importlib
import inspect
import io
import pathlib
import pkgutil
import re
import types

import pytest
import torch

pytest.importorskip("docutils", reason="the reST check needs docutils (the test extra)")
from docutils import nodes, utils  # noqa: E402
from docutils.core import publish_doctree  # noqa: E402
from docutils.parsers.rst import Directive, directives, roles  # noqa: E402

import pyro_trees

# Sphinx roles that the docstrings may use; anything else is an unknown role (an error),
# as it would be in the built docs.
SPHINX_ROLES = (
    "any attr class const data doc exc func meth mod obj ref term cite numref eq "
    "py:attr py:class py:const py:data py:exc py:func py:meth py:mod py:obj"
).split()


FIELD_IN_TEXT = re.compile(
    r"(?<![\w`]):(param|type|returns?|rtype|raises?|ivar|var|cvar|keyword|kwarg|key)"
    r"( [^:`\n]*)?:(?=\s|$)"
)


NAMED_FIELD = re.compile(
    r"^(param|parameter|arg|argument|key|keyword|kwarg|kwparam|ivar|var|cvar)\s+(.+)$"
)


def _inert_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    return [nodes.literal(rawtext, utils.unescape(text))], []


class _InertDirective(Directive):
    """A Sphinx directive stand-in: takes any arguments, options and body."""

    required_arguments = 0
    optional_arguments = 10
    final_argument_whitespace = True
    has_content = True
    option_spec = None  # accept (and ignore) any option

    def run(self):
        node = nodes.container()
        if self.content:
            self.state.nested_parse(self.content, self.content_offset, node)
        return [node]


class _UnparsedDirective(_InertDirective):
    """A literal-body stand-in (``code-block``, ``doctest``): the body is not reST."""

    def run(self):
        return [nodes.literal_block("\n".join(self.content), "\n".join(self.content))]


class _Docstring(Directive):
    """The body of an autodoc entry: nested parsing, so section titles are errors."""

    has_content = True

    def run(self):
        node = nodes.container()
        self.state.nested_parse(self.content, self.content_offset, node)
        return [node]


for _name in SPHINX_ROLES:
    roles.register_local_role(_name, _inert_role)
for _name in ("seealso", "versionadded", "versionchanged", "deprecated", "plot", "only", "todo"):
    directives.register_directive(_name, _InertDirective)
for _name in ("code-block", "sourcecode", "doctest", "testcode", "testoutput", "highlight"):
    directives.register_directive(_name, _UnparsedDirective)
directives.register_directive("pyro-trees-docstring", _Docstring)


def reST_problems(doc):
    """Return docutils' messages of level >= 2 for ``doc`` read as an autodoc body."""
    body = "\n".join("   " + line if line.strip() else "" for line in doc.splitlines())
    source = ".. pyro-trees-docstring::\n\n" + body + "\n"
    stream = io.StringIO()
    tree = publish_doctree(
        source,
        settings_overrides={
            "report_level": 2,
            "halt_level": 5,
            "warning_stream": stream,
            "file_insertion_enabled": False,
            "raw_enabled": False,
        },
    )
    # docutils numbers lines of the wrapped source: the docstring starts on line 3.
    out = []
    for message in stream.getvalue().strip().splitlines():
        if message.startswith("<string>:"):
            _, line, rest = message.split(":", 2)
            if line.isdigit():
                message = f"docstring line {int(line) - 2}:{rest}"
        out.append(message)
    # A field marker that docutils read as text (``:param a: x; :param b: y``, or one not
    # at the start of a line) renders as garbage in the built docs without any warning.
    for text in tree.findall(nodes.Text):
        if isinstance(text.parent, (nodes.literal, nodes.literal_block, nodes.math)):
            continue
        for match in FIELD_IN_TEXT.finditer(text.astext()):
            out.append(
                f"(WARNING/2) field marker {match.group(0).strip()!r} inside running text: "
                "each field must start its own line"
            )
    # ``:ivar a, b:``: Sphinx reads ``a,`` as the type of ``b``. One field per name.
    for name in tree.findall(nodes.field_name):
        match = NAMED_FIELD.match(name.astext())
        if match and "," in match.group(2) and not re.search(r"[\[(]", match.group(2)):
            out.append(
                f"(WARNING/2) field ':{name.astext()}:' names several objects: "
                "Sphinx reads all but the last as a type; give each its own field"
            )
    return out


def public_modules():
    """Every importable public module of pyro_trees, the package included."""
    mods = [pyro_trees]
    for info in pkgutil.walk_packages(pyro_trees.__path__, "pyro_trees."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        mods.append(importlib.import_module(info.name))
    return mods


def _is_ours(obj):
    return getattr(obj, "__module__", "") and obj.__module__.split(".")[0] == "pyro_trees"


def public_objects():
    """``(qualified name, object)`` for every documented object, each object once."""
    seen = set()
    out = []

    def add(name, obj):
        key = id(obj[2]) if isinstance(obj, tuple) else id(obj)
        if key in seen:
            return
        seen.add(key)
        out.append((name, obj))

    for mod in public_modules():
        add(mod.__name__, mod)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                continue  # checked as a module of its own
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # data: documented by the module's text, not its own docstring
            # Named where it is defined, so each object is reported once.
            where = getattr(obj, "__module__", None) or mod.__name__
            qual = f"{where}.{getattr(obj, '__qualname__', name)}"
            add(qual, obj)
            if inspect.isclass(obj) and _is_ours(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(value, (staticmethod, classmethod)):
                        value = value.__func__
                    if isinstance(value, (property, types.FunctionType)):
                        add(f"{qual}.{attr}", (obj, attr, value))
    return out


def docstring(obj):
    """The docstring autodoc shows for ``obj`` (inherited where the override has none)."""
    if isinstance(obj, tuple):
        cls, attr, value = obj
        doc = value.__doc__
        if doc is None:  # autodoc_inherit_docstrings: the first parent that defines it
            base = next((b for b in cls.__mro__[1:] if attr in vars(b)), None)
            if base is None or base in PLACEHOLDER_DOCS:
                return None
            doc = inspect.getdoc(vars(base)[attr])
        return inspect.cleandoc(doc) if doc else doc
    doc = obj.__doc__ if isinstance(obj, types.ModuleType) else inspect.getdoc(obj)
    return inspect.cleandoc(doc) if doc else doc


OBJECTS = public_objects()

# Parents whose docstrings only say "override me" (``nn.Module.forward``): an override
# must say what it does itself.
PLACEHOLDER_DOCS = (torch.nn.Module,)


def test_objects_found():
    names = {name for name, _ in OBJECTS}
    assert "pyro_trees.infer.fit.fit" in names
    assert "pyro_trees.models.hme.HME" in names
    assert "pyro_trees.models.hme.HME.forward" in names
    assert len(OBJECTS) > 150


def test_public_docstrings_are_valid_rest():
    failures = []
    for name, obj in OBJECTS:
        doc = docstring(obj)
        if not doc or not doc.strip():
            failures.append(f"{name}: no docstring")
            continue
        problems = reST_problems(doc)
        if problems:
            failures.append(f"{name}:\n    " + "\n    ".join(problems))
    assert not failures, f"{len(failures)} public docstrings fail:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    "doc",
    [
        "Unbalanced ``backtick.",
        "Bad field list.\n\n:param x: one\nunindented text",
        "Title inside a docstring\n------------------------\n\nBody.",
        "Unknown role :klass:`HME`.",
        "List\n\n* item\nnot indented",
        "Two fields on a line.\n\n:param a: one; :param b: two",
        "Two names in a field.\n\n:ivar a, b: shape and rate",
    ],
)
def test_check_catches_broken_rest(doc):
    assert reST_problems(doc)


def test_check_accepts_sphinx_markup():
    doc = inspect.cleandoc(
        """Sum over the leaves, :math:`\\sum_l p_l = 1`.

        See :class:`pyro_trees.models.HME`, :func:`fit`, :meth:`HME.forward`,
        :attr:`depth`, :mod:`pyro_trees.trees`, :data:`REGISTRY`, :exc:`ValueError`.

        .. math::

            \\log p(y \\mid x) = \\log \\sum_l \\pi_l(x) \\, p_l(y \\mid x)

        :param torch.Tensor x: inputs, shape ``(N, D)``.
        :param tuple[int, int] shape: a type with a comma.
        :returns: a tensor of shape ``(N,)``.
        :rtype: torch.Tensor

        .. seealso:: :func:`pyro_trees.infer.fit`

        **References**

        1. A paper.
        """
    )
    assert reST_problems(doc) == []


DOCS_API = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api"


def _documented_by_api_pages():
    """Ids of the objects the ``docs/api`` pages document (``automodule``/``autodata``)."""
    ids = set()
    for page in sorted(DOCS_API.glob("*.rst")):
        text = page.read_text()
        # ``.. automodule:: M`` then ``:members:`` (all of ``__all__``) or a name list.
        for match in re.finditer(
            r"^\.\. automodule:: (\S+)\n((?:   :[^\n]*\n(?:      [^\n]*\n)*)*)", text, re.M
        ):
            mod = importlib.import_module(match.group(1))
            opts = re.search(r":members:(.*?)(?=\n   :|\Z)", match.group(2), re.S)
            if opts is None:
                continue
            names = [n.strip() for n in opts.group(1).split(",") if n.strip()]
            if names:
                ids.update(id(getattr(mod, n)) for n in names)
            else:  # autodoc skips re-exported data (its ``#:`` comment is elsewhere)
                objs = (getattr(mod, n) for n in mod.__all__)
                ids.update(id(o) for o in objs if inspect.isclass(o) or callable(o))
        for match in re.finditer(r"^\.\. autodata:: (\S+)\.(\w+)$", text, re.M):
            ids.add(id(getattr(importlib.import_module(match.group(1)), match.group(2))))
    return ids


def test_api_pages_cover_every_public_name():
    """Every name in a public ``__all__`` is on an API page (demos and the root aside)."""
    documented = _documented_by_api_pages()
    missing = []
    for mod in public_modules():
        if mod is pyro_trees or mod.__name__.startswith(("pyro_trees.demo",)):
            continue
        if not hasattr(mod, "__all__"):
            missing.append(f"{mod.__name__} (no __all__)")
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if not isinstance(obj, types.ModuleType) and id(obj) not in documented:
                missing.append(f"{mod.__name__}.{name}")
    assert not missing, "add these to a page in docs/api/:\n" + "\n".join(missing)
