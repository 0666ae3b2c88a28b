"""Generate notebooks/treevi.ipynb (run: python notebooks/make_treevi.py)."""

from pathlib import Path

import nbformat as nbf
from _nb import save

cells = []


def md(s):
    cells.append(nbf.v4.new_markdown_cell(s.strip()))


def code(s):
    cells.append(nbf.v4.new_code_cell(s.strip()))


md(r"""
# TreeVI: why correlation *between instances* matters

Most amortised variational inference is **mean-field over data instances**:
$q(Z \mid X) = \prod_i q(z_i \mid x_i)$. That is exact when instances are independent a
priori. As soon as the prior couples instances (a graph, must-link constraints, two halves
of one user), the true posterior couples them too, and a factorised guide pays for it in
the ELBO.

TreeVI (Xiao & Su, NeurIPS 2024) keeps a Gaussian guide whose correlation between
instances follows a **tree**: the correlation of $z_i$ and $z_j$ is the product of edge
correlations along the path between them (eq. 3). Sampling is ancestral (eq. 8), so it
costs $O(ND)$, and the density and entropy are exact. This notebook shows, on the
synthetic model of Sec. 4.1:

1. the posterior correlation that mean-field throws away;
2. `TreeNormal`: its covariance is eq. 3, sampled without any $ND \times ND$ matrix;
3. mean-field vs TreeVI ($T_1$, $T_2$) vs MTreeVI with plain `pyro.infer.SVI`;
4. choosing the tree: maximum spanning tree and the learned structure of eqs. 16-17;
5. the cost of sampling a million-node tree.
""")

code(r"""
import os
import time

import matplotlib.pyplot as plt
import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_trees.distributions import TreeNormal
from pyro_trees.guides import (
    GroupEncoder, PairNet, TreeVIGuide, TreeVIMixtureGuide,
)
from pyro_trees.infer import MixtureTreeELBO, learn_tree_structure, maximum_spanning_tree
from pyro_trees.models import SYNTHETIC_AFFINITY, SyntheticGraphVAE

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
torch.set_num_threads(1)
pyro.set_rng_seed(0)
print("smoke mode" if SMOKE else "full mode")
""")

md(r"""
## 1. The model and its exact posterior

Groups of four related instances share the prior $Z_g \sim \mathcal N(0, (I + \lambda A)
\otimes I_D)$ with the loopy affinity $A$ of eq. 18, and $x_i \mid z_i \sim \mathcal N(z_i,
\sigma^2 I)$. Everything is Gaussian, so $\log p(x)$ and the posterior are exact.
""")

code(r"""
model = SyntheticGraphVAE()
c = (model.prior_tril @ model.prior_tril.T).double()
post_prec = torch.linalg.inv(c) + torch.eye(4, dtype=torch.float64) / model.noise_var
post_cov = torch.linalg.inv(post_prec)
post_corr = post_cov / post_cov.diagonal().sqrt().outer(post_cov.diagonal().sqrt())

fig, axes = plt.subplots(1, 2, figsize=(7, 3))
axes[0].imshow(SYNTHETIC_AFFINITY, cmap="Blues"); axes[0].set_title("affinity A (eq. 18)")
im = axes[1].imshow(post_corr, cmap="RdBu_r", vmin=-1, vmax=1)
axes[1].set_title("posterior correlation of z_1..z_4"); fig.colorbar(im)
plt.show()
print(post_corr.numpy().round(3))
""")

md(r"""
Mean-field sets every off-diagonal entry to zero. For a Gaussian posterior with precision
$\Lambda$, the best mean-field guide loses
$\tfrac12(\sum_i \log \Lambda_{ii} - \log\det\Lambda)$ nats per latent dimension.

## 2. `TreeNormal`: a tree of correlations, sampled in $O(ND)$

The paper's trees over the four instances are $T_1 = \{(1,2),(1,3),(2,4)\}$ and
$T_2 = \{(1,2),(1,4),(2,3)\}$, written as parent arrays (0-based, $-1$ at the root).
""")

code(r"""
T1, T2 = [-1, 0, 0, 1], [-1, 0, 1, 0]
rho = torch.tensor([[0.0], [0.6], [-0.5], [0.8]])
q = TreeNormal(torch.zeros(4, 1), torch.ones(4, 1), torch.tensor(T1), rho)
print(q)
print("covariance (eq. 3): corr(z_3, z_4) = rho_3 * rho_1 * rho_2 ... along the path")
print(q.covariance_matrix.numpy().round(3))
x = q.sample((20000 if not SMOKE else 2000,)).reshape(-1, 4)
print("empirical:\n", torch.cov(x.T).numpy().round(2))
""")

md(r"""
## 3. Mean-field vs TreeVI vs MTreeVI with plain SVI

The guides are amortised: an affine encoder of the group gives the means, and each tree
edge gets a correlation $\rho_{ij} = f(x_i, x_j)$ from a small pair network (eq. 12).
MTreeVI mixes $T_1$ and $T_2$ and trains with `MixtureTreeELBO` (one reparameterised draw
per tree, weighted by the mixture weights, with the exact mixture density).
""")

code(r"""
def make(name):
    # PairNet(num_nodes=4) adds a learnt offset per tree edge: the members of a group
    # carry no clue to which edge they sit on, and the posterior's correlations differ
    # by edge.
    enc = GroupEncoder(4, 4, 4)  # affine map of the group -> means; free scales
    if name == "mean-field":
        return TreeVIGuide(enc, None, plate="groups"), Trace_ELBO()
    if name in ("T1", "T2"):
        par = T1 if name == "T1" else T2
        net = PairNet(4, 4, num_nodes=4)
        return TreeVIGuide(enc, par, pair_net=net, plate="groups"), Trace_ELBO()
    nets = [PairNet(4, 4, num_nodes=4) for _ in (T1, T2)]
    g = TreeVIMixtureGuide(enc, [T1, T2], pair_net=nets, plate="groups")
    return g, MixtureTreeELBO()


groups, steps, passes = (40, 30, 2) if SMOKE else (400, 800, 20)
x = model.generate(groups, torch.Generator().manual_seed(0))
n_inst = groups * 4
exact = float(model.exact_log_likelihood(x).sum()) / n_inst
results = {}
for name in ["mean-field", "T1", "T2", "MTreeVI"]:
    pyro.clear_param_store()
    guide, elbo = make(name)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.005}), elbo)
    for _ in range(steps):
        svi.step(x, subsample_size=min(100, groups))
    with torch.no_grad():
        results[name] = -sum(elbo.loss(model, guide, x) for _ in range(passes)) / passes / n_inst
    print(f"{name:10s} ELBO/instance {results[name]:.4f}  gap {exact - results[name]:.4f}")
print(f"exact log p(x)/instance {exact:.4f}")
""")

md(r"""
`Predictive` gives the posterior predictive: `z` from the guide and reconstructions `x`
drawn from the likelihood given it (centred on the data, not equal to it).
""")

code(r"""
draws = Predictive(model, guide=guide, num_samples=50)(x)
print({k: tuple(v.shape) for k, v in draws.items()})
r = torch.corrcoef(torch.stack([draws["x"].mean(0).flatten(), x.flatten()]))[0, 1]
print(f"correlation of the predictive mean with the data: {float(r):.3f}")
""")

md(r"""
The ordering of the paper's Table 1 (mean-field < $T_1$ < $T_2$ < MTreeVI < exact) is a
property of the families; amortisation and a short run add noise on top (the benchmark
`benchmarks/treevi_synthetic.py` runs longer and several seeds). The best ELBO each family
can reach is available in closed form for mean-field:
""")

code(r"""
mf_gap = 0.5 * (post_prec.diagonal().log().sum() - torch.logdet(post_prec)) * 4 / 4
print(f"best possible mean-field gap per instance: {float(mf_gap):.4f} nats")
""")

md(r"""
## 4. Which tree?

A natural choice keeps the strongest correlations: the maximum spanning tree of the
mutual informations $-\tfrac12\log(1-r_{ij}^2)$ (the Chow-Liu tree). The paper also
learns the tree by continuous optimisation under the acyclicity constraint
$h(A) = \operatorname{tr} e^{A\circ A} - N = 0$ (eqs. 16-17), here with an augmented
Lagrangian on soft parent probabilities.
""")

code(r"""
mi = -0.5 * torch.log1p(-post_corr.pow(2)).float()
mi.fill_diagonal_(0.0)
print("maximum spanning tree:", maximum_spanning_tree(mi.masked_fill(torch.eye(4, dtype=torch.bool), -torch.inf)).tolist())
res = learn_tree_structure(mi, inner_steps=50 if SMOKE else 200, max_outer=10 if SMOKE else 20)
print("learned tree:", res.parents.tolist(), " h(soft) =", f"{res.h:.2e}", " h(hard) =", res.h_hard)
""")

md(r"""
## 5. Cost: a million nodes

`rsample` solves the ancestral recursion $u_j = \rho_j u_{\mathrm{pa}(j)} + \sqrt{1-\rho_j^2}\,\varepsilon_j$
with $O(ND)$ work. Shallow trees go level by level (one step per level). Deep trees use a
**heavy-path decomposition**: every node continues the path of its child with the largest
subtree, so any root-to-leaf path crosses at most $\log_2 N$ path boundaries; each round
solves all its paths at once with a parallel (odd-even) scan. A chain of $N$ nodes is a
single path: about $2\log_2 N$ sequential steps instead of $N$. Pointer jumping
(`method="jump"`) is the fully parallel alternative, at $O(ND \log N)$ work.
""")

code(r"""
n, d = (20_000 if SMOKE else 1_000_000), 10
chain = torch.arange(-1, n - 1)
q = TreeNormal(torch.zeros(n, d), torch.ones(n, d), chain, torch.full((n, d), 0.9))
for method in ("paths", "jump"):
    qm = TreeNormal(q.loc, q.scale, q.parents, q.rho, method=method)
    qm.rsample()  # builds the plan once
    t0 = time.perf_counter(); z = qm.rsample(); t = time.perf_counter() - t0
    print(f"chain of {n} nodes, D={d}, height {q.height}: method={method!r} rsample {t:.3f} s")
""")

if __name__ == "__main__":
    save(__file__, cells)
