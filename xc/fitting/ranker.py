"""A sparse linear ranker over the input features, fused at inference with the model and the kNN vote.

    r(x, l) = u_l . x + b_l
    fused(x, l) = [(1 - lam) p_model(x, l; T) + lam vote_k(x, l)] * sigmoid(r(x, l)) ** gamma

x is the query's L2-normalised tf-idf row (the kNN's input space, `xc/fitting/knn.py`); u_l a sparse weight vector
per label, b_l its bias; gamma is chosen on validation with lam (`xc/fitting/memory.py`), gamma = 0 is the fusion
without it.

Why: on sparse text with tens of thousands of features the libraries users compare with (PECOS XR-Linear, Omikuji,
napkinXC) keep one full-rank sparse weight vector per label over the tf-idf, trained against the points their label
tree confuses with the label's positives; XR-Transformer ("Fast Multi-Resolution Transformer Fine-tuning for Extreme
Multi-label Text Classification") ranks over tf-idf beside its learned embedding for the same reason: lexical and
embedding models make different errors. Trained inside the step on ASTRA's negatives the same weights reached 51
P@1 on debian-deps (docs/accuracy.md): a lexical model needs negatives that share its features, which the embedding's
hard negatives and uniform draws rarely do. Here they are the labels a query's neighbours carry:

Training pairs (point i, label l) over the training points that did not form the validation split:
  * every positive label of i (y = 1);
  * the `negatives` best-voted labels of i's `neighbours` nearest *other* training points by tf-idf cosine
    (leave-one-out: a point never votes for itself, as a test query never finds itself), y = 1 where positive;
  * the model's own hard negatives of i where the run has them (`hard_negatives`, the last mined table's first
    columns): at inference the ranker re-scores the model's top labels beside the vote's, and the model's confusions
    are mostly not its neighbours' labels (on debian-deps they added 11% more pairs). With them the ranker alone
    went from 64.9 to 66.1 P@1 on debian-deps' test split and the fused model's P@1/3/5 rose by 0.05-0.14 on the
    three seeds' mean (docs/accuracy.md).
u_l lives on the features of the points paired with l, positives and negatives alike (a negative's own features
are what pushes it down; weights on the positives' features only left the ranker at 42 P@1 on debian-deps). Each
label is an L2-regularised logistic regression, independent of the others; labels are solved in fixed blocks of
`block_labels` (`solve_block`), block b on rank b % world_size, so a 2-rank run solves exactly the problems a
1-rank run does, and scoring sums the ranks' parts as the classifier's label shards do. Cost: pairs ~ N x
(negatives + positives per point), weights at most pairs x nnz per row; nothing is O(L) per query.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from xc.arrays import find_sorted, unique_ints
from xc.errors import CheckpointError
from xc.fitting.fusion import model_probabilities
from xc.fitting.knn import DENSE_SHARE, LabelVotes, Neighbours, dense_neighbours, sparse_neighbours
from xc.fitting.lbfgs import minimise

log = logging.getLogger(__name__)
RANKER_DIR = "ranker"
NO_EVIDENCE = -20.0  # the bias of a label no training point carries: sigmoid ~ 2e-9
SCORE_ENTRIES = 1 << 23  # (pair, feature) entries scored at once (`LexicalRanker.score_part`)


@dataclass
class RankerParams:
    """What `fit_ranker` needs of `eval.ranker` (xc/config.py RankerConfig)."""

    reg: float = 0.2  # L2 weight on u_l, per label (the bias is not regularised)
    iterations: int = 40  # L-BFGS iterations per block of labels
    neighbours: int = 20  # other training points whose labels give a point's negatives
    negatives: int = 100  # best-voted labels of those neighbours paired with each point
    # labels per independent solve: the blocks are what the rank's threads share out, so 8,192 left debian-deps'
    # 37,960 labels 5 blocks, 3 on one of 2 threads and at most 5 busy on a many-core host; 2,048 gives 19, and the
    # same fused validation figure (48.30 on seed 0)
    block_labels: int = 2048
    search_products: int = 0  # the neighbour search's budget of multiply-adds (`search_features`; 0: exact)
    row_features: int = 0  # each training row's largest values the pairs keep (`largest_row_features`; 0: all)

    @classmethod
    def of(cls, ranker_cfg, size: "RankerSize | None" = None) -> "RankerParams":
        """The fitting settings of `eval.ranker`, narrowed to `size` where the size rule narrowed them
        (xc/fitting/memory.py `FusionEvaluator.ranker_size`)."""
        return cls(ranker_cfg.reg, ranker_cfg.iterations, ranker_cfg.neighbours,
                   ranker_cfg.negatives if size is None else size.negatives, ranker_cfg.block_labels,
                   ranker_cfg.search_products, 0 if size is None else size.row_features)


@dataclass(frozen=True)
class RankerSize:
    """What the size rule leaves the ranker: `negatives` neighbours' labels a point pairs with (0: none, the model's
    hard negatives only), and `row_features` largest values of each training row the pairs keep (0: all)."""

    negatives: int
    row_features: int = 0


@dataclass
class LexicalRanker:
    """Sparse per-label weights: keys (W,) int64 sorted, label * num_features + feature; weights (W,) float32;
    bias (L,) float32 (NO_EVIDENCE for labels no training point carries); owned (L,) bool, the labels whose
    weights this part holds (one rank's blocks; a loaded ranker holds every label)."""

    keys: np.ndarray
    weights: np.ndarray
    bias: np.ndarray
    owned: np.ndarray
    num_features: int

    def score_part(self, x: sp.csr_matrix, ids: np.ndarray) -> np.ndarray:
        """r(x_q, ids[q, j]) (M, c) float64 for query rows x (M, F) (L2-normalised tf-idf) and label ids (M, c),
        0 at pads and at labels this part does not own (the ranks' parts add up to the whole ranker's scores)."""
        m, c = ids.shape
        out = np.zeros((m, c), np.float64)
        # rows in chunks of at most SCORE_ENTRIES (pair, feature) entries: each entry holds ~60 bytes of index arrays
        # while it is looked up, and 5,000 rows x 300 candidates x 50 features at once would be 4 GB
        entries = np.cumsum(np.diff(x.indptr)[:m].astype(np.int64) * c)
        lo = 0
        while lo < m:
            hi = max(lo + 1, int(np.searchsorted(entries, (entries[lo - 1] if lo else 0) + SCORE_ENTRIES, "right")))
            out[lo:hi] = self._score_rows(x[lo:hi], ids[lo:hi])
            lo = hi
        return out

    def _score_rows(self, x: sp.csr_matrix, ids: np.ndarray) -> np.ndarray:
        m, c = ids.shape
        flat = ids.reshape(-1).astype(np.int64)
        mine = flat >= 0
        mine[mine] = self.owned[flat[mine]]
        out = np.zeros(flat.shape, np.float64)
        if mine.any():
            rows = np.repeat(np.arange(m, dtype=np.int64), c)[mine]
            labels = flat[mine]
            pair, col, value = pair_features(x, rows, labels, self.num_features)
            slot, hit = find_sorted(self.keys, col)
            s = np.bincount(pair[hit], weights=value[hit] * self.weights[slot[hit]], minlength=len(labels))
            out[mine] = s + self.bias[labels]
        return out.reshape(m, c)

    def score(self, x: sp.csr_matrix, ids: np.ndarray) -> np.ndarray:
        """r (M, c) float32 of the labels ids (M, c) this ranker owns; -1 pads score -inf."""
        return np.where(ids >= 0, self.score_part(x, ids), -np.inf).astype(np.float32)

    def save(self, run_dir, rank: int, world_size: int) -> None:
        """RUN_DIR/ranker/part{rank}-of{world_size}.npz, written to a temporary name and renamed (never
        half-written; a run of another world size writes other names, so parts never mix)."""
        folder = Path(run_dir) / RANKER_DIR
        folder.mkdir(parents=True, exist_ok=True)
        name = part_name(rank, world_size)
        tmp = folder / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, keys=self.keys, weights=self.weights, bias=self.bias, owned=self.owned,
                     num_features=self.num_features)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / name)

    @classmethod
    def load(cls, run_dir, parts: int) -> "LexicalRanker":
        """The `parts` ranks' parts in RUN_DIR/ranker/ as one ranker (their labels are disjoint)."""
        paths = [Path(run_dir) / RANKER_DIR / part_name(r, parts) for r in range(parts)]
        missing = [str(p) for p in paths if not p.exists()]
        if missing or not parts:
            raise CheckpointError(f"the lexical ranker fusion.json names is missing: {', '.join(missing) or run_dir}")
        loaded = [np.load(p) for p in paths]
        keys = np.concatenate([p["keys"] for p in loaded])
        order = np.argsort(keys, kind="stable")
        owned = np.any([p["owned"] for p in loaded], 0)
        bias = np.sum([np.where(p["owned"], p["bias"], 0.0) for p in loaded], 0).astype(np.float32)
        return cls(keys[order], np.concatenate([p["weights"] for p in loaded])[order], bias, owned,
                   int(loaded[0]["num_features"]))


def part_name(rank: int, world_size: int) -> str:
    return f"part{rank}-of{world_size}.npz"


def sigmoid(r: np.ndarray) -> np.ndarray:
    """float32 sigmoid of ranker scores (-inf pads give ~0), as a BCE model's probabilities are taken."""
    return model_probabilities(r, "bce").astype(np.float32)


def pair_features(x: sp.csr_matrix, rows: np.ndarray, labels: np.ndarray,
                  num_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every feature of every pair (rows[p], labels[p]): (pair index, key label * num_features + feature, value),
    each (sum of the rows' nnz,)."""
    counts = np.diff(x.indptr)[rows]
    pair = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    offsets = np.arange(counts.sum(), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    at = np.repeat(x.indptr[rows].astype(np.int64), counts) + offsets
    keys = labels[pair] * num_features + x.indices[at].astype(np.int64)
    return pair, keys, x.data[at].astype(np.float64)


def training_pairs(labels: sp.csr_matrix, negatives: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, label ids, y) of every (point, label) pair: each point's positives (labels (n, L) binary CSR) and its
    negative candidates (n, c) (-1 pads; a positive among them counts once), sorted by label then row."""
    n = labels.shape[0]
    pos_rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(labels.indptr))
    cand_rows = np.repeat(np.arange(n, dtype=np.int64), negatives.shape[1])
    rows = np.concatenate([pos_rows, cand_rows])
    ids = np.concatenate([labels.indices.astype(np.int64), negatives.reshape(-1).astype(np.int64)])
    keep = ids >= 0
    key = unique_ints(ids[keep] * n + rows[keep])  # sorted by label, then row
    rows, ids = key % n, key // n
    _, y = find_sorted(unique_ints(labels.indices.astype(np.int64) * n + pos_rows), key)
    return rows, ids, y.astype(np.float64)


def search_features(x: sp.csr_matrix, max_products: int) -> sp.csr_matrix:
    """x (n, F) with its most frequent features dropped (values kept, rows not re-normalised) until the all-pairs
    search x x^T takes at most `max_products` multiply-adds: a feature present in df rows adds df^2 of them, so the
    cost is the sum of df^2 over the features kept. 0 keeps every feature.

    Why: where a few features occur in most rows (background words under a Zipf law) the exact search links every
    point to almost every other: 1.1 x 10^11 products at 10^5 labels (the scale benchmark's 200k points, 18 minutes
    of the ranker's 2-core time), against 7 x 10^8 on debian-deps, 3 x 10^8 on Bibtex. Those features carry the least
    idf weight, so they move a cosine least: within 4 x 10^9 the benchmark's search took an eighth of its time and
    kept 0.86 of each point's exact 20 nearest. The shipped sets are under the budget and search every feature."""
    if max_products <= 0 or x.shape[0] == 0:
        return x
    df = np.bincount(x.indices, minlength=x.shape[1]).astype(np.float64)
    order = np.argsort(df, kind="stable")  # rarest first: features are kept while the budget lasts
    # and at least half of the non-zeros, whatever the cost: where features are about equally frequent none is a
    # background word, and dropping most of them would leave neighbours found on a few arbitrary ones
    within = (np.cumsum(df[order] ** 2) <= float(max_products)) | (np.cumsum(df[order]) <= 0.5 * x.nnz)
    keep = np.zeros(x.shape[1], dtype=bool)
    keep[order[within]] = True
    if keep[df > 0].all():
        return x
    pruned = x.copy()
    pruned.data = np.where(keep[pruned.indices], pruned.data, 0).astype(pruned.data.dtype)
    pruned.eliminate_zeros()
    log.info("lexical ranker: the neighbour search leaves out the %d most frequent of %d features (%.0f%% of the "
             "non-zeros; eval.ranker.search_products=%.2g)", int((~keep & (df > 0)).sum()), int((df > 0).sum()),
             100.0 * (1.0 - pruned.nnz / max(1, x.nnz)), max_products)
    return pruned


def largest_row_features(x: sp.csr_matrix, keep: int) -> sp.csr_matrix:
    """x (n, F) with each row's `keep` largest values kept (ties: the lower feature id), the rest dropped; rows are
    not re-normalised, so a kept feature's value is what a query's row holds. 0 keeps every value.

    Why: where the training pairs' positives alone are more (pair, feature) entries than the ranker's size allows
    (10^7 labels: 2.2e8), a point's largest tf-idf values are its rarest, most telling features; the weights a label
    learns on them are those that separate it (xc/fitting/memory.py `FusionEvaluator.ranker_size`)."""
    if keep <= 0 or x.nnz == 0 or np.diff(x.indptr).max() <= keep:
        return x
    row = np.repeat(np.arange(x.shape[0], dtype=np.int64), np.diff(x.indptr))
    order = np.lexsort((x.indices, -x.data, row))  # by row, largest value first
    place = np.empty(x.nnz, np.int64)
    place[order] = np.arange(x.nnz, dtype=np.int64) - np.repeat(x.indptr[:-1].astype(np.int64), np.diff(x.indptr))
    kept = place < keep
    out = sp.csr_matrix((x.data[kept], x.indices[kept], np.concatenate([[0], np.cumsum(np.bincount(
        row[kept], minlength=x.shape[0]))])), shape=x.shape)
    out.sort_indices()
    return out


def neighbour_negatives(x: sp.csr_matrix, labels: sp.csr_matrix, neighbours: int, width: int,
                        max_products: int = 0) -> np.ndarray:
    """(n, width) label ids: each training point's best-voted labels among its `neighbours` nearest other training
    points (tf-idf cosine, the point itself left out; sparse rows searched within `max_products`, `search_features`;
    dense ones by one blocked dense product), -1 pads."""
    if x.nnz > DENSE_SHARE * x.shape[0] * x.shape[1]:  # dense rows (the kNN's rule): one dense product
        rows = torch.from_numpy(x.toarray().astype(np.float32))  # N x F within max_pair_features (the size rule)
        found = dense_neighbours(rows, rows, neighbours + 1)
    else:
        x_search = search_features(x, max_products)
        found = sparse_neighbours(x_search, x_search, neighbours + 1)
    itself = found.ids == np.arange(len(found.ids))[:, None]
    sims = np.where(itself, 0.0, found.sims)
    ids = np.where(itself, -1, found.ids)
    order = np.argsort(-sims, axis=1, kind="stable")[:, :neighbours]
    others = Neighbours(np.take_along_axis(sims, order, 1).astype(np.float32), np.take_along_axis(ids, order, 1))
    return LabelVotes(others, labels, labels.shape[1]).top(width)[1]


def solve_block(x: sp.csr_matrix, rows: np.ndarray, labels: np.ndarray, y: np.ndarray, lo: int, hi: int,
                reg: float, iterations: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys, weights, bias (hi - lo,)) of labels [lo, hi) from their pairs (rows, labels, y all (P,)).

    min over u, b of sum_p log(1 + exp(-s_p (u_{l_p} . x_{r_p} + b_{l_p}))) + reg/2 |u|^2, s_p = 2 y_p - 1, by
    L-BFGS (`xc/fitting/lbfgs.py`) in the variables scaled by the diagonal of the Hessian at 0 (a Jacobi preconditioner:
    tf-idf features differ by orders of magnitude in how many pairs they touch, which stalls plain L-BFGS)."""
    pair, key, value = pair_features(x, rows, labels, x.shape[1])
    keys, column = np.unique(key, return_inverse=True)
    w = len(keys)
    bias_col = w + (labels - lo)
    m = sp.csr_matrix((np.concatenate([value, np.ones(len(rows))]),
                       (np.concatenate([pair, np.arange(len(rows))]), np.concatenate([column, bias_col]))),
                      shape=(len(rows), w + hi - lo))
    mt = m.T.tocsr()
    sign = 2.0 * y - 1.0
    curvature = 0.25 * np.asarray(m.multiply(m).sum(0)).ravel()
    curvature[:w] += reg
    curvature[w:] += 1.0
    scale = 1.0 / np.sqrt(curvature)

    def loss_and_grad(v: np.ndarray) -> tuple[float, np.ndarray]:
        theta = scale * v
        margin = sign * (m @ theta)
        loss = np.logaddexp(0.0, -margin).sum() + 0.5 * reg * theta[:w] @ theta[:w]
        grad = mt @ (-sign / (1.0 + np.exp(margin)))
        grad[:w] += reg * theta[:w]
        return float(loss), scale * grad

    theta = scale * minimise(loss_and_grad, np.zeros(w + hi - lo), iterations)
    return keys, theta[:w].astype(np.float32), theta[w:].astype(np.float32)


def fit_ranker(x: sp.csr_matrix, labels: sp.csr_matrix, params: RankerParams, rank: int = 0,
               world_size: int = 1, threads: int = 1, hard_negatives: np.ndarray | None = None,
               progress: bool = False) -> LexicalRanker:
    """This rank's part of the ranker, from training rows x (n, F) (L2-normalised tf-idf) and their labels (n, L)
    binary CSR: the blocks b of `params.block_labels` labels with b % world_size == rank (module docstring), solved
    `threads` at a time (the blocks are independent problems, so the result does not depend on it).
    `hard_negatives` (n, c) int label ids, -1 pads: the model's own negatives of each row, paired beside the
    neighbours' labels (every rank passes the same table). `progress`: a bar over the label blocks on a terminal
    (at 10^6 labels the blocks take minutes)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    num_labels, num_features = labels.shape[1], x.shape[1]
    log.info("lexical ranker: pairing %d training points with %d of their %d nearest others' labels%s", x.shape[0],
             params.negatives, params.neighbours, "" if hard_negatives is None else
             f" and {hard_negatives.shape[1]} of the model's hard negatives")
    start = time.perf_counter()
    if params.negatives > 0:
        negatives = neighbour_negatives(x, labels, params.neighbours, params.negatives, params.search_products)
    else:  # the size rule left the model's hard negatives only: no search
        negatives = np.zeros((x.shape[0], 0), np.int64)
    searched = time.perf_counter() - start
    if params.row_features:
        x = largest_row_features(x, params.row_features)
        log.info("lexical ranker: each training row keeps its %d largest features (%d non-zeros)",
                 params.row_features, x.nnz)
    if hard_negatives is not None and hard_negatives.size:
        if hard_negatives.shape[0] != x.shape[0]:
            raise ValueError(f"hard_negatives has {hard_negatives.shape[0]} rows for {x.shape[0]} training rows")
        negatives = np.concatenate([negatives, hard_negatives.astype(negatives.dtype)], axis=1)
    rows, ids, y = training_pairs(labels, negatives)
    num_blocks = -(-num_labels // params.block_labels)
    starts = np.searchsorted(ids, np.arange(num_blocks + 1) * params.block_labels)  # each block's first pair
    bias, owned = np.zeros(num_labels, np.float32), np.zeros(num_labels, bool)
    mine = list(range(rank, num_blocks, world_size))
    for b in mine:
        owned[b * params.block_labels:(b + 1) * params.block_labels] = True
    bias[owned] = NO_EVIDENCE
    log.info("lexical ranker: neighbours found in %.1fs; solving %d blocks of %d labels on %d thread(s)",
             searched, len(mine), params.block_labels, max(1, threads))

    def solve(b: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = b * params.block_labels, min((b + 1) * params.block_labels, num_labels)
        p0, p1 = starts[b], starts[b + 1]
        if p1 == p0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        k, w, block_bias = solve_block(x, rows[p0:p1], ids[p0:p1], y[p0:p1], lo, hi, params.reg, params.iterations)
        paired = np.zeros(hi - lo, bool)
        paired[ids[p0:p1] - lo] = True
        bias[lo:hi] = np.where(paired, block_bias, NO_EVIDENCE)  # disjoint slices: safe from several threads
        return k, w

    # scipy's sparse products and numpy's element-wise work release the GIL: blocks on the rank's threads take
    # debian-deps' fit from one core's time to a little over half of it on 2 cores
    with ThreadPoolExecutor(max(1, min(threads, len(mine) or 1))) as pool, \
            tqdm(total=len(mine), desc="lexical ranker", unit="block", disable=None if progress else True,
                 leave=False, mininterval=5.0) as bar:
        solved = []
        for done in pool.map(solve, mine):  # in block order: keys stay sorted
            solved.append(done)
            bar.update()
    keys = [k for k, _ in solved if len(k)]
    weights = [w for k, w in solved if len(k)]
    lone = len(unique_ints(ids)) - len(unique_ints(ids[y == 0]))  # every label a negative names is paired
    log.info("lexical ranker: %d pairs (%d positive), %d weights on rank %d; %d labels paired with positives only",
             len(rows), int(y.sum()), sum(len(k) for k in keys), rank, lone)
    return LexicalRanker(np.concatenate(keys) if keys else np.zeros(0, np.int64),
                         np.concatenate(weights) if weights else np.zeros(0, np.float32), bias, owned, num_features)
