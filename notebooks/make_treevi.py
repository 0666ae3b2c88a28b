"""Builder of notebooks/treevi.ipynb (``python notebooks/build.py treevi`` writes and executes it)."""
# ruff: noqa: E501  (markdown tables and equations are long lines)

from _nb import code, md, save

cells = [
    md(r"""
# TreeVI: why correlation *between instances* matters

**The problem.** Amortised variational inference (the VAE recipe) is almost always
**mean-field over data instances**: $q(Z \mid X) = \prod_i q(z_i \mid x_i)$. That is exact
when instances are independent a priori. As soon as the prior couples instances (a graph
over users, must-link constraints, the two halves of one record), the true posterior
couples them too, and a factorised guide pays for it in the ELBO. A full-covariance guide
over $N$ instances costs $O(N^2)$ parameters and $O(N^3)$ to sample: useless at scale.

**The idea.** TreeVI (Xiao & Su, NeurIPS 2024) keeps a Gaussian guide whose correlation
between instances follows a **tree**: the correlation of $z_i$ and $z_j$ is the product of
the edge correlations along the path between them (eq. 3). Sampling is ancestral along the
tree (eq. 8), so it costs $O(ND)$, and the density and entropy are exact. A mixture of trees
(MTreeVI) covers more correlation patterns, and the tree itself can be learnt.

This lecture uses the paper's synthetic model (Sec. 4.1), where everything is Gaussian and
$\log p(x)$ is exact, so every guide's ELBO gap can be measured, not guessed.
"""),
    code(r"""
import os
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets

import matplotlib.pyplot as plt
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from torch.distributions import constraints

from pyro_trees.distributions import TreeNormal
from pyro_trees.guides import GroupEncoder, PairNet, TreeVIGuide, TreeVIMixtureGuide
from pyro_trees.infer import MixtureTreeELBO, learn_tree_structure, maximum_spanning_tree
from pyro_trees.models import SYNTHETIC_AFFINITY, SyntheticGraphVAE

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
plt.rcParams["figure.dpi"] = 80  # keeps the committed notebook small
torch.set_num_threads(1)
pyro.set_rng_seed(0)
print("smoke mode" if SMOKE else "full mode")
"""),
    md(r"""
## 1. The generative model

Data come in $G$ independent groups of $N = 4$ related instances. Within a group the latent
codes share a graph prior with the loopy affinity $A$ of eq. 18 and strength $\lambda = 0.5$:

$$
Z_g \sim \mathcal N\big(0,\; (I_N + \lambda A) \otimes I_D\big), \qquad
X_g \mid Z_g \sim \mathcal N\big(Z_g W^\top + b,\; \sigma^2 I\big),
$$

with $D = F = 4$, $\sigma^2 = 0.5$ and the decoder fixed to $W = I$, $b = 0$, so that
$p(X_g) = \mathcal N\big(0, (I + \lambda A) \otimes I + \sigma^2 I\big)$ and the posterior are
available in closed form. Pyro sites of `pyro_trees.models.SyntheticGraphVAE`:

| site | distribution | shape |
|---|---|---|
| plate `groups` | over the $G$ groups (dim -1; subsampled in training) | `(G,)` |
| `z` | `KroneckerNormal`: $\mathcal N(0, (I_N + \lambda A) \otimes I_D)$ | event `(N, D) = (4, 4)` per group |
| `x` (observed) | $\mathcal N(z W^\top + b, \sigma^2)$, `to_event(2)` | event `(N, F) = (4, 4)` per group |

Since the posterior precision is $\Lambda = (I + \lambda A)^{-1} + I/\sigma^2$ (per latent
dimension), the exact posterior correlation between the four instances is:
"""),
    code(r"""
model = SyntheticGraphVAE()
prior_cov = (model.prior_tril @ model.prior_tril.T).double()  # I + lambda A
post_prec = torch.linalg.inv(prior_cov) + torch.eye(4, dtype=torch.float64) / model.noise_var
post_cov = torch.linalg.inv(post_prec)
sd = post_cov.diagonal().sqrt()
post_corr = post_cov / sd.outer(sd)


def heat(ax, m, title):
    im = ax.imshow(m, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            ax.text(j, i, f"{float(m[i, j]):.2f}", ha="center", va="center", fontsize=7)
    ticks = range(m.shape[0])
    ax.set(xticks=ticks, yticks=ticks, xticklabels=[f"$z_{k + 1}$" for k in ticks],
           yticklabels=[f"$z_{k + 1}$" for k in ticks], title=title)
    return im


fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
im = axes[0].imshow(SYNTHETIC_AFFINITY, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
axes[0].set(title="prior affinity A (eq. 18)", xticks=range(4), yticks=range(4),
            xlabel="instance", ylabel="instance")
fig.colorbar(im, ax=axes[0], label="affinity")
im = heat(axes[1], post_corr, "exact posterior correlation")
fig.colorbar(im, ax=axes[1], label="correlation")
fig.tight_layout()
plt.show()
"""),
    md(r"""
The affinity has a cycle (1-2-3 and 4 linked to all three), and so has the posterior: no
tree can represent it exactly. Mean-field sets every off-diagonal entry to zero.

## 2. A tree-structured guide by hand

Before the library: one latent dimension ($D = F = 1$), 64 groups, and a guide with its own
mean and scale per instance (not amortised). A tree guide draws standardised codes
ancestrally, $u_{\text{root}} = \varepsilon$, $u_j = \rho_j u_{\mathrm{pa}(j)} + \sqrt{1-\rho_j^2}\,\varepsilon_j$
(eq. 8), then $z = m + s \odot u$. Written as a matrix, $u = Ru + \operatorname{diag}(\sqrt{1-\rho^2})\,\varepsilon$
with $R_{j,\mathrm{pa}(j)} = \rho_j$, so the guide is a `MultivariateNormal` whose Cholesky factor
is $(I - R)^{-1}\operatorname{diag}(\sqrt{1-\rho^2})$ (lower triangular when parents come first).
Fine for four nodes; the library never forms this matrix. `parents=None` gives the mean-field
guide. The paper's two trees over the four instances are $T_1 = \{(1,2),(1,3),(2,4)\}$ and
$T_2 = \{(1,2),(1,4),(2,3)\}$ (parent arrays, 0-based, $-1$ at the root):
"""),
    code(r"""
T1, T2 = [-1, 0, 0, 1], [-1, 0, 1, 0]
tiny = SyntheticGraphVAE(latent_dim=1, in_features=1)
x_tiny = tiny.generate(64, torch.Generator().manual_seed(1))[..., 0]  # (G, 4)
prior = dist.MultivariateNormal(torch.zeros(4), scale_tril=tiny.prior_tril)


def tiny_model(x):
    with pyro.plate("groups", x.shape[0]):
        z = pyro.sample("z", prior)  # (G, 4)
        pyro.sample("x", dist.Normal(z, tiny.noise_var**0.5).to_event(1), obs=x)


def tree_tril(parents, rho):  # a factor L of the tree's correlation matrix, C = L L^T (eq. 3 / 8)
    n = len(parents)
    child = torch.tensor([j for j in range(n) if parents[j] >= 0])
    par = torch.tensor([parents[j] for j in child])
    R = rho.new_zeros(n, n).index_put((child, par), rho[child])
    root = torch.tensor([p < 0 for p in parents])
    d = torch.where(root, torch.ones_like(rho), (1 - rho**2).sqrt())
    return torch.linalg.solve(torch.eye(n, dtype=rho.dtype) - R, torch.diag(d))


def make_tiny_guide(parents):
    def guide(x):
        loc = pyro.param("loc", torch.zeros(x.shape))
        scale = pyro.param("scale", torch.full((4,), 0.5), constraint=constraints.positive)
        rho = pyro.param("rho", torch.zeros(4), constraint=constraints.interval(-0.99, 0.99))
        L = torch.diag(scale) if parents is None else scale[:, None] * tree_tril(parents, rho)
        with pyro.plate("groups", x.shape[0]):
            pyro.sample("z", dist.MultivariateNormal(loc, scale_tril=L))
    return guide


exact_tiny = float(tiny.exact_log_likelihood(x_tiny[..., None]).sum())
tiny_curves = {}
for name, parents in [("mean-field", None), ("T1", T1), ("T2", T2)]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    svi = SVI(tiny_model, make_tiny_guide(parents), pyro.optim.Adam({"lr": 0.03}),
              Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1))
    tiny_curves[name] = [-svi.step(x_tiny) for _ in range(60 if SMOKE else 300)]
    if parents is not None:
        print(f"{name}: learnt edge correlations {pyro.param('rho')[1:].detach().numpy().round(2)}")

fig, ax = plt.subplots(figsize=(6.5, 3.3))
w = 20
for name, curve in tiny_curves.items():
    smooth = torch.tensor(curve).unfold(0, w, 1).mean(-1)
    ax.plot(range(w - 1, len(curve)), smooth, label=name)
ax.axhline(exact_tiny, color="k", ls="--", label=r"exact $\log p(x)$")
ax.set(xlabel="SVI step", ylabel=f"ELBO (nats, {w}-step mean)", title="hand-written guides, D = 1",
       ylim=(exact_tiny - 15, exact_tiny + 3))
ax.legend()
plt.show()
for name, curve in tiny_curves.items():
    print(f"{name:>10}: ELBO {sum(curve[-100:]) / 100:8.2f}   gap {exact_tiny - sum(curve[-100:]) / 100:5.2f} nats "
          "(64 groups of 4 instances)")
"""),
    md(r"""
The ELBO gap is $\mathrm{KL}[q \,\|\, p(z \mid x)]$. Both trees close part of the mean-field
gap; neither closes all of it, because the posterior has a cycle.

## 3. The guide's factorisation and the objective

The library's `TreeVIGuide` is the amortised version: for each group,

$$
q(Z_g \mid X_g) = \prod_{d=1}^{D} \mathcal N\big(\mu_{\cdot d}(X_g),\, S_d\, C_d(T, \rho)\, S_d\big),\qquad
C_d(T,\rho)_{ij} = \prod_{(s,t) \in \mathrm{path}_T(i,j)} \rho_{t d},
$$

with means from an encoder (`GroupEncoder`: affine in the group's data, free scales) and
edge correlations $\rho_{jd} = \tanh(\text{PairNet}(x_j, x_{\mathrm{pa}(j)}))$ (eq. 12). Latent
dimensions are independent; instances are correlated along $T$. `TreeNormal` is this
distribution; its `log_prob` and `entropy` are exact and $O(ND)$.

The objective is the ELBO, $\mathbb E_q[\log p(X, Z) - \log q(Z \mid X)] \le \log p(X)$,
estimated by `Trace_ELBO` with one reparameterised draw per step and groups subsampled
(100 of 400 per step, the plate rescales). For the mixture of trees
$q = \sum_k w_k q_{T_k}$ (MTreeVI), `MixtureTreeELBO` draws one sample per tree and weights
it by $w_k$, with the exact mixture density in $\log q$: again an unbiased estimate of the
ELBO, nothing else.

## 4. Mean-field vs TreeVI vs MTreeVI with a plain `SVI` loop

`TreeNormal` first, for one group and one dimension: its covariance is eq. 3 (the product of
edge correlations along the path), and ancestral samples reproduce it.
"""),
    code(r"""
rho = torch.tensor([[0.0], [0.6], [-0.5], [0.8]])
q = TreeNormal(torch.zeros(4, 1), torch.ones(4, 1), torch.tensor(T1), rho)
draws = q.sample((2000 if SMOKE else 20000,)).reshape(-1, 4)
fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
heat(axes[0], q.covariance_matrix, "TreeNormal on $T_1$: eq. 3")
im = heat(axes[1], torch.corrcoef(draws.T), f"{len(draws)} ancestral draws")
fig.colorbar(im, ax=axes, label="correlation")
plt.show()
"""),
    code(r"""
def make(name):
    # PairNet(num_nodes=4) adds a learnt offset per tree edge: the members of a group
    # carry no clue to which edge they sit on, and the posterior's correlations differ
    # by edge.
    enc = GroupEncoder(4, 4, 4)  # affine map of the group -> means; free scales
    if name == "mean-field":
        return TreeVIGuide(enc, None, plate="groups", name=name), Trace_ELBO()
    if name in ("T1", "T2"):
        net = PairNet(4, 4, num_nodes=4)
        guide = TreeVIGuide(enc, T1 if name == "T1" else T2, pair_net=net, plate="groups",
                            name=name)
        return guide, Trace_ELBO()
    nets = [PairNet(4, 4, num_nodes=4) for _ in (T1, T2)]
    guide = TreeVIMixtureGuide(enc, [T1, T2], pair_net=nets, plate="groups", name=name)
    return guide, MixtureTreeELBO()


METHODS = ["mean-field", "T1", "T2", "MTreeVI"]
groups, steps, passes = (40, 30, 2) if SMOKE else (400, 600, 10)
x = model.generate(groups, torch.Generator().manual_seed(0))  # (G, 4, 4)
n_inst = groups * 4
exact = float(model.exact_log_likelihood(x).sum()) / n_inst
guides, curves, elbo_per_inst = {}, {}, {}
pyro.clear_param_store()
for name in METHODS:
    pyro.set_rng_seed(0)
    guide, elbo = make(name)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.005}), elbo)
    curves[name] = [-svi.step(x, subsample_size=min(100, groups)) / n_inst for _ in range(steps)]
    with torch.no_grad():
        loss = sum(elbo.loss(model, guide, x) for _ in range(passes)) / passes
    guides[name], elbo_per_inst[name] = guide, -loss / n_inst
    print(f"{name:>10}: ELBO/instance {elbo_per_inst[name]:.4f}  gap {exact - elbo_per_inst[name]:.4f}")
print(f"exact log p(x)/instance {exact:.4f}")

fig, ax = plt.subplots(figsize=(6.5, 3.3))
w = min(50, steps // 3)
for name in METHODS:
    smooth = torch.tensor(curves[name]).unfold(0, w, 1).mean(-1)
    ax.plot(range(w - 1, steps), smooth, label=name)
ax.axhline(exact, color="k", ls="--", label=r"exact $\log p(x)$")
ax.set(xlabel="SVI step", ylabel=f"ELBO / instance ({w}-step mean)",
       ylim=(exact - 0.5, exact + 0.05), title="amortised guides, training curves")
ax.legend(ncol=2, fontsize=8)
plt.show()
"""),
    md(r"""
## 5. How close can each family get?

The gap of a trained guide mixes two things: the **approximation gap** (the best member of
the family is still not the posterior) and the **amortisation and optimisation gap** (the
encoder and pair network, trained for 600 steps, do not reach that best member for every
group). Because the posterior covariance here is the same for every group, the first one
can be computed exactly: minimise $\mathrm{KL}[q \,\|\, p(z \mid x)]$ over the scales and edge
correlations of one tree (the means can match exactly), in closed form for Gaussians.
"""),
    code(r"""
def best_gap(parents):
    # min over q in the family of KL[q || posterior], per instance (D = N = 4, so per group and
    # latent dimension = per instance); closed-form Gaussian KL, optimised with Adam
    log_s = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    a = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([log_s, a], lr=0.05)
    for _ in range(100 if SMOKE else 600):
        rho = torch.zeros(4, dtype=torch.float64) if parents is None else torch.tanh(a)
        L = log_s.exp()[:, None] * tree_tril(parents, rho) if parents else torch.diag(log_s.exp())
        S = L @ L.T
        kl = 0.5 * (torch.trace(post_prec @ S) - 4 - torch.logdet(S) + torch.logdet(post_cov))
        opt.zero_grad()
        kl.backward()
        opt.step()
    return kl.item(), (S / S.diagonal().sqrt().outer(S.diagonal().sqrt())).detach()


best = {name: best_gap(p) for name, p in [("mean-field", None), ("T1", T1), ("T2", T2)]}
mf_closed = 0.5 * float(post_prec.diagonal().log().sum() - torch.logdet(post_prec))
print(f"mean-field: optimised {best['mean-field'][0]:.4f}, closed form {mf_closed:.4f} nats/instance")

fig, ax = plt.subplots(figsize=(7, 3.3))
pos = torch.arange(len(METHODS)).float()
ax.bar(pos - 0.2, [exact - elbo_per_inst[m] for m in METHODS], width=0.4,
       label="trained amortised guide (SVI)")
ax.bar(pos[:3] + 0.2, [best[m][0] for m in METHODS[:3]], width=0.4,
       label="best member of the family (exact)")
ax.set(xticks=pos, xticklabels=METHODS, ylabel=r"$\log p(x) - $ ELBO (nats / instance)",
       title="ELBO gap to the exact log-likelihood")
ax.legend()
plt.show()
"""),
    md(r"""
The trained gaps follow the paper's Table 1 ordering (mean-field > $T_1$ > $T_2$ > MTreeVI),
and each trained guide sits above its family's best: the difference is what amortisation
and a short run cost. (The best mixture has no closed form, so only its trained gap is shown.)

What does each guide actually capture? The correlation matrices of the trained amortised
guides, averaged over groups and latent dimensions, beside the exact one:
"""),
    code(r"""
def learnt_corr(guide):
    with torch.no_grad():
        cov = guide.distribution(x).covariance_matrix  # (G, N D, N D), rows (instance, dim)
    cov = cov.reshape(groups, 4, 4, 4, 4).diagonal(dim1=2, dim2=4)  # (G, i, j, d)
    var = cov.diagonal(dim1=1, dim2=2)  # (G, d, i)
    corr = cov / (var.transpose(1, 2)[:, :, None] * var.transpose(1, 2)[:, None]).sqrt()
    return corr.mean((0, 3))


fig, axes = plt.subplots(1, 4, figsize=(10, 2.9))
heat(axes[0], post_corr, "exact posterior")
heat(axes[1], torch.eye(4), "mean-field")
heat(axes[2], learnt_corr(guides["T1"]), "$T_1$, trained")
im = heat(axes[3], learnt_corr(guides["T2"]), "$T_2$, trained")
fig.colorbar(im, ax=axes, label="correlation", shrink=0.9)
plt.show()
"""),
    md(r"""
Each tree keeps the correlations on its edges and *implies* the others as products along
paths (e.g. in $T_2$, $\operatorname{corr}(z_3, z_4) = \rho_{23}\rho_{12}\rho_{14}$); pairs far
apart in the tree get small implied correlations whatever the posterior says.

`Predictive` gives the posterior predictive: `z` from the guide and reconstructions `x` drawn
from the likelihood given it (centred on the data, not equal to it).
"""),
    code(r"""
pyro.set_rng_seed(1)
draws = Predictive(model, guide=guides["T2"], num_samples=50)(x)
print({k: tuple(v.shape) for k, v in draws.items()})
mean_x = draws["x"].mean(0)
fig, ax = plt.subplots(figsize=(4.5, 3.5))
ax.scatter(x.flatten(), mean_x.flatten(), s=2, alpha=0.4, label="one feature of one instance")
lim = float(x.abs().max())
ax.plot([-lim, lim], [-lim, lim], "k--", lw=1, label="identity")
ax.set(xlabel="observed x", ylabel="posterior predictive mean of x", title="TreeVI $T_2$")
ax.legend(fontsize=8)
plt.show()
"""),
    md(r"""
The predictive mean is the data shrunk towards 0 (slope below 1): $\mathbb E[z \mid x]$
shrinks by the prior, as it should.

## 6. Which tree?

A natural choice keeps the strongest correlations: the maximum spanning tree of the mutual
informations $-\tfrac12\log(1-r_{ij}^2)$ (the Chow-Liu tree). The paper also learns the tree by
continuous optimisation under the acyclicity constraint
$h(A) = \operatorname{tr} e^{A\circ A} - N = 0$ (eqs. 16-17), here with an augmented
Lagrangian on soft parent probabilities.
"""),
    code(r"""
mi = -0.5 * torch.log1p(-post_corr.pow(2)).float()
mi.fill_diagonal_(0.0)
mst = maximum_spanning_tree(mi.masked_fill(torch.eye(4, dtype=torch.bool), -torch.inf))
print("maximum spanning tree (parents):", mst.tolist())
res = learn_tree_structure(mi, inner_steps=50 if SMOKE else 200, max_outer=10 if SMOKE else 20)
print("learned tree (parents):", res.parents.tolist(), " h(soft) =", f"{res.h:.2e}",
      " h(hard) =", res.h_hard)
print(f"best gap of the maximum spanning tree: {best_gap(mst.tolist())[0]:.4f} nats/instance "
      f"(T1 {best['T1'][0]:.4f}, T2 {best['T2'][0]:.4f})")
"""),
    md(r"""
The maximum spanning tree here is the chain $1-2-3-4$, which keeps the two strongest posterior
correlations (1-2 and 2-3) and the strongest remaining link of instance 4; its best gap is
smaller than that of either of the paper's trees. The paper's $T_1$ drops the 2-3
correlation and pays for it. The continuous search of eqs. 16-17 returns a valid tree
($h = 0$) with the same edges, rooted at instance 2: the root is a matter of bookkeeping,
since a tree Gaussian's density, gap and correlations depend only on its edges.

## 7. Cost: a million nodes

`rsample` solves the ancestral recursion with $O(ND)$ work. Shallow trees go level by level
(one step per level). Deep trees use a **heavy-path decomposition**: every node continues the
path of its child with the largest subtree, so any root-to-leaf path crosses at most
$\log_2 N$ path boundaries; each round solves all its paths at once with a parallel scan. A
chain of $N$ nodes is a single path: about $2\log_2 N$ sequential steps instead of $N$.
Pointer jumping (`method="jump"`) is the fully parallel alternative, at $O(ND \log N)$ work.
"""),
    code(r"""
sizes = [10_000, 100_000] if SMOKE else [10_000, 100_000, 1_000_000]
d = 10
times = {"paths": [], "jump": []}
for n in sizes:
    chain = torch.arange(-1, n - 1)  # the deepest tree: height n - 1
    for method in times:
        qm = TreeNormal(torch.zeros(n, d), torch.ones(n, d), chain, torch.full((n, d), 0.9),
                        method=method)
        qm.rsample()  # builds the plan once
        t0 = time.perf_counter()
        qm.rsample()
        times[method].append(time.perf_counter() - t0)
fig, ax = plt.subplots(figsize=(5.5, 3.3))
for method, t in times.items():
    ax.loglog(sizes, t, "o-", label=f'method="{method}"')
ax.set(xlabel="nodes N of a chain (D = 10)", ylabel="seconds per rsample",
       title="sampling a chain-shaped TreeNormal")
ax.legend()
plt.show()
print({m: [round(v, 3) for v in t] for m, t in times.items()})
"""),
    md(r"""
## 8. Where it fails

* **Loops.** The posterior here has a cycle; every tree drops at least one edge and keeps a
  non-zero approximation gap (section 5), however long it trains. A mixture of trees helps
  but is not the full covariance either; on a densely connected graph the best tree can be
  little better than mean-field.
* **Amortisation.** The trained gaps sit above the family's best: the encoder and pair
  network must produce every group's scales and correlations from its data, and after 600
  steps they do not for every group.
* **Implied long-range correlation.** Correlations of instances far apart in the tree are
  forced to be products of edge correlations, so they shrink geometrically with path length;
  a posterior with strong long-range dependence (e.g. a global latent shared by all
  instances) is poorly served by any tree.
* **Independent priors.** With $\lambda = 0$ the posterior factorises and TreeVI costs 2-3
  times mean-field for nothing (try it below).

## 9. Things to try

1. Set `SyntheticGraphVAE(strength=0.9)` (closer to singular): how do the mean-field and tree
   gaps grow?
2. Try a chain `[-1, 0, 1, 2]` and a star `[-1, 0, 0, 0]` with `best_gap`: which tree of four
   nodes is best for this posterior, and is it the maximum spanning tree?
3. Train the `TreeVIGuide` with `pair_inputs="codes"`, or for 3,000 steps: how much of the
   amortisation gap closes?
4. Set `strength=0.0`: check that every guide reaches the same ELBO.
5. Time `method="levels"` on a balanced binary tree of $10^6$ nodes
   (`parents = (torch.arange(n) - 1) // 2`) against the chain.

## References

* J. Xiao, Q. Su. *Reparameterizable Tree-structured Variational Inference for
  Instance-level Correlation Capturing* (TreeVI). NeurIPS 2024.
  [proceedings page](https://neurips.cc/virtual/2024/poster/94676)
* C. Chow, C. Liu. *Approximating discrete probability distributions with dependence
  trees.* IEEE Trans. Information Theory 14(3), 1968.
  [doi:10.1109/TIT.1968.1054142](https://doi.org/10.1109/TIT.1968.1054142)
* X. Zheng, B. Aragam, P. Ravikumar, E. Xing. *DAGs with NO TEARS: continuous optimization
  for structure learning.* NeurIPS 2018. [arXiv:1803.01422](https://arxiv.org/abs/1803.01422)
* D. P. Kingma, M. Welling. *Auto-encoding variational Bayes.* ICLR 2014.
  [arXiv:1312.6114](https://arxiv.org/abs/1312.6114)
"""),
]

if __name__ == "__main__":
    save(__file__, cells)
