"""TreeVI's clustering start (a pretrained autoencoder, then a Gaussian mixture on its
codes), the mixture alone: on one set of pretrained autoencoder codes, how the
clustering accuracy of the Gaussian mixture varies with its random start, whether
keeping the most likely of ``n_init`` starts (scikit-learn's ``n_init``, the protocol's
3) picks a better clustering, and what a full covariance gives. The codes come from
the protocol's pretraining (:func:`benchmarks._clustering.pretrain`: the DC-GMM
networks, batches of 32, Adam 1e-3) of one seed on a random subset of the 70,000
MNIST images. Run: ``python -m benchmarks.treevi_gmm_starts``."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks._clustering import cluster_metrics, load_images, pretrain
from benchmarks._common import write_results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-images", type=int, default=10000, help="random subset (0: all)")
    parser.add_argument("--ae-epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the pretraining")
    parser.add_argument("--starts", type=int, default=20, help="single-start mixtures fitted")
    parser.add_argument("--full-starts", type=int, default=5, help="full-covariance ones")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    from sklearn.mixture import GaussianMixture

    torch.set_num_threads(args.threads)
    x, y = load_images("all", args.num_images, False)
    _, _, codes, seconds = pretrain(
        torch.as_tensor(x),
        arch="dcgmm",
        latent=10,
        num_clusters=10,
        epochs=args.ae_epochs,
        batch_size=32,
        lr=1e-3,
        seed=args.seed,
    )
    c = codes.double().numpy()

    def one(cov, start):
        gmm = GaussianMixture(10, covariance_type=cov, n_init=1, random_state=start).fit(c)
        return float(gmm.score(c)), float(cluster_metrics(y, gmm.predict(c))["ACC"])

    diag = [one("diag", s) for s in range(args.starts)]
    full = [one("full", s) for s in range(args.full_starts)]
    loglik, acc = np.array([d[0] for d in diag]), np.array([d[1] for d in diag])
    blocks = {
        n: [max(diag[b : b + n])[1] for b in range(0, args.starts - n + 1, n)] for n in (3, 10)
    }
    rows = [
        (
            "diag, 1 start",
            f"{acc.mean():.1f} ± {acc.std():.1f}",
            f"{acc.min():.1f}-{acc.max():.1f}",
            args.starts,
        ),
        *(
            (
                f"diag, best of {n} by likelihood",
                f"{np.mean(v):.1f}",
                f"{min(v):.1f}-{max(v):.1f}",
                len(v),
            )
            for n, v in blocks.items()
        ),
        (
            "full, 1 start",
            f"{np.mean([f[1] for f in full]):.1f}",
            f"{min(f[1] for f in full):.1f}-{max(f[1] for f in full):.1f}",
            args.full_starts,
        ),
    ]
    table = "| mixture | ACC (mean ± sd) | ACC range | mixtures |\n|---|---|---|---|\n"
    table += "".join(f"| {a} | {b} | {r} | {n} |\n" for a, b, r, n in rows)
    corr = float(np.corrcoef(loglik, acc)[0, 1]) if acc.std() > 0 else float("nan")
    subset = f"a random {args.num_images:,}" if args.num_images else "all 70,000"
    markdown = (
        table + f"\nOne set of codes: {subset} of the MNIST images (train + test), grey levels, "
        f"the DC-GMM autoencoder pretrained for {args.ae_epochs} epochs from seed "
        f"{args.seed} ({seconds:.1f} s an epoch). Each mixture has 10 components, is "
        "fitted by scikit-learn's EM from one k-means start (its `random_state` 0, 1, ...) "
        "and scored by ACC (Hungarian matching) on the same images. 'best of n': the "
        "most likely of n consecutive starts, over disjoint blocks of the single starts "
        f"(the protocol keeps the best of 3). Correlation of a start's log-likelihood "
        f"with its ACC: {corr:.2f}.\n"
    )
    payload = {
        "diag": [{"start": s, "loglik": d[0], "acc": d[1]} for s, d in enumerate(diag)],
        "full": [{"start": s, "loglik": f[0], "acc": f[1]} for s, f in enumerate(full)],
        "best_of": {str(k): v for k, v in blocks.items()},
        "seconds_per_epoch": seconds,
    }
    print(write_results("treevi_gmm_starts", payload, markdown, args=vars(args)))
    print(markdown)


if __name__ == "__main__":
    main()
