"""Generate notebooks/rnn_tree.ipynb (run: python notebooks/make_rnn_tree.py)."""

from _nb import code, md, save

cells = [
    md(r"""
# Hierarchical mixtures of experts with the RNN-Tree

*Antorán, Yao, Pan, Hernández-Lobato & Doshi-Velez, Amortised Variational Inference for
Hierarchical Mixture Models.*

**The problem.** A decision tree of depth $D$ cuts the input space into $2^D$ regions and
predicts one value per region. CART grows it greedily, one node at a time, and on the
paper's *8-level pulse* a depth-3 CART tree finds only 5 of the 8 levels: its first cut is
the one that helps most *now*, not the one that lets the cuts below it work. A
hierarchical mixture of experts (HME) treats each point's path down the tree as a latent
variable; learning all the cuts **jointly** becomes posterior inference over the routing.
The paper puts a *tree-balance prior* on the routing and approximates the posterior with a
recurrent network, the **RNN-Tree**, trained by variational inference.

This lecture: the model and its sites; a ten-line hand-written version in plain Pyro; the
library's `HME` + `RNNTreeGuide` trained by a visible `SVI` loop; what the exact ELBO does
on the pulse (and why it differs from the paper's figure); then the estimator.
`PYRO_TREES_SMOKE=1` runs everything at toy sizes in seconds.
"""),
    code("""
import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from sklearn.tree import DecisionTreeRegressor

from pyro_trees.datasets import make_pulse, pulse_function
from pyro_trees.estimators import RNNTreeRegressor
from pyro_trees.guides import RNNTreeGuide
from pyro_trees.infer import TreeELBO
from pyro_trees.models import HME

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
STEPS = 10 if SMOKE else 600
pyro.set_rng_seed(0)
X, y = make_pulse(400)  # 400 inputs on [-4, 4], noise-free targets (App. F.1)
x = torch.tensor(X, dtype=torch.float32)
t = torch.tensor(y, dtype=torch.float32)
grid = np.linspace(-4, 4, 801)[:, None]
"""),
    md(r"""
## 1. The generative model

For $N$ inputs $x_n\in\mathbb{R}^L$ and a complete tree of depth $D$, every point takes a
path $\mathbf m_n\in\{0,1\}^D$ (equivalently a leaf $\ell_n\in\{0,\dots,2^D-1\}$, whose bits
are the decisions, 1 = right). The **tree-balance prior** (eqs. 4-6) says that at every
node the points reaching it split about evenly:

$$p(M\mid X)=\prod_{d=0}^{D-1} p(M_{:,d}\mid X),\qquad
p(M_{:,d}\mid X)=\binom{N}{K_d}\,0.5^N,\quad K_d=\textstyle\sum_n m^{(n)}_d ,$$

and each leaf's expert explains the targets (Sec. 5: constant experts, unit noise):

$$y_n\mid \ell_n \sim \mathcal N(\mu_{\ell_n},\ \sigma^2),\qquad \sigma=1 .$$

The prior couples the points (it counts them). The library writes it as a per-point
marginal (uniform over the $2^D$ leaves) inside the data plate and lets the loss add the
coupling $\log c(M)=\log p(M)-\sum_n\log 2^{-D}$:

| site | distribution | shape | where |
|---|---|---|---|
| `leaf` | `BalancedLeaf(D, N)`: uniform over $2^D$ leaves per point; coupling added by `TreeELBO` | `(N,)` | plate `"data"` (dim -1) |
| `obs` | `Normal(leaf_loc[leaf], noise_scale)` | `(N,)` | plate `"data"` |
| `leaf_loc` | parameter $\mu$ (point estimate, the paper's $\theta$) | `(2**D, 1)` | - |
| `noise_scale` | a parameter (the default, `noise_scale=None`), or fixed: `noise_scale=1.0` is the paper's $\sigma=1$ | `(1,)` | - |
"""),
    md(r"""
## 2. A hand-written HME in plain Pyro (depth 1)

Before the library class: one gate, two constant experts, a step in the data. The guide
is a logistic gate $q(\text{right}\mid x)=\sigma(w_0+w_1x)$ (eq. 12 with one input); the
leaf is **enumerated**, so `TraceEnum_ELBO` sums the two branches exactly instead of
sampling them. The learnt threshold is $-w_0/w_1$.
"""),
    code("""
def tiny_model(x, y):
    mu = pyro.param("mu", torch.tensor([-1.0, 1.0]))
    with pyro.plate("data", len(x)):
        leaf = pyro.sample("leaf", dist.Categorical(torch.ones(2) / 2))  # uniform prior
        pyro.sample("obs", dist.Normal(mu[leaf], 1.0), obs=y)

def tiny_guide(x, y):
    w = pyro.param("w", torch.tensor([0.0, 1.0]))
    with pyro.plate("data", len(x)):
        right = torch.sigmoid(w[0] + w[1] * x)
        pyro.sample("leaf", dist.Categorical(torch.stack([1 - right, right], -1)),
                    infer={"enumerate": "parallel"})

pyro.clear_param_store()
xs = torch.linspace(-2, 2, 100)
ys = torch.where(xs > 0.5, 3.0, 0.0)
svi = pyro.infer.SVI(tiny_model, tiny_guide, pyro.optim.Adam({"lr": 0.1}),
                     pyro.infer.TraceEnum_ELBO(max_plate_nesting=1))
tiny_losses = [svi.step(xs, ys) for _ in range(20 if SMOKE else 300)]
w = pyro.param("w").detach()
print(f"threshold {-w[0] / w[1]:.3f} (true 0.5), slope {w[1]:.1f}, "
      f"experts {pyro.param('mu').detach().numpy().round(2)} (true 0, 3)")
fig, ax = plt.subplots(1, 2, figsize=(9, 3))
ax[0].plot(tiny_losses); ax[0].set_xlabel("SVI step"); ax[0].set_ylabel("-ELBO (nats)")
ax[0].set_title("hand-written HME")
ax[1].plot(xs, ys, "k.", ms=3, label="data")
ax[1].plot(xs, torch.sigmoid(w[0] + w[1] * xs), label="q(right | x)")
ax[1].set_xlabel("x"); ax[1].set_ylabel("y / probability"); ax[1].legend()
plt.tight_layout(); plt.show()
"""),
    md(r"""
The routing of a point is soft: $q(\text{right}\mid x)$ is a sigmoid, not a step. That is
the posterior, not a defect: a point's leaf is uncertain wherever its likelihood under
both experts is comparable (remember that question for Section 5).

## 3. The guide and the objective

**RNN-Tree guide.** A GRU walks down the tree; at every node its state gives, for each
input dimension $l$, a split $(w_{l0},w_{l1})$ (eq. 10) and a softmax over which dimension
to split (eq. 11); the probability of going right marginalises the dimension (eqs. 12-13):
$q(m\mid h,x)=\sum_l \mathrm{softmax}_l\,\sigma(w_{l0}+w_{l1}x_l)$. The guide factorises
over points and along each path,

$$q(M\mid X)=\prod_{n=1}^N\prod_{d=0}^{D-1} q\big(m^{(n)}_d\mid \mathbf m^{(n)}_{0:d-1},x_n\big).$$

(`feedback="hard"`, the default, feeds each path's own decisions back, so every node has
its own state; the paper's eq. 14 feeds back probabilities plus noise, `feedback="soft"`.)

**Objective.** `TreeELBO()` (defaults) maximises eq. 7,

$$\mathcal L=\sum_n \mathbb E_{q(\ell_n)}\log p(y_n\mid\ell_n)
\;-\;\sum_n \mathrm{KL}\big(q(\ell_n)\,\|\,\mathrm{Unif}\big)\;+\;\mathbb E_q[\log c(M)] ,$$

with the first two terms summed **exactly** over the $2^D$ leaves (Pyro's enumeration)
and the balance coupling by the **Stirling approximation** of App. B (eqs. 9 and 22), so it
is an ELBO up to that approximation. The middle term charges a confident routing
decision: up to $D\log 2$ nats per point. Two settings are **not** ELBOs:
`TreeELBO(entropy_weight=-1)` flips that term's sign, as eq. 22 of App. B prints it
(eq. 9 of the main text has the ELBO's sign), so confidence is *rewarded*;
`entropy_weight=0` drops it (Frosst & Hinton's objective). The expert means $\mu$ and
$\sigma$ are point estimates, so $\mathcal L$ is also maximised over them
(type-II maximum likelihood).
"""),
    md(r"""
## 4. The library model and guide, plain `SVI`

At the first `svi.step(x, y)` the guide standardises `x` and starts at the *balanced* tree
(every node cuts its points at their median: the balance prior's mode), and the experts
take one M-step on it. On 400 evenly spaced inputs the median cuts of a depth-3 tree fall
at $-3,-2,\dots,3$: the pulse's edges. Training then moves cuts, sharpness and experts.
This section fixes the noise at the paper's $\sigma=1$ (`noise_scale=1.0`); the
library's default learns it, and Section 5 shows why.
"""),
    code("""
pyro.clear_param_store()
pyro.set_rng_seed(0)
model = HME(in_features=1, depth=3, noise_scale=1.0)  # the paper's sigma = 1 (default: learnt)
guide = RNNTreeGuide(in_features=1, depth=3)
svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), loss=TreeELBO())
losses = [svi.step(x, t) for _ in range(STEPS)]

with torch.no_grad():
    q = guide.tree(torch.tensor(grid, dtype=torch.float32)).exp().numpy()  # (801, 8)
    mu = model.leaf_loc.detach().numpy()[:, 0]
    q_train = guide.tree(x).exp()
print("expert means   ", mu.round(2))
print("pulse levels   ", pulse_function(np.arange(-3.5, 4, 1.0)))
print(f"median over the training points of max_leaf q(leaf | x): {q_train.max(1).values.median():.2f}")
print(f"mean q per leaf (the balance prior wants 1/8 = 0.125): {q_train.mean(0).numpy().round(3)}")

fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
ax[0].plot(losses); ax[0].set_xlabel("SVI step"); ax[0].set_ylabel("-ELBO (nats)")
ax[0].set_title("TreeELBO(), sigma = 1")
im = ax[1].imshow(q.T, aspect="auto", interpolation="nearest", origin="lower",
                  extent=[-4, 4, -0.5, 7.5], vmin=0, vmax=1, cmap="viridis")
ax[1].set_xlabel("x"); ax[1].set_ylabel("leaf"); ax[1].set_title("routing posterior q(leaf | x)")
fig.colorbar(im, ax=ax[1], label="probability")
ax[2].plot(grid, pulse_function(grid[:, 0]), "k", lw=1, label="pulse (truth)")
ax[2].plot(grid, q @ mu, label="posterior mean  sum q mu")
ax[2].plot(grid, mu[guide.rules().route(torch.tensor(grid, dtype=torch.float32))], "--",
           label="most likely tree")
ax[2].set_xlabel("x"); ax[2].set_ylabel("y"); ax[2].legend(fontsize=8)
ax[2].set_title("prediction")
plt.tight_layout(); plt.show()
"""),
    md(r"""
The most likely tree reads as rules, thresholds in the units of `x` (branches that no
input can reach are left out, so every printed leaf is a region of the input line):
"""),
    code("""
print(guide.rules(leaf_values=[f"mu = {m:.2f}" for m in mu]).export_text(feature_names=["x"]))
"""),
    md(r"""
`Predictive` draws from the posterior predictive: a leaf from $q(\ell\mid x)$, then
$y\sim\mathcal N(\mu_\ell,1)$. The 90 % band is about $\pm1.6$ wide, because the model
*says* the noise is $\sigma=1$ (the pulse itself is noise-free).
"""),
    code("""
draws = pyro.infer.Predictive(model, guide=guide, num_samples=200, parallel=True)(x)["obs"].numpy()
lo, hi = np.quantile(draws, [0.05, 0.95], axis=0)
plt.figure(figsize=(7, 3))
plt.fill_between(X[:, 0], lo, hi, alpha=0.3, label="90% posterior predictive")
plt.plot(X[:, 0], draws.mean(0), label="predictive mean")
plt.plot(X[:, 0], y, "k", lw=1, label="pulse")
plt.xlabel("x"); plt.ylabel("y"); plt.legend(fontsize=8); plt.title("Predictive, sigma = 1")
plt.show()
"""),
    md(r"""
## 5. What the exact ELBO does here, and why

On the pulse the $\sigma=1$ fit above kept the crisp tree it started from: the start's
sigmoids are steep (slope 40 over each node's spread) and Adam moves a slope by about the
learning rate a step. The bound itself, though, prefers soft routing here. For a single
point the best $q(\ell_n)$ is the exact posterior over leaves, $q(\ell)\propto
p(y_n\mid\ell)$; with $\sigma=1$ a point on level 2.5 is only $e^{1.1}\approx3$ times more
likely under its own expert than under the neighbour at 4.0. With the paper's
$\sigma = 1$ and level gaps of 1-3, *the model itself* is unsure which leaf a point
belongs to, and a confident decision costs entropy (up to $\log 2$ per level) that the
likelihood does not pay back.

The per-point optimum of two experts $\Delta$ apart is $q=\mathrm{sigmoid}(\Delta^2/2\sigma^2)$:
"""),
    code("""
gaps = np.array([1.0, 1.5, 2.0, 3.0])
for s in (1.0, 0.3, 0.1):
    print(f"sigma = {s}:  q(own leaf) for gaps {gaps} = {(1 / (1 + np.exp(-gaps**2 / (2 * s**2)))).round(3)}")
"""),
    md(r"""
So the price of a confident decision is set by $\sigma$. Where the start is not already
the right crisp tree, a fixed $\sigma$ far above the data's noise lets the bound trade
the fit for vague routing. A step function the model never saw shows it
(`make_steps`: 8 levels 0.5 apart in a random order, inputs drawn at random so that the
balanced start's median cuts miss the edges, noise 0.1): the README's loop, Adam 0.01,
with $\sigma = 1$ and with $\sigma$ learnt. The error is the predictive mean's
against the noise-free function.
"""),
    code("""
from pyro_trees.datasets import make_steps

Xs, ys, fs = make_steps(400, random_state=0)
xs_t, ys_t = torch.tensor(Xs, dtype=torch.float32), torch.tensor(ys, dtype=torch.float32)
checks = sorted({1, STEPS // 6, STEPS // 2, STEPS})
for noise_scale in (1.0, None):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    m_, g_ = HME(1, 3, noise_scale=noise_scale), RNNTreeGuide(1, 3)
    svi = pyro.infer.SVI(m_, g_, pyro.optim.Adam({"lr": 0.01}), loss=TreeELBO())
    errs = []
    for step in range(1, STEPS + 1):
        svi.step(xs_t, ys_t)
        if step in checks:
            mean = pyro.infer.Predictive(m_, guide=g_, num_samples=200)(xs_t)["obs"].mean(0)
            errs.append(f"{step}: {np.mean((mean.numpy() - fs) ** 2):.3f}")
    print(f"noise_scale={noise_scale}: MSE after step " + ", ".join(errs)
          + f"  (var f = {fs.var():.2f}; final sigma {float(m_.scale().detach()[0]):.2f})")
"""),
    md(r"""
With $\sigma=1$ the error falls at first, then rises again as training goes on: the bound
buys entropy with blurred routing and experts. Learning $\sigma$
(`noise_scale=None`, the library's default; still the ELBO) lets the likelihood pay for
crisp routing. On the noise-free pulse $\sigma$ ends near 0.4, well below 1: it starts at
5 % of the spread of $y$ (the start tree's residual is about 0 here) and rises to what the
routing's remaining blur at the cuts leaves, and the most likely tree finds all 8
levels, where CART at depth 3 finds 5. (From a start at that zero residual, $\sigma$
would instead stay tiny and the first losses would be tens of thousands of nats a point;
the loss is plotted on a log scale.)
"""),
    code("""
pyro.clear_param_store()
pyro.set_rng_seed(0)
model_s = HME(in_features=1, depth=3, noise_scale=None)
guide_s = RNNTreeGuide(in_features=1, depth=3)
svi = pyro.infer.SVI(model_s, guide_s, pyro.optim.Adam({"lr": 0.03}), loss=TreeELBO())
losses_s = [svi.step(x, t) for _ in range(STEPS)]
with torch.no_grad():
    q_s = guide_s.tree(torch.tensor(grid, dtype=torch.float32)).exp().numpy()
    mu_s = model_s.leaf_loc.detach().numpy()[:, 0]
    sigma_s = float(model_s.scale()[0])
cart = DecisionTreeRegressor(max_depth=3).fit(X, y)
hard_s = mu_s[guide_s.rules().route(torch.tensor(grid, dtype=torch.float32))]
truth = pulse_function(grid[:, 0])
print(f"learnt sigma {sigma_s:.3g}; expert means {mu_s.round(2)}")
print(f"regions on the grid: RNN-Tree {len(np.unique(hard_s))}, CART depth 3 {len(np.unique(cart.apply(grid)))}")
print(f"grid MSE: RNN-Tree posterior mean {np.mean((q_s @ mu_s - truth)**2):.4f}, "
      f"most likely tree {np.mean((hard_s - truth)**2):.4f}, CART {np.mean((cart.predict(grid) - truth)**2):.4f}; "
      f"sigma = 1 posterior mean {np.mean((q @ mu - truth)**2):.4f}")

fig, ax = plt.subplots(1, 3, figsize=(13, 3.4))
ax[0].semilogy(losses_s); ax[0].set_xlabel("SVI step"); ax[0].set_ylabel("-ELBO (nats, log scale)")
ax[0].set_title("TreeELBO(), sigma learnt")
im = ax[1].imshow(q_s.T, aspect="auto", interpolation="nearest", origin="lower",
                  extent=[-4, 4, -0.5, 7.5], vmin=0, vmax=1, cmap="viridis")
ax[1].set_xlabel("x"); ax[1].set_ylabel("leaf"); ax[1].set_title("q(leaf | x), sigma learnt")
fig.colorbar(im, ax=ax[1], label="probability")
ax[2].plot(grid, truth, "k", lw=1, label="pulse")
ax[2].plot(grid, q_s @ mu_s, label="RNN-Tree, posterior mean")
ax[2].plot(grid, cart.predict(grid), "--", label="CART depth 3")
ax[2].set_xlabel("x"); ax[2].set_ylabel("y"); ax[2].legend(fontsize=8); ax[2].set_title("all 8 levels vs CART")
plt.tight_layout(); plt.show()
print(guide_s.rules(leaf_values=[f"mu = {m:.2f}" for m in mu_s]).export_text(feature_names=["x"]))
"""),
    md(r"""
**Where the method fails.** (i) With a fixed, too-large $\sigma$ the exact ELBO prefers
soft routing and blurred experts (the step function above); the paper's crisp figure comes from an
objective that rewards confidence (eq. 22's sign), not from the ELBO. (ii) The fit depends
on the start: the balanced start already cuts at the pulse's edges here because the
inputs are evenly spaced; from random splits (`init=None`) training often ends in a tree
with only some of the levels (try it below). (iii) Learning $\sigma$ on noise-free data
is degenerate ($\sigma\to0$): the bound is unbounded and its value means nothing; only
the routing it produces does.

## 6. The estimator (the convenience)

`RNNTreeRegressor` wraps the same model and guide with a validation split, early stopping
and restarts of the start. Its **default objective is not the ELBO**:
`entropy_weight=-1` (eq. 22's sign) adds $+\sum_n \mathrm{KL}(q(\ell_n)\|\mathrm{Unif})$
instead of subtracting it, which rewards confident routing by up to $D\log 2$ nats per
point, and `refit_leaves="auto"` then gives each leaf of the most likely tree the mean of
the training targets it receives, if that lowers the error on the validation split
(`routing="posterior"` keeps the trained experts). `entropy_weight=1.0` trains the ELBO above.
`routing="hard"` predicts with the most likely tree; `routing="posterior"` averages the
experts over $q(\ell\mid x)$.
"""),
    code("""
est = RNNTreeRegressor(depth=3, random_state=0, num_steps=STEPS if SMOKE else None).fit(X, y)
hard = est.predict(grid)                       # routing="hard" (the default)
soft = est.predict(grid, routing="posterior")  # experts averaged over q(leaf | x)
print(f"estimator: {len(np.unique(est.apply(grid)))} regions; grid MSE hard {np.mean((hard - truth)**2):.4f}, "
      f"posterior {np.mean((soft - truth)**2):.4f}")
plt.figure(figsize=(7, 3))
plt.plot(grid, truth, "k", lw=1, label="pulse")
plt.plot(grid, hard, label='RNNTreeRegressor, routing="hard"')
plt.plot(grid, soft, ":", label='routing="posterior"')
plt.xlabel("x"); plt.ylabel("y"); plt.legend(fontsize=8); plt.title("estimator defaults (entropy_weight=-1)")
plt.show()
print(est.export_text(feature_names=["x"]))
"""),
    md(r"""
The same tree drawn (`pyro_trees.plotting.plot_tree`): each split shows its threshold, the
band of inputs the soft tree routes unsure (probability of going right between 5 % and
95 %) and the probability that the node routes on $x$ at all; each leaf its value with the
experts' 90 % noise interval.
"""),
    code("""
from pyro_trees.plotting import plot_tree

plot_tree(est, feature_names=["x"])
plt.show()
"""),
    md(r"""
## Things to try

1. Set `noise_scale=0.3` in Section 4 and predict from the table in Section 5 how sharp
   the routing will be; then check the heat map.
2. Start from random splits: `RNNTreeGuide(1, 3, init=None)` and `HME(1, 3, init=None)`.
   How many levels does the most likely tree find over five seeds?
3. Train Section 4 with `TreeELBO(entropy_weight=-1.0)` and compare the heat map and the
   expert means. Which of the paper's figures does it reproduce, and what is it no longer
   a bound on?
4. Draw the inputs at random (`np.sort(np.random.default_rng(0).uniform(-4, 4, 400))`)
   instead of evenly: the balanced start no longer cuts at the edges. What does the ELBO
   fit find now?
5. Binary parity (`pyro_trees.datasets.make_parity`, `parity_test_set`): fit
   `RNNTreeClassifier(depth=4)` on 4 noisy bits and compare with a depth-4 CART, whose
   first greedy split gains nothing.

## References

- J. Antorán, J. Yao, W. Pan, J. M. Hernández-Lobato, F. Doshi-Velez. *Amortised
  Variational Inference for Hierarchical Mixture Models.* ICML 2020 Workshop on
  Uncertainty and Robustness in Deep Learning.
  [openreview.net/forum?id=Ghw8Ugp2L8](https://openreview.net/forum?id=Ghw8Ugp2L8)
- N. Frosst, G. Hinton. *Distilling a Neural Network Into a Soft Decision Tree.* 2017.
  [arXiv:1711.09784](https://arxiv.org/abs/1711.09784)
- M. I. Jordan, R. A. Jacobs. *Hierarchical Mixtures of Experts and the EM Algorithm.*
  Neural Computation 6(2), 1994. [doi:10.1162/neco.1994.6.2.181](https://doi.org/10.1162/neco.1994.6.2.181)
- L. Breiman, J. Friedman, R. Olshen, C. Stone. *Classification and Regression Trees.* 1984.
"""),
]

if __name__ == "__main__":
    save(__file__, cells)
