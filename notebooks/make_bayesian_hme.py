"""Generate notebooks/bayesian_hme.ipynb (run: python notebooks/make_bayesian_hme.py)."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from _nb import save

cells = [
    new_markdown_cell(
        """# Bayesian hierarchical mixtures of experts

Bishop & Svensén (UAI 2003) put priors on every weight of a hierarchical mixture of
linear experts and fit it by variational Bayes. The lower bound on the evidence then
chooses the **tree topology**: every binary tree with up to `E` experts is fitted from
many random starts and the one with the highest bound is kept.

This notebook shows, with `pyro_trees`:

1. the toy inverse problem and its *Ockham hill* of bounds,
2. that the closed-form coordinate ascent never decreases the bound,
3. the same model as a plain Pyro model trained by SVI,
4. the two-link robot arm, whose inverse kinematics are bimodal.

Set `PYRO_TREES_SMOKE=1` to run everything at toy sizes in seconds."""
    ),
    new_code_cell(
        """import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import torch

from pyro_trees.datasets import robot_arm, robot_arm_forward, toy_inverse
from pyro_trees.estimators import BayesianHMERegressor
from pyro_trees.guides import BayesianHMEGuide
from pyro_trees.infer import bayesian_hme_vb as vb
from pyro_trees.models import BayesianHME
from pyro_trees.topology import Topology, enumerate_topologies

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
RESTARTS = 4 if SMOKE else 50
ITERS = 25 if SMOKE else 200
torch.set_num_threads(2)"""
    ),
    new_markdown_cell(
        """## Topologies

A `Topology` is any full binary tree, balanced or not, given by its gates in heap
numbering (root 1, children `2i`, `2i+1`). `enumerate_topologies` lists each tree once up
to mirror symmetry: 1, 1, 1, 2, 3, 6, 11, 23 trees for 1-8 experts."""
    ),
    new_code_cell(
        """print([len(enumerate_topologies(n, n)) for n in range(1, 9)])
for top in enumerate_topologies(5, 4):
    print(top, "gates", top.gates, "experts", top.experts)"""
    ),
    new_markdown_cell(
        """## The toy inverse problem

`x ~ U(0, 1)`, `t = x + 0.3 sin(2 pi x) + noise`; we learn the multi-valued map `t -> x`.
The regressor searches every topology with 1-5 experts and keeps the best bound of each."""
    ),
    new_code_cell(
        """t_in, x_out = toy_inverse(200, seed=0)
est = BayesianHMERegressor(max_experts=3 if SMOKE else 5, n_restarts=RESTARTS, n_iter=ITERS,
                           tol=1e-6, routing="hard", random_state=0).fit(t_in, x_out)
for top, b in zip(est.topologies_, est.bounds_):
    print(f"{top.num_experts} experts {str(top):24s} best bound {b:8.2f}")
print("selected:", est.topology_, "model-averaging weights:", np.round(est.weights_, 3))

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
axes[0].plot([t.num_experts for t in est.topologies_], est.bounds_, "o")
axes[0].set_xlabel("experts (one point per topology)"); axes[0].set_ylabel("best bound")
grid = np.linspace(t_in.min(), t_in.max(), 300)[:, None]
lo, hi = est.predict_interval(grid, level=0.9)
axes[1].plot(t_in[:, 0], x_out, ".", color="0.6", ms=3, label="data")
axes[1].fill_between(grid[:, 0], lo, hi, alpha=0.2, label="90% predictive interval")
axes[1].plot(grid[:, 0], est.predict(grid), ".", ms=2, label="most probable expert")
axes[1].plot(grid[:, 0], est.predict(grid, routing="posterior"), "-", label="mixture mean")
axes[1].legend(); plt.show()"""
    ),
    new_markdown_cell(
        """## Coordinate ascent never decreases the bound

Each update (experts, noise, precisions, the Jaakkola-Jordan parameters, gates,
assignments) maximises the bound over one factor. Restarts are a batch dimension."""
    ),
    new_code_cell(
        """data = vb.VBData.build(torch.as_tensor(t_in), torch.as_tensor(x_out), Topology([1, 3]))
state = vb.init_state(data, (8,), generator=torch.Generator().manual_seed(0))
res = vb.run_vb(data, state, num_iters=ITERS, tol=None)
steps = torch.diff(res.history, dim=0)
print("smallest change of the bound over a cycle:", float(steps.min()))
plt.plot(res.history.numpy()); plt.xlabel("cycle"); plt.ylabel("bound (8 restarts)"); plt.show()"""
    ),
    new_markdown_cell(
        """## The same model in Pyro

`BayesianHME` is a `PyroModule` whose observation sums the expert assignment out exactly;
`BayesianHMEGuide` has Gaussian weights and Gamma precisions. A plain `SVI` loop trains
it. The posterior has several basins, so at its first call on data the guide starts
itself from the best of 20 short closed-form VB runs. Its ELBO uses the exact
log-sigmoid, so at the same `q` it is a little higher than the closed-form bound above.
`Predictive` then draws from the posterior predictive: the draws lie on the branches of
the inverse."""
    ),
    new_code_cell(
        """pyro.clear_param_store()
pyro.set_rng_seed(0)
x_t = torch.as_tensor(t_in, dtype=torch.float32)
y_t = torch.as_tensor(x_out, dtype=torch.float32)
model = BayesianHME(1, 1, est.topology_)
guide = BayesianHMEGuide(model)
svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.003}), pyro.infer.Trace_ELBO())
for step in range(100 if SMOKE else 500):
    loss = svi.step(x_t, y_t)
elbo = -pyro.infer.Trace_ELBO(num_particles=200).loss(model, guide, x_t, y_t)
print(f"SVI ELBO {elbo:.2f}   closed-form VB bound {est.elbo_:.2f}")
draws = pyro.infer.Predictive(model, guide=guide, num_samples=20)(x_t)["obs"][..., 0]
plt.plot(np.tile(t_in[:, 0], 20), draws.reshape(-1).numpy(), ".", ms=1, label="posterior predictive")
plt.plot(t_in[:, 0], x_out, "k.", ms=3, label="data")
plt.xlabel("t (input)"); plt.ylabel("x (target)"); plt.legend(); plt.show()"""
    ),
    new_markdown_cell(
        """## Two-link robot arm

Joint angles `0.3 <= theta1 <= 1.2`, `pi/2 <= theta2 <= 3 pi/2`, link lengths 0.8 and 0.2.
From the end-effector position we predict the angles; in the middle of the workspace two
angle pairs reach the same point. A single-valued least-squares fit averages them; the
most probable expert of a 16-expert HME picks one. Errors are end-effector distances
after mapping the predicted angles forward."""
    ),
    new_code_cell(
        """pos, ang = robot_arm(200 if SMOKE else 1000, seed=0)
pos_te, ang_te = robot_arm(100 if SMOKE else 1000, seed=1)
arm = BayesianHMERegressor(topologies=[Topology.balanced(2 if SMOKE else 4)],
                           n_restarts=3 if SMOKE else 20, n_iter=ITERS, tol=1e-6,
                           routing="hard", random_state=0).fit(pos, ang)
err = np.linalg.norm(robot_arm_forward(arm.predict(pos_te)) - pos_te, axis=-1)
w = np.linalg.lstsq(np.c_[pos, np.ones(len(pos))], ang, rcond=None)[0]
lin = np.linalg.norm(robot_arm_forward(np.c_[pos_te, np.ones(len(pos_te))] @ w) - pos_te, axis=-1)
print(f"mean end-effector error: HME {err.mean():.4f}, linear least squares {lin.mean():.4f}")
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
for ax, e, name in zip(axes, [err, lin], ["Bayesian HME (16 experts)", "least squares"]):
    sc = ax.scatter(pos_te[:, 0], pos_te[:, 1], c=e, s=5, vmin=0, vmax=lin.max())
    ax.set_title(name)
fig.colorbar(sc, ax=axes, label="end-effector error"); plt.show()"""
    ),
]

if __name__ == "__main__":
    save(__file__, cells)
