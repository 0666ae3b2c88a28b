"""Pyro's test hygiene: a fixed seed per test, a clean param store, validation on, and
no process-wide state carried from one test to the next."""

import os
import signal

import pyro
import pytest
import sklearn  # noqa: F401  (sets KMP_* variables when first imported: here, not in a test)
import torch

os.environ.setdefault("TQDM_DISABLE", "1")

#: the seed every test starts from; another value (``PYRO_TREES_TEST_SEED=1 make test``)
#: checks that no test passes by the luck of one seed
SEED = int(os.environ.get("PYRO_TREES_TEST_SEED", "0"))


def _process_state() -> dict:
    """What one test could change for every later one: torch's default dtype, thread
    count and grad mode, Pyro's settings (validation included), the SIGINT handler, and
    the environment."""
    return {
        "default dtype": torch.get_default_dtype(),
        "torch threads": torch.get_num_threads(),
        "grad enabled": torch.is_grad_enabled(),
        "pyro settings": pyro.settings.get(),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        # not ours: pytest's PYTEST_CURRENT_TEST changes with every phase of every test,
        # and torch sets TORCHINDUCTOR_CACHE_DIR once, on first use
        "environment": {
            k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TORCHINDUCTOR_"))
        },
    }


@pytest.fixture(autouse=True)
def _pyro_hygiene():
    pyro.clear_param_store()
    pyro.set_rng_seed(SEED)
    pyro.enable_validation(True)
    before = _process_state()
    yield
    pyro.clear_param_store()
    after = _process_state()
    changed = sorted(k for k in before if before[k] != after[k])
    # put it back first, so that one leaking test fails alone
    torch.set_default_dtype(before["default dtype"])
    torch.set_num_threads(before["torch threads"])
    torch.set_grad_enabled(before["grad enabled"])
    pyro.settings.set(**before["pyro settings"])
    signal.signal(signal.SIGINT, before["SIGINT handler"])
    for key in set(after["environment"]) - set(before["environment"]):
        del os.environ[key]
    os.environ.update(before["environment"])
    assert not changed, f"the test left process-wide state changed: {changed}"


def pytest_configure(config):
    # under pytest-xdist (``make test`` runs one worker per core) each worker computes on
    # its share of the cores: torch's default of every core per process would run
    # workers x cores threads on the machine, and OpenMP threads that wait on each other
    # slow every worker down; the processes a test starts (notebook kernels, torchrun
    # ranks, the demo) inherit the same share through OMP_NUM_THREADS
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
