"""ClassifierShard: the one-vs-all classifier vectors of one contiguous label range [lo, hi).

The rows are a plain tensor, not an nn.Parameter: no autograd-visible O(L) parameter exists, so
neither DDP nor an optimizer ever touches all rows. A step gathers the rows it needs as a small leaf
tensor, the loss back-propagates into that, and `optim.SparseRowSGD` writes the update back.

Low-precision rows (bfloat16/float16) halve the memory and bandwidth of the forward gather, but an SGD
update smaller than half a unit in the last place (for bf16, about 0.4% of the value) rounds away, so
rows that receive many small updates stop moving. With `master_fp32` the shard keeps an fp32 master copy
(`master`, same shape): the optimiser reads and updates the masters, and `weight` is always their rounding.
The forward pass reads `weight`; the master copy costs 4 more bytes per element.

Without masters, bfloat16 rows can instead be written by stochastic rounding (`rounding="stochastic"`,
xc/models/rounding.py): each element rounds up or down with probabilities that make the rounding unbiased, so
small updates survive in expectation at 2 bytes per element. Its random bits are keyed by (seed, global label
id, column, optimiser step), so the rows do not depend on the shard layout and a resumed run rounds as the
uninterrupted one would have.
"""

from __future__ import annotations

import torch

from xc.errors import CheckpointError
from xc.models.rounding import round_rows

# Rows are initialised in fixed chunks seeded by (seed, chunk index), so the initial value of a label's
# vector does not depend on how many shards or ranks the labels are split over.
_INIT_CHUNK = 1 << 16


class ClassifierShard:
    """weight: (hi - lo, d) rows for global labels [lo, hi) in `dtype`; rows >= num_labels are padding
    (zero). master: (hi - lo, d) float32 master rows, or None (float32 storage, or master_fp32=False).
    rounding: how updated values are stored in a low-precision `weight`, "nearest" or "stochastic" (bfloat16
    rows without masters only)."""

    def __init__(self, lo: int, hi: int, num_labels: int, dim: int, init_std: float, seed: int,
                 device: torch.device, dtype: torch.dtype = torch.float32, master_fp32: bool = False,
                 rounding: str = "nearest"):
        self.lo, self.hi, self.num_labels, self.dim, self.seed = lo, hi, num_labels, dim, seed
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be nearest or stochastic, not {rounding!r}")
        if rounding == "stochastic" and (dtype != torch.bfloat16 or master_fp32):
            raise ValueError("stochastic rounding writes bfloat16 rows without fp32 masters; "
                             f"got {dtype} rows, master_fp32={master_fp32}")
        self.stochastic = rounding == "stochastic"
        self.row_sq: torch.Tensor | None = None  # (hi - lo, 1) row-wise Adagrad accumulators (xc.train.optim), if used
        # (num_real_rows,) float32 added to every score at inference, never in training: the label prior chosen
        # after training (xc/fitting/label_prior.py); None = the plain scores
        self.score_bias: torch.Tensor | None = None
        self.weight = torch.zeros(hi - lo, dim, dtype=dtype, device=device)
        self.master = (torch.zeros(hi - lo, dim, dtype=torch.float32, device=device)
                       if master_fp32 and dtype != torch.float32 else None)
        first, last = lo // _INIT_CHUNK, (min(hi, num_labels) - 1) // _INIT_CHUNK
        for chunk in range(first, last + 1):
            c_lo = chunk * _INIT_CHUNK
            gen = torch.Generator().manual_seed(seed * 1_000_003 + chunk)
            rows = torch.randn(_INIT_CHUNK, dim, generator=gen) * init_std
            a, b = max(lo, c_lo), min(hi, num_labels, c_lo + _INIT_CHUNK)
            self.weight[a - lo:b - lo] = rows[a - c_lo:b - c_lo].to(device=device, dtype=dtype)
            if self.master is not None:
                self.master[a - lo:b - lo] = rows[a - c_lo:b - c_lo].to(device=device)

    def drop_training_state(self) -> None:
        """Training is over: the fp32 masters (the rows stay their rounding) and the Adagrad accumulators go."""
        self.master = self.row_sq = None

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo

    @property
    def num_real_rows(self) -> int:
        return max(0, min(self.hi, self.num_labels) - self.lo)

    def gather(self, local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows for candidate ids (any shape, local to the shard) as a differentiable leaf.

        Returns (unique_ids (U,), rows (U, d) leaf with requires_grad, inverse (same shape as
        local_ids) indexing rows). Duplicated candidates share one row, so their gradients add up.
        """
        unique_ids, inverse = torch.unique(local_ids, return_inverse=True)
        rows = self.weight.index_select(0, unique_ids).float().detach().requires_grad_(True)
        return unique_ids, rows, inverse

    def all_rows(self) -> torch.Tensor:
        """Every row (hi - lo, d) as a differentiable leaf (full-BCE mode)."""
        return self.weight.float().detach().requires_grad_(True)

    def exact_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(U, d) float32 values of rows `ids` (U,) as the optimiser sees them: the masters if kept."""
        return (self.master if self.master is not None else self.weight).index_select(0, ids).float()

    def write_rows(self, ids: torch.Tensor, values: torch.Tensor, step: int | None = None) -> None:
        """Set rows `ids` (U,) (local) to `values` (U, d) float32: the masters exactly, `weight` rounded; `step`,
        the global optimiser step, keys stochastic rounding (with the global label ids lo + ids)."""
        if step is None and self.stochastic:  # a fixed key would round each element the same way every time
            raise ValueError("stochastically rounded rows are written with the global step that keys the rounding")
        if self.master is not None:
            self.master.index_copy_(0, ids, values)
        stored = round_rows(values, self.weight.dtype, self.stochastic, self.seed, ids + self.lo, step or 0)
        self.weight.index_copy_(0, ids, stored)

    def state_dict(self) -> dict:
        state = {"lo": self.lo, "hi": self.hi, "num_labels": self.num_labels, "weight": self.weight.cpu()}
        if self.master is not None:
            state["master"] = self.master.cpu()
        if self.row_sq is not None:
            state["row_sq"] = self.row_sq.cpu()
        return state

    def load_state_dict(self, state: dict, copy=None) -> None:
        """`copy(dst, src)`: how a stored tensor is copied into this shard's (default `dst.copy_(src)`; a checkpoint
        mapped from its file passes one that releases the file's pages as it goes, xc/run/checkpoint.py)."""
        copy = copy or torch.Tensor.copy_
        if (state["lo"], state["hi"]) != (self.lo, self.hi) or tuple(state["weight"].shape) != tuple(self.weight.shape):
            raise CheckpointError(
                f"classifier shard rows [{state['lo']}, {state['hi']}) in the checkpoint do not match "
                f"this rank's [{self.lo}, {self.hi}); resume with the same world size and parallel.num_label_shards"
            )
        # The most precise values the checkpoint holds: its masters if it kept any (a run may switch
        # classifier_dtype or master_fp32 on resume); `weight` is always their rounding.
        exact = state.get("master", state["weight"])
        copy(self.weight, exact)  # copy_ casts to the shard's device and dtype
        if self.master is not None:
            copy(self.master, exact)
        if self.row_sq is not None:  # a checkpoint of an SGD run starts its accumulators at zero
            if "row_sq" in state:
                copy(self.row_sq, state["row_sq"])
            else:
                self.row_sq.zero_()


# A batch whose candidates share few distinct rows scores every row by one dense product and picks each query's
# columns from it, where gathering each query's own C rows of width d would move B x C x d floats twice (forward
# and the backward's index_add). Forward and backward, B = 256, d = 1024, 2 CPU threads: C = 88 gathered took
# 185 ms at U = 600 rows (dense 10 ms) and 206 ms at U = 8,000 (dense 109 ms); C = 24 gathered took 17-18 ms
# whatever U, dense 13 ms at U = 983 and 28 ms at U = 2,000. The two meet near U = 54 C at C = 24 and beyond
# U = 90 C at C = 88 (the gathered block outgrows the caches). Dense up to U = DENSE_ROWS_PER_COLUMN x C.
DENSE_ROWS_PER_COLUMN = 48


def score(embeddings: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Scores <phi_q, w_c> for per-query candidates.

    embeddings (B, d); rows (U, d); inverse (B, C) indexing rows -> scores (B, C).
    Where U <= DENSE_ROWS_PER_COLUMN x C: (B, U) scores of every row by one product, each query's C taken from it
    (the same sums in another order). Else the rows are gathered per query, B*C*d floats: index_select rather than
    rows[inverse], whose backward is an index_add where advanced indexing's is an accumulating index_put (forward
    and backward of 256 x 24 rows of 1024 on 2 CPU threads: 36 against 46 ms), and a product and a sum rather than
    a batched matrix product of (C, d) by (d, 1), which ran below memory speed (256 x 8 rows: 6.1 against 7.8 ms).
    """
    if rows.shape[0] <= DENSE_ROWS_PER_COLUMN * inverse.shape[1]:
        return (embeddings @ rows.t()).gather(1, inverse)
    cand = rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, rows.shape[1])  # (B, C, d)
    return (cand * embeddings.unsqueeze(1)).sum(-1)
