"""What the classifier rows cost in memory, by precision, and how much memory a run has for them.

At d = 64 a label's float32 row is 256 B, so 10^8 labels are 25.6 GB of rows before any optimiser state, the
miner's snapshot or a checkpoint: beyond a 24 GiB host. The figures here are the analytic bytes per component
(tools/bench_memory.py prints them per precision and size; xc/defaults.py's `model.classifier_dtype: auto` rule
reads them to choose float32 or bfloat16 rows).
"""

from __future__ import annotations

import os

# (bytes per stored element, bytes per fp32 master element) of each way of keeping the rows
PRECISIONS = {"float32": (4, 0), "bfloat16+master": (2, 4), "bfloat16+SR": (2, 0)}
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
