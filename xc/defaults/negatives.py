"""The rules of the negatives (xc/defaults/__init__.py): the miner's mode, backend, first snapshot and re-ranking,
and the sampler's first hard epoch, shared pool, random part and exact loss.

* ``sampler.start_epoch`` (tau_s, the first epoch trained with hard negatives): 1, except 2 where an asynchronous
  miner (pool, ray, external) mines the classifier rows. That miner's generation t is snapshotted at the start of
  epoch t - 1 (ASTRA Sec. 3.2), so generation 1 would be the untrained rows at step 0: random "hard" negatives,
  mined at the cost of an index build and N searches on the cores training needs (at 10^5 labels: 0.1% of them
  still in the rows' top-16 when they were used, docs/miner_quality.md). The synchronous miner mines trained rows at
  the epoch boundary itself, and label-text (E-hard) mining indexes pretrained embeddings, so both keep 1, as
  does an asynchronous miner whose first snapshot is taken partway into epoch 0 (``miner.first_snapshot_at``).
* ``miner.ann.backend: auto`` (the synchronous miner's default, conf/miner/sync.yaml): exact search up to
  ``CLUSTERED_COST_RATIO`` (4) x ``miner.ann.cluster_candidates`` labels (32,768 with the default 8,192), else
  ``diskann``, whose miner tries the query-clustered search first and keeps it where a probe block reaches
  ``miner.ann.clustered_recall`` against exact search (xc/miner/task.py). Exact search of N queries costs N·L·d;
  the clustered search about N·(K + L/cluster_size)·d with K = cluster_candidates, so above 4K labels it scans a
  quarter of what exact search does or less. On debian-deps (37,960 labels, 41k queries, d 1,024) a refresh took
  7.6 s against 21 s exact on 2 cores, recall@16 0.96; at 10^6 labels and 2M queries the factor is 100, and exact
  mining took over 25 minutes a refresh on 2 cores against 2.5 (docs/miner_quality.md).
* ``miner.first_snapshot_at`` (an asynchronous miner on classifier rows, re-ranking on, ``sampler.start_epoch``
  left to its rule): ``FIRST_SNAPSHOT_AT`` = 0.5, so generation 1 is the rows half-way into epoch 0 and hard
  negatives start at epoch 1, as with the synchronous miner; else 0. At 10^6 labels the first hard epoch is where
  hard negatives paid (P@3 after epoch 2: 73.73 against 73.09 with none yet), and without re-ranking the half-epoch
  snapshot was too stale to help (73.08; docs/miner_quality.md).
* ``miner.rerank_candidates`` (an asynchronous miner on classifier rows): ``RERANK_FACTOR`` x k_hard candidates
  per query, of which the trainer keeps the k_hard that score highest under its rows and encoder at the switch
  (xc/refresh/rerank.py); k_hard (no re-ranking) for the synchronous miner, whose rows are current. An asynchronous
  generation is an epoch old when used: at 10^6 labels 42% of its top-16 was still in the rows' top-16 at the
  switch, while its top-128 held 79% of it (top-32 56%, top-64 69%, top-256 88%; docs/miner_quality.md).
* ``sampler.shared_pool`` (astra, uniform, curriculum in the classifier mode): ``POOL_SIZE`` uniform draws in a
  pool shared by the batch (with ASTRA's hard union) where a query's own k_hard + k_random draws would be under
  ``POOL_MAX_DRAW_SHARE`` (1%) of the labels (8,000 labels with the default 80 draws), else 0 (each query draws its
  own). The sampled softmax's log of an estimate of the denominator from so few of the labels is biased low and
  noisy; one pool of thousands of columns for the batch costs one dense product, which is cheaper than gathering
  each query's own rows. At 10^6 labels it took P@1 after the first epoch from 78.8 to 87.4 and after 3 epochs
  from 85.7 to 89.0; on debian-deps (37,960 labels) the run took 6.6 minutes instead of 9.9 at equal or better
  P@1/3/5, and the 10^4 synthetic set is unchanged in quality and 20% faster (docs/miner_quality.md). Bibtex and
  Delicious (draws 50% and 8% of their labels) keep per-query draws.
* ``sampler.random_proposal`` (astra, curriculum in the classifier mode): ``popularity`` under the same condition
  (a query's k_hard + k_random draws under ``POOL_MAX_DRAW_SHARE`` of the labels), else ``uniform``. With so thin
  a share of the labels drawn, a step's uniform draws almost never hold the popular labels that compete with every
  query; drawn from q ∝ (count + 1)^alpha and weighted 1 / (k q), the random part holds them and stays unbiased.
  Chosen on validation (mean P@1/3/5 of the model alone, then as served): at 10^6 labels with 0.1 training points a
  label 54.62 against 40.74 after the default 3 epochs and 64.02 against 61.59 after 10 (docs/negatives_that_pay.md);
  level where the uniform draws already meet the popular labels: debian-deps 46.27 against 46.11 (served 48.36
  against 48.39), the 10^4-label synthetic set 78.57 against 78.48 (81.11 against 81.09), Bibtex and Delicious (per-query
  draws, outside the rule) within 0.4.

* ``miner.mode: auto`` (xc-train's default): ``pool``, with one single-threaded worker per spare core, where the
  ranks train on GPUs and the host's cores less ``GPU_RANK_THREADS`` (2) per local rank leave at least
  ``POOL_MIN_SPARE_CORES`` (4); ``sync`` otherwise (every CPU host, where the pool's cores are the ones training
  needs: on 2 cores a miner core-second costs 0.33 s of training, docs/miner_quality.md). On a GPU host the cores idle
  while the GPU trains, so mining there is free and the negatives come without stopping training; the pool's
  other rules (first snapshot, re-ranking) follow from the resolved mode. But where exact search of every training
  query against a rank's rows costs at most ``GPU_EXACT_MACS`` (10^13) multiply-adds, a GPU rank mines them itself:
  ``sync`` with ``miner.ann.backend: torch`` (exact top-k by matrix products on the rank's GPU). That is seconds
  at most (an H100 searched 100k queries against 10^6 rows of width 64, 6.4·10^12 multiply-adds, in 1.5 s), while
  the pool's index build and search took 10-15 s a generation for debian-deps' 38k rows, and the GPU trained an
  epoch in 1.6 s, so every epoch boundary waited for the pool (54 s of a 3-minute run, docs/accuracy.md). With
  10^5 labels and 200k points (2·10^13 at width 1024) and beyond, the pool mines beside training as before.
* ``miner.ann.backend: auto`` on a GPU host past that bound, where the installed faiss sees a GPU (faiss-gpu,
  ``bash tools/setup.sh --gpu``): ``faiss_gpu`` with ``miner.ann.gpu_index: ivf`` (faiss's IVF index built and searched
  on the GPU), its recall measured on the miner's sample as every backend's; without faiss-gpu, the CPU rule below.
* ``sampler.name`` (the classifier mode): ``full``, the exact loss over every label, where the data has no more
  labels than the negatives a query draws (k_hard + k_random, 80 by default): sampling could not draw that many
  distinct negatives, and the exact loss then scores no more columns per query than the sampled one. The loss
  (``sampler.loss``) is kept. Sets of 2 to 80 labels (MULAN/MEKA ARFF sets) train with the defaults; every
  shipped set has more labels and samples as before.
* ``miner.async_snapshot`` (pool, external, ray): snapshots written in the background from a host copy of the rows
  where the rows, their state and that copy fit in the same share of the free host memory; else the trainer writes
  them from the rows and waits (10^8 bfloat16 rows at d = 64: 12.8 GB, the copy as much again).
"""

from __future__ import annotations

from xc.config_checks import POOL_SAMPLERS
from xc.distributed.host_threads import GPU_RANK_THREADS

POOL_SIZE, POOL_MAX_DRAW_SHARE = 1024, 0.01
CLUSTERED_COST_RATIO = 4
RERANK_FACTOR = 8
POOL_MIN_SPARE_CORES = 4
GPU_EXACT_MACS = 1e13
FIRST_SNAPSHOT_AT = 0.5


def auto_start_epoch(miner_mode: str, hard_source: str, first_snapshot_at: float = 0.0) -> int:
    untrained = miner_mode != "sync" and hard_source == "classifier" and first_snapshot_at == 0
    return 2 if untrained else 1


def auto_first_snapshot_at(miner_mode: str, hard_source: str, start_epoch_is_rule: bool, rerank_off: bool) -> float:
    on = miner_mode != "sync" and hard_source == "classifier" and start_epoch_is_rule and not rerank_off
    return FIRST_SNAPSHOT_AT if on else 0.0


def auto_rerank_candidates(miner_mode: str, hard_source: str, k_hard: int) -> int:
    return RERANK_FACTOR * k_hard if miner_mode != "sync" and hard_source == "classifier" else k_hard


def auto_miner_backend(num_labels: int, cluster_candidates: int, gpu_exact: bool = False,
                       gpu_index: bool = False) -> str:
    """`gpu_exact`: a synchronous miner on a GPU rank whose exact search is within GPU_EXACT_MACS; `gpu_index`: a
    GPU rank past that bound where faiss sees a GPU (faiss-gpu installed): faiss's IVF index on the GPU."""
    if gpu_exact:
        return "torch"
    if num_labels <= CLUSTERED_COST_RATIO * cluster_candidates:
        return "exact"
    return "faiss_gpu" if gpu_index else "diskann"


def faiss_sees_a_gpu() -> bool:
    """Does the installed faiss have GPU support and a CUDA device? (faiss-cpu: no.)"""
    from xc.ann.faiss_backend import gpu_status  # lazy: the tests monkeypatch faiss_backend.gpu_status

    return gpu_status()[0] > 0


def exact_search_macs(queries: int, num_labels: int, world_size: int, row_dim: int) -> float:
    """Multiply-adds of one exact search of `queries` against one rank's share of the label rows."""
    return float(queries) * -(-num_labels // max(1, world_size)) * row_dim


def auto_shared_pool(sampler: str, mode: str, num_labels: int, draws: int) -> int:
    """POOL_SIZE where a query's own `draws` (k_hard + k_random) would be under POOL_MAX_DRAW_SHARE of the labels."""
    thin = draws < POOL_MAX_DRAW_SHARE * num_labels
    return POOL_SIZE if sampler in POOL_SAMPLERS and mode == "classifier" and thin else 0


def auto_random_proposal(sampler: str, mode: str, num_labels: int, draws: int) -> str:
    """`sampler.random_proposal: null`: popularity for ASTRA's mixture (astra, curriculum; classifier mode) where a
    query's own `draws` (k_hard + k_random) would be under POOL_MAX_DRAW_SHARE of the labels, else uniform."""
    thin = draws < POOL_MAX_DRAW_SHARE * num_labels
    return "popularity" if sampler in ("astra", "curriculum") and mode == "classifier" and thin else "uniform"


def auto_miner(device_type: str, cores: int, local_ranks: int, exact_macs: float | None = None) -> tuple[str, int, str]:
    """(miner.mode, miner.workers, why) for `miner.mode: auto`: the CPU pool where this host's ranks train on GPUs
    and at least POOL_MIN_SPARE_CORES cores are left after GPU_RANK_THREADS per rank, with one single-threaded
    worker per spare core; else the synchronous miner, which is also a GPU rank's choice where its exact search
    (`exact_macs`, see exact_search_macs) is within GPU_EXACT_MACS."""
    if device_type != "cuda":
        return "sync", 0, "the ranks train on the CPU: a pool would take the cores training needs"
    if exact_macs is not None and exact_macs <= GPU_EXACT_MACS:
        return "sync", 0, (f"GPU ranks: exact search on the rank's GPU ({exact_macs:.2g} multiply-adds a refresh, "
                           f"<= {GPU_EXACT_MACS:.0e}) takes seconds, less than waiting for a CPU pool's index")
    spare = cores - local_ranks * GPU_RANK_THREADS
    if spare < POOL_MIN_SPARE_CORES:
        return "sync", 0, (f"{cores} cores less {GPU_RANK_THREADS} for each of {local_ranks} GPU rank(s) leave "
                           f"{spare}, under {POOL_MIN_SPARE_CORES}")
    return "pool", spare, (f"GPU ranks: {cores} cores less {GPU_RANK_THREADS} for each of {local_ranks} rank(s) "
                           f"leave {spare} to mine while they train")


def exact_loss_rule(sampler_name: str, k_hard: int, k_random: int, mode: str, num_labels: int) -> bool:
    """Whether the data has so few labels that every query's negatives would cover them all: then the exact loss
    over all labels replaces sampling (see the module docstring)."""
    return sampler_name != "full" and mode == "classifier" and k_hard + k_random >= num_labels
