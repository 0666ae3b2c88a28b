"""The plotting tests draw on Matplotlib's Agg backend (no display needed) and close every
figure after each test."""

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")
