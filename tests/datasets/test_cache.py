import hashlib
import importlib.resources
import pathlib
import urllib.error
import urllib.request

import pytest

from pyro_trees.datasets import REGISTRY, cached_path, data_home, fetch, load_uci
from pyro_trees.datasets import cache as cache_module

UCI_DATA = "uci/housing/data.csv.gz"


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PYRO_TREES_DATA", str(tmp_path))
    monkeypatch.setattr(cache_module, "_VERIFIED", set())
    return tmp_path


def test_data_home(monkeypatch, tmp_path):
    monkeypatch.setenv("PYRO_TREES_DATA", str(tmp_path))
    assert data_home() == tmp_path
    monkeypatch.setenv("PYRO_TREES_DATA", "")
    assert data_home() == pathlib.Path.home() / ".cache" / "pyro_trees"
    monkeypatch.delenv("PYRO_TREES_DATA")
    assert data_home() == pathlib.Path.home() / ".cache" / "pyro_trees"


def test_registry():
    assert len(REGISTRY) == 68 + 42
    for relpath, entry in REGISTRY.items():
        assert entry.relpath == relpath
        for digest in (entry.sha256, *entry.also_sha256):
            assert len(digest) == 64 and int(digest, 16) >= 0
        if relpath != "cora/cora.npz":
            assert entry.urls and all(u.startswith("https://") for u in entry.urls)
    assert REGISTRY[UCI_DATA].urls == (
        "https://raw.githubusercontent.com/treforevans/uci_datasets/HEAD/"
        "uci_datasets/housing/data.csv.gz",
    )
    assert REGISTRY["movielens/ml-latest-small/ratings.csv"].member == "ml-latest-small/ratings.csv"


def test_missing_file_says_where(tmp_cache):
    with pytest.raises(FileNotFoundError) as info:
        cached_path(UCI_DATA)
    message = str(info.value)
    assert REGISTRY[UCI_DATA].urls[0] in message
    assert str(tmp_cache / "uci" / "housing" / "data.csv.gz") in message
    assert "PYRO_TREES_DATA" in message
    with pytest.raises(FileNotFoundError, match="ml-latest-small.zip"):
        cached_path("movielens/ml-latest-small/ratings.csv")
    with pytest.raises(FileNotFoundError, match="tkipf/gcn"):
        cached_path("cora/cora.npz")
    # Loaders pass the error on.
    with pytest.raises(FileNotFoundError, match="uci_datasets"):
        load_uci("housing")


def test_missing_mnist_file_is_named(tmp_cache):
    # A cache with the test set but not the training images: load_mnist names the file.
    from pyro_trees.datasets import load_mnist

    (tmp_cache / "mnist").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(verify=False)
    message = str(info.value)
    assert "mnist/train-images-idx3-ubyte.gz" in message
    assert str(tmp_cache / "mnist" / "train-images-idx3-ubyte.gz") in message
    assert "https://" in message


def test_other_accepted_copy(tmp_cache, monkeypatch):
    # A file may be accepted in more than one packing (train-images-idx3-ubyte.gz gzipped
    # again has another hash); any other content is refused, naming both digests.
    relpath = "uci/LICENSE"
    origin, copy = b"as the origin serves it", b"the same, packed again"
    digests = [hashlib.sha256(c).hexdigest() for c in (origin, copy)]
    entry = cache_module.RemoteFile(relpath, digests[0], (), also_sha256=(digests[1],))
    monkeypatch.setitem(REGISTRY, relpath, entry)
    target = tmp_cache / relpath
    target.parent.mkdir(parents=True)
    for content in (origin, copy):
        target.write_bytes(content)
        assert cached_path(relpath) == target
    target.write_bytes(b"something else")
    with pytest.raises(ValueError, match=f"expected SHA-256 {digests[0]} or {digests[1]}"):
        cached_path(relpath)


def test_mnist_training_images_registered():
    entry = REGISTRY["mnist/train-images-idx3-ubyte.gz"]
    # the original site's .gz, then the re-gzipped copy of the offline cache (same IDX bytes)
    assert entry.sha256.startswith("440fcabf") and entry.also_sha256[0].startswith("0b367032")
    assert entry.urls[0] == "https://yann.lecun.com/exdb/mnist/train-images-idx3-ubyte.gz"


def test_unknown_file():
    with pytest.raises(ValueError, match="unknown data file 'nope.csv'"):
        cached_path("nope.csv")


def test_checksum_mismatch_detected(tmp_cache):
    target = tmp_cache / UCI_DATA
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not the real file")
    actual = hashlib.sha256(b"not the real file").hexdigest()
    with pytest.raises(ValueError) as info:
        cached_path(UCI_DATA)
    message = str(info.value)
    assert str(target) in message and REGISTRY[UCI_DATA].sha256 in message and actual in message
    # Skipping verification returns the path.
    assert cached_path(UCI_DATA, verify=False) == target


def test_verified_once_and_rechecked_after_change(tmp_cache, monkeypatch):
    content = b"fake data\n"
    relpath = "uci/LICENSE"
    entry = REGISTRY[relpath]
    monkeypatch.setitem(
        REGISTRY, relpath, cache_module.RemoteFile(relpath, hashlib.sha256(content).hexdigest(), ())
    )
    target = tmp_cache / relpath
    target.parent.mkdir(parents=True)
    target.write_bytes(content)
    calls = []
    real = cache_module.sha256sum
    monkeypatch.setattr(cache_module, "sha256sum", lambda p: calls.append(p) or real(p))
    assert cached_path(relpath) == target
    assert cached_path(relpath) == target
    assert len(calls) == 1
    target.write_bytes(b"changed, longer content\n")
    with pytest.raises(ValueError, match="checksum mismatch"):
        cached_path(relpath)
    assert entry.sha256 != REGISTRY[relpath].sha256


@pytest.mark.parametrize("content", ["1\n2\n", ""], ids=["edited", "emptied"])
def test_edited_kin8nm_index_is_refused(tmp_cache, content):
    # An edited index would silently change the split, an empty one train on 0 rows.
    target = tmp_cache / "kin8nm" / "index_train_0.txt"
    target.parent.mkdir(parents=True)
    target.write_text(content)
    with pytest.raises(ValueError, match="checksum mismatch"):
        cached_path("kin8nm/index_train_0.txt")


def test_registry_is_a_package_data_file():
    text = importlib.resources.files("pyro_trees.datasets").joinpath("registry.csv").read_text()
    lines = text.splitlines()
    assert lines[0] == "relpath,sha256,origin,path_at_origin"
    assert sorted(line.split(",")[0] for line in lines[1:]) == list(REGISTRY)


def test_fetch_without_network(tmp_cache, monkeypatch):
    def refuse(url, timeout=None):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    with pytest.raises(ConnectionError) as info:
        fetch(UCI_DATA)
    message = str(info.value)
    assert "network" in message and REGISTRY[UCI_DATA].urls[0] in message
    assert str(tmp_cache / UCI_DATA) in message
    assert not (tmp_cache / UCI_DATA).exists()
    with pytest.raises(FileNotFoundError, match="cannot download cora/cora.npz"):
        fetch("cora/cora.npz")


class _FakeResponse:
    def __init__(self, data):
        self.data = data

    def read(self, size=-1):
        data, self.data = (self.data, b"") if size < 0 else (self.data[:size], self.data[size:])
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_fetch_verifies_download(tmp_cache, monkeypatch):
    content = b"some bytes"
    relpath = "uci/LICENSE"
    good = cache_module.RemoteFile(relpath, hashlib.sha256(content).hexdigest(), ("https://x/a",))
    monkeypatch.setitem(REGISTRY, relpath, good)
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: _FakeResponse(content))
    path = fetch(relpath)
    assert path == tmp_cache / relpath and path.read_bytes() == content
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: _FakeResponse(b"bad"))
    with pytest.raises(ValueError, match="checksum mismatch for the download"):
        fetch(relpath, force=True)
    assert path.read_bytes() == content  # the valid copy is kept
    # A corrupt copy is replaced without force.
    path.write_bytes(b"corrupt")
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: _FakeResponse(content))
    assert fetch(relpath).read_bytes() == content


def test_fetch_zip_member(tmp_cache, monkeypatch):
    import io
    import zipfile

    content = b"userId,movieId,rating,timestamp\n1,1,4.0,964982703\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ml-latest-small/ratings.csv", content)
        archive.writestr("ml-latest-small/README.txt", b"readme")
    relpath = "movielens/ml-latest-small/ratings.csv"
    entry = REGISTRY[relpath]
    monkeypatch.setitem(
        REGISTRY,
        relpath,
        cache_module.RemoteFile(
            relpath, hashlib.sha256(content).hexdigest(), entry.urls, entry.member
        ),
    )
    monkeypatch.setattr(
        urllib.request, "urlopen", lambda url, timeout=None: _FakeResponse(buffer.getvalue())
    )
    assert fetch(relpath).read_bytes() == content
    assert [p.name for p in (tmp_cache / "movielens" / "ml-latest-small").iterdir()] == [
        "ratings.csv"
    ]


def test_load_sklearn_without_scikit_learn(monkeypatch):
    import importlib

    from pyro_trees.datasets import load_sklearn

    real = importlib.import_module

    def no_sklearn(name, *args):
        if name.startswith("sklearn"):
            raise ImportError("No module named 'sklearn'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_sklearn)
    with pytest.raises(ImportError, match="pip install scikit-learn"):
        load_sklearn("iris")
