"""Generate notebooks/heteroscedastic_gp.ipynb.

Run: python notebooks/make_heteroscedastic_gp.py
"""

from pathlib import Path

import nbformat as nbf
from _nb import save

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = [
    md("""# A GP whose noise is an RNN-Tree

Antorán et al., *Amortised Variational Inference for Hierarchical Mixture Models*, Sec. 5.2 and
App. E. The data are $y = f(x) + \\epsilon$ with $f \\sim \\mathcal{GP}$ and
$\\epsilon \\sim \\mathcal{N}(0, e^{2 s_\\ell})$, where the leaf $\\ell$ of each input comes from a
tree over $x$ with the tree-balance prior. The noise model is then a short list of rules:
regions of $x$ and their noise levels.

Pieces, all plain Pyro:

* `HeteroscedasticGP`: the model (a `PyroModule`, `forward(x, y=None)`).
* `HeteroscedasticGPGuide(model)`: the RNN-Tree routing posterior $q(\\ell \\mid x)$ (and $q(u)$
  for the sparse version).
* `Trace_ELBO`: for the exact GP it is minus the bound of App. E,
  $\\log\\mathcal{N}(y\\mid c, K + R) + C - \\mathrm{KL}(q(M)\\,\\|\\,p(M))$, with the function
  integrated out and the routing expectation in closed form.

Set `PYRO_TREES_SMOKE=1` to run this notebook in seconds (the tests do)."""),
    code("""import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import torch

from pyro_trees.datasets import make_noise_task, noise_log_sigma, noise_task_mean
from pyro_trees.guides import HeteroscedasticGPGuide
from pyro_trees.models import HeteroscedasticGP

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
N = 120 if SMOKE else 600
STEPS = 8 if SMOKE else 150
torch.set_default_dtype(torch.float64)
pyro.set_rng_seed(0)"""),
    md("""## 1. The F.3 noise task

$f(x) = -x^3 + x^2$ on $[-2, 1]$ with a four-step $\\log\\sigma$ (0, 2/3, 2, 10/3). We standardise
$y$ and remember its scale."""),
    code("""X, Y, log_sigma = make_noise_task(N, random_state=0)
y_mean, y_std = Y.mean(), Y.std()
x = torch.tensor(X)
y = torch.tensor((Y - y_mean) / y_std)
plt.scatter(X[:, 0], Y, s=3, color="0.5"); plt.plot(X[:, 0], noise_task_mean(X[:, 0]), "k")
plt.xlabel("x"); plt.ylabel("y");"""),
    md("""## 2. Model, guide and plain SVI

The guide is built from the model. At the first step the pair starts balanced: a homoscedastic
GP fit, a tree whose nodes cut at the median of the points reaching them (the tree-balance
prior's mode), and each leaf's noise set from the residuals it receives."""),
    code("""model = HeteroscedasticGP(in_features=1, depth=2)
guide = HeteroscedasticGPGuide(model)
svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
losses = [svi.step(x, y) for _ in range(STEPS)]
plt.plot(losses); plt.xlabel("step"); plt.ylabel("-bound");"""),
    md("""## 3. Prediction: the posterior predictive, the most likely tree, the routing posterior

`Predictive` with the guide draws the function from its posterior given the training data, each
point's leaf from the routing posterior and `y`. `model.predict` gives the same in closed form:
with `routing="hard"` each new input gets its leaf in the single most likely tree (the paper's
App. E); `routing="posterior"` keeps the routing uncertainty (a mixture over leaves)."""),
    code("""grid = np.linspace(-2, 1, 301)
xg = torch.tensor(grid[:, None])
draws = pyro.infer.Predictive(model, guide=guide, num_samples=200)(xg)["obs"] * y_std + y_mean
tree = model.predict(xg, guide, routing="hard")
post = model.predict(xg, guide, routing="posterior")
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
lo, hi = np.quantile(draws.numpy(), [0.05, 0.95], axis=0)
axes[0].scatter(X[:, 0], Y, s=3, color="0.6")
axes[0].plot(grid, tree.mean * y_std + y_mean, "C0"); axes[0].fill_between(grid, lo, hi, alpha=0.2)
axes[1].plot(grid, noise_log_sigma(grid), "k--", label="truth")
axes[1].plot(grid, tree.log_sigma + np.log(y_std), label="most likely tree")
axes[1].plot(grid, post.log_sigma + np.log(y_std), label="routing posterior")
axes[1].set_ylabel("log sigma(x)"); axes[1].legend();"""),
    md("""The noise function as rules (log sigma in standardised units; add `log(y_std)` for the
original units):"""),
    code("""print(model.noise_rules(guide).export_text(feature_names=["x"]))
print("log(y_std) =", round(float(np.log(y_std)), 3))"""),
    md("""## 4. Large N: the sparse model with minibatches

With `inducing_points`, the model samples whitened inducing outputs `u` (the guide holds
$q(u)$) and the likelihood is the SVGP one, with the leaf summed out at the routing
probabilities. The same loop trains it on minibatches (`subsample_size`), at a cost
independent of N per step. Each model gets its own `name`, so both live in one param store."""),
    code("""z = torch.linspace(-2, 1, 20).unsqueeze(-1)
sparse = HeteroscedasticGP(1, 2, inducing_points=z, name="sparse")
sguide = HeteroscedasticGPGuide(sparse)
svi = pyro.infer.SVI(sparse, sguide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
losses = [svi.step(x, y, subsample_size=64) for _ in range(STEPS * 2)]
pred = sparse.predict(xg, sguide)
plt.plot(grid, noise_log_sigma(grid), "k--", label="truth")
plt.plot(grid, pred.log_sigma + np.log(y_std), label="sparse model, most likely tree")
plt.legend(); plt.ylabel("log sigma(x)");"""),
    md("""## 5. The RNN-Tree in your own model

The module docstring of `pyro_trees.guides.rnn_tree` has a recipe for putting the
RNN-Tree guide into any Pyro model that needs an input-dependent discrete partition:
a `BalancedLeaf` site in the model's data plate, a `Categorical(logits=RNNTree(x))` site in
the guide marked for parallel enumeration, and `TreeELBO`. The tests
(`tests/models/test_heteroscedastic_gp.py::test_recipe_user_model`) do it for Poisson counts."""),
]

if __name__ == "__main__":
    save(__file__, cells)
