"""The exact sparse kNN's top-k (xc/fitting/knn.py `sparse_neighbours`) against two ways to pick it without a Python
loop over queries: a vectorised numpy top-k over each block's CSR product (one np.lexsort for the whole block), and
`sparse_dot_topn` (PyPI), whose C++ fuses the product and the top-n. All on one tf-idf-like matrix, in this one
process, on one thread and on two; each is checked for rankings identical to xc's (same ids and sims, same order).

    XC_THREADS=1 .venv/bin/python tools/bench/bench_knn_topk.py --points 20000 --queries 20000 --k 50
    PYTHONPATH=/path/to/sparse_dot_topn .venv/bin/python tools/bench/bench_knn_topk.py   # also times sparse_dot_topn

The matrix: `--points` rows over `--features` words drawn from a Zipf law (s = 1.1, about 80 words a row), tf-idf
weighted and L2-normalised, as `input_vectors` makes them; the queries are its first `--queries` rows searched against
all rows (the ranker's all-pairs search); `--duplicates` repeats memory rows. Reports seconds per 1,000 queries, the
best of `--repeats` runs, and the rows whose ranked ids differ from xc's.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import scipy.sparse as sp


def tfidf_matrix(points: int, features: int, words: int, seed: int = 0) -> sp.csr_matrix:
    """(points, features) float32 L2-normalised tf-idf rows of Zipf-distributed words."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(words, points).clip(1)
    p = 1.0 / np.arange(1, features + 1) ** 1.1
    cols = rng.choice(features, int(lengths.sum()), p=p / p.sum())
    rows = np.repeat(np.arange(points), lengths)
    m = sp.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)), shape=(points, features))
    m.sum_duplicates()
    df = np.bincount(m.indices, minlength=features)
    idf = (np.log((1.0 + points) / (1.0 + df)) + 1.0).astype(np.float32)
    m = sp.csr_matrix(m @ sp.diags(idf))
    norms = np.sqrt(np.asarray(m.multiply(m).sum(1)).ravel()).clip(1e-12)
    return sp.csr_matrix(sp.diags(1.0 / norms.astype(np.float32)) @ m)


def _rank_into(sims, ids, first, rows, vals, cols, k: int) -> None:
    """Write each row's top k of (rows, vals, cols) entries, best first and equal ones by memory index, into
    sims / ids from row `first` on."""
    keep = vals > 0
    rows, vals, cols = rows[keep], vals[keep], cols[keep]
    order = np.lexsort((cols, -vals, rows))
    rows, vals, cols = rows[order], vals[order], cols[order]
    rank = np.arange(len(rows)) - np.searchsorted(rows, rows)
    top = rank < k
    sims[first + rows[top], rank[top]] = vals[top]
    ids[first + rows[top], rank[top]] = cols[top]


def lexsort_neighbours(queries: sp.csr_matrix, memory: sp.csr_matrix, k: int, threads: int):
    """The same blocks as sparse_neighbours, each ranked by one lexsort over (query, -sim, memory index)."""
    from concurrent.futures import ThreadPoolExecutor

    from xc.fitting.knn import query_blocks

    m = queries.shape[0]
    memory_t = memory.T.tocsr()
    sims = np.zeros((m, k), np.float32)
    ids = np.full((m, k), -1, np.int64)

    def search(span):
        start, stop = span
        block = (queries[start:stop] @ memory_t).tocsr()
        rows = np.repeat(np.arange(stop - start), np.diff(block.indptr))
        _rank_into(sims, ids, start, rows, block.data, block.indices, k)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(search, query_blocks(queries, memory_t)))
    return sims, ids


def topn_neighbours(queries: sp.csr_matrix, memory: sp.csr_matrix, k: int, threads: int):
    """sparse_dot_topn's fused product and top-n, laid out as xc's Neighbours (ties re-ordered by memory index)."""
    from sparse_dot_topn import sp_matmul_topn

    out = sp_matmul_topn(queries, memory.T.tocsr(), top_n=k, threshold=0.0, sort=True,
                         n_threads=threads if threads > 1 else None)
    out = out.tocsr()
    m = queries.shape[0]
    sims = np.zeros((m, k), np.float32)
    ids = np.full((m, k), -1, np.int64)
    _rank_into(sims, ids, 0, np.repeat(np.arange(m), np.diff(out.indptr)), out.data, out.indices, k)
    return sims, ids


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=20000)
    parser.add_argument("--queries", type=int, default=20000)
    parser.add_argument("--features", type=int, default=50000)
    parser.add_argument("--words", type=int, default=80)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--duplicates", action="store_true", help="repeat each memory row 1-6 times (shuffled), so "
                        "equal similarities straddle the k-th place, as duplicate training points make them")
    parser.add_argument("--methods", default="xc,lexsort,topn", help="which to time, of xc, lexsort and topn")
    parser.add_argument("--out", default=None, help="JSON here")
    args = parser.parse_args(argv)

    import torch

    from xc.fitting.knn import sparse_neighbours

    memory = tfidf_matrix(args.points, args.features, args.words)
    queries = memory[: args.queries]
    if args.duplicates:
        rng = np.random.default_rng(0)
        memory = memory[rng.permutation(np.repeat(np.arange(args.points), rng.integers(1, 7, args.points)))]
    methods = {"xc (per-query loop)": None, "numpy lexsort per block": lexsort_neighbours,
               "sparse_dot_topn": topn_neighbours}
    methods = {name: fn for (name, fn), key in zip(methods.items(), ("xc", "lexsort", "topn"))
               if key in args.methods.split(",")}
    try:
        import sparse_dot_topn  # noqa: F401
    except ImportError:
        methods.pop("sparse_dot_topn", None)
        print("sparse_dot_topn is not installed: not timed")
    figures = {"points": memory.shape[0], "duplicates": args.duplicates, "queries": args.queries, "features": args.features, "k": args.k,
               "nnz_per_row": memory.nnz / args.points, "results": []}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        reference = None  # the first method's answer (xc's, where it is timed)
        for name, fn in methods.items():
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                if fn is None:
                    nb = sparse_neighbours(queries, memory, args.k)
                    got = nb.sims, nb.ids
                else:
                    got = fn(queries, memory, args.k, threads)
                best = min(best, time.perf_counter() - start)
            if reference is None:
                reference = got
            same = bool(np.array_equal(got[0], reference[0]) and np.array_equal(got[1], reference[1]))
            rows_differ = int(((got[1] != reference[1]).any(1)).sum())
            row = {"method": name, "threads": threads, "s_per_1k_queries": round(1000 * best / args.queries, 4),
                   "identical": same, "rows_differing": rows_differ}
            figures["results"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return figures


if __name__ == "__main__":
    main()
