"""Generate notebooks/vart.ipynb (run: python notebooks/make_vart.py)."""

from pathlib import Path

import nbformat as nbf
from _nb import save

cells = []


def md(text):
    cells.append(nbf.v4.new_markdown_cell(text.strip()))


def code(text):
    cells.append(nbf.v4.new_code_cell(text.strip()))


md(r"""
# VaRT: variational regression trees

This notebook walks through VaRT (Salazar, *VaRT: Variational Regression Trees*, NeurIPS 2023)
as implemented in `pyro_trees`:

1. the **nonparametric prior** over stochastic trees (the model is not truncated),
2. the **truncated variational family** with Gumbel-softmax split indicators,
3. training with plain `pyro.infer.SVI` on the λ-weighted ELBO, and
4. **posterior predictive intervals** with `pyro.infer.Predictive`, the scikit-learn style
   `VaRTRegressor`, and treatment effects with `VaRTCausal`.

Set `PYRO_TREES_SMOKE=1` to run everything with tiny sizes (the tests do).
""")
code(r"""
import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_trees.estimators import VaRTCausal, VaRTRegressor
from pyro_trees.guides import VaRTGuide
from pyro_trees.models import VaRT, tree_mean
from pyro_trees.datasets import make_vart_causal_toy, make_vart_step

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
STEPS = 30 if SMOKE else 1000
torch.set_num_threads(1)
pyro.set_rng_seed(0)
""")
md(r"""
## 1. The prior: a stochastic tree of unbounded depth

Every heap-numbered node $i$ (root 1, children $2i, 2i+1$) splits with probability
$\gamma_d = \alpha(1+d)^{-\beta}$, carries split weights $\beta_i \sim \mathcal N(0, S)$
(go left with probability $\sigma(\beta_i^\top x)$) and leaf parameters
$\theta_i \sim \mathcal N(0, \Psi)$ with a leaf noise $\log\sigma_i$. The model samples
level by level and stops at the first level where no node splits, so it needs no
truncation: with $\gamma_d \to 0$ a prior tree is finite almost surely.
""")
code(r"""
model = VaRT(1)
x = torch.linspace(-3, 3, 200).unsqueeze(-1)
depths = []
fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
for k in range(200 if not SMOKE else 20):
    tree = model.sample_tree(like=x)  # a prior draw: 2**(D + 1) - 1 nodes
    depths.append(tree["split"].shape[-1].bit_length() - 1)
    if k < 6:
        axes[1].plot(x[:, 0], tree_mean(tree, x), lw=1)
axes[0].hist(depths, bins=np.arange(max(depths) + 2) - 0.5)
axes[0].set_title("depth of prior trees")
axes[1].set_title("regression functions of six prior trees")
plt.show()
""")
md(r"""
## 2. The truncated guide and the Gumbel-softmax relaxation

`VaRTGuide(model, depth)` truncates the process at depth $D$: internal positions
$i < 2^D$ get relaxed split indicators $s_i$ (eqs. 20-22), Gaussian splits and leaves;
the nodes of level $D$ are leaves with probability one. As the temperature $\tau \to 0$
the relaxed indicators become hard Bernoulli draws.
""")
code(r"""
from pyro_trees.distributions import RelaxedSplitIndicator

fig, axes = plt.subplots(1, 4, figsize=(12, 2.5), sharey=True)
for ax, tau in zip(axes, [2.0, 0.5, 0.1, 0.0]):
    s = RelaxedSplitIndicator(torch.tensor(0.5), tau).rsample((5000,))
    ax.hist(s.numpy(), bins=30)
    ax.set_title(f"tau = {tau}")
plt.show()
""")
md(r"""
## 3. Training with plain SVI

`sample_tree` scales every tree site by λ and each node's terms by its soft indicator
(eqs. 23-26), and the guide does the same, so `Trace_ELBO` estimates
$E_q \log p(Y\mid X, T, \Theta) - \lambda\,\mathrm{KL}(q\|p)$ (eq. 4). The guide's
defaults (depth 3, temperature 0.5, split rules started through data points at the first
call) need no extra step. Data: the step function of the paper's Figure A.
""")
code(r"""
d = make_vart_step(100, random_state=0)
x_train = torch.tensor(d["X"], dtype=torch.float32)
y_train = torch.tensor(d["y"], dtype=torch.float32)

pyro.clear_param_store()
model = VaRT(1)
guide = VaRTGuide(model)
svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), Trace_ELBO())
losses = [svi.step(x_train, y_train) for _ in range(STEPS)]
plt.plot(losses); plt.yscale("symlog"); plt.title("negative ELBO"); plt.show()
print("split probabilities of the guide:", guide.split_probs().numpy().round(2))
""")
md(r"""
## 4. Posterior predictive and Bayesian intervals

Eq. 32: draw trees from $q$, then $y^*$ from the likelihood. `Predictive` does both, at the
guide's temperature (here 0.5) or with hard trees (`guide.temperature_set_to(0.0)`); the
`mean` site is each tree's regression function.
""")
code(r"""
x = torch.linspace(-2.2, 2.2, 200).unsqueeze(-1)
pred = Predictive(model, guide=guide, num_samples=200, parallel=True)(x)
with guide.temperature_set_to(0.0):
    hard = Predictive(model, guide=guide, num_samples=200)(x)
lo, hi = pred["obs"].quantile(0.05, 0), pred["obs"].quantile(0.95, 0)
plt.scatter(x_train[:, 0], y_train, s=6, color="gray")
plt.plot(x[:, 0], pred["mean"].mean(0), label="posterior predictive mean")
plt.plot(x[:, 0], hard["mean"].mean(0), ls=":", label="hard trees")
plt.fill_between(x[:, 0], lo, hi, alpha=0.3, label="90 % predictive interval")
plt.plot(x[:, 0], d["step"](x[:, 0].numpy()), "k--", lw=1, label="truth")
plt.legend(); plt.show()
""")
md(r"""
## 5. The estimator

`VaRTRegressor` wraps all of this (standardisation, ClippedAdam through `pyro_trees.fit`,
annealing, batched deterministic prediction, pickling): `predict`, `predict_interval`,
`sample`, `feature_importances_` and `export_text()` of the most probable tree.
""")
code(r"""
est = VaRTRegressor(depth=3, num_steps=STEPS, random_state=0).fit(x_train.numpy(), y_train.numpy())
x_test = make_vart_step(500, random_state=1)["X"]
y_test = d["step"](x_test[:, 0]) + 0.1 * np.random.default_rng(2).normal(size=500)
lo, hi = est.predict_interval(x_test, level=0.9)
print("test RMSE", np.sqrt(np.mean((est.predict(x_test) - y_test) ** 2)))
print("coverage of 90 % intervals", np.mean((y_test >= lo) & (y_test <= hi)))
print(est.export_text(feature_names=["x"]))
""")
md(r"""
## 6. Treatment effects

`VaRTCausal` fits one VaRT on $(X, A)$ and reads the CATE (eq. 33) and ATE (eq. 34) off the
same posterior trees, with intervals. Toy data of eqs. 35-37, partially overlapping arms.
""")
code(r"""
d = make_vart_causal_toy(80 if SMOKE else 300, "partial", random_state=0)
reg = VaRTRegressor(depth=3, lam=1.0, num_steps=STEPS // 2, num_samples=50 if SMOKE else 200,
                    random_state=0)
causal = VaRTCausal(reg).fit(d["X"], d["A"], d["y"])
ate = causal.ate(level=0.9)
print(f"true ATE {np.mean(d['mu1'] - d['mu0']):.2f}; VaRT {ate['mean']:.2f} "
      f"[{ate['lower']:.2f}, {ate['upper']:.2f}]")
grid = np.linspace(d["X"].min(), d["X"].max(), 200)[:, None]
po = causal.potential_outcomes(grid, level=0.8)
for a, color, truth in ((1, "tab:red", d["f1"]), (0, "tab:blue", d["f0"])):
    sel = d["A"] == a
    plt.scatter(d["X"][sel, 0], d["y"][sel], s=6, color=color, alpha=0.4)
    plt.plot(grid[:, 0], truth(grid[:, 0]), color=color, lw=1)
    plt.plot(grid[:, 0], po[a][0], color=color, ls="--")
    plt.fill_between(grid[:, 0], po[a][1], po[a][2], color=color, alpha=0.2)
plt.title("80 % bands of E[Y(a) | x]"); plt.show()
""")

if __name__ == "__main__":
    save(__file__, cells)
