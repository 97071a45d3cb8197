"""What the classifier rows cost in memory, by width and precision; how much memory a run has for them; and the
rules of xc/defaults/ that read both (listed there): the rows' width and precision, chosen together
(`row_layout`), and whether the snapshot writer may copy them (`snapshot_copy_fits`).

At d = 64 a label's float32 row is 256 B, so 10^8 labels are 25.6 GB of rows before any optimiser state, the
miner's snapshot or a checkpoint: beyond a 24 GiB host. The figures here are the analytic bytes per component
(tools/bench/bench_memory.py prints them per precision and size).

The miner's working set is what its search holds beside the snapshot. The query-clustered search, which a graph
backend's miner tries first (`miner.ann.clustered_recall`), reads the snapshot as it is stored, bfloat16 rows
upcast a block at a time (xc/ann/bf16_rows.py): nothing the size of the rows. A graph index needs the rows as
float32, their mean-centred copy and its own vectors and edges (`miner_bytes`: 12 B a row element and the edges),
more than the rows themselves at every width: it is counted where the miner builds a graph without that trial, and
elsewhere the miner builds one only where it fits in the memory free when it would (xc/miner/task.py), keeping the
clustered search otherwise. The host's free memory: xc/free_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from xc.ann.centering import is_graph_like
from xc.ann.diskann_backend import graph_build_bytes
from xc.config import AnnConfig, ModelConfig
from xc.distributed import host_threads
from xc.free_memory import FreeMemory, host_memory

# (bytes per stored element, bytes per fp32 master element) of each way of keeping the rows
PRECISIONS = {"float32": (4, 0), "bfloat16+master": (2, 4), "bfloat16+SR": (2, 0)}
# the share of the free memory the rows, their state, the miner's snapshot and its working set may take; the rest is
# for the data, the encoder and its optimiser (a 200k x 1024 table with Adam's moments: 2.4 GB), the snapshot
# writer's copy, a step's buffers and the evaluation (docs/negatives_that_pay.md, "How wide the rows are")
ROW_MEMORY_SHARE = 0.6
MIN_ROW_DIM = 64  # the narrowest rows the width rule projects to
ROW_STATE_BYTES = 4  # row-wise Adagrad's one float32 accumulator per row (shard.row_sq)
# a label's lexical weights (model.lexical_features, xc/models/lexical.py): per feature slot an int32 feature id and a
# float32 weight, per label one Adagrad accumulator. Their copy by feature for ranking (8 B a non-zero weight) is not
# counted: it holds the non-zero weights only (3.75 of 32 million after 3 epochs at 10^6 labels, S = 32).
LEXICAL_SLOT_BYTES = 8
# the most of the free host memory a CPU rank's background snapshot writer may copy: at 10^7 labels of 256 bfloat16
# the copy (4.8 GiB, 21% of a 22.8 GiB host) raised the training peak by as much, and saved 5.4 s of a 30 s stall a
# generation (the rest is encoding the queries), so there the trainer writes from its rows
SNAPSHOT_COPY_SHARE = 0.125


def precision_of(dtype: str, master_fp32: bool) -> str:
    """The PRECISIONS key of rows stored as `dtype` ("float32", "bfloat16", "float16"), with or without masters."""
    if dtype == "float32":
        return "float32"
    return ("bfloat16" if dtype == "bfloat16" else "float16") + ("+master" if master_fp32 else "+SR")


def classifier_bytes(num_rows: int, dim: int, precision: str, rowadagrad: bool = True) -> dict[str, int]:
    """Bytes of `num_rows` classifier rows of width `dim` kept as `precision` (a PRECISIONS key; float16 costs
    what bfloat16 does): {"rows", "masters", "row_sq", "snapshot" (the miner's copy, in the rows' precision:
    xc/refresh/writer.py),
    "checkpoint" (a rank file: rows, masters and accumulators)}."""
    stored, master = PRECISIONS["b" + precision if precision.startswith("float16") else precision]
    rows, masters = num_rows * dim * stored, num_rows * dim * master
    row_sq = num_rows * ROW_STATE_BYTES if rowadagrad else 0
    return {"rows": rows, "masters": masters, "row_sq": row_sq, "snapshot": rows,
            "checkpoint": rows + masters + row_sq}


def training_bytes(num_rows: int, dim: int, precision: str, rowadagrad: bool, snapshot_here: bool) -> int:
    """What training keeps resident for the rows: rows, masters, accumulators and, where the miner's snapshot
    (in the rows' precision) lives in the same memory (the host, for CPU ranks), one snapshot copy."""
    parts = classifier_bytes(num_rows, dim, precision, rowadagrad)
    return parts["rows"] + parts["masters"] + parts["row_sq"] + (parts["snapshot"] if snapshot_here else 0)


def available_memory(device_type: str) -> FreeMemory:
    """Free memory where the rows will live: the current CUDA device's (torch.cuda.mem_get_info) for CUDA ranks,
    the host's (`host_memory`) otherwise (and where no CUDA device can be asked, as when a config is resolved for
    one elsewhere)."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return FreeMemory(int(torch.cuda.mem_get_info()[0]), "CUDA free memory")
    return host_memory()


def auto_rounding(dtype: str, master_fp32: bool) -> str:
    return "stochastic" if dtype == "bfloat16" and not master_fp32 else "nearest"


def _rank_rows(num_labels: int, world_size: int) -> int:
    return -(-num_labels // max(1, world_size))  # one rank's label shard, rounded up


def miner_bytes(num_rows: int, dim: int, graph_degree: int) -> int:
    """The working set of a graph index the miner builds over `num_rows` rows of `dim` (`graph_build_bytes`: the
    snapshot read as float32, its mean-centred copy, the graph's own float32 vectors and ceil(R x slack) + 1 u32
    edges a node). At 10^6 rows of 1024 that is 12.5 GB: a pool worker was measured at 12.0 GB resident."""
    return graph_build_bytes(num_rows, dim, graph_degree)


def graph_first(ann: AnnConfig) -> bool:
    """Whether the miner builds a graph index without first trying the query-clustered search: a graph backend (or
    `auto`, a graph past the exact search's size) with `clustered_recall` 0. Its working set is then counted."""
    return ann.clustered_recall <= 0 and (ann.backend == "auto" or is_graph_like(ann.backend, ann))


def lexical_bytes(num_rows: int, lexical_features: int) -> int:
    """Bytes of `num_rows` labels' lexical weights, `lexical_features` slots each (0: none), with their accumulators."""
    return num_rows * (LEXICAL_SLOT_BYTES * lexical_features + ROW_STATE_BYTES) if lexical_features > 0 else 0


def lexical_memory_share(num_labels: int, lexical_features: int, device_type: str, world_size: int) -> tuple[float, str]:
    """(share, what): the bytes of a rank's lexical weights (`lexical_bytes`) over what the row rule may use
    (ROW_MEMORY_SHARE of the free memory where the rows live), and a phrase saying so, for the
    `model.lexical_features: null` rule (xc/defaults/model.py)."""
    need = lexical_bytes(_rank_rows(num_labels, world_size), lexical_features)
    free = available_memory(device_type)
    share = need / max(1.0, ROW_MEMORY_SHARE * free.bytes)
    return share, (f"{lexical_features} a label take {need / 2**30:.3g} GiB, {share:.0%} of the "
                   f"{ROW_MEMORY_SHARE:.0%} of {free.bytes / 2**30:.3g} GiB ({free.source}) the rows may use")


def layout_bytes(num_rows: int, dim: int, precision: str, rowadagrad: bool, graph_degree: int,
                 on_gpu: bool, graph: bool = True, lexical_features: int = 0) -> tuple[int, int]:
    """(bytes on the device the rows live on, bytes on the host) for `num_rows` rows of `dim` kept as `precision`.
    CPU ranks: everything on the host (rows, masters, accumulators, the labels' lexical weights, the miner's
    snapshot and, where `graph`, the working set of its graph index; 0 on a device). GPU ranks: rows, masters,
    accumulators and lexical weights on the GPU; the snapshot and the index on the host."""
    parts = classifier_bytes(num_rows, dim, precision, rowadagrad)
    state = parts["rows"] + parts["masters"] + parts["row_sq"] + lexical_bytes(num_rows, lexical_features)
    miner = parts["snapshot"] + (miner_bytes(num_rows, dim, graph_degree) if graph else 0)
    return (state, miner) if on_gpu else (0, state + miner)


def row_widths(width: int, given: int | None, projectable: bool) -> list[int]:
    """The row widths the rule tries, widest first: the given `model.bottleneck_dim`; the encoder's own `width`
    where no projection applies (a text encoder, the dual mode); else `width` and each power of two below it down
    to MIN_ROW_DIM."""
    if given is not None:
        return [given]
    if not projectable or width <= MIN_ROW_DIM:
        return [width]
    below = 1 << (width.bit_length() - 1)  # the largest power of two under a width that is not one ...
    below = below // 2 if below == width else below  # ... or half of one that is
    return [width] + [below >> i for i in range(below.bit_length()) if below >> i >= MIN_ROW_DIM]


@dataclass(frozen=True)
class RowLayout:
    """What the rule chose: rows of `dim` (None: the encoder's width, no projection), kept as `dtype`, and the log
    line saying why (None where nothing was measured)."""

    dim: int | None
    dtype: str
    note: str | None
    fits: bool = True


def row_layout(model: ModelConfig, width: int, num_labels: int, device_type: str, world_size: int,
               rowadagrad: bool, ann: AnnConfig, projectable: bool) -> RowLayout:
    """The rows' width (`model.bottleneck_dim: null`) and precision (`model.classifier_dtype: auto`), chosen
    together: the widest of `row_widths` whose rows fit, in float32 where they fit, else in bfloat16 without masters
    (half the bytes for twice the width); where none fits, MIN_ROW_DIM in bfloat16 and a warning-worthy note. "Fit":
    `layout_bytes` within ROW_MEMORY_SHARE of the free memory where each part lives (`available_memory`: the GPU
    for CUDA ranks, and the host for the snapshot and the index; a CPU host counts its local ranks' rows together),
    the miner's graph index counted only where it builds one without trying the clustered search (`graph_first`:
    the module docstring). `width` is the encoder's output width; the label bias adds one column a row; `ann` the
    miner's index settings."""
    widths = row_widths(width, model.bottleneck_dim, projectable)
    precisions = (["float32", "bfloat16+SR"] if model.classifier_dtype == "auto" else
                  [precision_of(model.classifier_dtype, model.classifier_master_fp32)])
    if len(widths) == 1 and len(precisions) == 1:
        return RowLayout(model.bottleneck_dim, model.classifier_dtype, None)  # nothing to choose: nothing measured
    on_gpu = device_type == "cuda"
    rows = _rank_rows(num_labels, world_size)
    host_rows = rows * host_threads.local_ranks()  # a host holds its local ranks' rows or their snapshots
    device = available_memory(device_type) if on_gpu else None
    host = available_memory("cpu")
    bias, graph, degree = int(model.label_bias), graph_first(ann), ann.diskann_graph_degree
    lexical = model.lexical_features or 0  # None: before its rule (xc/defaults/ resolve_lexical), counted as none

    def fits(dim: int, precision: str) -> tuple[bool, int, int]:
        gpu_need = layout_bytes(rows, dim + bias, precision, rowadagrad, degree, on_gpu, graph, lexical)[0]
        host_need = layout_bytes(host_rows, dim + bias, precision, rowadagrad, degree, on_gpu, graph, lexical)[1]
        ok = host_need <= ROW_MEMORY_SHARE * host.bytes and (not on_gpu or gpu_need <= ROW_MEMORY_SHARE * device.bytes)
        return ok, gpu_need, host_need

    chosen = next(((d, p) for d in widths for p in precisions if fits(d, p)[0]), None)
    fitted = chosen is not None
    dim, precision = chosen or (widths[-1], precisions[-1])
    _, gpu_need, host_need = fits(dim, precision)
    dtype = "float32" if precision == "float32" else precision.split("+")[0]
    where = (f"{gpu_need / 2**30:.3g} GiB of the {device.bytes / 2**30:.3g} GiB free on the GPU and "
             if on_gpu else "") + (f"{host_need / 2**30:.3g} GiB of the {host.bytes / 2**30:.3g} GiB available on "
                                  f"the host ({host.source})")
    tried = f"; widths {', '.join(map(str, widths))}" if len(widths) > 1 else ""
    note = (f"classifier rows: {dim} wide in {dtype}{' + stochastic rounding' if precision == 'bfloat16+SR' else ''}"
            f" (rows, their state,{' the lexical weights,' if lexical > 0 else ''} the miner's snapshot"
            f"{' and index' if graph else ''} need {where}; the rule allows "
            f"{ROW_MEMORY_SHARE:.0%}{tried})")
    if not graph:
        extra = miner_bytes(host_rows, dim + bias, degree) / 2**30
        note += (f"; the miner's clustered search reads the snapshot as stored, and builds a graph index ({extra:.3g} "
                 "GiB more) only where that fits when it would")
    if not fitted:
        note += "; nothing fits: the narrowest and smallest is tried, and may run out of memory"
    projected = dim if dim != width or model.bottleneck_dim is not None else None
    return RowLayout(projected, dtype, note, fitted)


def snapshot_copy_fits(model: ModelConfig, num_labels: int, row_dim: int, device_type: str, world_size: int,
                       rowadagrad: bool) -> tuple[bool, str]:
    """The `miner.async_snapshot: None` rule: whether this host holds a host copy of its local ranks' rows (what the
    background writer takes at the boundary) and, for CPU ranks, the rows and their state too, within
    ROW_MEMORY_SHARE of the free host memory; and why. Where it does not (10^8 bfloat16 rows at d = 64 are 12.8 GB,
    the copy as much again), the trainer writes the snapshot from the rows themselves and waits for it: the same
    files (tests/integration/test_snapshot_async.py). CPU ranks also write from the rows where the copy alone is
    over SNAPSHOT_COPY_SHARE of the free memory: there the copy buys only the write's seconds (the rows are the
    trainer's own memory, nothing is transferred), and it sets the run's peak."""
    rows = _rank_rows(num_labels, world_size) * host_threads.local_ranks()
    precision = precision_of(model.classifier_dtype, model.classifier_master_fp32)
    copy = classifier_bytes(rows, row_dim, precision, rowadagrad)["snapshot"]
    need = copy if device_type == "cuda" else training_bytes(rows, row_dim, precision, rowadagrad, snapshot_here=True)
    free = host_memory()
    fits = need <= ROW_MEMORY_SHARE * free.bytes
    why = (f"{precision} rows with a copy for the background writer need {need / 2**30:.3g} GiB of the "
           f"{free.bytes / 2**30:.3g} GiB available on the host ({free.source}); the rule allows {ROW_MEMORY_SHARE:.0%}")
    if fits and device_type != "cuda" and copy > SNAPSHOT_COPY_SHARE * free.bytes:
        fits = False
        why = (f"the background writer's copy of the rows would be {copy / 2**30:.3g} GiB, over "
               f"{SNAPSHOT_COPY_SHARE:.1%} of the {free.bytes / 2**30:.3g} GiB available on the host ({free.source}): "
               "the trainer writes the snapshot from its rows and waits the write's seconds")
    return fits, f"miner.async_snapshot={str(fits).lower()} ({why})"
