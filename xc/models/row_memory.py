"""What the classifier rows cost in memory, by precision; how much memory a run has for them; and the two rules
of xc/defaults.py that read both (listed there): the rows' precision and whether the snapshot writer may copy them.

At d = 64 a label's float32 row is 256 B, so 10^8 labels are 25.6 GB of rows before any optimiser state, the
miner's snapshot or a checkpoint: beyond a 24 GiB host. The figures here are the analytic bytes per component
(tools/bench_memory.py prints them per precision and size).
"""

from __future__ import annotations

import os
from dataclasses import replace

from xc.config import ModelConfig
from xc.distributed import host_threads

# (bytes per stored element, bytes per fp32 master element) of each way of keeping the rows
PRECISIONS = {"float32": (4, 0), "bfloat16+master": (2, 4), "bfloat16+SR": (2, 0)}
# the share of the free memory the rows (their state, the snapshot writer's copy) may take; the rest is for the
# miner's index over the snapshot (about its size again), the data, the encoder and a step's buffers
ROW_MEMORY_SHARE = 0.5
ROW_STATE_BYTES = 4  # row-wise Adagrad's one float32 accumulator per row (shard.row_sq)


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


def host_available_bytes() -> int:
    """The host memory a new allocation can take without swapping (Linux MemAvailable), else the physical total."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes(device_type: str) -> int:
    """Free memory where the rows will live: the current CUDA device's (torch.cuda.mem_get_info) for CUDA ranks,
    the host's otherwise (and where no CUDA device can be asked, as when a config is resolved for one elsewhere)."""
    import torch

    if device_type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    return host_available_bytes()


def auto_classifier_dtype(float32_bytes: int, available: int) -> str:
    """float32 where the rows' resident bytes in float32 (`xc.models.row_memory.training_bytes`) are within
    ROW_MEMORY_SHARE of the `available` bytes, else bfloat16 (stochastically rounded, no masters)."""
    return "float32" if float32_bytes <= ROW_MEMORY_SHARE * available else "bfloat16"


def auto_rounding(dtype: str, master_fp32: bool) -> str:
    return "stochastic" if dtype == "bfloat16" and not master_fp32 else "nearest"


def _rank_rows(num_labels: int, world_size: int) -> int:
    return -(-num_labels // max(1, world_size))  # one rank's label shard, rounded up


def row_precision(model: ModelConfig, num_labels: int, row_dim: int, device_type: str, world_size: int,
                  rowadagrad: bool) -> tuple[ModelConfig, str | None]:
    """`model` with classifier_dtype and classifier_rounding resolved, and the log line of the dtype rule (None
    where the dtype was given). A CPU host holds its local ranks' rows and their snapshots; a GPU its rank's rows."""
    note = None
    if model.classifier_dtype == "auto":
        rows = _rank_rows(num_labels, world_size) * (host_threads.local_ranks() if device_type != "cuda" else 1)
        need = training_bytes(rows, row_dim, "float32", rowadagrad, snapshot_here=device_type != "cuda")
        free = available_bytes(device_type)
        dtype = auto_classifier_dtype(need, free)
        model = replace(model, classifier_dtype=dtype, classifier_master_fp32=model.classifier_master_fp32
                        and dtype == "float32")
        where = "on the GPU" if device_type == "cuda" else "on the host"
        note = (f"classifier rows: {dtype}{' + stochastic rounding' if dtype == 'bfloat16' else ''} (float32 would "
                f"need {need / 2**30:.3g} GiB of the {free / 2**30:.3g} GiB available {where}; the rule allows "
                f"{ROW_MEMORY_SHARE:.0%})")
        if dtype == "bfloat16":  # bf16 rows and their bf16 snapshot may not fit either: say so
            half = training_bytes(rows, row_dim, "bfloat16+SR", rowadagrad, snapshot_here=device_type != "cuda")
            note += f"; bfloat16 needs {half / 2**30:.3g} GiB"
    if model.classifier_rounding == "auto":
        model = replace(model, classifier_rounding=auto_rounding(model.classifier_dtype, model.classifier_master_fp32))
    return model, note


def snapshot_copy_fits(model: ModelConfig, num_labels: int, row_dim: int, device_type: str, world_size: int,
                       rowadagrad: bool) -> tuple[bool, str]:
    """The `miner.async_snapshot: None` rule: whether this host holds a host copy of its local ranks' rows (what the
    background writer takes at the boundary) and, for CPU ranks, the rows and their state too, within
    ROW_MEMORY_SHARE of the free host memory; and why. Where it does not (10^8 bfloat16 rows at d = 64 are 12.8 GB,
    the copy as much again), the trainer writes the snapshot from the rows themselves and waits for it: the same
    files (tests/integration/test_snapshot_async.py)."""
    rows = _rank_rows(num_labels, world_size) * host_threads.local_ranks()
    precision = precision_of(model.classifier_dtype, model.classifier_master_fp32)
    need = (classifier_bytes(rows, row_dim, precision, rowadagrad)["snapshot"] if device_type == "cuda" else
            training_bytes(rows, row_dim, precision, rowadagrad, snapshot_here=True))
    free = host_available_bytes()
    fits = need <= ROW_MEMORY_SHARE * free
    return fits, (f"miner.async_snapshot={str(fits).lower()} ({precision} rows with a copy for the background writer "
                  f"need {need / 2**30:.3g} GiB of the {free / 2**30:.3g} GiB available on the host; the rule allows "
                  f"{ROW_MEMORY_SHARE:.0%})")
