"""Pyro's test hygiene: a fixed seed per test, a clean param store, validation on."""

import os

import pyro
import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")

#: the seed every test starts from; another value (``PYRO_TREES_TEST_SEED=1 make test``)
#: checks that no test passes by the luck of one seed
SEED = int(os.environ.get("PYRO_TREES_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def _pyro_hygiene():
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED)
    pyro.enable_validation(True)
    yield
    pyro.clear_param_store()


def pytest_addoption(parser):
    parser.addoption(
        "--reverse-order",
        action="store_true",
        help="run the collected tests in reverse order (a check that no test leans on "
        "state an earlier test left behind)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-order"):
        items.reverse()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
