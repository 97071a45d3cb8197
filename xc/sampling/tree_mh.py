"""Clustering-based proposal and independent Metropolis–Hastings over an SG tree ("Improving Dual-Encoder Training through Dynamic Indexes for Negative Mining", §2.2, §2.5).

`find_clustering` is Algorithm 2 batched over B queries: starting from the root's children, a frontier
node F is kept as a cluster when it is a leaf, has reached the deepest level m, or cannot hold a target
within b^m of the query (pruning test d(x, F) > maxd(F) + b^m, the digest's maxd variant of the paper's
b^k + b^m); otherwise it is expanded into its children, and its own point becomes a singleton cluster
(every target is one node, so expanding must leave the representative somewhere). The frontier is
capped at F nodes per query (best score first); capped nodes are kept as coarse clusters, so the
output is always a PARTITION of the tree's targets. The paper then keeps the top-k closest clusters.

Proposal (our choice, documented in docs/dynamic_tree.md): a mixture over
    the top-k clusters of the partition (disjoint)  +  the root's singleton and the root's children
(the "coarse mass" component the public NysSG code appends), each component c drawn with probability
    p_c ∝ |C_c| · exp(β s̃(x, rep C_c))          (eq. 7's |C|-weighting, which that code omits)
and a target drawn uniformly inside it. The coarse part covers every target, so Q > 0 everywhere and the
MH chain targets the β-softmax over s̃ exactly; its density is computed exactly as
    Q(y) = Σ_{c ∋ y} p_c / |C_c|      (a target lies in at most one top cluster and one coarse one).
Without the coarse part (`coarse=False`) Q is eq. 7 restricted to the top-k clusters and MH targets the
softmax restricted to their union (what the paper runs: greedier, biased).

`mh_chains` runs independent MH (proposals do not depend on the state, so all are drawn up front):
    accept y' w.p. min(1, exp(β s̃(y') - β s̃(y)) · Q(y) / Q(y')),
chains initialised from a Q draw. Cluster membership is tested on DFS ranges: cluster C is the slice
order[start : start + size] of the tree's DFS layout, so uniform-in-cluster sampling is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xc.sampling.sgtree import SGTree


@dataclass
class Proposal:
    """Per-query mixture components, padded to K columns (pad: size 0, logw -inf).

    start, size (B, K) int64 DFS ranges; rep (B, K) int64 node ids; score (B, K) float32 s̃(x, rep);
    logp (B, K) float64 log mixture weights (rows sum to 1)."""
    start: np.ndarray
    size: np.ndarray
    rep: np.ndarray
    score: np.ndarray
    logp: np.ndarray


def _concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) over pairs, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offsets + np.arange(total)


def _rank_in_group(group: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Order by (group, -key) and each element's rank within its group: (perm, rank)."""
    span = 2.0 * float(np.abs(key).max()) + 1.0  # one float sort on group·span - key == lexsort, faster
    perm = np.argsort(group * span - key.astype(np.float64))
    g = group[perm]
    first = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1]]))
    rank = np.arange(len(g)) - np.repeat(first, np.diff(np.concatenate([first, [len(g)]])))
    return perm, rank


def find_clustering(tree: SGTree, qphi: np.ndarray, deepest_level: int, frontier: int,
                    top_clusters: int, beta: float, coarse: bool = True) -> Proposal:
    """Algorithm 2 for queries qphi (B, d') on one tree, then the top-k + coarse mixture proposal."""
    tree.ensure_layout()
    pts, b_m = tree.pts, tree.base ** deepest_level
    nq = qphi.shape[0]
    root = tree.root
    ch0 = tree.child_idx[tree.child_ptr[root]:tree.child_ptr[root + 1]]
    out_q, out_n, out_single = [np.arange(nq)], [np.full(nq, root)], [np.ones(nq, bool)]
    out_s = [qphi @ pts[root]]
    fq, fn = np.repeat(np.arange(nq), len(ch0)), np.tile(ch0, nq)
    while len(fq):
        s = (qphi[fq] * pts[fn]).sum(1)
        stop = (tree.size[fn] == 1) | (tree.level[fn] <= deepest_level) | (np.exp(-s) > tree.maxd[fn] + b_m)
        out_q.append(fq[stop]), out_n.append(fn[stop]), out_s.append(s[stop])
        out_single.append(np.zeros(int(stop.sum()), bool))
        fq, fn, s = fq[~stop], fn[~stop], s[~stop]
        if len(fq) == 0:
            break
        if np.bincount(fq).max() > frontier:
            perm, rank = _rank_in_group(fq, s)
            fq, fn, s = fq[perm], fn[perm], s[perm]
            cap = rank >= frontier  # capped: kept whole as a coarse cluster, the partition stays a partition
            out_q.append(fq[cap]), out_n.append(fn[cap]), out_s.append(s[cap])
            out_single.append(np.zeros(int(cap.sum()), bool))
            fq, fn, s = fq[~cap], fn[~cap], s[~cap]
        out_q.append(fq), out_n.append(fn), out_s.append(s), out_single.append(np.ones(len(fq), bool))
        counts = tree.child_ptr[fn + 1] - tree.child_ptr[fn]  # expanded: its point stays as a singleton
        fq, fn = np.repeat(fq, counts), tree.child_idx[_concat_ranges(tree.child_ptr[fn], counts)]
    cq, cn, single = np.concatenate(out_q), np.concatenate(out_n), np.concatenate(out_single)
    score = np.concatenate(out_s)
    perm, rank = _rank_in_group(cq, score)
    keep = perm[rank < top_clusters]
    col = rank[rank < top_clusters]
    coarse_nodes = np.concatenate([[root], ch0]) if coarse else np.zeros(0, dtype=np.int64)
    width = top_clusters + len(coarse_nodes)
    rep = np.full((nq, width), root, dtype=np.int64)
    sz = np.zeros((nq, width), dtype=np.int64)
    sc = np.zeros((nq, width), dtype=np.float32)
    rep[cq[keep], col] = cn[keep]
    sz[cq[keep], col] = np.where(single[keep], 1, tree.size[cn[keep]])
    sc[cq[keep], col] = score[keep]
    if coarse:  # root singleton + root's children: components that together contain every target
        rep[:, top_clusters:] = coarse_nodes
        sz[:, top_clusters:] = np.concatenate([[1], tree.size[ch0]])
        sc[:, top_clusters:] = qphi @ pts[coarse_nodes].T
    logw = np.where(sz > 0, np.log(np.maximum(sz, 1)) + beta * sc.astype(np.float64), -np.inf)
    logp = logw - np.logaddexp.reduce(logw, axis=1, keepdims=True)
    return Proposal(start=tree.start[rep], size=sz, rep=rep, score=sc, logp=logp)


def log_q(prop: Proposal, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """log Q of targets at DFS positions pos (...,) for query rows (...,): exact mixture density."""
    st, sz, lp = prop.start[rows], prop.size[rows], prop.logp[rows]
    inside = (pos[..., None] >= st) & (pos[..., None] < st + sz)
    terms = np.where(inside, lp - np.log(np.maximum(sz, 1)), -np.inf)
    return np.logaddexp.reduce(terms, axis=-1)


def draw(prop: Proposal, tree: SGTree, shape: tuple[int, ...],
         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draws from Q for every query: (node ids, DFS positions), each (B, *shape)."""
    nq = prop.logp.shape[0]
    cum = np.cumsum(np.exp(prop.logp), axis=1)
    cum /= cum[:, -1:]  # exactly 1 at the last live column, so u in [0, 1) never lands on a pad
    u = rng.random((nq, *shape))
    flat_u = u.reshape(nq, -1)
    comp = np.stack([np.searchsorted(cum[q], flat_u[q], side="right") for q in range(nq)]).reshape(u.shape)
    comp = np.minimum(comp, prop.size.shape[1] - 1)
    rows = np.arange(nq).reshape((nq,) + (1,) * len(shape))
    size = prop.size[rows, comp]
    pos = prop.start[rows, comp] + np.floor(rng.random(u.shape) * size).astype(np.int64)
    return tree.order[pos], pos


def mh_chains(prop: Proposal, tree: SGTree, qphi: np.ndarray, beta: float, num_chains: int, chain_len: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Independent MH per query: (states (B, chains, chain_len + 1) node ids, their scores s̃).

    Column t is the chain state after t MH steps (column 0: the initial Q draw)."""
    nq = qphi.shape[0]
    nodes, pos = draw(prop, tree, (num_chains, chain_len + 1), rng)
    rows = np.broadcast_to(np.arange(nq)[:, None, None], nodes.shape)
    s = np.einsum("bctk,bk->bct", tree.pts[nodes], qphi)
    logq = log_q(prop, rows, pos)
    log_ratio = beta * s.astype(np.float64) - logq  # log P~/Q of every proposal
    states, scores = nodes.copy(), s.copy()
    cur = log_ratio[:, :, 0]
    log_u = np.log(rng.random((nq, num_chains, chain_len + 1)))
    for t in range(1, chain_len + 1):
        accept = log_u[:, :, t] < log_ratio[:, :, t] - cur
        states[:, :, t] = np.where(accept, nodes[:, :, t], states[:, :, t - 1])
        scores[:, :, t] = np.where(accept, s[:, :, t], scores[:, :, t - 1])
        cur = np.where(accept, log_ratio[:, :, t], cur)
    return states, scores
