"""TreeVI cost: ``TreeNormal.rsample`` / ``log_prob`` time against N (D = 10), next to a
mean-field ``Normal`` of the same size measured in the same run, and the time per
training epoch of TreeVI over mean-field on the Cora graph model.

Run: ``python -m benchmarks.treevi_cost [--smoke]``.

Trees: a random recursive tree (node ``i`` picks its parent uniformly among ``0..i-1``;
height about ``e ln N``) and a chain (height ``N - 1``). Each is sampled with the plan
``method="auto"`` picks (level by level for the shallow tree, heavy paths for the chain)
and with the alternative for comparison (heavy paths; pointer jumping). Mean-field and
tree samples alternate inside every repeat so both see the same machine load. The
issue's goals: ``rsample`` for ``N = 1,000,000, D = 10`` on CPU in well under a second,
time linear in N; time per epoch of TreeVI over mean-field in the same run <= 1.5x (the
paper reports 2-3x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from benchmarks._common import markdown_table, write_results
from pyro_trees.distributions import TreeNormal


def timed_pair(fa, fb, repeats):
    """Median seconds of ``fa`` and ``fb``, alternating within each repeat."""
    ta, tb = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb)


def sampling_rows(sizes, d, repeats):
    g = torch.Generator().manual_seed(0)
    for method in ("levels", "paths", "jump"):  # warm-up: first-call costs of torch ops
        w = torch.rand(64, d)
        q = TreeNormal(w, w + 1, torch.arange(-1, 63), w - 0.5, method=method)
        q.log_prob(q.rsample())
        torch.distributions.Normal(w, w + 1).rsample()
    rows = []
    for n in sizes:
        loc, scale = torch.randn(n, d, generator=g), torch.rand(n, d, generator=g) + 0.5
        rho = torch.rand(n, d, generator=g) * 1.8 - 0.9
        random_tree = (torch.rand(n, generator=g) * torch.arange(n)).long()
        random_tree[0] = -1
        chain = torch.arange(-1, n - 1)
        mf = torch.distributions.Normal(loc, scale)
        for tree_name, parents, methods in (
            ("random recursive", random_tree, ("levels", "paths")),
            ("chain", chain, ("paths", "jump")),
        ):
            t0 = time.perf_counter()
            base = TreeNormal(loc, scale, parents, rho)
            t_check = time.perf_counter() - t0
            for method in methods:
                t0 = time.perf_counter()
                plan = {"levels": "levels", "paths": "paths", "jump": "jumps"}[method]
                info = getattr(base._plan, plan)
                t_plan = time.perf_counter() - t0
                q = TreeNormal(loc, scale, base._plan, rho, method=method)
                steps = {
                    "levels": q.height,
                    "paths": f"{len(info[2]) - 1} rounds",
                    "jump": len(info),
                }[method]
                t_mf, t_rs = timed_pair(mf.rsample, q.rsample, repeats)
                t_mf_lp, t_lp = timed_pair(
                    lambda mf=mf, x=loc: mf.log_prob(x).sum((-2, -1)),
                    lambda q=q, x=loc: q.log_prob(x),
                    repeats,
                )
                rows.append(
                    {
                        "N": n,
                        "tree": tree_name,
                        "height": q.height,
                        "method": method + (" (auto)" if method == base._choose_method() else ""),
                        "sequential depth": steps,
                        "check s (once)": t_check,
                        "plan s (once)": t_plan,
                        "rsample s": t_rs,
                        "rsample ns / (N D)": 1e9 * t_rs / (n * d),
                        "rsample / mean-field": t_rs / t_mf,
                        "log_prob s": t_lp,
                        "log_prob / mean-field": t_lp / t_mf_lp,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def epoch_rows(epochs, smoke):
    """Seconds per epoch of minibatch SVI on the Cora graph-prior VAE (the set-up of
    ``benchmarks.treevi_graph``): mean-field guide vs TreeVI guide, alternating blocks."""
    from benchmarks.treevi_graph import cosine, load_cora_split
    from pyro_trees.guides import GaussianEncoder, PairNet, TreeVIGuide, tree_batches
    from pyro_trees.infer import maximum_spanning_tree
    from pyro_trees.models import GraphPriorVAE

    x, train_edges, _ = load_cora_split(0)
    x = torch.as_tensor(x)
    if smoke:
        x = x[:, :200]
    n, f = x.shape
    te = torch.as_tensor(train_edges)
    t1 = maximum_spanning_tree(cosine(x)[te[:, 0], te[:, 1]], edges=te, num_nodes=n)
    batches = tree_batches(t1, 256, generator=torch.Generator().manual_seed(0))
    a = torch.zeros(n, n)
    a[te[:, 0], te[:, 1]] = a[te[:, 1], te[:, 0]] = 1
    strength = min(0.5, 0.9 / abs(float(torch.linalg.eigvalsh(a.double())[0])))
    store = pyro.get_param_store()
    runs = {}
    for name in ("mean-field", "TreeVI"):
        pyro.set_rng_seed(0)
        with store.scope() as state:
            model = GraphPriorVAE(
                te, f, num_nodes=n, strength=strength, latent_dim=16, hidden_sizes=(128,)
            )
            enc = GaussianEncoder(f, 16, hidden_sizes=(128,))
            tree = None if name == "mean-field" else t1
            pair = None if name == "mean-field" else PairNet(f, 16)
            guide = TreeVIGuide(enc, tree, pair_net=pair)
            svi = SVI(model, guide, pyro.optim.Adam({"lr": 2e-3}), Trace_ELBO())
            for b in batches:  # warm-up epoch (lazy plans, allocator)
                svi.step(x, idx=b)
        runs[name] = (svi, state)
    secs = {name: [] for name in runs}
    for _ in range(epochs):
        for name, (svi, state) in runs.items():
            with store.scope(state):
                t0 = time.perf_counter()
                for b in batches:
                    svi.step(x, idx=b)
                secs[name].append(time.perf_counter() - t0)
    mf = statistics.median(secs["mean-field"])
    return [
        {
            "guide": name,
            "s / epoch (median)": statistics.median(s),
            "ratio to mean-field": statistics.median(s) / mf,
            "paper": "1" if name == "mean-field" else "2-3x",
            "batches": len(batches),
            "epochs timed": len(s),
        }
        for name, s in secs.items()
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--skip-epochs", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    sizes = [1_000, 10_000] if args.smoke else [10_000, 100_000, 1_000_000]
    d, repeats = 10, 3 if args.smoke else 5
    rows = sampling_rows(sizes, d, repeats)
    md = markdown_table(rows) + (
        f"\nD = {d}, median of {repeats} runs, {threads} torch thread(s), float32, CPU, no "
        "autograd. 'check' (parent validation with depths, parameter checks) and 'plan' "
        "(level, heavy-path or jump bookkeeping) are paid once per tree and shared by "
        "`expand` and by any TreeNormal built on the same plan. Ratios: mean-field "
        "`Normal(loc, scale)` timed alternately with the tree in the same repeats.\n"
    )
    payload = {"rows": rows}
    if not args.skip_epochs:
        erows = epoch_rows(2 if args.smoke else 5, args.smoke)
        payload["epochs"] = erows
        md += (
            "\n## Time per epoch, TreeVI vs mean-field (Cora graph-prior VAE, batches of "
            "256 from DFS pieces of the spanning tree T1)\n\n"
            + markdown_table(erows)
            + "\nSame encoder, decoder and prior; TreeVI adds the pair network for rho "
            "and the tree in the guide. Blocks of one epoch alternate between the two.\n"
        )
    load = os.getloadavg()[0]
    md += f"\n1-minute load average at the end of the run: {load:.1f} on {os.cpu_count()} CPUs.\n"
    print(md)
    if not args.smoke:
        write_results("treevi_cost", payload, md, args=vars(args))
    return rows


if __name__ == "__main__":
    main()
