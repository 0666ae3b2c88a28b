"""Tree structures over data instances for TreeVI: given, initialised, or learned.

Three ways to obtain the ``parents`` array of a :class:`~pyro_trees.distributions.TreeNormal`
(Xiao & Su 2024, Sec. 2.3 and App. D):

* :func:`maximum_spanning_tree` of a given graph or of pairwise weights (constraints,
  similarities, absolute correlations);
* :func:`similarity_dfs_tree`: a depth-first search whose next step is drawn with
  probability increasing in the similarity of the neighbours (App. D.2);
* :func:`learn_tree_structure`: the acyclicity-constrained continuous optimisation of
  eqs. 16-17, solved by an augmented Lagrangian, jointly with the variational parameters
  when the objective is the ELBO of the relaxed family
  (:func:`~pyro_trees.infer.soft_tree_elbo`). For an amortised guide,
  :func:`~pyro_trees.infer.learn_guide_tree` (:mod:`pyro_trees.infer.tree_vi_structure`)
  builds that objective from a Pyro model and the guide's networks and installs the
  learned tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from pyro_trees._forest import validate_parents

__all__ = [
    "LearnedTree",
    "acyclicity",
    "learn_tree_structure",
    "maximum_spanning_tree",
    "parents_from_edges",
    "parents_to_adjacency",
    "parents_to_probs",
    "similarity_dfs_tree",
]


def parents_from_edges(edges, num_nodes: int, root: int | None = 0) -> torch.Tensor:
    """Orient the undirected edges of a forest away from its roots.

    :param edges: integer array ``(E, 2)`` of undirected edges.
    :param int num_nodes: ``N``.
    :param root: the root of the tree holding this node; other trees of the forest are
        rooted at their smallest node.
    :returns: parent array ``(N,)`` with ``-1`` at roots.
    :raises ValueError: if the edges contain a cycle or an index out of range.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import breadth_first_order, connected_components

    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    if edges.size and (edges.min() < 0 or edges.max() >= num_nodes):
        raise ValueError(f"edge index out of range [0, {num_nodes - 1}]")
    n_comp, labels = connected_components(
        coo_matrix((np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(num_nodes, num_nodes)),
        directed=False,
    )
    if (
        len({tuple(sorted(e)) for e in edges.tolist()}) != num_nodes - n_comp
        or (edges[:, 0] == edges[:, 1]).any()
    ):
        raise ValueError("edges contain a cycle (or a repeated edge); they must form a forest")
    graph = coo_matrix(
        (np.ones(len(edges)), (edges[:, 0], edges[:, 1])), shape=(num_nodes, num_nodes)
    ).tocsr()
    parents = np.full(num_nodes, -1, dtype=np.int64)
    seen = np.zeros(n_comp, dtype=bool)
    order = list(range(num_nodes))
    if root is not None:
        order = [root] + order
    for start in order:
        if seen[labels[start]]:
            continue
        seen[labels[start]] = True
        _, pred = breadth_first_order(graph, start, directed=False, return_predecessors=True)
        mask = labels == labels[start]
        parents[mask] = np.where(pred[mask] < 0, -1, pred[mask])
    return torch.as_tensor(parents)


def maximum_spanning_tree(weights, edges=None, num_nodes: int | None = None, root: int = 0):
    """Maximum-weight spanning tree (a forest where the graph is disconnected).

    Either ``weights`` is a dense symmetric ``(N, N)`` matrix (``-inf`` or ``nan`` for
    absent edges; all finite off-diagonal entries are candidate edges), or ``edges``
    ``(E, 2)`` and ``weights`` ``(E,)`` describe a sparse graph (e.g. must-link
    constraints or a citation graph). With absolute correlations or mutual informations
    as weights this is the Chow-Liu tree.

    :returns: parent array ``(N,)`` (``-1`` at roots).
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import minimum_spanning_tree

    w = torch.as_tensor(weights).detach().cpu().double().numpy()
    if edges is None:
        if w.ndim != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"dense weights must be square (N, N), got {w.shape}")
        n = w.shape[0]
        i, j = np.triu_indices(n, 1)
        wij = w[i, j]
        keep = np.isfinite(wij)
        i, j, wij = i[keep], j[keep], wij[keep]
    else:
        e = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
        if w.shape != (len(e),):
            raise ValueError(f"weights must have shape ({len(e)},) for {len(e)} edges")
        if num_nodes is None:
            raise ValueError("num_nodes is required with an edge list")
        n = num_nodes
        if e.size and (e.min() < 0 or e.max() >= n):
            raise ValueError(f"edge index out of range [0, {n - 1}]")
        i, j, wij = e[:, 0], e[:, 1], w
        keep = (i != j) & np.isfinite(wij)
        i, j, wij = i[keep], j[keep], wij[keep]
    if len(wij) == 0:
        return torch.full((n,), -1, dtype=torch.long)
    # A monotone decreasing positive transform turns the maximum into a minimum
    # spanning tree (scipy treats explicit zeros as absent edges).
    cost = wij.max() - wij + 1.0
    mst = minimum_spanning_tree(coo_matrix((cost, (i, j)), shape=(n, n)).tocsr()).tocoo()
    return parents_from_edges(np.stack([mst.row, mst.col], 1), n, root=root)


def similarity_dfs_tree(
    features,
    *,
    num_neighbors: int | None = 10,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random depth-first-search tree biased towards similar instances (App. D.2).

    Starting from a random instance, the search steps to an unvisited neighbour drawn
    with probability :math:`\\propto \\exp(\\cos(x_i, x_j) / \\tau)`, and backtracks
    when none is left. Neighbours are the ``num_neighbors`` nearest in cosine
    similarity (``None``: every instance, which makes the DFS tree a single chain). If
    the neighbour graph is disconnected the search restarts from a random unvisited
    instance, giving a forest. Cost :math:`O(N k)` after the neighbour search.

    :param features: ``(N, F)`` array.
    :returns: parent array ``(N,)``.
    """
    x = torch.as_tensor(features).detach().double().cpu()
    if x.dim() != 2:
        raise ValueError(f"features must have shape (N, F), got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("features contain NaN or infinite values")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    n = x.shape[0]
    xn = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
    k = n - 1 if num_neighbors is None else min(num_neighbors, n - 1)
    if k <= 0:
        return torch.full((n,), -1, dtype=torch.long)
    nbr_idx, nbr_sim = [], []
    for start in range(0, n, 2048):  # blockwise to keep memory O(block * N)
        s = xn[start : start + 2048] @ xn.T
        s[torch.arange(s.shape[0]), torch.arange(start, start + s.shape[0])] = -math.inf
        v, i = s.topk(k, dim=1)
        nbr_idx.append(i)
        nbr_sim.append(v)
    nbr_idx = torch.cat(nbr_idx).numpy()
    weight = torch.cat(nbr_sim).div(temperature)
    weight = (weight - weight.max(1, keepdim=True).values).exp().numpy()
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    parents = np.full(n, -1, dtype=np.int64)
    visited = np.zeros(n, dtype=bool)
    for start in rng.permutation(n):
        if visited[start]:
            continue
        visited[start] = True
        stack = [start]
        while stack:
            v = stack[-1]
            cand = ~visited[nbr_idx[v]]
            if not cand.any():
                stack.pop()
                continue
            w = weight[v] * cand
            u = nbr_idx[v][rng.choice(k, p=w / w.sum())]
            visited[u] = True
            parents[u] = v
            stack.append(u)
    return torch.as_tensor(parents)


def parents_to_adjacency(parents, num_nodes: int | None = None) -> torch.Tensor:
    """Symmetric 0/1 adjacency ``(N, N)`` of a forest."""
    parents = validate_parents(parents, num_nodes)
    n = parents.numel()
    a = torch.zeros(n, n)
    child = (parents >= 0).nonzero().squeeze(-1)
    a[child, parents[child]] = 1.0
    return a + a.T


def parents_to_probs(parents, num_nodes: int | None = None) -> torch.Tensor:
    """One-hot soft parents ``(N, N + 1)`` (float64) of a forest: row ``i`` puts its mass
    on ``parents[i]``, or on the last column (root) where ``parents[i] = -1``. The hard
    point of the relaxation of :func:`learn_tree_structure` and
    :class:`~pyro_trees.distributions.SoftTreeNormal`, where that distribution equals the
    forest's :class:`~pyro_trees.distributions.TreeNormal`; the inverse of
    :meth:`~pyro_trees.distributions.SoftTreeNormal.hard_parents`. Its first ``N`` columns
    are the oriented parent-pointer matrix that :func:`acyclicity` scores.

    :param parents: parent array ``(N,)`` (validated: in range, acyclic).
    :param int num_nodes: ``N``, if ``parents`` must have that length.
    """
    parents = validate_parents(parents, num_nodes)
    n = parents.numel()
    probs = torch.zeros(n, n + 1, dtype=torch.float64, device=parents.device)
    probs[torch.arange(n, device=parents.device), torch.where(parents < 0, n, parents)] = 1.0
    return probs


def acyclicity(adjacency: torch.Tensor) -> torch.Tensor:
    r"""NOTEARS acyclicity :math:`h(A) = \operatorname{tr} e^{A \circ A} - N` (eq. 16).

    It is zero exactly when the *directed* graph of ``A`` has no cycle. A symmetric
    matrix with any edge has 2-cycles, so for undirected forests we apply it to the
    oriented, parent-pointer matrix ``A[i, j] = 1`` iff ``j`` is the parent of ``i``:
    with at most one parent per node, that graph is acyclic iff its undirected skeleton
    is a forest (see :func:`learn_tree_structure`).
    """
    n = adjacency.shape[-1]
    return torch.linalg.matrix_exp(adjacency * adjacency).diagonal(dim1=-2, dim2=-1).sum(-1) - n


@dataclass
class LearnedTree:
    """Result of :func:`learn_tree_structure`.

    :ivar parents: hard parent array ``(N,)`` (argmax of the soft parents, cycles cut).
    :ivar probs: soft parent matrix ``(N, N + 1)``; the last column is "root".
    :ivar h: acyclicity of the soft parent matrix at the end.
    :ivar h_hard: acyclicity of the hard parent matrix (0 for a valid forest).
    :ivar history: ``(outer_iteration, objective, h, rho)`` per outer iteration.
    :ivar elbo: a Monte Carlo ELBO per tree of the hard tree with the learnt parameters,
        where the caller computes one (:func:`~pyro_trees.infer.learn_guide_tree`
        does, to rank restarts); ``None`` otherwise.

    .. rubric:: Examples

    >>> import torch
    >>> from pyro_trees.infer import learn_tree_structure
    >>> w = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    >>> res = learn_tree_structure(lambda p: (p[:, :3] * w).sum(), 3, inner_steps=5, max_outer=2)
    >>> res.parents.shape, res.probs.shape, res.h_hard
    (torch.Size([3]), torch.Size([3, 4]), 0.0)
    """

    parents: torch.Tensor
    probs: torch.Tensor
    h: float
    h_hard: float
    history: list = field(default_factory=list)
    elbo: float | None = None


def learn_tree_structure(
    objective: Callable[[torch.Tensor], torch.Tensor] | torch.Tensor,
    num_nodes: int | None = None,
    *,
    init_parents=None,
    init_strength: float = 2.0,
    root_score: float = 0.0,
    temperature: float = 0.3,
    max_outer: int = 20,
    inner_steps: int = 200,
    lr: float = 0.05,
    rho_init: float = 1.0,
    rho_max: float = 1e8,
    h_tol: float = 1e-6,
    generator: torch.Generator | None = None,
    params: Iterable[torch.Tensor] | None = None,
    param_lr: float | None = None,
    single_root: bool = False,
) -> LearnedTree:
    r"""Learn a forest by the acyclicity-constrained optimisation of eqs. 16-17.

    Each node ``i`` has a soft parent distribution ``P[i] = softmax(L[i] / T)`` over the
    other nodes and a "root" option; the oriented matrix :math:`A = P_{:, :N}` replaces
    the paper's symmetric ``A`` (see :func:`acyclicity`). We maximise
    ``objective(P)`` subject to :math:`h(A) = 0` by the augmented Lagrangian

    .. math:: \min_L\ -f(P) + \alpha\, h(A) + \tfrac{\rho}{2} h(A)^2,

    updating :math:`\alpha \leftarrow \alpha + \rho h` after each inner solve (Adam,
    ``inner_steps``) and multiplying :math:`\rho` by 10 when ``h`` did not drop below a
    quarter of its previous value (Zheng et al. 2018). At the end the hard parents are
    the row-wise argmax; any cycle left is cut at its weakest link (that node becomes a
    root).

    ``objective`` is either a callable ``P -> scalar`` (e.g. a TreeVI ELBO in which edge
    ``(j, i)`` enters with weight ``P[i, j]``), or a symmetric ``(N, N)`` tensor of edge
    scores ``W``, for which ``f(P) = sum_ij P[i, j] W[i, j]`` (with mutual informations
    :math:`-\tfrac12\log(1-r_{ij}^2)` this is the Chow-Liu objective whose optimum is
    :func:`maximum_spanning_tree`). Cost :math:`O(N^3)` per step (matrix exponential):
    meant for a few hundred nodes, e.g. one minibatch.

    **Joint optimisation (eq. 17).** With ``params`` (e.g. the variational ``loc``,
    ``scale`` and correlation parameters, or a guide's ``parameters()``), the inner Adam
    updates them together with the logits, so the objective is maximised over the
    parameters and the structure jointly: with ``objective = lambda P:
    soft_tree_elbo(log_joint, loc, scale, rho, P)`` this is eq. 17, the negative ELBO
    minimised over the guide parameters and ``A`` subject to :math:`h(A) = 0`. The
    tensors in ``params`` are updated in place (they must be leaves with
    ``requires_grad=True``); the objective must recompute anything derived from them on
    every call. Without ``params`` the behaviour is exactly that of the logits-only
    solver.

    The oriented relaxation has local optima: joining two trees of a forest, or moving an
    edge, can require re-orienting a whole subtree, which a gradient step does not do.
    On an 8-node Gaussian model whose posterior is a tree (``tests/infer/
    test_soft_tree_elbo.py``), ``lr=0.1``, ``param_lr=0.05``, 16 particles and 100 inner
    steps recovered the exact tree from near-uniform logits in 17 of 20 problems (the
    others missed one edge); run a few restarts (``generator``) and keep the hard tree
    with the best ELBO.

    :param init_parents: parent array ``(N,)`` to start from (default: near-uniform
        logits, small random perturbations drawn from ``generator``).
    :param float init_strength: logit bonus of ``init_parents`` (the start puts weight
        about :math:`1 / (1 + N e^{-s / T})` on them: 0.99 for ``s = 2``, ``T = 0.3``,
        ``N = 8``, a strong start; smaller values start softer).
    :param float root_score: score of the "root" option (for a matrix objective).
    :param float lr: Adam step size of the logits.
    :param params: extra tensors optimised jointly with the logits (default none).
    :param float param_lr: Adam step size of ``params`` (default ``lr``).
    :param bool single_root: relax spanning trees instead of forests: the root
        probabilities form one softmax over the nodes (logit ``L[i, N]``), so the soft
        parents hold exactly one unit of root mass, and node ``i`` spreads the rest,
        ``1 - r_i``, over its parents (``softmax(L[i, :N] / T)``). The hard tree is the
        most probable root plus each other node's most probable parent (cycles cut as
        above). With learnt edge correlations nothing is lost: a forest is a spanning
        tree whose extra edges have zero correlation. What is gained: in the free
        relaxation every root option lowers :math:`h` for all nodes at once, so when
        the objective's gain per edge is small next to the penalty (weakly correlated
        posteriors) the solver escapes to the empty forest, which is acyclic; with one
        unit of root mass it must orient edges instead.
    :returns: :class:`LearnedTree`.
    """
    if isinstance(objective, torch.Tensor):
        w = objective.detach()
        if w.dim() != 2 or w.shape[0] != w.shape[1]:
            raise ValueError(f"an edge-score objective must be square (N, N), got {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("edge scores contain NaN or infinite values")
        num_nodes = w.shape[0]
        w_root = torch.cat([w, w.new_full((num_nodes, 1), root_score)], 1)

        def objective(p, w_root=w_root):
            return (p * w_root).sum()

    if num_nodes is None:
        raise ValueError("num_nodes is required with a callable objective")
    extra = [] if params is None else list(params)
    for k, t in enumerate(extra):
        if not isinstance(t, torch.Tensor) or not t.is_leaf or not t.requires_grad:
            raise ValueError(
                f"params[{k}] must be a leaf tensor with requires_grad=True (an nn.Parameter "
                "or a tensor made with requires_grad_())"
            )
    if param_lr is not None and not param_lr > 0:
        raise ValueError(f"param_lr must be positive, got {param_lr}")
    n = num_nodes
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    logits = 0.01 * torch.randn(n, n + 1, generator=gen, dtype=torch.float64)
    if init_parents is not None:
        logits += init_strength * parents_to_probs(init_parents, n)
    logits.requires_grad_()
    mask = torch.zeros(n, n + 1, dtype=torch.bool)
    mask[torch.arange(n), torch.arange(n)] = True

    def soft(lg):
        if not single_root or n == 1:
            return torch.softmax(lg.masked_fill(mask, -math.inf) / temperature, dim=1)
        root = torch.softmax(lg[:, n] / temperature, dim=0)  # one unit of root mass
        par = torch.softmax(lg[:, :n].masked_fill(mask[:, :n], -math.inf) / temperature, dim=1)
        return torch.cat([par * (1 - root).unsqueeze(1), root.unsqueeze(1)], 1)

    alpha, rho, h_prev = 0.0, rho_init, math.inf
    history = []
    for outer in range(max_outer):
        groups = [{"params": [logits], "lr": lr}]
        if extra:
            groups.append({"params": extra, "lr": lr if param_lr is None else param_lr})
        opt = torch.optim.Adam(groups)
        for _ in range(inner_steps):
            opt.zero_grad()
            p = soft(logits)
            h = acyclicity(p[:, :n])
            loss = -objective(p.to(torch.get_default_dtype())).double() + alpha * h
            loss = loss + 0.5 * rho * h * h
            loss.backward()
            opt.step()
        with torch.no_grad():
            p = soft(logits)
            h = float(acyclicity(p[:, :n]))
            f = float(objective(p.to(torch.get_default_dtype())))
        history.append((outer, f, h, rho))
        if h <= h_tol:
            break
        alpha += rho * h
        if h > 0.25 * h_prev:
            rho = min(rho * 10, rho_max)
        h_prev = h
    with torch.no_grad():
        p = soft(logits)
        if single_root and n > 1:
            best = p[:, :n].argmax(1)
            best[p[:, n].argmax()] = n
        else:
            best = p.argmax(1)
        parents = torch.where(best == n, torch.tensor(-1), best)
        parents = _cut_cycles(parents, p)
        h_hard = float(acyclicity(parents_to_probs(parents, n)[:, :n]))
    return LearnedTree(parents=parents, probs=p.detach(), h=h, h_hard=h_hard, history=history)


def _cut_cycles(parents: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Make the node with the weakest parent probability on each cycle a root."""
    parents = parents.clone()
    n = parents.numel()
    while True:
        try:
            validate_parents(parents)
            return parents
        except ValueError as e:
            if "cycle" not in str(e):
                raise
        # walk from a node that never reaches a root until a node repeats
        ptr = torch.where(parents < 0, torch.full_like(parents, n), parents)
        ptr = torch.cat([ptr, ptr.new_tensor([n])])
        reach = ptr.clone()
        for _ in range(max(1, math.ceil(math.log2(n + 1))) + 1):
            reach = reach[reach]
        v = int((reach[:n] != n).nonzero()[0])
        seen = []
        while v not in seen:
            seen.append(v)
            v = int(parents[v])
        cycle = seen[seen.index(v) :]
        weakest = min(cycle, key=lambda u: float(probs[u, parents[u]]))
        parents[weakest] = -1
