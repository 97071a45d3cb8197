"""Process groups and collectives: the only place parallelism is applied; and the torch threads each rank takes on
its host beside a local miner pool (`host_threads`, imported by name)."""

from xc.distributed.comm import (
    DistContext,
    all_reduce,
    all_gather_object,
    all_gather_no_grad,
    all_gather_with_grad,
    on_rank0,
    broadcast_object,
    barrier,
    init_distributed,
    shutdown,
    sum_row_grads,
    sum_rows_by_id,
    wrap_data_parallel,
)

__all__ = [
    "DistContext", "all_gather_object", "all_gather_no_grad", "all_gather_with_grad", "broadcast_object", "barrier",
    "init_distributed", "on_rank0", "shutdown", "sum_row_grads", "sum_rows_by_id", "wrap_data_parallel",
]
