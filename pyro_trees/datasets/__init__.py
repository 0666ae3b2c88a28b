"""Data for pyro_trees: synthetic tasks from the papers and loaders for public data sets.

Public files are read from a cache directory (:func:`data_home`: ``$PYRO_TREES_DATA``,
default ``~/.cache/pyro_trees``) and verified against the SHA-256 checksums in
:data:`~pyro_trees.datasets.cache.REGISTRY`. A missing file raises :class:`FileNotFoundError` saying
where to get it and where to put it; :func:`fetch` downloads it on a machine with internet access.

Each paper's synthetic generators live in their own module (:mod:`.hme` for
Antorán et al.); :mod:`.public` holds the loaders, :mod:`.cache` the cache itself.
"""

from pyro_trees.datasets.bayesian_hme import (
    robot_arm,
    robot_arm_forward,
    toy_inverse,
)
from pyro_trees.datasets.cache import (
    REGISTRY,
    RemoteFile,
    cached_path,
    data_home,
    fetch,
    sha256sum,
)
from pyro_trees.datasets.hme import (
    NOISE_LOG_SIGMA_LEVELS,
    PULSE_LEVELS,
    make_noise_task,
    make_parity,
    make_pulse,
    make_steps,
    noise_log_sigma,
    noise_task_mean,
    parity_test_set,
    pulse_function,
)
from pyro_trees.datasets.public import (
    SKLEARN_DATASETS,
    UCI_DATASETS,
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
from pyro_trees.datasets.vart import (
    make_vart_causal_toy,
    make_vart_step,
    simulate_ihdp_surface,
)

__all__ = [
    "NOISE_LOG_SIGMA_LEVELS",
    "PULSE_LEVELS",
    "REGISTRY",
    "RemoteFile",
    "SKLEARN_DATASETS",
    "UCI_DATASETS",
    "cached_path",
    "data_home",
    "fetch",
    "load_cora",
    "load_ihdp",
    "load_kin8nm",
    "load_mnist",
    "load_mnist_subset",
    "load_mnist_test",
    "load_movielens_small",
    "load_sklearn",
    "load_uci",
    "make_noise_task",
    "make_parity",
    "make_pulse",
    "make_steps",
    "make_vart_causal_toy",
    "make_vart_step",
    "noise_log_sigma",
    "noise_task_mean",
    "parity_test_set",
    "pulse_function",
    "robot_arm",
    "robot_arm_forward",
    "sha256sum",
    "simulate_ihdp_surface",
    "toy_inverse",
    "uci_split",
]
