"""Generate notebooks/bayesian_hme.ipynb (run: python notebooks/make_bayesian_hme.py)."""

from _nb import code, md, save

cells = [
    md(r"""
# Bayesian hierarchical mixtures of experts

*Bishop & Svensén, Bayesian Hierarchical Mixtures of Experts (UAI 2003).*

**The problem.** Inverse problems are often multi-valued: from the position of a robot
arm's hand you cannot tell which of two elbow configurations produced it. A least-squares
regressor averages the branches and lands between them. A *mixture of experts* lets
soft gates pick a linear expert per region of the input and so can follow every branch;
arranged as a tree of gates it is a *hierarchical* mixture (HME). Fitted by maximum
likelihood, an HME overfits and says nothing about **how many experts** or **which tree**
to use. Bishop & Svensén put priors on every weight and fit the posterior by variational
Bayes; the lower bound on the evidence then scores each tree, and the best bound picks
the topology.

This lecture: the model and its sites; a hand-written Bayesian mixture of two experts in
plain Pyro; closed-form VB and model selection by the bound (the *Ockham hill*); the
library's `BayesianHME` + `BayesianHMEGuide` in a visible `SVI` loop and how its Monte
Carlo ELBO relates to the closed-form bound; a failure of SVI; the robot arm.
`PYRO_TREES_SMOKE=1` runs everything at toy sizes in seconds.
"""),
    code("""
import os

import matplotlib.pyplot as plt
import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from pyro_trees.datasets import robot_arm, robot_arm_forward, toy_inverse
from pyro_trees.estimators import BayesianHMERegressor
from pyro_trees.guides import BayesianHMEGuide
from pyro_trees.infer import bayesian_hme_vb as vb
from pyro_trees.models import BayesianHME
from pyro_trees.topology import Topology, enumerate_topologies

SMOKE = os.environ.get("PYRO_TREES_SMOKE") == "1"
RESTARTS = 4 if SMOKE else 50
ITERS = 25 if SMOKE else 200
SVI_STEPS = 10 if SMOKE else 500
pyro.set_rng_seed(0)
t_in, x_out = toy_inverse(200, seed=0)  # x ~ U(0,1), t = x + 0.3 sin(2 pi x) + noise; learn t -> x
"""),
    md(r"""
## 1. The generative model

For a binary tree with $G$ gates and $E=G+1$ experts, inputs $x_n$ with a constant 1
appended ($\tilde x_n\in\mathbb R^P$, $P=L+1$) and targets $y_n\in\mathbb R^D$:

$$\beta_g\sim\mathrm{Gamma}(a_0,b_0),\quad v_g\mid\beta_g\sim\mathcal N(0,\beta_g^{-1}I_P),\qquad
\alpha_j,\ \tau_j\sim\mathrm{Gamma}(a_0,b_0),\quad W_j\mid\alpha_j\sim\mathcal N(0,\alpha_j^{-1}I),$$

$$\pi_j(x_n)=\prod_{g\in\mathrm{path}(j)}\sigma\big(s_{gj}\,v_g^\top\tilde x_n\big),\qquad
y_n\sim\sum_{j=1}^E\pi_j(x_n)\,\mathcal N\big(W_j\tilde x_n,\ \tau_j^{-1}I_D\big),$$

with $s_{gj}=\pm1$ for a right/left turn and $a_0=b_0=10^{-3}$ (broad priors). The
expert assignment $z_n$ is **summed out exactly** in the likelihood, so the only latent
variables are global:

| site | distribution | shape | plate |
|---|---|---|---|
| `beta` | Gamma$(a_0,b_0)$ | `(G,)` | `"gates"` |
| `v` | Normal$(0,\beta^{-1})$, event 1 | `(G, P)` | `"gates"` |
| `alpha` | Gamma$(a_0,b_0)$ | `(E,)` | `"experts"` |
| `tau` | Gamma$(a_0,b_0)$ | `(E,)` | `"experts"` |
| `W` | Normal$(0,\alpha^{-1})$, event 2 | `(E, D, P)` | `"experts"` |
| `obs` | MixtureSameFamily over the $E$ experts | `(N, D)` | `"data"` |

A `Topology` is any full binary tree given by its gates in heap numbering (root 1,
children $2i$, $2i+1$); `enumerate_topologies` lists each tree once up to mirror symmetry.
"""),
    code("""
print("trees with 1..8 experts:", [len(enumerate_topologies(n, n)) for n in range(1, 9)])
for top in enumerate_topologies(4, 3):
    print(f"{str(top):18s} gates {top.gates}  experts {top.experts}")
"""),
    md(r"""
## 2. A hand-written Bayesian mixture of two experts

Before the library: one gate, two linear experts, priors on everything, written with
plain `pyro.sample`, and a mean-field guide of `pyro.param`s. The assignment is summed out
by `MixtureSameFamily`, so plain `Trace_ELBO` trains it. (Fixed unit prior precisions on
the weights here, to keep it short; the noise precisions are Gamma.)
"""),
    code("""
x1 = torch.as_tensor(t_in[:, 0], dtype=torch.float32)
y1 = torch.as_tensor(x_out, dtype=torch.float32)
X1 = torch.stack([x1, torch.ones_like(x1)], -1)  # input with the bias column, (N, 2)

def mix_model(X, y):
    v = pyro.sample("v", dist.Normal(torch.zeros(2), 3.0).to_event(1))   # gate weights
    W = pyro.sample("W", dist.Normal(torch.zeros(2, 2), 3.0).to_event(2))  # expert weights
    tau = pyro.sample("tau", dist.Gamma(torch.ones(2), 0.01).to_event(1))  # noise precisions
    gate = X @ v
    mix = dist.Categorical(logits=torch.stack([torch.nn.functional.logsigmoid(-gate),
                                               torch.nn.functional.logsigmoid(gate)], -1))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.MixtureSameFamily(mix, dist.Normal(X @ W.T, tau.rsqrt())), obs=y)

def mix_guide(X, y):
    for name, shape in (("v", (2,)), ("W", (2, 2))):
        loc = pyro.param(f"{name}_loc", 0.5 * torch.randn(shape))
        scale = pyro.param(f"{name}_scale", 0.1 * torch.ones(shape), constraint=constraints.positive)
        pyro.sample(name, dist.Normal(loc, scale).to_event(len(shape)))
    a = pyro.param("tau_a", 10 * torch.ones(2), constraint=constraints.positive)
    b = pyro.param("tau_b", 0.1 * torch.ones(2), constraint=constraints.positive)
    pyro.sample("tau", dist.Gamma(a, b).to_event(1))

pyro.clear_param_store(); pyro.set_rng_seed(1)
svi = pyro.infer.SVI(mix_model, mix_guide, pyro.optim.Adam({"lr": 0.02}), pyro.infer.Trace_ELBO())
mix_losses = [svi.step(X1, y1) for _ in range(20 if SMOKE else 800)]
print("final -ELBO (mean of the last 50 steps):", round(float(np.mean(mix_losses[-50:])), 1))
fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
ax[0].plot(mix_losses)
ax[0].set_ylim(min(mix_losses) - 10, np.quantile(mix_losses, 0.9))
ax[0].set_xlabel("SVI step"); ax[0].set_ylabel("-ELBO (one sample)"); ax[0].set_title("hand-written model")
W_loc = pyro.param("W_loc").detach()
ax[1].plot(t_in[:, 0], x_out, ".", color="0.6", ms=3, label="data")
tt = torch.linspace(float(x1.min()), float(x1.max()), 100)
for j in range(2):
    ax[1].plot(tt, W_loc[j, 0] * tt + W_loc[j, 1], label=f"expert {j} (posterior mean)")
ax[1].set_xlabel("t (input)"); ax[1].set_ylabel("x (target)"); ax[1].legend(fontsize=8)
plt.tight_layout(); plt.show()
"""),
    md(r"""
Two straight lines cannot follow this S-shaped inverse; the question the paper asks is
*how many* experts, in *which* tree, the data support.

## 3. The objective: closed-form VB and its bound

The paper's variational posterior factorises over the global factors and the
assignments,

$$q=\prod_g q(v_g)\,q(\beta_g)\ \prod_j q(W_j)\,q(\alpha_j)\,q(\tau_j)\ \prod_n q(z_n),$$

Gaussian $q(v_g)$, $q(W_j)$ and Gamma precisions. The sigmoid gates are not conjugate, so
the paper also bounds each $\log\sigma(\cdot)$ from below by the Jaakkola-Jordan quadratic
(one parameter $\xi$ per point and gate). Each coordinate update (experts, noise,
precisions, $\xi$, gates, assignments) then maximises that bound $\mathcal L_{\rm VB}$ in
closed form, so the bound never decreases (up to rounding), and $\mathcal L_{\rm VB}\le\log p(Y\mid X)$
scores the tree. Restarts are a batch dimension:
"""),
    code("""
data = vb.VBData.build(torch.as_tensor(t_in), torch.as_tensor(x_out), Topology([1, 3]))
res = vb.run_vb(data, vb.init_state(data, (20,), generator=torch.Generator().manual_seed(0)),
                num_cycles=ITERS, tol=None)
steps = torch.diff(res.history, dim=0)
best = int(res.bound.argmax())
print(f"smallest change of the bound over a cycle: {float(steps.min()):.1e} "
      f"(no decrease beyond float64 rounding: {bool(steps.min() > -1e-9)})")
print("final bound of the 20 restarts:", np.sort(res.bound.numpy()).round(1))
plt.figure(figsize=(7, 3.2))
plt.plot(res.history.numpy(), lw=0.8)
plt.ylim(bottom=float(res.history[-1].min()) - 20)
plt.xlabel("coordinate-ascent cycle"); plt.ylabel("bound (nats)")
plt.title("closed-form VB, 3 experts (E (E E)), 20 restarts"); plt.show()
"""),
    md(r"""
The restarts end in different basins (experts swapping roles or sharing a branch): the
bound is multimodal, so many restarts are part of the method.

## 4. Model selection by the bound: the Ockham hill

`BayesianHMERegressor` runs the closed-form VB for every tree with 1-5 experts from many
restarts and keeps the best bound of each; the bound rises while experts are needed and
falls once extra experts only add prior volume. (It standardises $t$ and $x$ first and
reports the bound in the data's units.)
"""),
    code("""
est = BayesianHMERegressor(max_experts=3 if SMOKE else 5, num_restarts=RESTARTS, num_cycles=ITERS,
                           tol=1e-6, routing="hard", random_state=0).fit(t_in, x_out)
for top, b in zip(est.topologies_, est.bounds_):
    print(f"{top.num_experts} experts {str(top):24s} best bound {b:8.2f}")
print("selected:", est.topology_)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
axes[0].plot([tp.num_experts for tp in est.topologies_], est.bounds_, "o", label="one tree each")
axes[0].set_xlabel("number of experts"); axes[0].set_ylabel("best bound (nats)")
axes[0].set_title("Ockham hill"); axes[0].legend()
grid = np.linspace(t_in.min(), t_in.max(), 300)[:, None]
lo, hi = est.predict_interval(grid, level=0.9)
axes[1].plot(t_in[:, 0], x_out, ".", color="0.6", ms=3, label="data")
axes[1].fill_between(grid[:, 0], lo, hi, alpha=0.2, label="90% predictive interval")
axes[1].plot(grid[:, 0], est.predict(grid), ".", ms=2, label="most probable expert")
axes[1].plot(grid[:, 0], est.predict(grid, routing="posterior"), "-", label="mixture mean")
axes[1].set_xlabel("t (input)"); axes[1].set_ylabel("x (target)"); axes[1].legend(fontsize=8)
axes[1].set_title("selected tree"); plt.tight_layout(); plt.show()
"""),
    md(r"""
The mixture mean (the conditional average) cuts between the branches where the inverse
has three values; the most probable expert stays on one branch, and the predictive
interval covers all of them.

## 5. The same model in Pyro, plain `SVI`

`BayesianHME` is the generative model of Section 1 as a `PyroModule`;
`BayesianHMEGuide` has the paper's global factors (full-covariance Gaussians for $v_g$ and
$W_j$, Gamma precisions) but **no** $q(z)$ and **no** Jaakkola-Jordan bound: the model
sums $z$ out and uses the exact log-sigmoid. So plain `Trace_ELBO` estimates

$$\mathrm{ELBO}(q)=\mathbb E_{q(v,\beta,W,\alpha,\tau)}\big[\log p(Y,v,\beta,W,\alpha,\tau\mid X)
-\log q(v,\beta,W,\alpha,\tau)\big]$$

by Monte Carlo (one sample per step). It is an ELBO, and **at the same global $q$ it is at
least $\mathcal L_{\rm VB}$**: the exact sum over $z$ and the exact log-sigmoid remove two
sources of slack. To see this, load the best closed-form VB state of Section 3 (same data,
same model) into the guide and estimate its ELBO with many samples; then run SVI from
there.

By default (`init="vb"`) the guide does this itself at its first call on data: it runs
the closed-form VB from 20 random starts for 100 cycles and starts from the best bound.
"""),
    code("""
xt, yt = torch.as_tensor(t_in), torch.as_tensor(x_out)  # float64, as the VB state
pyro.clear_param_store(); pyro.set_rng_seed(0)
model = BayesianHME(1, 1, Topology([1, 3]))
guide = BayesianHMEGuide(model).load_vb_state(res.state.index(best))
mc_elbo = pyro.infer.Trace_ELBO(num_particles=20 if SMOKE else 500, vectorize_particles=True,
                                max_plate_nesting=1)
elbo_at_vb = -mc_elbo.loss(model, guide, xt, yt)
svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.003}), pyro.infer.Trace_ELBO())
svi_losses = [svi.step(xt, yt) for _ in range(SVI_STEPS)]
elbo_after = -mc_elbo.loss(model, guide, xt, yt)
print(f"closed-form bound L_VB at the VB q       {float(res.bound[best]):8.2f}")
print(f"Monte Carlo ELBO at the same q            {elbo_at_vb:8.2f}")
print(f"Monte Carlo ELBO after {SVI_STEPS} SVI steps      {elbo_after:8.2f}")
print(f"single-sample -loss, last {min(50, SVI_STEPS)} steps: mean {-np.mean(svi_losses[-50:]):.2f}, sd {np.std(svi_losses[-50:]):.2f}")
print(f"(the estimator's best bound, fitted on standardised data: {est.elbo_:.2f})")
"""),
    md(r"""
Read the three numbers top to bottom. The Monte Carlo ELBO at the VB posterior is
**above** the closed-form bound: the gap is the slack of the Jaakkola-Jordan bound and of
the factorised $q(z)$, which the Pyro model does not need. SVI then changes the ELBO by
much less than that gap within this step budget: from a good start, a few hundred Adam
steps at `lr=0.003` mostly trade noise. A single-sample loss is noisy (its standard
deviation is printed), so compare ELBOs with many samples, never one step's loss. The
estimator's bound is not directly comparable: the estimator standardises $t$ and $x$,
and the broad priors are not exactly scale-invariant, so it fits a slightly different
model. `Predictive` draws from the posterior predictive; the draws lie on the branches:
"""),
    code("""
draws = pyro.infer.Predictive(model, guide=guide, num_samples=20)(xt)["obs"][..., 0]
fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
ax[0].plot(-np.array(svi_losses)); ax[0].axhline(elbo_after, color="k", ls="--", label="ELBO, many samples")
ax[0].set_xlabel("SVI step"); ax[0].set_ylabel("ELBO (nats)"); ax[0].legend(); ax[0].set_title("SVI from the VB start")
ax[1].plot(np.tile(t_in[:, 0], 20), draws.reshape(-1).numpy(), ".", ms=1, label="posterior predictive draws")
ax[1].plot(t_in[:, 0], x_out, "k.", ms=3, label="data")
ax[1].set_xlabel("t (input)"); ax[1].set_ylabel("x (target)"); ax[1].legend(fontsize=8)
plt.tight_layout(); plt.show()
"""),
    md(r"""
## 6. Where SVI fails: the start

The posterior is multimodal, and gradient steps do not jump between basins. From a
random start (`init="random"`) the same SVI budget ends far below the VB start: experts
overlap or one is left without data. An expert without data is also where a numerical
trap sat: its $q(\tau)$ has shape close to the prior's $a_0=10^{-3}$, most reparameterised
draws then underflow, and the one-sample ELBO reads a spurious gain as the shape falls, so
an earlier version of the guide drove that shape to zero until the step raised on a NaN
concentration. The guide now keeps every Gamma shape above $a_0$ (the exact optimum is
$a_0$ plus a count, so nothing is lost).
"""),
    code("""
pyro.clear_param_store(); pyro.set_rng_seed(0)
model_r = BayesianHME(1, 1, Topology([1, 3]))
guide_r = BayesianHMEGuide(model_r, init="random", init_scale=1.0)
svi = pyro.infer.SVI(model_r, guide_r, pyro.optim.Adam({"lr": 0.003}), pyro.infer.Trace_ELBO())
random_losses = [svi.step(xt, yt) for _ in range(SVI_STEPS)]
elbo_random = -mc_elbo.loss(model_r, guide_r, xt, yt)
print(f"ELBO after {SVI_STEPS} steps: VB start {elbo_after:.1f}, random start {elbo_random:.1f}")
print("q(tau) shapes, random start:", guide_r.tau_conc.detach().numpy().round(3))
plt.figure(figsize=(7, 3.2))
plt.plot(-np.array(svi_losses), label='init="vb" (from the VB state)')
plt.plot(-np.array(random_losses), label='init="random"')
plt.ylim(bottom=min(-200, float(-np.median(random_losses[:50]))))
plt.xlabel("SVI step"); plt.ylabel("single-sample ELBO (nats)"); plt.legend(); plt.title("the start decides the basin")
plt.show()
"""),
    md(r"""
## 7. The two-link robot arm

Joint angles $0.3\le\theta_1\le1.2$, $\pi/2\le\theta_2\le3\pi/2$, links 0.8 and 0.2. From
the hand's position we predict the angles; in the middle of the workspace two angle pairs
reach the same point. Least squares averages them; the most probable expert of a
16-expert Bayesian HME picks one. Errors are hand-position distances after mapping the
predicted angles forward.
"""),
    code("""
pos, ang = robot_arm(200 if SMOKE else 1000, seed=0)
pos_te, ang_te = robot_arm(100 if SMOKE else 1000, seed=1)
arm = BayesianHMERegressor(topologies=[Topology.balanced(2 if SMOKE else 4)],
                           num_restarts=3 if SMOKE else 10, num_cycles=ITERS, tol=1e-6,
                           routing="hard", random_state=0).fit(pos, ang)
err = np.linalg.norm(robot_arm_forward(arm.predict(pos_te)) - pos_te, axis=-1)
w = np.linalg.lstsq(np.c_[pos, np.ones(len(pos))], ang, rcond=None)[0]
lin = np.linalg.norm(robot_arm_forward(np.c_[pos_te, np.ones(len(pos_te))] @ w) - pos_te, axis=-1)
print(f"mean hand-position error: HME {err.mean():.4f}, linear least squares {lin.mean():.4f}")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
for ax, e, name in zip(axes, [err, lin], [f"Bayesian HME ({arm.topology_.num_experts} experts)", "least squares"]):
    sc = ax.scatter(pos_te[:, 0], pos_te[:, 1], c=e, s=5, vmin=0, vmax=lin.max())
    ax.set_title(name); ax.set_xlabel("x1 (hand position)")
axes[0].set_ylabel("x2 (hand position)")
fig.colorbar(sc, ax=axes, label="hand-position error"); plt.show()
"""),
    md(r"""
## Things to try

1. Add the 4-expert trees to Section 3: run `vb.run_vb` on `Topology([1, 3, 7])` and
   `Topology([1, 2, 3])` and compare their best bounds with the 3-expert tree's.
2. Change the noise of the toy (`toy_inverse(200, noise=0.15)`): does the Ockham hill
   still peak at 3 experts? Why might more noise favour fewer experts?
3. In Section 5, run SVI for 3,000 steps and track the 500-sample ELBO every 500 steps:
   how much does SVI add to the VB start, and how does that compare with the gap
   between the ELBO and $\mathcal L_{\rm VB}$?
4. Start SVI from `init="data"` (one data-driven random start) for five seeds and count
   how often it reaches the VB start's ELBO.
5. Replace the hand-written guide of Section 2 by `pyro.infer.autoguide.AutoNormal` and
   compare the final ELBO: what does AutoNormal assume about the precisions?

## References

- C. M. Bishop, M. Svensén. *Bayesian Hierarchical Mixtures of Experts.* UAI 2003.
  [arXiv:1212.2447](https://arxiv.org/abs/1212.2447)
- M. I. Jordan, R. A. Jacobs. *Hierarchical Mixtures of Experts and the EM Algorithm.*
  Neural Computation 6(2), 1994.
- T. S. Jaakkola, M. I. Jordan. *Bayesian parameter estimation via variational methods.*
  Statistics and Computing 10, 2000.
- C. M. Bishop. *Neural Networks for Pattern Recognition.* Oxford University Press, 1995
  (the toy inverse problem and the robot arm).
"""),
]

if __name__ == "__main__":
    save(__file__, cells)
