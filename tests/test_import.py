"""``import pyro_trees`` is light and clean: subpackages load on first use, GPyTorch only
with the Gaussian-process models, and no DeprecationWarning of ours (strict test suites
run with ``-W error::DeprecationWarning``)."""

import subprocess
import sys

import pytest

import pyro_trees


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_loads_no_heavy_dependency():
    loaded = _run(
        "import sys, pyro_trees; "
        "print(sorted(m for m in ('torch', 'pyro', 'sklearn', 'gpytorch') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_models_guides_and_estimators_import_without_gpytorch_under_strict_warnings():
    loaded = _run(
        "import sys, pyro_trees.models, pyro_trees.guides, pyro_trees.infer, "
        "pyro_trees.estimators; print('gpytorch' in sys.modules)"
    )
    assert loaded == "False"


def test_a_gaussian_process_model_imports_gpytorch_cleanly_under_strict_warnings():
    assert (
        _run(
            "import sys; from pyro_trees.models import HeteroscedasticGP; "
            "HeteroscedasticGP(1, 2); print('gpytorch' in sys.modules)"
        )
        == "True"
    )


@pytest.mark.parametrize("name", pyro_trees.__all__)
def test_every_public_name_resolves(name):
    assert getattr(pyro_trees, name) is not None
    assert name in dir(pyro_trees)


def test_the_root_re_exports_every_public_estimator():
    from pyro_trees import estimators

    classes = {n for n in estimators.__all__ if isinstance(getattr(estimators, n), type)}
    assert classes <= set(pyro_trees.__all__)
    for name in classes:
        assert getattr(pyro_trees, name) is getattr(estimators, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pyro_trees.nope  # noqa: B018
