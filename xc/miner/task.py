"""Mine one label shard: index its classifier rows, search every training query, drop positives.

Used in-process by the trainer's sync mode and inside worker processes by the miner service.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from xc.ann import search_excluding
from xc.ann.base import recall_at_k
from xc.ann.bf16_rows import bf16_from_bits, float32_copy, is_bf16
from xc.ann.centering import is_graph_like
from xc.ann.diskann_backend import graph_build_bytes
from xc.ann.exact import exact_topk
from xc.ann.norm_head import NormHeadIndex, head_only_rows
from xc.arrays import csr_rows
from xc.config import AnnConfig
from xc.faults import Faults
from xc.free_memory import host_memory
from xc.fsutil import HashingWriter
from xc.handoff import BF16, describe, open_snapshot, positives_of_rows, read_static_positives, storage_failed
from xc.miner.params import build_ann

log = logging.getLogger(__name__)

SEARCH_BLOCK = 65536  # queries per search call: bounds the memory of candidate lists
MIN_RETRY_CLUSTER = 32  # the clustered trial's retry halves the clusters' size, not below this
# the share of the free memory a graph index may take where the clustered trial fell short: the rows' width rule's
# share (xc/models/row_memory.py), the rest left to the trainer beside it
GRAPH_MEMORY_SHARE = 0.6


PROBE_SEED = 7_919  # the probes' sample is drawn apart from the logged recall's (seeded by generation)


@dataclass
class ShardStats:
    build_seconds: float
    search_seconds: float
    recall: float | None  # ANN recall@k against exact search on a sample (None for exact)
    head_only: int = 0  # rows of the exact head searched alone (no index built; xc/ann/norm_head.py), 0 = index
    head_share: float | None = None  # the probe's top-k share held by that head (or by the largest one tried)
    clustered_probe: float | None = None  # the clustered search's recall on the probe (None: not tried)
    search: str = ""  # what searched: "clustered", "head_only", "graph" (backend's index + head), "exact"
    rows_scanned: int | None = None  # clustered: the rows its last block scanned, fewer where the norm floor held


def exclusions_of(indptr: np.ndarray, indices: np.ndarray, query_ids: np.ndarray, lo: int, n: int):
    """Positives of the queries `query_ids` (m,), in that order, as CSR of shard-local ids (others dropped)."""
    sub_indptr, sub_indices = csr_rows(indptr, indices, query_ids)
    lengths = np.diff(sub_indptr)
    local = np.asarray(sub_indices, dtype=np.int64) - lo
    keep = (local >= 0) & (local < n)
    counts = np.bincount(np.repeat(np.arange(len(lengths)), lengths)[keep], minlength=len(lengths))
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), local[keep]


def probe_sample(queries: np.ndarray, pos_indptr: np.ndarray, pos_indices: np.ndarray, lo: int, n: int,
                 size: int, seed: int, block: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """(queries (m, d) float32, exclusions CSR of shard-local ids, size, picks (m,) their query ids):
    max(size, block) seeded training queries, drawn apart from the recall sample, for the miner's probes
    (`shard_index`); the first `size` are the ones checked against exact search, all of them one search block
    for the clustered trial."""
    rng = np.random.default_rng(seed + PROBE_SEED)
    m = min(max(size, block), len(queries))
    picks = rng.choice(len(queries), size=m, replace=False)
    picks = np.concatenate([np.sort(picks[:size]), np.sort(picks[size:])]).astype(np.int64)
    indptr, indices = exclusions_of(pos_indptr, pos_indices, picks, lo, n)
    return np.array(queries[picks], dtype=np.float32), indptr, indices, min(size, m), picks


def judged_depth(k: int, recall_k: int) -> int:
    """The depth a table of k per query is judged at: recall_k where the trainer keeps recall_k of k re-ranked
    candidates (the snapshot manifest's k_keep), else (0) k."""
    return min(k, recall_k or k)


def wants_probe(ann: AnnConfig, recall_sample: int) -> tuple[bool, int]:
    """(probe at all, block size): a graph backend probes for the head-only test and the clustered trial."""
    if recall_sample <= 0 or not is_graph_like(ann.backend, ann):
        return False, 0
    head = ann.head_only_recall > 0 and ann.exact_head > 0
    clustered = ann.clustered_recall > 0
    return head or clustered, SEARCH_BLOCK if clustered else 0


def shard_index(rows: np.ndarray, ann: AnnConfig, threads: int = 1, probe=None, k: int = 0, recall_k: int = 0):
    """(index, build seconds): the shard's search structure over rows (n, d) float32, or None for the exact
    backend (searched by blocked products straight from the rows).

    With a `probe` (`probe_sample`) a graph backend first tries the query-clustered search on the probe block
    and keeps it where its recall on the probe's checked queries reaches `ann.clustered_recall` (no graph is
    built: `index.search_kind` "clustered"); otherwise its exact head may be searched alone ("head_only") where
    it holds `ann.head_only_recall` of the probe's exact top-k, else the graph is built ("graph") where it fits in
    the free memory (`_graph_fits`; else the clustered search is kept). The trial reads bfloat16 rows as stored; only
    a graph takes their float32 copy. Where the
    table holds candidates to be re-ranked (`miner.rerank_candidates`), `recall_k` < k is the depth that is
    kept: the probes judge how much of the exact top-recall_k the k returned hold."""
    start = time.perf_counter()
    recall_k = judged_depth(k, recall_k)
    if ann.backend == "exact":
        return None, 0.0
    clustered = clustered_probe = truth = None
    if probe is not None and ann.clustered_recall > 0:
        index, clustered_probe, truth = _clustered_trial(rows, ann, threads, probe, k, recall_k)
        if clustered_probe < ann.clustered_recall and ann.cluster_size >= 2 * MIN_RETRY_CLUSTER:
            # once more with clusters half as large before a graph is built: tighter clusters share more of their
            # top rows, at about the same cost (the candidates per query are the same). At 10^5 labels a probe at
            # 0.89 sent a refresh to DiskANN, whose search found 0.45 of the top-16 in twice the clustered time
            tighter = replace(ann, cluster_size=ann.cluster_size // 2)
            retry, retry_probe, truth = _clustered_trial(rows, tighter, threads, probe, k, recall_k, truth)
            if retry_probe > clustered_probe:
                index, clustered_probe = retry, retry_probe
        clustered = index
        if clustered_probe >= ann.clustered_recall or not _graph_fits(rows, ann, clustered_probe, recall_k):
            return _as_clustered(clustered, clustered_probe), time.perf_counter() - start
    rows = search_rows(rows, ann.backend)  # the clustered trial read the rows as stored; a graph owns float32 ones
    index = build_ann(ann, threads)
    size, share = 0, None
    if probe is not None and isinstance(index, NormHeadIndex) and ann.head_only_recall > 0:
        q, indptr, indices, checked, _ = probe
        size, share = head_only_rows(rows, q[:checked], indptr[:checked + 1], indices[:indptr[checked]], recall_k, ann,
                                     truth=truth)  # the trial's exact top-k of the same queries, if it ran
        if size:
            index.head_only(size)
    index.build(rows)
    if clustered is not None and not size:
        # the graph is judged on the probe as the clustered search was: where it holds less of the exact top-k, the
        # clustered search stays (at 10^5 labels a graph held 0.45 where the probe's clusters held 0.89)
        q, indptr, indices, checked, _ = probe
        found = search_excluding(index, q[:checked], k, indptr[:checked + 1], indices[:indptr[checked]])
        graph_probe = float(recall_at_k(found, truth))
        if graph_probe < clustered_probe:
            log.info("miner: the graph holds %.3f of the probe's exact top-%d, the clustered search %.3f: the clustered "
                     "search is kept", graph_probe, recall_k, clustered_probe)
            return _as_clustered(clustered, clustered_probe), time.perf_counter() - start
    index.head_only_size, index.head_probe_share = size, share
    index.clustered_probe = clustered_probe
    index.search_kind = "head_only" if size else ("graph" if is_graph_like(ann.backend, ann) else ann.backend)
    return index, time.perf_counter() - start


def _graph_fits(rows, ann: AnnConfig, clustered_probe: float, recall_k: int) -> bool:
    """Whether a graph index over `rows` fits in GRAPH_MEMORY_SHARE of the memory free now (xc/free_memory.py);
    where it does not, the clustered search the trial built is kept below its recall target, and a warning says so.
    The rows' width rule leaves the graph out of its count where this trial comes first (xc/models/row_memory.py)."""
    need, free = graph_build_bytes(rows.shape[0], rows.shape[1], ann.diskann_graph_degree), host_memory()
    if need <= GRAPH_MEMORY_SHARE * free.bytes:
        return True
    log.warning("miner: the clustered search holds %.3f of the probe's exact top-%d (miner.ann.clustered_recall %.2f), "
                "but a graph index over these %d x %d rows needs %.3g GiB, over %.0f%% of the %.3g GiB free (%s): the "
                "clustered search is kept (larger miner.ann.cluster_candidates raise its recall)", clustered_probe,
                recall_k, ann.clustered_recall, rows.shape[0], rows.shape[1], need / 2**30, 100 * GRAPH_MEMORY_SHARE,
                free.bytes / 2**30, free.source)
    return False


def _as_clustered(index, probe_recall: float):
    """The clustered trial's index as the shard's search (no head searched alone), its probe recall recorded."""
    index.head_only_size, index.head_probe_share = 0, None
    index.clustered_probe, index.search_kind = probe_recall, "clustered"
    return index


def trial_params(ann: AnnConfig) -> AnnConfig:
    """The clustered search as a graph backend's miner tries it: on the CPU (the miner pool is CPU work; a GPU is
    used only where `miner.ann.backend=clustered` or `torch` asks for it)."""
    return replace(ann, backend="clustered", torch_device="cpu")


def _clustered_trial(rows: np.ndarray, ann: AnnConfig, threads: int, probe, k: int, recall_k: int,
                     truth: np.ndarray | None = None):
    """(clustered index over rows, the share of the probe's exact top-recall_k its top-k hold, those exact ids
    (checked, recall_k)): the whole probe block is searched (so it is clustered as a search block is), the
    first `checked` queries against exact search (`truth`, where an earlier trial found it)."""
    import torch

    q, indptr, indices, checked, picks = probe
    index = build_ann(trial_params(ann), threads)
    index.build(rows)
    found = index.search_excluding(q, k, indptr, indices)
    index.trial_search = (picks, found)  # where the probe block is every query, this is the whole table
    ids = found[:checked]
    if truth is None:
        _, truth = exact_topk(torch.from_numpy(q[:checked]), row_tensor(rows), recall_k, indptr[:checked + 1],
                              indices[:indptr[checked]])
        truth = truth.numpy()
    return index, float(recall_at_k(ids, truth)), truth


def search_block(index, rows: np.ndarray, lo: int, queries: np.ndarray, pos_indptr: np.ndarray,
                 pos_indices: np.ndarray, k: int, start: int, stop: int) -> np.ndarray:
    """The (stop - start, k) int32 table of queries [start, stop): each one's k best non-positive labels of the
    shard (global ids, -1 = none). `queries` and the positives' CSR cover all N queries."""
    import torch

    n = rows.shape[0]
    table = np.full((stop - start, k), -1, dtype=np.int32)
    rows_t = row_tensor(rows) if index is None else None
    for a in range(start, stop, SEARCH_BLOCK):
        b = min(stop, a + SEARCH_BLOCK)
        ex_ptr, ex_idx = exclusions_of(pos_indptr, pos_indices, np.arange(a, b), lo, n)
        block = np.array(queries[a:b], dtype=np.float32)  # a writable copy: torch refuses read-only memmaps
        if index is None:
            _, ids = exact_topk(torch.from_numpy(block), rows_t, k, ex_ptr, ex_idx)
            ids = ids.numpy()
        else:
            ids = search_excluding(index, block, k, ex_ptr, ex_idx)
        got = ids.shape[1]
        table[a - start:b - start, :got] = np.where(ids >= 0, ids + lo, -1)
    return table


def trial_table(index, num_queries: int, lo: int, k: int) -> np.ndarray | None:
    """The (num_queries, k) table the clustered trial already searched, where the search kept is the clustered one
    and the trial's block held every query (a shard's whole query set fits one search block); else None."""
    picks, found = getattr(index, "trial_search", None) or (None, None)
    if getattr(index, "search_kind", None) != "clustered" or picks is None or len(picks) != num_queries:
        return None
    table = np.full((num_queries, k), -1, dtype=np.int32)
    table[picks, :found.shape[1]] = np.where(found >= 0, found + lo, -1)
    return table


def mine_table(rows: np.ndarray, lo: int, queries: np.ndarray, pos_indptr: np.ndarray, pos_indices: np.ndarray,
               k: int, ann: AnnConfig, threads: int = 1, recall_sample: int = 0, seed: int = 0,
               recall_k: int = 0) -> tuple[np.ndarray, ShardStats]:
    """The (N, k) int32 table of each query's k best non-positive labels of one shard (global ids).

    rows (n, d) float32 classifier vectors of global labels [lo, lo + n), or a bfloat16 tensor (n, d) (bfloat16
    rows: the exact, torch and clustered backends score them in float32 a block at a time, the others build on a
    float32 copy, `search_rows`); queries (N, d) float32;
    positives as CSR over queries with global label ids. recall_k (0 = k): the depth the recall (and the
    probes) judge, the share of each sampled query's exact top-recall_k that its k returned hold; less than k
    where the trainer keeps recall_k of k re-ranked candidates (xc/refresh/rerank.py).
    """
    probing, block = wants_probe(ann, recall_sample)
    # a graph backend's clustered trial reads bfloat16 rows as stored; a graph, if one is built, takes a float32 copy
    rows = search_rows(rows, "clustered" if probing and ann.clustered_recall > 0 else ann.backend)
    probe = (probe_sample(queries, pos_indptr, pos_indices, lo, rows.shape[0], recall_sample, seed, block)
             if probing else None)
    index, build_s = shard_index(rows, ann, threads, probe, k, recall_k)
    start_search = time.perf_counter()
    table = trial_table(index, queries.shape[0], lo, k)
    if table is None:
        table = search_block(index, rows, lo, queries, pos_indptr, pos_indices, k, 0, queries.shape[0])
    search_s = time.perf_counter() - start_search
    recall = None
    if index is not None and recall_sample > 0:
        hits, total = sampled_hits(table, rows, lo, queries, pos_indptr, pos_indices, judged_depth(k, recall_k),
                                   recall_sample, seed)
        recall = hits / total if total else 1.0
    return table, ShardStats(build_s, search_s, recall, getattr(index, "head_only_size", 0),
                             getattr(index, "head_probe_share", None), getattr(index, "clustered_probe", None),
                             getattr(index, "search_kind", "exact" if index is None else ann.backend),
                             (getattr(index, "last_search", None) or {}).get("rows_scanned"))


BLOCKWISE_BACKENDS = ("exact", "torch", "clustered")  # search bfloat16 rows without a float32 copy


def search_rows(rows, backend: str):
    """The rows as the search takes them: float32 (n, d) numpy, or bfloat16 rows kept as a tensor for the
    backends that upcast them block by block (`BLOCKWISE_BACKENDS`); any other backend builds on an explicit
    float32 copy (logged with its size)."""
    if is_bf16(rows):
        return rows if backend in BLOCKWISE_BACKENDS else float32_copy(rows, f"miner.ann.backend={backend}")
    return np.ascontiguousarray(rows, dtype=np.float32)


def row_tensor(rows):
    """A torch view of the search's rows (float32 numpy, possibly a read-only memmap, or a bfloat16 tensor)."""
    import torch

    if isinstance(rows, torch.Tensor):
        return rows
    with warnings.catch_warnings():  # a snapshot's rows are a read-only memmap, and the search only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows)


def snapshot_rows(snapshot, shard: int):
    """A snapshot shard's rows for `mine_table`: the float32 memmap, or a bfloat16 tensor over the bit patterns."""
    rows = snapshot.shard_rows(shard)
    return bf16_from_bits(rows) if snapshot.shard_dtype(shard) == BF16 else rows


def sampled_hits(table, rows, lo, queries, pos_indptr, pos_indices, k, sample, seed,
                 start: int = 0) -> tuple[int, int]:
    """(hits, total) of `table` (the rows of queries [start, start + len(table))) against exact search on a
    seeded sample of `sample` of those queries: recall = hits / total, of the exact top-k (k <= the table's
    width: a wider table holds candidates)."""
    import torch

    rng = np.random.default_rng(seed)
    picks = np.sort(rng.choice(len(table), size=min(sample, len(table)), replace=False))
    query_ids = start + picks
    ex_ptr, ex_idx = exclusions_of(pos_indptr, pos_indices, query_ids, lo, rows.shape[0])
    # one blocked product for the whole sample: row by row, each query would read every row again
    _, exact = exact_topk(torch.from_numpy(np.array(queries[query_ids], dtype=np.float32)),  # a writable copy
                          row_tensor(rows), k, ex_ptr, ex_idx)
    hits = total = 0
    for p, ids in zip(picks, exact.numpy()):
        truth = set((ids[ids >= 0] + lo).tolist())
        if truth:
            hits += len(truth & set(table[p][table[p] >= 0].tolist()))
            total += len(truth)
    return hits, total


def run_shard_task(task: dict[str, Any]) -> dict[str, Any]:
    """Worker-process entry: mine one shard of a published snapshot into the staging directory.

    Returns the manifest entry of the written `neg.shard{s}.int32` plus timings. The file is complete
    and fsynced before this returns; the coordinator publishes the generation only when every shard
    returned. The tests' fault injection (xc/faults.py: miner_hang, miner_delay_s, miner_kill,
    miner_enospc) is read here from this process's environment, which a spawned worker inherits from the
    trainer or xc-miner that launched it: the task is where a worker process starts doing work.
    """
    faults = Faults.from_env(os.environ)
    if faults.miner_hang and _first_fault(task):  # a task that outlives the run
        (Path(task["run_dir"]) / "handoff" / "control" / "fault-hang-pid").write_text(str(os.getpid()))
        time.sleep(3600)
    if faults.miner_delay_s > 0:  # a slow miner (docs/reliability.md): each shard task takes this much longer
        time.sleep(faults.miner_delay_s)
    snapshot = open_snapshot(task["run_dir"], task["generation"], checksum=False)
    shard = task["shard"]
    entry = next(e for e in snapshot.manifest["shards"] if e["shard"] == shard)
    pos_indptr, pos_indices = positives_of_rows(*read_static_positives(task["run_dir"]), snapshot.query_rows())
    ann = AnnConfig(**task["ann"])
    table, stats = mine_table(snapshot_rows(snapshot, shard), entry["lo"], snapshot.queries(), pos_indptr, pos_indices,
                              task["k"], ann, task["threads"], task["recall_sample"], seed=task["generation"],
                              recall_k=task.get("recall_k", 0))
    path = Path(task["stage"]) / f"neg.shard{shard}.int32"
    try:
        with open(path, "wb") as file:
            handle = HashingWriter(file)  # the manifest's digest, taken as the bytes are written
            data = table.tobytes()
            if faults.miner_kill and _first_fault(task):
                handle.write(data[: len(data) // 2])  # a half-written file, then an unclean death
                handle.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if faults.miner_enospc and _first_fault(task):
                handle.write(data[: len(data) // 2])  # half a file, then a full disk
                raise OSError(28, "No space left on device (injected)", str(path))
            handle.write(data)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:  # the stage is abandoned by the coordinator; a storage failure travels as one line
        path.unlink(missing_ok=True)
        raise storage_failed(exc, path) from None
    return {"entry": dict(describe(path, table.shape, np.int32, handle.hexdigest()), shard=shard),
            "build_seconds": stats.build_seconds, "search_seconds": stats.search_seconds,
            "recall": stats.recall, "head_only": stats.head_only, "head_share": stats.head_share,
            "clustered_probe": stats.clustered_probe, "search": stats.search, "rows_scanned": stats.rows_scanned,
            "pid": os.getpid()}


def _first_fault(task: dict[str, Any]) -> bool:
    """Fault injection fires once per run directory (a marker file remembers it fired)."""
    marker = Path(task["run_dir"]) / "handoff" / "control" / "fault-fired"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        return True
    except FileExistsError:
        return False
