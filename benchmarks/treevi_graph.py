"""TreeVI, Secs. 4.3-4.4: user matching (MovieLens) and link prediction (Cora) with a
graph-correlated prior VAE, plain VAE vs mean-field vs TreeVI vs MTreeVI.

Run: ``python -m benchmarks.treevi_graph [--smoke] [--task movielens|cora|both]``.

Data (offline stand-ins, said beside the paper's figures): MovieLens latest-small (610
users; the paper used MovieLens 20M) and the Cora citation graph (2,708 nodes; the paper
used Epinions, not available offline).

* **User matching** (Table 3): every user's rated movies (movies rated by >= 20 users)
  are split at random into two halves, giving two synthetic users joined by an edge of
  the correlation graph. 90 % of the users train; for the held-out users the score is the
  reciprocal rank of each half's dual among all other held-out halves by the distance of
  the posterior means (Test RR).
* **Link prediction** (Table 4): per node, ``max(1, floor(0.1 deg))`` of its edges are
  held out (edges whose removal would isolate a node are kept); the model trains on the
  rest. Test NCRR: for every node with held-out edges, the cumulative reciprocal rank of
  its held-out neighbours among all non-training candidates by latent distance,
  normalised by its ideal value, averaged over nodes.

Methods, all with the same encoder/decoder: VAE (prior N(0, I), mean-field guide);
MF (graph prior N(0, (I + lambda A) ⊗ I), mean-field guide); TreeVI (graph prior, tree
guide on T1); MTreeVI (graph prior, mixture of T1 and T2). Trees: T1 = maximum spanning
forest of the training graph weighted by feature cosine similarity (for user matching the
pairs themselves); T2 = maximum spanning tree of ``10 A + cos`` over all nodes (for
Cora: random weights on the graph edges). Minibatches are connected DFS pieces of T1
(:func:`pyro_trees.guides.tree_batches`); each step estimates the ELBO of the batch's
marginal model (see :mod:`pyro_trees.guides.tree_vi`).
"""

from __future__ import annotations

import argparse
import csv
import time
from collections import defaultdict

import numpy as np
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from benchmarks._common import markdown_table, write_results
from pyro_trees.datasets import data_home
from pyro_trees.guides import (
    GaussianEncoder,
    PairNet,
    TreeVIGuide,
    TreeVIMixtureGuide,
    tree_batches,
)
from pyro_trees.infer import MixtureTreeELBO, maximum_spanning_tree
from pyro_trees.models import GraphPriorVAE

PAPER_RR = {"VAE": 0.3498, "TreeVI": None, "MTreeVI": None}  # TreeVI rows not legible
PAPER_NCRR = {"VAE": 0.0052, "TreeVI": None, "MTreeVI": None}
# The paper's TreeVI / MTreeVI cells of Tables 3-4 are bold and did not survive text
# extraction; its best baselines are CVAE 0.7129 (RR) and 0.0171 (NCRR).


def load_movielens_pairs(seed, min_count=20):
    path = data_home() / "movielens" / "ml-latest-small" / "ratings.csv"
    user_movies = defaultdict(list)
    counts = defaultdict(int)
    with open(path) as f:
        for row in csv.DictReader(f):
            user_movies[int(row["userId"])].append(int(row["movieId"]))
            counts[int(row["movieId"])] += 1
    movies = sorted(m for m, c in counts.items() if c >= min_count)
    col = {m: i for i, m in enumerate(movies)}
    rng = np.random.default_rng(seed)
    users = sorted(user_movies)
    x = np.zeros((2 * len(users), len(movies)), dtype=np.float32)
    for k, u in enumerate(users):
        ms = [col[m] for m in user_movies[u] if m in col]
        rng.shuffle(ms)
        half = len(ms) // 2
        x[2 * k, ms[:half]] = 1
        x[2 * k + 1, ms[half:]] = 1
    order = rng.permutation(len(users))
    n_test = len(users) // 10
    test_users, train_users = order[:n_test], order[n_test:]

    def nodes(us):
        return np.stack([2 * us, 2 * us + 1], 1).reshape(-1)

    return x, nodes(train_users), nodes(test_users)


def load_cora_split(seed):
    d = np.load(data_home() / "cora" / "cora.npz")
    x = d["features"].astype(np.float32)
    edges = d["edges"].astype(np.int64)
    n = x.shape[0]
    rng = np.random.default_rng(seed)
    deg = np.bincount(edges.reshape(-1), minlength=n)
    quota = np.maximum(1, deg // 10)
    held = np.zeros(len(edges), dtype=bool)
    taken = np.zeros(n, dtype=np.int64)
    cur_deg = deg.copy()
    for e in rng.permutation(len(edges)):
        i, j = edges[e]
        if taken[i] < quota[i] and cur_deg[i] > 1 and cur_deg[j] > 1:
            held[e] = True
            taken[i] += 1
            cur_deg[i] -= 1
            cur_deg[j] -= 1
    return x, edges[~held], edges[held]


def reciprocal_rank(emb, test_nodes):
    z = emb[test_nodes]
    dist = torch.cdist(z, z)
    dist.fill_diagonal_(float("inf"))
    m = len(test_nodes)
    dual = torch.arange(m) ^ 1  # halves are stored in pairs (2k, 2k+1)
    target = dist[torch.arange(m), dual]
    rank = (dist < target[:, None]).sum(1) + 1
    return float((1.0 / rank).mean())


def ncrr(emb, train_edges, test_edges, n):
    dist = torch.cdist(emb, emb)
    dist.fill_diagonal_(float("inf"))
    tr = torch.as_tensor(train_edges)
    dist[tr[:, 0], tr[:, 1]] = float("inf")
    dist[tr[:, 1], tr[:, 0]] = float("inf")
    test = defaultdict(list)
    for i, j in test_edges.tolist():
        test[i].append(j)
        test[j].append(i)
    scores = []
    for i, js in test.items():
        d = dist[i]
        ranks = torch.stack([(d <= d[j]).sum() for j in js]).double()
        crr = (1.0 / ranks).sum()
        ideal = (1.0 / torch.arange(1, len(js) + 1, dtype=torch.float64)).sum()
        scores.append(float(crr / ideal))
    return float(np.mean(scores))


def cosine(x):
    xn = x / x.norm(dim=1, keepdim=True).clamp_min(1e-8)
    return xn @ xn.T


def run_method(name, x, adj_edges, n, trees, batches, *, epochs, latent, strength, seed):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    f = x.shape[1]
    model = GraphPriorVAE(
        adj_edges,
        f,
        num_nodes=n,
        strength=0.0 if name == "VAE" else strength,
        latent_dim=latent,
        hidden_sizes=(128,),
    )
    enc = GaussianEncoder(f, latent, hidden_sizes=(128,))
    if name in ("VAE", "MF"):
        guide, elbo = TreeVIGuide(enc, None), Trace_ELBO()
    elif name == "TreeVI":
        guide, elbo = TreeVIGuide(enc, trees[0], pair_net=PairNet(f, latent)), Trace_ELBO()
    else:
        guide = TreeVIMixtureGuide(enc, torch.stack(trees), pair_net=PairNet(f, latent))
        elbo = MixtureTreeELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 2e-3}), elbo)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for _ in range(epochs):
        for b in torch.randperm(len(batches), generator=g).tolist():
            svi.step(x, idx=batches[b])
    seconds = time.perf_counter() - t0
    return guide, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--task", default="both", choices=["movielens", "cora", "both"])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = 1 if args.smoke else args.seeds
    methods = ["VAE", "MF", "TreeVI", "MTreeVI"]
    rows, raw = [], {}
    if args.task in ("movielens", "both"):
        scores, secs = defaultdict(list), defaultdict(list)
        for seed in range(seeds):
            x_all, train_nodes, test_nodes = load_movielens_pairs(seed)
            x_all = torch.as_tensor(x_all)
            x = x_all[torch.as_tensor(train_nodes)]
            n = x.shape[0]
            pairs = torch.stack([torch.arange(0, n, 2), torch.arange(1, n, 2)], 1)
            t1 = torch.tensor([-1 if i % 2 == 0 else i - 1 for i in range(n)])
            w = cosine(x)
            w[pairs[:, 0], pairs[:, 1]] = w[pairs[:, 1], pairs[:, 0]] = 10.0
            w.fill_diagonal_(-float("inf"))
            t2 = maximum_spanning_tree(w)
            batches = tree_batches(t1, 256, generator=torch.Generator().manual_seed(seed))
            for name in methods:
                guide, s = run_method(
                    name,
                    x,
                    pairs,
                    n,
                    [t1, t2],
                    batches,
                    epochs=3 if args.smoke else 150,
                    latent=16,
                    strength=0.5,
                    seed=seed,
                )
                secs[name].append(s)
                # held-out users are embedded by the trained encoder
                scores[name].append(reciprocal_rank(guide.median(x_all), test_nodes))
                print(f"movielens seed {seed} {name:8s} RR {scores[name][-1]:.4f} ({s:.0f} s)")
        raw["movielens"] = {"rr": dict(scores), "seconds": dict(secs)}
        for name in methods:
            v = torch.tensor(scores[name])
            rows.append(
                {
                    "task": "user matching (MovieLens small; paper: 20M)",
                    "method": name,
                    "metric": "test RR",
                    "ours": float(v.mean()),
                    "± std": float(v.std()) if len(v) > 1 else 0.0,
                    "paper": PAPER_RR.get(name) if name != "MF" else None,
                    "train s (ratio to MF)": sum(secs[name]) / sum(secs["MF"]),
                }
            )
    if args.task in ("cora", "both"):
        scores, secs = defaultdict(list), defaultdict(list)
        for seed in range(seeds):
            x, train_edges, test_edges = load_cora_split(seed)
            x = torch.as_tensor(x)
            n = x.shape[0]
            te = torch.as_tensor(train_edges)
            cos = cosine(x)
            t1 = maximum_spanning_tree(cos[te[:, 0], te[:, 1]], edges=te, num_nodes=n)
            rnd = torch.rand(len(te), generator=torch.Generator().manual_seed(seed))
            t2 = maximum_spanning_tree(rnd, edges=te, num_nodes=n)
            batches = tree_batches(t1, 256, generator=torch.Generator().manual_seed(seed))
            a = torch.zeros(n, n)
            a[te[:, 0], te[:, 1]] = a[te[:, 1], te[:, 0]] = 1
            lam_min = float(torch.linalg.eigvalsh(a.double())[0])
            strength = min(0.5, 0.9 / abs(lam_min))
            for name in methods:
                if args.smoke and name == "MTreeVI":
                    continue
                guide, s = run_method(
                    name,
                    x,
                    te,
                    n,
                    [t1, t2],
                    batches,
                    epochs=2 if args.smoke else 60,
                    latent=16,
                    strength=strength,
                    seed=seed,
                )
                secs[name].append(s)
                scores[name].append(ncrr(guide.median(x), train_edges, test_edges, n))
                print(f"cora seed {seed} {name:8s} NCRR {scores[name][-1]:.4f} ({s:.0f} s)")
        raw["cora"] = {"ncrr": dict(scores), "seconds": dict(secs)}
        for name in methods:
            if not scores[name]:
                continue
            v = torch.tensor(scores[name])
            rows.append(
                {
                    "task": "link prediction (Cora; paper: Epinions)",
                    "method": name,
                    "metric": "test NCRR",
                    "ours": float(v.mean()),
                    "± std": float(v.std()) if len(v) > 1 else 0.0,
                    "paper": PAPER_NCRR.get(name) if name != "MF" else None,
                    "train s (ratio to MF)": sum(secs[name]) / sum(secs["MF"]),
                }
            )
    md = markdown_table(rows) + (
        f"\n{seeds} seed(s). Stand-in data: MovieLens latest-small for MovieLens 20M and "
        "Cora for Epinions, so the paper's figures are context, not targets. The "
        "paper's TreeVI/MTreeVI cells of Tables 3-4 are unreadable in our copy of the "
        "text. Speed on a shared 2-core machine (contended).\n"
    )
    print(md)
    if not args.smoke:
        write_results("treevi_graph", {"rows": rows, "raw": raw}, md, args=vars(args))
    return rows


if __name__ == "__main__":
    main()
