"""TreeVI, Table 2 (MNIST row): constrained clustering in the DC-GMM protocol with 6,000
pairwise constraints: VaDE, mean-field (DC-GMM), TreeVI and MTreeVI, same run.

Run: ``python -m benchmarks.treevi_clustering [--smoke]``; ``--stage diagnose`` records
where the shared pipeline falls short (the start, VaDE, DC-GMM), ``--stage start`` the
pretrained start alone.

Defaults follow the paper's protocol, each setting and its source listed in
:data:`benchmarks._clustering.PROTOCOL`: all 70,000 MNIST images as grey levels (``--data``,
``--num-images`` for a random subset, ``--binarise``), the VaDE / DC-GMM networks
(``--arch dcgmm``: 784-500-500-2000-10, ReLU), the autoencoder pretrained for 10 epochs
(``--ae-epochs``) and a diagonal Gaussian mixture fitted to its codes, uniform fixed
mixture weights (``--cluster-weights``), 6,000 random constraints of weight ``W_ij = ±1e4``
(``--weight``; eq. 19 sums both orders of a pair, so the model gets ``±2W`` per pair), and
1,000 epochs (``--epochs``) of Adam at 1e-3 decayed by 0.9 every 20 epochs, ten seeds.

Every table starts with the row "AE + GMM": the pretrained start alone (the mixture's
assignment of the codes), the stage VaDE and DC-GMM start from. Methods (``--methods``):
``VaDE`` (mean-field, no constraints), ``mean-field (DC-GMM)``, ``TreeVI``, ``MTreeVI``;
``--stage diagnose`` runs the first two and writes ``treevi_clustering_stages``;
``--stage start`` none (``treevi_clustering_start``).

Minibatches (``--batches``): ``dcgmm`` (DC-GMM's) shuffles the images into batches of
``--batch-size``, then adds the constraint pairs half a batch at a time, so every
constraint enters every epoch; ``tree`` cuts a depth-first listing of T1 (which holds
the constraint pairs as edges) into chunks. Every method sees the same batches in the
same order. The model's constraint term counts only pairs with both ends in the batch;
each step's objective is the batch's own ELBO.

TreeVI's tree T1: maximum spanning tree of the 10-nearest-neighbour graph of the
autoencoder codes (cosine similarity) with must-links added at weight 10 and
cannot-links at weight 5 (``--no-cannot-edges``: cannot-links left out and removed from
the neighbour graph); MTreeVI mixes it with a similarity-weighted DFS tree T2 (App. D.2).
The pair network sees the two ends' encoder outputs ``[loc, scale]`` (``--pair-inputs
codes``; eq. 12 uses the images, ``data``) and the edge's constraint flags
(``--no-edge-features`` drops them).

Estimator (``--estimator``): ``trace`` (``Trace_ELBO``; ``MixtureTreeELBO`` for MTreeVI)
or ``pairwise`` (:class:`~pyro_trees.infer.PairwiseELBO`, mean-field and TreeVI; writes
``treevi_clustering_pairwise``).

Metrics: ACC (Hungarian matching), NMI, ARI on all images clustered; mean ± std over
seeds, per method the seeds it wins against mean-field and the mean paired difference,
and seconds per training epoch beside the paper's (RTX 3090). ``--part FILE`` runs a
subset of seeds (``--first-seed``, ``--seeds``), ``--merge A,B`` combines parts;
``--name`` writes a variant; ``--start-cache DIR`` keeps each seed's pretrained start.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO

from benchmarks._clustering import (
    ARCHS,
    PROTOCOL,
    PROTOCOL_NOTES,
    build_trees,
    cached_start,
    cluster_metrics,
    dcgmm_batches,
    fit_gmm,
    load_images,
    make_networks,
    pretrain,
    sample_constraints,
)
from benchmarks._common import markdown_table, write_results
from pyro_trees.guides import (
    PairNet,
    TreeVIGuide,
    TreeVIMixtureGuide,
    tree_batches,
)
from pyro_trees.infer import MixtureTreeELBO, PairwiseELBO, keep_freed_memory
from pyro_trees.models import ConstrainedClusteringVAE

START = "AE + GMM (start)"
PAPER = {  # Table 2, MNIST (70,000 images); s / epoch from Sec. 4.2 (RTX 3090)
    START: {"ACC": None, "NMI": None, "ARI": None, "s / epoch": None},
    "VaDE": {"ACC": 89.0, "NMI": 82.8, "ARI": 80.9, "s / epoch": None},
    "mean-field (DC-GMM)": {"ACC": 96.5, "NMI": 91.4, "ARI": 92.5, "s / epoch": "2-3"},
    "TreeVI": {"ACC": 97.4, "NMI": 93.1, "ARI": 93.7, "s / epoch": "~5"},
    "MTreeVI": {"ACC": 97.5, "NMI": 93.1, "ARI": 94.0, "s / epoch": "~9"},
}
METHODS = "mean-field (DC-GMM),TreeVI,MTreeVI"
STAGES = "VaDE,mean-field (DC-GMM)"


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
        rho = guide.distribution(x).components[0].rho
    else:
        rho = guide.distribution(x).rho
    r = rho.mean(-1).cpu()
    kind = constraint_edges(tree, pairs, must).bool()
    out = []
    for m in (kind[:, 0], kind[:, 1], (tree >= 0) & ~kind.any(-1)):
        out.append(float(r[m].mean()) if m.any() else None)
    return out


@torch.no_grad()
def final_elbo(model, guide, elbo, x, num=8):
    """The training objective (ELBO, per image) at the end, averaged over ``num`` draws."""
    return -sum(elbo.loss(model, guide, x) for _ in range(num)) / num / len(x)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--smoke", action="store_true", help="1,000 images, 100 constraints, 2 epochs"
    )
    parser.add_argument("--stage", default="methods", choices=("methods", "diagnose", "start"))
    parser.add_argument(
        "--methods", default=METHODS, help="comma-separated; --stage diagnose: " + STAGES
    )
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--data", default="all", choices=("all", "train", "test"))
    parser.add_argument("--num-images", type=int, default=0, help="random subset (0: all)")
    parser.add_argument("--binarise", action="store_true", help="pixels >= 0.5 (before issue 40)")
    parser.add_argument("--arch", default="dcgmm", choices=tuple(ARCHS))
    parser.add_argument("--ae-epochs", type=int, default=10, help="autoencoder pretraining")
    parser.add_argument("--ae-batch-size", type=int, default=32)
    parser.add_argument("--ae-lr", type=float, default=1e-3)
    parser.add_argument(
        "--ae-dropout", type=float, default=0.0, help="input dropout: a denoising autoencoder"
    )
    parser.add_argument(
        "--ae-init",
        default="torch",
        choices=("torch", "glorot"),
        help="start of the autoencoder's layers (glorot: Keras' default, the papers' codes')",
    )
    parser.add_argument(
        "--ae-layerwise-epochs",
        type=int,
        default=0,
        help="greedy layer-wise denoising pretraining first, this many epochs a layer",
    )
    parser.add_argument("--gmm-inits", type=int, default=3)
    parser.add_argument("--shared-pretrain", action="store_true", help="one start for all seeds")
    parser.add_argument("--start-cache", help="directory keeping each pretrained start")
    parser.add_argument("--cluster-weights", default="uniform", choices=("uniform", "gmm"))
    parser.add_argument("--num-constraints", type=int, default=6000)
    parser.add_argument(
        "--weight", type=float, default=1e4, help="|W_ij|; the model gets 2W a pair"
    )
    parser.add_argument("--batches", default="dcgmm", choices=("dcgmm", "tree"))
    parser.add_argument("--epochs", type=int, default=1000, help="passes over the minibatches")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay", type=float, default=0.9)
    parser.add_argument("--lr-decay-every", type=int, default=20, help="epochs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pair-inputs", default="codes", choices=("data", "codes"))
    parser.add_argument("--no-edge-features", action="store_true")
    parser.add_argument("--cannot-edges", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--zero-rho-init", action="store_true", help="rho starts at 0")
    parser.add_argument(
        "--rng-offset", type=int, default=0, help="training noise seed = seed + offset"
    )
    parser.add_argument("--estimator", default="trace", choices=("trace", "pairwise"))
    parser.add_argument("--pair-particles", type=int, default=16, help="draws of the pairwise term")
    parser.add_argument(
        "--elbo-draws", type=int, default=8, help="draws of the final ELBO (0: skip)"
    )
    parser.add_argument(
        "--name", help="result name (a variant); default from --stage, --estimator, --weight"
    )
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--part", help="write the raw results of these seeds to this file")
    parser.add_argument("--merge", help="comma-separated --part files to combine")
    args = parser.parse_args(argv)
    if args.stage != "methods" and args.methods == METHODS:
        args.methods = STAGES if args.stage == "diagnose" else ""
    if args.smoke:
        args.num_images, args.num_constraints, args.seeds = 1000, 100, 1
        args.epochs, args.ae_epochs, args.elbo_draws = 2, 1, 1
    return args


def make_guide(name, enc, trees, args, latent):
    """The guide and ELBO of method ``name``, around the pretrained encoder ``enc``."""
    if name in ("VaDE", "mean-field (DC-GMM)"):
        guide, elbo = TreeVIGuide(enc, None), Trace_ELBO()
    else:
        ef = not args.no_edge_features
        net = PairNet(
            784 if args.pair_inputs == "data" else 2 * latent,
            latent,
            hidden_sizes=(64,),
            edge_features=2 * int(ef),
            zero_init=args.zero_rho_init,
        )
        (t1, t2), (e1, e2) = trees["trees"], trees["edge_features"]
        if name == "TreeVI":
            guide = TreeVIGuide(
                enc,
                t1,
                pair_net=net,
                edge_features=e1 if ef else None,
                pair_inputs=args.pair_inputs,
            )
            elbo = Trace_ELBO()
        else:
            guide = TreeVIMixtureGuide(
                enc,
                torch.stack([t1, t2]),
                pair_net=net,
                edge_features=torch.stack([e1, e2]) if ef else None,
                pair_inputs=args.pair_inputs,
            )
            elbo = MixtureTreeELBO()
    if args.estimator == "pairwise":
        if name == "MTreeVI":
            raise SystemExit("--estimator pairwise supports mean-field and TreeVI")
        elbo = PairwiseELBO(args.pair_particles)
    return guide, elbo


def start_of(seed, x, y, args):
    """The pretrained autoencoder and the mixture fitted to its codes (cached)."""
    s = args.first_seed if args.shared_pretrain else seed
    keys = ("data", "num_images", "binarise", "arch", "ae_epochs", "ae_batch_size", "ae_lr")
    keys += ("ae_dropout",) if args.ae_dropout else ()
    keys += ("ae_init",) if args.ae_init != "torch" else ()
    keys += ("ae_layerwise_epochs",) if args.ae_layerwise_epochs else ()
    settings = {k: getattr(args, k) for k in keys} | {"seed": s, "gmm_inits": args.gmm_inits}

    def build():
        enc, dec, codes, sec = pretrain(
            x,
            arch=args.arch,
            latent=10,
            num_clusters=10,
            epochs=args.ae_epochs,
            batch_size=args.ae_batch_size,
            lr=args.ae_lr,
            seed=s,
            dropout=args.ae_dropout,
            init=args.ae_init,
            layerwise_epochs=args.ae_layerwise_epochs,
        )
        gmm = fit_gmm(codes, 10, s, args.gmm_inits)
        cpu = lambda d: {k: v.cpu() for k, v in d.items()}  # noqa: E731
        return {
            "enc": cpu(enc),
            "dec": cpu(dec),
            "codes": codes,
            "ae_seconds": sec,
            "weights": gmm.weights_,
            "means": gmm.means_,
            "variances": gmm.covariances_,
            "pred": gmm.predict(codes.double().numpy()),
        }

    return cached_start(args.start_cache, settings, build)


def run_seed(seed, x, y, names, args):
    """Every method of one seed from the same start: ``{name: (metrics, s / epoch,
    diagnostics)}``, the start's row first."""
    dev, n = x.device, len(y)
    pairs, must = sample_constraints(y, args.num_constraints, np.random.default_rng(seed))
    w = torch.where(must, 2 * args.weight, -2 * args.weight)
    start = start_of(seed, x, y, args)
    ml, cl = constraint_rates(start["pred"], pairs, must)
    out = {START: (cluster_metrics(y, start["pred"]), start["ae_seconds"], {"must": ml})}
    out[START][2]["cannot"] = cl
    trees = {}
    if args.batches == "tree" or {"TreeVI", "MTreeVI"} & set(names):
        t = build_trees(start["codes"], pairs, must, seed, cannot_links=args.cannot_edges)
        trees = {"trees": t, "edge_features": [constraint_edges(ti, pairs, must) for ti in t]}
    _, dec_h, act = ARCHS[args.arch]
    for name in names:
        pyro.clear_param_store()
        pyro.set_rng_seed(seed + args.rng_offset)
        constrained = name != "VaDE"
        model = ConstrainedClusteringVAE(
            784,
            10,
            latent_dim=10,
            hidden_sizes=dec_h,
            activation=act,
            learn_cluster_weights=args.cluster_weights == "gmm",
            constraints=pairs if constrained else None,
            weights=w if constrained else None,
        )
        model.decoder.load_state_dict(start["dec"])
        with torch.no_grad():
            if args.cluster_weights == "gmm":
                model.cluster_logits.copy_(torch.as_tensor(np.log(start["weights"])))
            model.cluster_loc.copy_(torch.as_tensor(start["means"]))
            model.cluster_log_scale.copy_(0.5 * torch.as_tensor(np.log(start["variances"])))
        enc = make_networks(args.arch, 10, 10)[0]
        enc.load_state_dict(start["enc"])
        guide, elbo = make_guide(name, enc, trees, args, 10)
        model.to(dev)
        guide.to(dev)
        optim = pyro.optim.StepLR(
            {
                "optimizer": torch.optim.Adam,
                "optim_args": {"lr": args.lr},
                "step_size": args.lr_decay_every,
                "gamma": args.lr_decay,
            }
        )
        svi = SVI(model, guide, optim, elbo)
        gen = torch.Generator().manual_seed(seed)  # the same batches for every method
        own = pairs if constrained else pairs[:0]
        t0 = time.perf_counter()
        for _ in range(args.epochs):
            if args.batches == "dcgmm":
                batches = dcgmm_batches(n, own, args.batch_size, gen)
            else:
                batches = tree_batches(trees["trees"][0], args.batch_size, generator=gen)
            for idx in batches:
                svi.step(x, idx=idx.to(dev))
            optim.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        sec = (time.perf_counter() - t0) / max(args.epochs, 1)
        with torch.no_grad():
            z = torch.cat([guide.median(xc) for xc in x.split(8192)])
            pred = model.predict(z).cpu().numpy()
        ml, cl = constraint_rates(pred, pairs, must)
        rho = [None] * 3
        if name in ("TreeVI", "MTreeVI"):
            rho = edge_rho(guide, x, trees["trees"][0], pairs, must)
        d = {"must": ml, "cannot": cl, "rho_ml": rho[0], "rho_cl": rho[1], "rho_other": rho[2]}
        d["elbo"] = final_elbo(model, guide, elbo, x, args.elbo_draws) if args.elbo_draws else None
        out[name] = (cluster_metrics(y, pred), sec, d)
        print(f"seed {seed} {name:20s} {out[name][0]} {sec:.2f} s/epoch {d}", flush=True)
    return out


def main(argv=None):
    args = parse(argv)
    if args.merge:
        return merge(args.merge.split(","))
    torch.set_num_threads(1)
    keep_freed_memory()  # its loops are its own; infer.fit and the estimators do the same
    x_np, y = load_images(args.data, args.num_images, args.binarise)
    x = torch.as_tensor(x_np, device=args.device)
    names = [m for m in args.methods.split(",") if m]
    cols = [START, *names]
    results, seconds, diag = ({k: [] for k in cols} for _ in range(3))
    print(f"{len(y)} images, {args.num_constraints} constraints, methods {names}", flush=True)
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name, (metrics, sec, d) in run_seed(seed, x, y, names, args).items():
            results[name].append(metrics)
            seconds[name].append(sec)
            diag[name].append(d)
        print(f"seed {seed} {START:20s} {results[START][-1]}", flush=True)
    meta = {"n": len(y), "args": vars(args), "names": cols}
    if args.part:
        Path(args.part).write_text(
            json.dumps({"raw": results, "seconds": seconds, "diagnostics": diag, **meta})
        )
        return None
    write = not (args.smoke or args.no_write)
    return summarise(cols, results, seconds, diag, meta, write=write)


def merge(paths):
    """Combine the ``--part`` files of runs over disjoint seeds into one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    names = parts[0]["names"]
    cat = lambda key: {k: sum((p[key][k] for p in parts), []) for k in names}  # noqa: E731
    meta = {k: parts[0][k] for k in ("n", "args", "names")}
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


def describe(meta, seeds):
    """The setup under the table: the run's settings beside the protocol's."""
    a = meta["args"]
    data = {"all": "MNIST images (train + test)", "train": "MNIST training images"}
    what = data.get(a["data"], "MNIST test images")
    subset = "a random subset of " if a["num_images"] else "all "
    pixels = "bits (pixels >= 0.5)" if a["binarise"] else "grey levels"
    enc_h, dec_h, act = ARCHS[a["arch"]]
    batches = (
        "DC-GMM's batches (shuffled images, then the constraint pairs half a batch at a time)"
        if a["batches"] == "dcgmm"
        else "chunks of a DFS of T1 (which holds the constraint pairs)"
    )
    sched = f"lr {a['lr']:g}" + (
        f" x {a['lr_decay']:g} every {a['lr_decay_every']} epochs" if a["lr_decay"] != 1 else ""
    )
    layerwise = (
        ", after greedy layer-wise denoising pretraining of "
        f"{a['ae_layerwise_epochs']} epochs a layer"
        if a.get("ae_layerwise_epochs")
        else ""
    )
    text = (
        f"\n{seeds} seed(s) on {meta['n']:,} images ({subset}{what}), {pixels}, on "
        f"{a['device']}. Networks: encoder 784-{'-'.join(map(str, enc_h))}-10, decoder "
        f"10-{'-'.join(map(str, dec_h))}-784, {act}. Start: {a['ae_epochs']} autoencoder "
        f"epochs (Adam {a['ae_lr']:g}, batches of {a['ae_batch_size']}"
        f"{', input dropout ' + format(a['ae_dropout'], 'g') if a.get('ae_dropout') else ''}"
        f"{', Glorot-uniform start' if a.get('ae_init') == 'glorot' else ''}"
        f"{layerwise}"
        f"{', one start for all seeds' if a['shared_pretrain'] else ''}), then a diagonal "
        f"GMM on the codes ({a['gmm_inits']} inits); mixture weights "
        f"{'uniform, fixed' if a['cluster_weights'] == 'uniform' else 'from the GMM, learned'}"
        f". {a['num_constraints']:,} random constraints, W_ij = ±{a['weight']:g} (±"
        f"{2 * a['weight']:g} a pair in the model). {a['epochs']} epochs of Adam ({sched}) "
        f"over {batches}, batches of {a['batch_size']}. "
        "Row 'AE + GMM (start)': the mixture's assignment of the pretrained codes, before "
        "any ELBO step; its 's / epoch' is the pretraining's. 'seeds won, paired diff': "
        "seeds where the method beats mean-field on that metric, and the mean paired "
        "difference ± its standard error. 'kept': constraints the predicted clusters "
        f"satisfy; 'ELBO / image': the final training objective ({a['elbo_draws']} draws); "
        "'rho': the learned edge correlation (mean over edges and latent dimensions) on "
        "the must-link, cannot-link and other edges of T1. 's / epoch (paper)': Sec. 4.2, "
        "GeForce RTX 3090.\n"
    )
    if a["estimator"] == "pairwise":
        text += (
            f"Estimator: PairwiseELBO for every method (one independent draw of the "
            f"marginals for the per-instance terms, {a['pair_particles']} draws of q for "
            "the constraint term, exact entropy; same settings for both guides).\n"
        )
    rows = [
        {"setting": k, "before issue 40": b, "protocol (defaults)": p, "source": src}
        for k, b, p, src in PROTOCOL
    ]
    return (
        text
        + "\nThe protocol and its sources:\n\n"
        + markdown_table(rows)
        + (f"\n{PROTOCOL_NOTES}\n")
    )


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
                row[f"{m}: seeds won, paired diff"] = txt if name not in (base, START) else ""
        row["s / epoch"] = float(np.mean(seconds[name]))
        row["s / epoch (paper)"] = PAPER[name]["s / epoch"]
        if base is not None and name != START:
            row["ratio to MF"] = sum(seconds[name]) / sum(seconds[base])
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
    md = markdown_table(rows, columns=list(max(rows, key=len))) + describe(meta, seeds)
    print(md)
    if write:
        a = meta["args"]
        name = a["name"]
        if name is None:
            name = {"methods": "treevi_clustering", "diagnose": "treevi_clustering_stages"}.get(
                a["stage"], "treevi_clustering_start"
            )
            if a["estimator"] != "trace":
                name += f"_{a['estimator']}"
            if a["weight"] != 1e4:  # the paper's weight keeps the plain name
                name += f"_w{a['weight']:g}"
        payload = {"rows": rows, "raw": results, "seconds": seconds, "diagnostics": diag}
        write_results(name, payload | meta, md, device=a["device"])
    return rows


if __name__ == "__main__":
    main()
