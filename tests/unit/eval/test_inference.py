"""Batch inference (xc/eval/inference.py): which rows are encoded, and that the result is the rows' embeddings."""

from __future__ import annotations

import numpy as np
import torch

from xc.distributed import DistContext
from xc.eval.inference import encode_rows


def test_encode_rows_encodes_only_real_rows_and_keeps_their_order():
    """The last round is not padded with copies of an input: a single long query once became batch_size copies
    (5 MB of features -> 9 GB). Embeddings come back in row order, whatever the rounds."""
    table = torch.randn(20, 3)
    seen: list[int] = []

    def inputs(rows: np.ndarray) -> dict[str, torch.Tensor]:
        seen.append(len(rows))
        return {"dense": table[torch.from_numpy(np.asarray(rows))]}

    class Encoder(torch.nn.Module):
        def forward(self, batch):
            return batch["dense"] * 2

    rows = np.array([7, 3, 11, 0, 19], dtype=np.int64)
    emb = encode_rows(Encoder(), inputs, rows, batch_size=4, ctx=DistContext())
    assert seen == [4, 1]
    torch.testing.assert_close(emb, table[torch.from_numpy(rows)] * 2)
    seen.clear()
    assert encode_rows(Encoder(), inputs, rows[:1], batch_size=256, ctx=DistContext()).shape == (1, 3)
    assert seen == [1]
