"""Figures of a deep GP's layers: each layer's function and the compositions, per seed.

Like Figs. 2-5 of Ustyuzhaninov et al.: one column per layer showing the function of
that layer on its own input range, then the composition with the data; several
fitted models (seeds, initialisations) in different colours, several posterior draws
of each on top of each other.
"""

from __future__ import annotations

__all__ = ["plot_dgp_layers"]


def plot_dgp_layers(samples, data=None, *, labels=None, axes=None, title=None, alpha=0.5):
    """Plot per-layer function draws of one or more fitted deep GPs (1-D layers).

    :param samples: a dict from :func:`pyro_trees.infer.layer_samples`, or a list of
        them (one per seed, drawn in different colours).
    :param data: optional ``(x, y)`` shown as black dots in the composition panel.
    :param labels: legend labels, one per element of ``samples``.
    :param axes: ``L + 1`` matplotlib axes; default a new row of subplots.
    :returns: the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    if isinstance(samples, dict):
        samples = [samples]
    L = len(samples[0]["layers"])
    if axes is None:
        fig, axes = plt.subplots(1, L + 1, figsize=(3.0 * (L + 1), 2.8))
    else:
        fig = axes[0].figure
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, smp in enumerate(samples):
        c = colors[k % len(colors)]
        for i in range(L):
            g = smp["grids"][i][:, 0].cpu()
            for s, f in enumerate(smp["layers"][i][..., 0].cpu()):
                lab = labels[k] if (labels and i == 0 and s == 0) else None
                axes[i].plot(g, f, color=c, alpha=alpha, lw=1, label=lab)
        x = smp["grids"][0][:, 0].cpu()
        for f in smp["compositions"][-1][..., 0].cpu():
            axes[L].plot(x, f, color=c, alpha=alpha, lw=1)
    for i in range(L):
        axes[i].set_title(f"layer {i + 1}: $f_{i + 1}$")
        axes[i].set_xlabel("input of layer" if i else "x")
    axes[L].set_title("composition")
    axes[L].set_xlabel("x")
    if data is not None:
        axes[L].scatter(data[0].reshape(-1).cpu(), data[1].reshape(-1).cpu(), s=8, c="k", zorder=3)
    if labels:
        axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
