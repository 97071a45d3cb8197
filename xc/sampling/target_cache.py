"""The contract for negative sources that mine from a cache of label-tower embeddings (dual-encoder mode).

In label-feature (dual-encoder) mode a label's score is <f(x), g(text_l) [+ w_l]>, and the label tower g
keeps training. Encoding every label every step is the O(L) cost we avoid, so hard negatives are mined
from a *cache* of label embeddings that goes stale as g moves. Each way of living with that staleness is
one `TargetCacheSource` for one label shard [lo, hi):

- stale cache (encode once), full re-encode every w steps, partial re-encode (`xc.sampling.label_cache`);
- the target corrector, a residual MLP over cached vectors trained to match fresh encodings (002);
- the dynamic tree index with Nystrom drift correction (000).

The trainer owns the label tower and hands each source an `encode` callback; every label a source asks
to be encoded is counted, so the re-embedding cost of each policy is reported in the same unit.
All ids here are LOCAL to the shard: 0 <= id < hi - lo.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

# encode(local_ids (n,) int64 numpy) -> (n, d) float32 fresh label-tower embeddings, no autograd.
EncodeFn = Callable[[np.ndarray], torch.Tensor]


class TargetCacheSource(ABC):
    """Mines hard negatives for one label shard from cached (possibly stale) label embeddings."""

    num_rows: int  # hi - lo
    encodings: int = 0  # labels this source has asked `encode` for, over the whole run

    @abstractmethod
    def refresh(self, step: int, encode: EncodeFn) -> int:
        """Called once per optimizer step before mining: re-encode what the policy says is due.

        Returns the number of labels encoded by this call (also added to `self.encodings`)."""

    @abstractmethod
    def mine(self, query_emb: torch.Tensor, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hard negatives for a batch.

        query_emb (B, d) float32, detached; returns (neg_ids (B, k) int64 local ids, log_q (B, k) float32
        or None). log_q is the log proposal probability when the source samples (needed for a logQ
        correction); None when it takes a deterministic top-k."""

    def observe(self, query_emb: torch.Tensor, sampled_ids: torch.Tensor, fresh_emb: torch.Tensor,
                diagnostics: bool = True, keep_ids: torch.Tensor | None = None) -> dict[str, float]:
        """After the step's loss: the queries (B, d) detached, the local ids (S,) scored this step and
        their fresh encodings (S, d) detached. A learning source (the corrector) trains here; returns
        metrics to log (e.g. the corrector loss), the costlier ones only with `diagnostics` (the trainer
        asks on the steps it logs); keep_ids: local ids of the step's positives in the shard. The default
        does nothing."""
        return {}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per structure (cache, corrector, tree, landmarks...), for the memory table."""
        return {}

    def state_dict(self) -> dict:
        return {"encodings": self.encodings}

    def load_state_dict(self, state: dict) -> None:
        self.encodings = int(state.get("encodings", 0))
