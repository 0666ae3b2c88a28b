"""TreeVI cost: ``TreeNormal.rsample`` / ``log_prob`` time against N (D = 10), next to a
mean-field ``Normal`` of the same size measured in the same run.

Run: ``python -m benchmarks.treevi_cost [--smoke]``.

Trees: a random recursive tree (node ``i`` picks its parent uniformly among ``0..i-1``;
height about ``e ln N``, sampled level by level) and a chain (height ``N - 1``, sampled
by pointer jumping in ``ceil(log2 N)`` steps). The issue's goal: ``rsample`` for
``N = 1,000,000, D = 10`` on CPU in well under a second, time linear in N.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import markdown_table, write_results
from pyro_trees.distributions import TreeNormal


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    sizes = [1_000, 10_000] if args.smoke else [10_000, 100_000, 1_000_000]
    d, repeats = 10, 3 if args.smoke else 5
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        loc, scale = torch.randn(n, d, generator=g), torch.rand(n, d, generator=g) + 0.5
        rho = torch.rand(n, d, generator=g) * 1.8 - 0.9
        random_tree = (torch.rand(n, generator=g) * torch.arange(n)).long()
        random_tree[0] = -1
        chain = torch.arange(-1, n - 1)
        mf = torch.distributions.Normal(loc, scale)
        t_mf = timed(lambda mf=mf: mf.rsample(), repeats)
        t_mf_lp = timed(lambda mf=mf, x=loc: mf.log_prob(x).sum(), repeats)
        for tree_name, parents in (("random recursive", random_tree), ("chain", chain)):
            t0 = time.perf_counter()
            q = TreeNormal(loc, scale, parents, rho)
            _ = q._plan.levels if q._choose_method(n * d) == "levels" else q._plan.jumps
            t_build = time.perf_counter() - t0
            method = q._choose_method(n * d)
            t_rs = timed(lambda q=q: q.rsample(), repeats)
            t_lp = timed(lambda q=q, x=loc: q.log_prob(x), repeats)
            steps = q.height if method == "levels" else len(q._plan.jumps)
            rows.append(
                {
                    "N": n,
                    "tree": tree_name,
                    "height": q.height,
                    "method": method,
                    "sequential steps": steps,
                    "build s (once)": t_build,
                    "rsample s": t_rs,
                    "rsample ns / (N D)": 1e9 * t_rs / (n * d),
                    "rsample / mean-field": t_rs / t_mf,
                    "log_prob s": t_lp,
                    "log_prob / mean-field": t_lp / t_mf_lp,
                }
            )
            print(rows[-1], flush=True)
    md = markdown_table(rows) + (
        f"\nD = {d}, median of {repeats} runs, {threads} torch thread(s), float32, CPU. "
        "'build' (parent validation, depths, level or jump plan) is paid once per tree. "
        "Timings on a shared 2-core machine are contended.\n"
    )
    print(md)
    if not args.smoke:
        write_results("treevi_cost", {"rows": rows}, md)
    return rows


if __name__ == "__main__":
    main()
