"""Generate notebooks/rnn_tree.ipynb (run: python notebooks/make_rnn_tree.py)."""

from pathlib import Path

import nbformat as nbf
from _nb import save

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = [
    md("""# Hierarchical mixtures of experts with the RNN-Tree

Antorán et al., *Amortised Variational Inference for Hierarchical Mixture Models*.

An HME routes every input down a binary tree to one of $2^D$ experts. pyro_trees writes it as a
Pyro model with three pieces:

* `HME`: the generative model. Each point's leaf has the tree-balance prior `TreeBalance`,
  which believes every node splits the points that reach it in half. Each leaf's expert
  predicts `y`.
* `RNNTreeGuide`: the routing posterior. A GRU walks down the tree and, at every node,
  chooses which input dimension to split and where (eqs. 10-13).
* `TreeELBO`: Pyro's enumerated ELBO, exact over the leaves, plus the Stirling
  approximation of the balance prior's coupling (App. B).

Set `PYRO_TREES_SMOKE=1` to run this notebook in seconds (the tests do)."""),
    code("""import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import torch

from pyro_trees.datasets import make_parity, make_pulse, parity_test_set, pulse_function
from pyro_trees.estimators import RNNTreeClassifier, RNNTreeRegressor
from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import TreeELBO
from pyro_trees.models import HME

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
STEPS = 30 if SMOKE else 600
pyro.set_rng_seed(0)"""),
    md("""## 1. Plain Pyro: model, guide, SVI

Nothing here is special: a `PyroModule` model, a guide with the same signature, and `SVI`.
The guide marks the leaf for parallel enumeration, so the expected log-likelihood is an exact
sum over the $2^D$ leaves (no score-function estimator).

At the first `svi.step(x, y)` the guide standardises `x` itself and starts at the balanced
tree, where every node splits its points at the median (the mode of the balance prior), and
the model's experts take one M-step on that tree: the habits of mixture modelling, done
for you. On the pulse the balanced tree already cuts at the eight levels' edges."""),
    code("""X, y = make_pulse(400)
x = torch.tensor(X, dtype=torch.float32)
t = torch.tensor(y, dtype=torch.float32)

pyro.clear_param_store()
model = HME(in_features=1, depth=3)
guide = RNNTreeGuide(in_features=1, depth=3)
svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), loss=TreeELBO())
losses = [svi.step(x, t) for _ in range(STEPS)]
plt.plot(losses); plt.xlabel("step"); plt.ylabel("-ELBO");"""),
    md("""The most likely tree reads as rules, thresholds in the units of `x`; `Predictive` draws
`y` from the posterior predictive:"""),
    code("""print(guide.rules().export_text())
draws = pyro.infer.Predictive(model, guide=guide, num_samples=100)(x)["obs"]
plt.plot(X[:, 0], y, "k", lw=1, label="truth")
plt.plot(X[:, 0], draws.mean(0), label="posterior predictive mean")
plt.legend();"""),
    md("""The estimators below add held-out early stopping and train with `entropy_weight=-1`,
the sign of eq. 22, which rewards confident routing. With `entropy_weight=1` (the exact
ELBO, `TreeELBO()`'s default) confident routing costs up to $D\\log 2$ nats per point, so
the bound softens the cuts a little. `benchmarks/results/hme_pulse.md` measures both."""),
    md("## 2. The 8-level pulse: all 8 regions from a depth-3 tree"),
    code("""est = RNNTreeRegressor(depth=3, random_state=0, entropy_weight=-1.0, num_steps=STEPS).fit(X, y)
grid = np.linspace(-4, 4, 1001)[:, None]
plt.plot(grid, pulse_function(grid[:, 0]), "k", lw=1, label="truth")
plt.plot(grid, est.predict(grid), label=f"RNN-Tree ({len(set(est.apply(grid)))} regions)")
try:
    from sklearn.tree import DecisionTreeRegressor
    cart = DecisionTreeRegressor(max_depth=3).fit(X, y)
    plt.plot(grid, cart.predict(grid), "--", label=f"CART depth 3 ({len(set(cart.apply(grid)))} regions)")
except ImportError:
    pass
plt.legend();"""),
    md("The single most likely tree reads as rules, thresholds in the units of `X`:"),
    code("print(est.export_text(feature_names=['x']))"),
    md("""The full routing posterior is also available. `routing="posterior"` averages the experts
over $q(\\text{leaf} \\mid x)$ instead of using only the most likely tree:"""),
    code("""proba = est.predict_leaf_proba(grid)
plt.imshow(proba.T, aspect="auto", extent=[-4, 4, 7.5, -0.5]); plt.xlabel("x"); plt.ylabel("leaf");"""),
    md("""## 3. Binary parity: where greedy trees fail

A point is labelled 1 when an even number of its bits are on. Every single split gains nothing, so
CART's greedy choice is blind, and noisy inputs confuse it at any depth. The RNN-Tree learns all
the splits jointly."""),
    code("""bits = 4 if SMOKE else 8
Xp, yp = make_parity(3000, bits=bits, sigma=0.3, random_state=0)
Xt, yt = parity_test_set(bits)
clf = RNNTreeClassifier(depth=bits, random_state=0, entropy_weight=-1.0, batch_size=500,
                        num_steps=STEPS // 2).fit(Xp, yp)
print("RNN-Tree test accuracy:", clf.score(Xt, yt))
try:
    from sklearn.tree import DecisionTreeClassifier
    print("CART test accuracy:", DecisionTreeClassifier(max_depth=bits + 4).fit(Xp, yp).score(Xt, yt))
except ImportError:
    pass"""),
]

if __name__ == "__main__":
    save(__file__, cells)
