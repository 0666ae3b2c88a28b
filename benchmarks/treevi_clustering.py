"""TreeVI, Table 2 (MNIST row): constrained clustering in the DC-GMM style with 6,000
pairwise constraints, mean-field vs TreeVI vs MTreeVI posteriors, same run.

Run: ``python -m benchmarks.treevi_clustering [--smoke]``.

Data: the first ``--num-images`` (default: all 10,000) of the MNIST test images we have
offline (the paper used all 70,000), binarised at 0.5. Constraints: 6,000 random pairs
labelled must-link (same digit) or cannot-link, weight ``±W`` (the paper: 1e4; here
``--weight``, default 1e4; other weights write ``..._w<W>``). Every method starts from
the same pretrained autoencoder (``--ae-epochs``) and a Gaussian mixture fitted to its
codes (VaDE / DC-GMM practice), then trains for ``--epochs`` passes of Adam over
minibatches.

Minibatches: the model's constraint term counts only pairs with both ends in the batch,
so the batches are chunks of a depth-first listing of T1 (``tree_batches``), which holds
the constraint pairs as edges; every method sees the same batches in the same order.
Each step's objective is the ELBO of the batch's instances alone (its constraints among
them), not a rescaled estimate of the full-data ELBO.

TreeVI's tree T1: maximum spanning tree of the 10-nearest-neighbour graph of the
autoencoder codes (cosine similarity) with must-links added at weight 10 (so they enter
first) and cannot-links at weight 5 (``--no-cannot-edges``: cannot-links left out and
removed from the neighbour graph); MTreeVI mixes it with a similarity-weighted DFS tree
T2 (App. D.2). The pair network sees the two ends' encoder outputs ``[loc, log scale]``
(``--pair-inputs codes``; the paper's eq. 12 uses the images, ``data``) and the edge's
constraint flags (must-link, cannot-link; ``--no-edge-features`` drops them). Both guides
share every other setting.

Estimator (``--estimator``): ``trace`` trains mean-field and TreeVI with
``Trace_ELBO`` (MTreeVI with ``MixtureTreeELBO``) and writes ``treevi_clustering``;
``pairwise`` trains mean-field and TreeVI with :class:`~pyro_trees.infer.PairwiseELBO`
(the same ELBO with lower variance: per-instance terms on one independent draw of the
marginals, the constraint term averaged over ``--pair-particles`` draws of ``q``, exact
entropy; identical settings for both guides) and writes ``treevi_clustering_pairwise``.

Metrics: ACC (Hungarian matching), NMI, ARI; mean ± std over seeds, and per method the
seeds it wins against mean-field with the mean paired difference. ``--part FILE`` runs
a subset of seeds (``--first-seed``, ``--seeds``) and ``--merge A,B`` combines parts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from benchmarks._common import markdown_table, write_results
from pyro_trees.datasets import data_home
from pyro_trees.guides import (
    GaussianEncoder,
    PairNet,
    TreeVIGuide,
    TreeVIMixtureGuide,
    tree_batches,
)
from pyro_trees.infer import (
    MixtureTreeELBO,
    PairwiseELBO,
    maximum_spanning_tree,
    similarity_dfs_tree,
)
from pyro_trees.models import ConstrainedClusteringVAE

PAPER = {  # Table 2, MNIST (70,000 images)
    "mean-field (DC-GMM)": {"ACC": 96.5, "NMI": 91.4, "ARI": 92.5},
    "TreeVI": {"ACC": 97.4, "NMI": 93.1, "ARI": 93.7},
    "MTreeVI": {"ACC": 97.5, "NMI": 93.1, "ARI": 94.0},
}


def load_mnist_test():
    root = data_home() / "mnist"
    with gzip.open(root / "t10k-images-idx3-ubyte.gz") as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(root / "t10k-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)
    return (x >= 128).astype(np.float32), y.astype(np.int64)


def cluster_metrics(y, pred):
    from scipy.optimize import linear_sum_assignment
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    k = max(y.max(), pred.max()) + 1
    cm = np.zeros((k, k), dtype=np.int64)
    np.add.at(cm, (pred, y), 1)
    r, c = linear_sum_assignment(-cm)
    return {
        "ACC": 100 * cm[r, c].sum() / len(y),
        "NMI": 100 * normalized_mutual_info_score(y, pred),
        "ARI": 100 * adjusted_rand_score(y, pred),
    }


def pretrain(x, latent, hidden, epochs, seed):
    """Deterministic autoencoder (encoder mean + decoder) and a GMM on its codes."""
    from sklearn.mixture import GaussianMixture

    torch.manual_seed(seed)
    enc = GaussianEncoder(x.shape[1], latent, hidden_sizes=hidden)
    dec = nn.Sequential(nn.Linear(latent, hidden[0]), nn.Softplus(), nn.Linear(hidden[0], 784))
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)
    for _ in range(epochs):
        for b in torch.randperm(len(x)).split(256):
            opt.zero_grad()
            z = enc(x[b])[0]
            loss = nn.functional.binary_cross_entropy_with_logits(dec(z), x[b], reduction="sum")
            (loss / len(b)).backward()
            opt.step()
    with torch.no_grad():
        codes = enc(x)[0]
    gmm = GaussianMixture(10, covariance_type="diag", random_state=seed).fit(codes.numpy())
    return enc.state_dict(), dec.state_dict(), gmm, codes


def build_trees(codes, pairs, must, seed, k=10, cannot_links=False):
    n = len(codes)
    cn = codes / codes.norm(dim=1, keepdim=True)
    sim = cn @ cn.T
    sim.fill_diagonal_(-2.0)
    val, nbr = sim.topk(k, dim=1)
    edges = torch.stack([torch.arange(n).repeat_interleave(k), nbr.reshape(-1)], 1)
    weights = val.reshape(-1)
    cannot = {tuple(sorted(p)) for p in pairs[~must].tolist()}
    keep = torch.tensor([tuple(sorted(e)) not in cannot for e in edges.tolist()])
    edges = torch.cat([edges[keep], pairs[must]])
    weights = torch.cat([weights[keep], torch.full((int(must.sum()),), 10.0)])
    if cannot_links:  # after the must-links, before any similarity edge
        edges = torch.cat([edges, pairs[~must]])
        weights = torch.cat([weights, torch.full((int((~must).sum()),), 5.0)])
    t1 = maximum_spanning_tree(weights, edges=edges, num_nodes=n)
    t2 = similarity_dfs_tree(codes, num_neighbors=k, generator=torch.Generator().manual_seed(seed))
    return t1, t2


def constraint_edges(tree, pairs, must):
    """``(N, 2)`` float features of each node's parent edge in ``tree``: column 0 is 1 on
    must-link constraints, column 1 on cannot-links (both 0 on similarity edges)."""
    n = len(tree)
    key = lambda a, b: torch.minimum(a, b) * n + torch.maximum(a, b)  # noqa: E731
    edge = key(torch.arange(n), tree.clamp_min(0))
    cols = [torch.isin(edge, key(pairs[m][:, 0], pairs[m][:, 1])) for m in (must, ~must)]
    return (torch.stack(cols, -1) & (tree >= 0).unsqueeze(-1)).float()


def constraint_rates(pred, pairs, must):
    """Percent of must-links with both ends in one cluster, of cannot-links split."""
    p = torch.as_tensor(pred)
    same = p[pairs[:, 0]] == p[pairs[:, 1]]
    return 100 * float(same[must].float().mean()), 100 * float((~same[~must]).float().mean())


@torch.no_grad()
def edge_rho(guide, x, tree, pairs, must):
    """Mean learned edge correlation (over edges and latent dimensions) of the tree
    ``tree`` on its must-link edges, its cannot-link edges and its other edges."""
    if isinstance(guide, TreeVIMixtureGuide):
        rho = guide._components(x, None)[0].rho
    else:
        rho = guide.distribution(x).rho
    kind = constraint_edges(tree, pairs, must).bool()
    r = rho.mean(-1)
    out = []
    for m in (kind[:, 0], kind[:, 1], (tree >= 0) & ~kind.any(-1)):
        out.append(float(r[m].mean()) if m.any() else None)
    return out


@torch.no_grad()
def final_elbo(model, guide, elbo, x, num=8):
    """The training objective (ELBO, per image) at the end, averaged over ``num`` draws."""
    return -sum(elbo.loss(model, guide, x) for _ in range(num)) / num / len(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=60, help="passes over the minibatches")
    parser.add_argument("--ae-epochs", type=int, default=30, help="autoencoder pretraining")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight", type=float, default=1e4)
    parser.add_argument("--num-images", type=int, default=10000)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(PAPER), help="comma-separated")
    parser.add_argument("--pair-inputs", default="codes", choices=("data", "codes"))
    parser.add_argument("--no-edge-features", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--cannot-edges",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cannot-links as edges of T1 (so that batches hold them)",
    )
    parser.add_argument("--zero-rho-init", action="store_true", help="rho starts at 0")
    parser.add_argument(
        "--rng-offset", type=int, default=0, help="training noise seed = seed + offset"
    )
    parser.add_argument(
        "--estimator",
        default="trace",
        choices=("trace", "pairwise"),
        help="trace: Trace_ELBO (MixtureTreeELBO for MTreeVI); pairwise: PairwiseELBO "
        "(Rao-Blackwellised, exact entropy) for mean-field and TreeVI",
    )
    parser.add_argument(
        "--pair-particles", type=int, default=16, help="draws of the pairwise term (pairwise)"
    )
    parser.add_argument("--part", help="write the raw results of these seeds to this file")
    parser.add_argument("--merge", help="comma-separated --part files to combine")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge.split(","))
    torch.set_num_threads(1)
    x_np, y = load_mnist_test()
    n, epochs, ae_epochs, seeds = (
        min(args.num_images, len(y)),
        args.epochs,
        args.ae_epochs,
        args.seeds,
    )
    if args.smoke:
        n, epochs, ae_epochs, seeds = 1000, 1, 1, 1
    x = torch.as_tensor(x_np[:n])
    y = y[:n]
    latent, hidden = 10, (256,)
    names = args.methods.split(",")
    ef = not args.no_edge_features
    zi = args.zero_rho_init
    pair_in = 784 if args.pair_inputs == "data" else 2 * latent
    results = {k: [] for k in names}
    seconds = {k: [] for k in names}
    diag = {k: [] for k in names}
    for seed in range(args.first_seed, args.first_seed + seeds):
        rng = np.random.default_rng(seed)
        pairs = torch.as_tensor(rng.choice(n, size=(6000, 2)))
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        must = torch.as_tensor(y[pairs[:, 0]] == y[pairs[:, 1]])
        w = torch.where(must, args.weight, -args.weight)
        enc_state, dec_state, gmm, codes = pretrain(x, latent, hidden, ae_epochs, seed)
        t1, t2 = build_trees(codes, pairs, must, seed, cannot_links=args.cannot_edges)
        e1, e2 = constraint_edges(t1, pairs, must), constraint_edges(t2, pairs, must)
        for name in names:
            pyro.clear_param_store()
            pyro.set_rng_seed(seed + args.rng_offset)
            model = ConstrainedClusteringVAE(
                784, 10, latent_dim=latent, hidden_sizes=hidden, constraints=pairs, weights=w
            )
            model.decoder.load_state_dict(dec_state)
            with torch.no_grad():
                model.cluster_logits.copy_(torch.as_tensor(np.log(gmm.weights_)))
                model.cluster_loc.copy_(torch.as_tensor(gmm.means_))
                model.cluster_log_scale.copy_(0.5 * torch.as_tensor(np.log(gmm.covariances_)))
            enc = GaussianEncoder(784, latent, hidden_sizes=hidden)
            enc.load_state_dict(enc_state)
            if name.startswith("mean-field"):
                guide, elbo = TreeVIGuide(enc, None), Trace_ELBO()
            elif name == "TreeVI":
                guide = TreeVIGuide(
                    enc,
                    t1,
                    pair_net=PairNet(
                        pair_in, latent, hidden_sizes=(64,), edge_features=2 * int(ef), zero_init=zi
                    ),
                    edge_features=e1 if ef else None,
                    pair_inputs=args.pair_inputs,
                )
                elbo = Trace_ELBO()
            else:
                guide = TreeVIMixtureGuide(
                    enc,
                    torch.stack([t1, t2]),
                    pair_net=PairNet(
                        pair_in, latent, hidden_sizes=(64,), edge_features=2 * int(ef), zero_init=zi
                    ),
                    edge_features=torch.stack([e1, e2]) if ef else None,
                    pair_inputs=args.pair_inputs,
                )
                elbo = MixtureTreeELBO()
            if args.estimator == "pairwise":
                if name == "MTreeVI":
                    raise SystemExit("--estimator pairwise supports mean-field and TreeVI")
                elbo = PairwiseELBO(args.pair_particles)
            svi = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), elbo)
            batches = torch.Generator().manual_seed(seed)  # same batches for every method
            t0 = time.perf_counter()
            for _ in range(epochs):
                for idx in tree_batches(t1, args.batch_size, generator=batches):
                    svi.step(x, idx=idx)
            seconds[name].append((time.perf_counter() - t0) / epochs)
            pred = model.predict(guide.median(x)).numpy()
            results[name].append(cluster_metrics(y, pred))
            ml, cl = constraint_rates(pred, pairs, must)
            rho = [None] * 3 if name.startswith("mean") else edge_rho(guide, x, t1, pairs, must)
            diag[name].append(
                {
                    "must": ml,
                    "cannot": cl,
                    "rho_ml": rho[0],
                    "rho_cl": rho[1],
                    "rho_other": rho[2],
                    "elbo": final_elbo(model, guide, elbo, x),
                }
            )
            print(f"seed {seed} {name:20s} {results[name][-1]} {diag[name][-1]}", flush=True)
    meta = {"n": n, "epochs": epochs, "ae_epochs": ae_epochs, "weight": args.weight}
    meta.update(batch_size=args.batch_size, lr=args.lr, cannot_edges=args.cannot_edges)
    meta["estimator"] = args.estimator
    meta["args"] = vars(args)
    meta["pair_particles"] = args.pair_particles if args.estimator == "pairwise" else None
    if args.part:
        Path(args.part).write_text(
            json.dumps(
                {"names": names, "raw": results, "seconds": seconds, "diagnostics": diag, **meta},
                default=float,
            )
        )
        return None
    return summarise(names, results, seconds, diag, meta, write=not (args.smoke or args.no_write))


def merge(paths):
    """Combine the ``--part`` files of runs over disjoint seeds into one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    names = parts[0]["names"]
    cat = lambda key: {k: sum((p[key][k] for p in parts), []) for k in names}  # noqa: E731
    keys = ("n", "epochs", "ae_epochs", "weight", "estimator", "pair_particles")
    keys += ("batch_size", "lr", "cannot_edges")
    meta = {k: parts[0].get(k) for k in keys}
    return summarise(names, cat("raw"), cat("seconds"), cat("diagnostics"), meta, write=True)


def paired(results, name, base):
    """Per metric: wins of ``name`` over ``base`` in paired seeds and the mean paired
    difference with its standard error."""
    out = {}
    for m in ("ACC", "NMI", "ARI"):
        d = np.array([a[m] - b[m] for a, b in zip(results[name], results[base], strict=True)])
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        out[m] = f"{int((d > 0).sum())}/{len(d)}, {d.mean():+.2f} ± {se:.2f}"
    return out


def summarise(names, results, seconds, diag, meta, write):
    seeds = len(results[names[0]])
    base = next((k for k in names if k.startswith("mean")), None)
    rows = []
    for name in names:
        row = {"method": name}
        for m in ("ACC", "NMI", "ARI"):
            v = torch.tensor([r[m] for r in results[name]], dtype=torch.float64)
            row[f"{m} (ours)"] = (
                f"{float(v.mean()):.1f} ± {float(v.std()) if len(v) > 1 else 0.0:.1f}"
            )
            row[f"{m} (paper)"] = PAPER[name][m]
        if base is not None:
            for m, txt in paired(results, name, base).items():
                row[f"{m}: seeds won, paired diff"] = txt if name != base else ""
        ref = seconds[base] if base is not None else seconds[name]
        row["s / epoch"] = float(np.mean(seconds[name]))
        row["ratio to MF"] = sum(seconds[name]) / sum(ref)
        row["must-links kept %"] = float(np.mean([d["must"] for d in diag[name]]))
        row["cannot-links kept %"] = float(np.mean([d["cannot"] for d in diag[name]]))
        for col, k in (
            ("ELBO / image", "elbo"),
            ("rho, must-link edges of T1", "rho_ml"),
            ("rho, cannot-link edges of T1", "rho_cl"),
            ("rho, other edges of T1", "rho_other"),
        ):
            vals = [d[k] for d in diag[name] if d.get(k) is not None]
            row[col] = float(np.mean(vals)) if vals else None
        rows.append(row)
    md = markdown_table(rows) + (
        f"\n{seeds} seed(s); the first {meta['n']} MNIST test images (the paper: all 70,000 "
        f"MNIST images); 6,000 constraints of weight ±{meta['weight']:g}; {meta['epochs']} "
        f"epochs of Adam (lr {meta['lr']:g}) over batches of {meta['batch_size']} (chunks of "
        f"T1, which holds the must-links{' and cannot-links' if meta['cannot_edges'] else ''}"
        f"; the same batches for every method) after {meta['ae_epochs']} autoencoder epochs. "
        "'seeds won, "
        "paired diff': seeds where the method beats mean-field on that metric, and the mean "
        "paired difference ± its standard error. 'kept': constraints the predicted clusters "
        "satisfy; 'ELBO / image': the final training objective (8 draws); 'rho': the "
        "learned edge correlation (mean over edges and latent dimensions) on the "
        "must-link, cannot-link and other edges of T1. Speed: one torch thread, with "
        "another run on the second core.\n"
    )
    est = meta.get("estimator") or "trace"
    if est == "pairwise":
        md += (
            f"Estimator: PairwiseELBO for every method (one independent draw of the "
            f"marginals for the per-instance terms, {meta['pair_particles']} draws of q for "
            "the constraint term, exact entropy; same settings for both guides).\n"
        )
    print(md)
    if write:
        name = "treevi_clustering" if est == "trace" else f"treevi_clustering_{est}"
        if meta["weight"] != 1e4:  # the paper's weight keeps the plain name
            name += f"_w{meta['weight']:g}"
        write_results(
            name,
            {"rows": rows, "raw": results, "seconds": seconds, "diagnostics": diag, **meta},
            md,
        )
    return rows


if __name__ == "__main__":
    main()
