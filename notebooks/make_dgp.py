"""Generate notebooks/dgp.ipynb (run: python notebooks/make_dgp.py)."""

from pathlib import Path

import nbformat as nbf
from _nb import save

cells = []


def md(s):
    cells.append(nbf.v4.new_markdown_cell(s.strip()))


def code(s):
    cells.append(nbf.v4.new_code_cell(s.strip()))


md(r"""
# Deep GPs and compositional uncertainty

A deep GP composes functions, $f = f_L \circ \dots \circ f_1$ with $f_i \sim \mathcal{GP}$.
Many compositions explain the same data; a Bayesian posterior should keep that
*compositional uncertainty*. Ustyuzhaninov et al. (*Compositional uncertainty in deep
Gaussian processes*) show that the standard doubly stochastic inference with a
**factorised** guide $q(U_1)\cdots q(U_L)$ collapses every inner layer to a
deterministic map, and propose two fixes:

1. a **jointly Gaussian** guide over the inducing outputs of all layers;
2. free-form Gaussians over the **outputs of each layer at the inducing inputs**,
   $q(F_i^Z)$, propagated through the layers (eqs. 3-7), whose size grows linearly
   with depth.

This notebook fits all three with pyro_trees on the paper's kind of toy data,
$y = \sin(7 e^{x})$, and draws each layer's function for several seeds, as in the
paper's Figs. 2-5.
""")

code(r"""
import os
import warnings

import matplotlib.pyplot as plt
import pyro
import torch
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import gpytorch

from pyro_trees.guides import DGPFactorisedGuide, DGPIntermediateGuide, DGPJointGuide
from pyro_trees.infer import collapse_ratio, dgp_predict, fit, layer_samples
from pyro_trees.models import DeepGP
from pyro_trees.plotting import plot_dgp_layers

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
STEPS = 30 if SMOKE else 3000
PARTICLES = 2 if SMOKE else 16
SEEDS = [0] if SMOKE else [0, 1, 2]
torch.set_num_threads(1)

x = torch.linspace(-1, 1, 50, dtype=torch.float64).unsqueeze(-1)
y = torch.sin(7 * torch.exp(x[:, 0])) + 0.05 * torch.randn(50, dtype=torch.float64)
plt.scatter(x[:, 0], y, s=8, c="k"); plt.title("y = sin(7 exp(x))");
""")

md(r"""
## The model and its guides

`DeepGP` takes one GPyTorch kernel per layer (here squared exponential, then periodic)
and inducing inputs. With `inducing="layer"` each layer has its own inducing inputs
$Z_i$ and inducing outputs `u_i` (the sites the factorised and joint guides
describe); with `inducing="propagated"` there is one $Z$ in the input space and the
sites are the layer outputs `f_z_i` at it (eq. 3). The guides only describe these
sites: the map to the layer outputs at the data is the model's GP conditional
(`pyro_trees.gp.conditional`), shared by all of them.

Everything is plain Pyro: the shortest SVI loop with the factorised guide, then
`Predictive`, which draws `y` (site `obs`) and the inner layer's outputs (`f_1`).
""")

code(r"""
def kernels(L, seed=0):
    g = torch.Generator().manual_seed(1000 + seed)
    ks = []
    for i in range(L):
        base = gpytorch.kernels.RBFKernel() if i < L - 1 else gpytorch.kernels.PeriodicKernel()
        k = gpytorch.kernels.ScaleKernel(base).double()
        k.base_kernel.lengthscale = 0.3 + 0.7 * float(torch.rand((), generator=g))
        ks.append(k)
    return ks

Z = torch.linspace(-1, 1, 15, dtype=torch.float64).unsqueeze(-1)
model = DeepGP(kernels(2), Z)
guide = DGPFactorisedGuide(model)
svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), TraceMeanField_ELBO())
for _ in range(STEPS // 3):
    loss = svi.step(x, y)
draws = Predictive(model, guide=guide, num_samples=100)(x)
print("negative ELBO:", round(loss, 2), "| y draws", tuple(draws["obs"].shape),
      "| f_1 draws", tuple(draws["f_1"].shape))
plt.plot(x[:, 0], draws["obs"].mean(0), label="mean of the y draws")
plt.scatter(x[:, 0], y, s=8, c="k"); plt.legend()
pyro.clear_param_store()
""")

md(r"""
## Fitting the three guides, several seeds

`fit` is the library's training loop (Adam, progress bar, checkpoints); every guide
here is trained with `TraceMeanField_ELBO` (closed-form KLs; for the intermediate
guides that is eq. 7: $\mathrm{KL}[q(F_i^Z)\|p(F_i^Z\mid F_{i-1}^Z)]$ in closed form at
sampled $F_{i-1}^Z$), 16 Monte Carlo draws a step, and a learning rate that falls from
0.01 to 0.001 along a half cosine (`lr_scheduler=`). At a constant rate every guide stops
short of its optimum, by different amounts from seed to seed, and the comparison of the
guides' fits becomes a comparison of their noise (`benchmarks/dgp_composition.py` measures
both). The cell fits 24 models, about 25 minutes on one CPU core (from the benchmark's
times per fit).

The intermediate-output guide comes in two forms. The paper's free-form
$q(F_i^Z) = N(m_i, S_i)$ (eq. 4, `DGPIntermediateGuide(model, whiten=False)`) draws $F_i^Z$
independently of its inputs $F_{i-1}^Z$; it only trains with a large jitter (`1e-2`),
which turns the inducing outputs into noisy observations and shrinks the fit (see the
guide's docstring). The **whitened** form (`whiten=True`) draws
$F_i^Z = \mu_i(F_{i-1}^Z) + L_i(F_{i-1}^Z)(a_i + B_i\epsilon_i)$, always a smooth function
of its own inputs, with the same parameters (linear in depth) and the default jitter:
it is the row shown in the figures. The eq. 4 form is fitted too and appears in the
table below.
""")

code(r"""
KINDS = ("factorised", "joint", "intermediate", "intermediate eq. 4")


def build(kind, L, seed):
    with pyro.settings.context(module_local_params=True):
        if kind == "intermediate":  # whitened, default jitter
            m = DeepGP(kernels(L, seed), Z, inducing="propagated")
            return m, DGPIntermediateGuide(m, whiten=True), TraceMeanField_ELBO
        if kind == "intermediate eq. 4":  # free-form q(F_i^Z): needs the large jitter
            m = DeepGP(kernels(L, seed), Z, inducing="propagated", jitter=1e-2)
            return m, DGPIntermediateGuide(m, whiten=False), TraceMeanField_ELBO
        m = DeepGP(kernels(L, seed), [Z] * L)
        if kind == "joint":
            # absolute cross entries: the couplings grow whatever the posterior scale
            return m, DGPJointGuide(m, cross_scale=0.3, cross_relative=False), TraceMeanField_ELBO
        return m, DGPFactorisedGuide(m), TraceMeanField_ELBO

def cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS, eta_min=1e-3)


grid = torch.linspace(-1, 1, 100, dtype=torch.float64).unsqueeze(-1)
results = {}
for L in (2, 3):
    for kind in KINDS:
        for seed in SEEDS:
            pyro.set_rng_seed(seed)
            m, g, elbo = build(kind, L, seed)
            loss = elbo(num_particles=PARTICLES, vectorize_particles=True, max_plate_nesting=1)
            fit(m, g, x, y, loss=loss, num_steps=STEPS, lr=0.01, progress=False,
                lr_scheduler=cosine)
            smp = layer_samples(m, g, grid, num_samples=10)
            pred = dgp_predict(m, g, x, y, num_samples=100)
            results[L, kind, seed] = (m, g, smp, pred)
""")

md(r"""
## Two layers (like Fig. 2)

Each row is a guide (the intermediate one whitened); each colour a seed (a different
initialisation); ten posterior draws per seed. The first column is $f_1$ on $[-1, 1]$,
the second $f_2$ on the range of $f_1$'s outputs, the third the composition with the
data.
""")

code(r"""
def figure(L):
    fig, axes = plt.subplots(3, L + 1, figsize=(3.0 * (L + 1), 8))
    for r, kind in enumerate(("factorised", "joint", "intermediate")):
        plot_dgp_layers([results[L, kind, s][2] for s in SEEDS], data=(x, y),
                        labels=[f"seed {s}" for s in SEEDS], axes=axes[r])
        axes[r, 0].set_ylabel("intermediate (whitened)" if kind == "intermediate" else kind)
    fig.tight_layout()

figure(2)
""")

md(r"""
## Three layers (like Figs. 3-5)
""")

code(r"""
figure(3)
""")

md(r"""
## Measuring the collapse

`collapse_ratio` divides the spread of a layer's function across posterior draws (mean
standard deviation over its input range) by its prior spread. Near zero means the
layer became a deterministic map.
""")

code(r"""
rows = []
for (L, kind, seed), (m, g, smp, pred) in results.items():
    ratios = [round(collapse_ratio(m, smp, i), 3) for i in range(1, L)]
    rows.append((L, kind, seed, ratios, round(pred["log_lik"], 3)))
print(f"{'L':>2} {'guide':>18} {'seed':>4}  inner-layer spread   train log-lik")
for L, kind, seed, ratios, ll in rows:
    print(f"{L:>2} {kind:>18} {seed:>4}  {str(ratios):<20} {ll}")
""")

md(r"""
## Restarts

On a problem this small a start can stick: in the benchmark's six seeds one whitened
fit ended with the likelihood noise at 0.29 (the data's is 0.05), with an ELBO 65 nats
below its restart's. `fit_restarts` trains several fits from different seeds (each
`make(seed)` builds a fresh model and guide, so the kernels start elsewhere too) and
keeps the one with the highest ELBO, a Monte Carlo estimate drawn from one seed for all.
The ELBO is the objective the fits maximise, so no held-out data are needed. The cell
costs two fits, about three minutes on one core.
""")

code(r"""
from pyro_trees.infer import fit_restarts


def make(seed):
    m, g, elbo = build("intermediate", 2, seed)
    return m, g, elbo(num_particles=PARTICLES, vectorize_particles=True, max_plate_nesting=1)


out = fit_restarts(make, x, y, num_restarts=2, seed=SEEDS[0], num_steps=STEPS, lr=0.01,
                   lr_scheduler=cosine, progress=False, score_repeats=8)
print("ELBO of each restart:", [round(v, 2) for v in out.elbos], "- kept restart", out.best)
print("its noise sd:", round(float(out.model.noise.detach()), 4))
""")

md(r"""
## Predictions through `pyro.infer.Predictive`

`dgp_predict` wraps `Predictive`: the predictive is a mixture over draws of the inner
layers of the last layer's Gaussian; it returns the mean, variance, central
intervals (the exact quantiles of that mixture) and, given targets, the log
predictive density. Here, the whitened intermediate guide on two layers.
""")

code(r"""
m, g, _, _ = results[2, "intermediate", SEEDS[0]]
xs = torch.linspace(-1.3, 1.3, 200, dtype=torch.float64).unsqueeze(-1)
p = dgp_predict(m, g, xs, num_samples=200)
plt.fill_between(xs[:, 0], p["lower"], p["upper"], alpha=0.3, label="95% interval")
plt.plot(xs[:, 0], p["mean"], label="mean")
plt.scatter(x[:, 0], y, s=8, c="k")
plt.legend();
""")

if __name__ == "__main__":
    save(__file__, cells)
