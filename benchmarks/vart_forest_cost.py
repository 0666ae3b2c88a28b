"""Cost of one training step of a VaRT forest against one deep VaRT tree, same data.

Run from the repository root: ``python -m benchmarks.vart_forest_cost``. Times the
vectorised ELBO and its backward pass (``VaRTForestELBO`` for forests of K trees of depth
3-4, ``VaRTELBO`` for single trees of depth 5-8) on 1,000 rows of 8 inputs, one thread,
interleaved rounds (the machine is shared: the median of the rounds is reported, and the
ratio to the depth-7 tree measured in the same rounds).
"""

from __future__ import annotations

import time

import numpy as np
import pyro
import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.guides import VaRTForestGuide, VaRTGuide
from pyro_trees.infer.vart_elbo import vart_elbo
from pyro_trees.infer.vart_forest_elbo import vart_forest_elbo
from pyro_trees.models import VaRT, VaRTForest

CONFIGS = [("tree", 1, 5), ("tree", 1, 7), ("tree", 1, 8), ("forest", 20, 3)]
CONFIGS += [("forest", 50, 3), ("forest", 50, 4)]


def _step_fn(kind, k, depth, x, y):
    if kind == "tree":
        model = VaRT(x.shape[1])
        guide = VaRTGuide(model, depth)
        loss = vart_elbo
    else:
        model = VaRTForest(x.shape[1], num_trees=k, depth=depth)
        guide = VaRTForestGuide(model)
        loss = vart_forest_elbo
    guide(x)
    params = list(guide.parameters())

    def step():
        for p in params:
            p.grad = None
        (-loss(model, guide, x, y)).backward()

    return step


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(1000, 8), torch.randn(1000)
    with pyro.settings.context(module_local_params=True):
        steps = {c: _step_fn(*c, x, y) for c in CONFIGS}
        times = {c: [] for c in CONFIGS}
        for _ in range(7):  # interleaved rounds of 10 steps each
            for c, step in steps.items():
                step()
                t = time.perf_counter()
                for _ in range(10):
                    step()
                times[c].append((time.perf_counter() - t) / 10)
    base = np.median(times[("tree", 1, 7)])
    rows = [
        {
            "model": f"{kind} K={k} depth {d}",
            "nodes": k * (2 ** (d + 1) - 1),
            "ms per step": 1e3 * float(np.median(t)),
            "ratio to one depth-7 tree": float(np.median(t) / base),
        }
        for (kind, k, d), t in times.items()
    ]
    md = (
        "One ELBO evaluation plus backward pass, 1,000 rows x 8 inputs, one thread, median "
        "of 7 interleaved rounds of 10 steps (shared 2-core machine).\n\n" + markdown_table(rows)
    )
    write_results("vart_forest_cost", {"rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
