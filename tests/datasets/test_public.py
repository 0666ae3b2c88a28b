"""Loaders on the real cache; skipped when it is absent (CI has it)."""

import numpy as np
import pytest

from pyro_trees.datasets import (
    SKLEARN_DATASETS,
    UCI_DATASETS,
    data_home,
    load_cora,
    load_ihdp,
    load_kin8nm,
    load_mnist,
    load_mnist_subset,
    load_mnist_test,
    load_movielens_small,
    load_sklearn,
    load_uci,
    uci_split,
)

needs_cache = pytest.mark.skipif(
    not (data_home() / "uci").is_dir(),
    reason=f"public-data cache absent: no {data_home() / 'uci'} "
    "(set PYRO_TREES_DATA to a pyro_trees data cache)",
)
pytestmark = [pytest.mark.data, needs_cache]

# (N, D) of each UCI set as shipped by uci_datasets.
UCI_SHAPES = {
    "airfoil": (1503, 5),
    "autompg": (392, 7),
    "autos": (159, 25),
    "breastcancer": (194, 33),
    "concrete": (1030, 8),
    "concreteslump": (103, 7),
    "fertility": (100, 9),
    "forest": (517, 12),
    "housing": (506, 13),
    "kin40k": (40000, 8),
    "machine": (209, 7),
    "pendulum": (630, 9),
    "servo": (167, 4),
    "skillcraft": (3338, 19),
    "sml": (4137, 26),
    "solar": (1066, 10),
    "stock": (536, 11),
    "tamielectric": (45781, 3),
    "wine": (1599, 11),
    "yacht": (308, 6),
}


def test_uci_shapes_table_is_complete():
    assert sorted(UCI_SHAPES) == list(UCI_DATASETS)


@pytest.mark.parametrize("name", UCI_DATASETS)
def test_load_uci(name):
    X, y, mask = load_uci(name)
    n, d = UCI_SHAPES[name]
    assert X.shape == (n, d) and y.shape == (n,) and mask.shape == (n, 10)
    assert X.dtype == y.dtype == np.float64 and mask.dtype == bool
    assert np.isfinite(X).all() and np.isfinite(y).all()
    # Ten 90/10 splits.
    assert np.all(np.abs(mask.mean(axis=0) - 0.1) < 0.02)


def test_uci_split():
    X, y, mask = load_uci("yacht")
    X_train, y_train, X_test, y_test = uci_split("yacht", 3)
    assert len(X_test) == mask[:, 3].sum() and len(X_train) + len(X_test) == len(X)
    np.testing.assert_array_equal(X_test, X[mask[:, 3]])
    np.testing.assert_array_equal(y_train, y[~mask[:, 3]])
    with pytest.raises(ValueError, match=r"split must be in \[0, 9\]"):
        uci_split("yacht", 10)


def test_load_uci_bad_name():
    with pytest.raises(ValueError, match="valid names: airfoil, autompg"):
        load_uci("boston")


def test_load_kin8nm():
    X, y = load_kin8nm()
    assert X.shape == (8192, 8) and y.shape == (8192,)
    X_train, y_train, X_test, y_test = load_kin8nm(split=19)
    assert X_train.shape == (7373, 8) and X_test.shape == (819, 8)
    assert y_train.shape == (7373,) and y_test.shape == (819,)
    with pytest.raises(ValueError, match="split"):
        load_kin8nm(split=20)


def test_load_ihdp():
    data = load_ihdp(1)
    assert data["x"].shape == (747, 25)
    for key in ("treatment", "y_factual", "y_cfactual", "mu0", "mu1"):
        assert data[key].shape == (747,)
    assert set(np.unique(data["treatment"])) == {0, 1}
    # Column 13 (0-based) is coded 1/2, the other binary columns 0/1.
    assert set(np.unique(data["x"][:, 13])) == {1.0, 2.0}
    binary = np.delete(data["x"][:, 6:], 13 - 6, axis=1)
    assert np.isin(binary, (0.0, 1.0)).all()
    assert not np.array_equal(load_ihdp(10)["y_factual"], data["y_factual"])
    with pytest.raises(ValueError, match="replication"):
        load_ihdp(0)


def test_load_mnist():
    X, y = load_mnist_subset()
    assert X.shape == (5000, 784) and X.dtype == np.float32 and y.dtype == np.int64
    assert X.min() == 0.0 and X.max() == 1.0
    assert np.array_equal(np.bincount(y), [500] * 10)
    X, y = load_mnist_test()
    assert X.shape == (10000, 784) and X.dtype == np.float32 and y.shape == (10000,)
    assert X.min() == 0.0 and X.max() == 1.0 and set(np.unique(y)) == set(range(10))
    assert load_mnist_test(flatten=False)[0].shape == (10000, 28, 28)


# images per digit 0..9, as published with the IDX files
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


@pytest.mark.skipif(
    not (data_home() / "mnist" / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"no {data_home() / 'mnist' / 'train-images-idx3-ubyte.gz'}: the cache lacks "
    "the 60,000 MNIST training images",
)
def test_load_mnist_all():
    X, y = load_mnist()
    assert X.shape == (70000, 784) and X.dtype == np.float32
    assert y.shape == (70000,) and y.dtype == np.int64
    assert X.min() == 0.0 and X.max() == 1.0
    # grey levels, not binarised
    assert len(np.unique(X[:100])) > 100
    assert np.bincount(y[:60000]).tolist() == MNIST_TRAIN_COUNTS
    assert np.bincount(y[60000:]).tolist() == MNIST_TEST_COUNTS
    X_test, y_test = load_mnist("test")
    np.testing.assert_array_equal(X[60000:], X_test)
    np.testing.assert_array_equal(y[60000:], y_test)
    X_train, y_train = load_mnist("train", flatten=False)
    assert X_train.shape == (60000, 28, 28) and y_train.shape == (60000,)
    np.testing.assert_array_equal(X_train.reshape(60000, -1), X[:60000])
    with pytest.raises(ValueError, match="split must be 'all', 'train' or 'test'"):
        load_mnist("valid")


def test_load_movielens_small():
    data = load_movielens_small()
    assert data["rating"].shape == (100836,)
    assert len(data["user_ids"]) == 610 and len(data["movie_ids"]) == 9724
    np.testing.assert_array_equal(data["user_ids"][data["user"]], data["user_id"])
    np.testing.assert_array_equal(data["movie_ids"][data["movie"]], data["movie_id"])
    assert data["rating"].min() == 0.5 and data["rating"].max() == 5.0


def test_load_cora():
    data = load_cora()
    assert data["features"].shape == (2708, 1433) and data["features"].dtype == np.uint8
    assert data["labels"].shape == (2708,) and set(np.unique(data["labels"])) == set(range(7))
    edges = data["edges"]
    assert edges.shape == (5278, 2) and np.all(edges[:, 0] < edges[:, 1]) and edges.max() < 2708


@pytest.mark.parametrize("name", SKLEARN_DATASETS)
def test_load_sklearn(name):
    if name != "boston":
        pytest.importorskip("sklearn")
    X, y = load_sklearn(name)
    shapes = {
        "boston": (506, 13),
        "breast_cancer": (569, 30),
        "diabetes": (442, 10),
        "digits": (1797, 64),
        "iris": (150, 4),
        "wine": (178, 13),
    }
    assert X.shape == shapes[name] and y.shape == (shapes[name][0],) and X.dtype == np.float64
    assert y.dtype == (np.float64 if name in ("boston", "diabetes") else np.int64)


def test_load_sklearn_bad_name():
    with pytest.raises(ValueError, match="valid names: boston"):
        load_sklearn("mnist")
