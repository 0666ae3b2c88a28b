"""Demo: the RNN-Tree on the 8-level pulse and on noisy parity (Antorán et al., F.1-F.2)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from pyro_trees.datasets import make_parity, make_pulse, parity_test_set, pulse_function
from pyro_trees.estimators import RNNTreeClassifier, RNNTreeRegressor

__all__ = ["run"]


def run(out_dir: Path, smoke: bool = False) -> list[dict]:
    """Fit the RNN-Tree to the 8-level pulse (F.1) and to 6-bit noisy parity (F.2).

    Writes ``hme_pulse_rules.txt`` and, with matplotlib, ``hme_pulse.png`` into
    ``out_dir``.

    :param out_dir: folder for the outputs (created if missing).
    :param bool smoke: tiny step counts, for the tests.
    :returns: rows for the pulse (regions used, training MSE) and the parity test
        accuracy.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    X, y = make_pulse(400)
    x_grid = np.linspace(-4, 4, 2001)
    t0 = time.perf_counter()
    est = RNNTreeRegressor(
        3, random_state=0, entropy_weight=-1.0, num_steps=40 if smoke else 600
    ).fit(X, y)
    seconds = time.perf_counter() - t0
    pred = est.predict(x_grid[:, None])
    regions = len(set(est.apply(x_grid[:, None]).tolist()))
    rows.append(
        {
            "model": "RNN-Tree (HME)",
            "task": "8-level pulse, depth 3",
            "metric": "regions used (of 8)",
            "paper": 8,
            "ours": regions,
            "seconds": seconds,
        }
    )
    rows.append(
        {
            "model": "RNN-Tree (HME)",
            "task": "8-level pulse, depth 3",
            "metric": "train MSE",
            "paper": None,
            "ours": float(np.mean((est.predict(X) - y) ** 2)),
            "seconds": seconds,
        }
    )
    (out_dir / "hme_pulse_rules.txt").write_text(est.export_text(feature_names=["x"]))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(x_grid, pulse_function(x_grid), color="k", lw=1, label="truth")
        ax.plot(x_grid, pred, color="C0", label=f"RNN-Tree, depth 3 ({regions} regions)")
        try:
            from sklearn.tree import DecisionTreeRegressor

            cart = DecisionTreeRegressor(max_depth=3).fit(X, y)
            ax.plot(
                x_grid, cart.predict(x_grid[:, None]), color="C3", ls="--", label="CART, depth 3"
            )
        except ImportError:  # pragma: no cover - scikit-learn is optional
            pass
        ax.legend(fontsize=7)
        ax.set_xlabel("x")
        fig.tight_layout()
        fig.savefig(out_dir / "hme_pulse.png", dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass

    bits = 6
    Xp, yp = make_parity(1500, bits=bits, sigma=0.2, random_state=0)
    Xt, yt = parity_test_set(bits)
    t0 = time.perf_counter()
    clf = RNNTreeClassifier(
        bits, random_state=0, entropy_weight=-1.0, batch_size=500, num_steps=20 if smoke else 250
    ).fit(Xp, yp)
    rows.append(
        {
            "model": "RNN-Tree (HME)",
            "task": f"{bits}-bit parity, sigma 0.2",
            "metric": "test accuracy",
            "paper": None,
            "ours": clf.score(Xt, yt),
            "seconds": time.perf_counter() - t0,
        }
    )
    return rows
