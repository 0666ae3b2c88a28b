"""Build hook: the package's long description is README.md with its repository-relative
links made absolute, so that they work wherever the description is shown (a package
index, ``pip show``). Everything else is declared in setup.cfg; the repository's address
is its ``project_urls`` entry ``Source`` there, the one place to change it."""

import configparser
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
#: a Markdown link or image target: ``](target)``
LINK = re.compile(r"\]\(([^)\s]+)\)")


def source_url() -> str:
    """The ``Source`` entry of ``project_urls`` in setup.cfg."""
    config = configparser.ConfigParser()
    config.read(HERE / "setup.cfg")
    for line in config["metadata"]["project_urls"].strip().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "Source":
            return value.strip().rstrip("/")
    raise KeyError("setup.cfg: project_urls has no Source entry")


def absolute_links(markdown: str, base: str, branch: str = "main") -> str:
    """``markdown`` with every repository-relative link target made absolute:
    ``docs/guide/`` becomes ``{base}/tree/{branch}/docs/guide/``, a file
    ``{base}/blob/{branch}/path`` (anchors kept); absolute URLs, ``mailto:`` and
    in-page ``#anchors`` are left as they are."""

    def fix(match: re.Match) -> str:
        target = match.group(1)
        if re.match(r"^([a-z][a-z0-9+.-]*:|#)", target):
            return match.group(0)
        path = target.removeprefix("./")
        kind = "tree" if path.split("#")[0].endswith("/") else "blob"
        return f"]({base}/{kind}/{branch}/{path})"

    return LINK.sub(fix, markdown)


if __name__ == "__main__":
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    setup(long_description=absolute_links(readme, source_url()))
