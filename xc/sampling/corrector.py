"""The target corrector ("Target Corrector Networks"): a residual MLP h over a FROZEN cache, trained to match fresh encodings.

The cache B is encoded once (as `lf_stale`). Hard negatives are the exact top-k of <f(x), h(B[y])> over
the shard (h applied without gradient, in chunks). After each step the trainer hands `observe` the
queries f(x) and the FRESH encodings g(y) of the labels S it scored; h is trained on

    softmax (default): L_h = mean_x CE(P_S(.|x), P_{h,S}(.|x)),  P_S = softmax_S <f(x), g(y)> (target,
                       detached), P_{h,S} = softmax_S <f(x), h(B[y])> (f(x) detached)
    mse:               L_h = mean_y ||h(B[y]) - g(y)||^2

with its own Adam optimizer. Mining through h costs n * d * hidden per
step; with `corrector_mine_every` r > 1 it reads h(B) as it was at the last of every r updates instead (the
table is rebuilt from h's weights of that update on a resume, so resumes stay exact). Stop-gradients: the task loss never sees h (it scores fresh g), and L_h
sees only detached f and g, so h learns only from L_h and f, g only from L_task. The combined objective
L_task + lambda * L_h therefore splits into two independent updates; lambda multiplies L_h (it matters
for the logged loss and for SGD, while Adam is invariant to it up to epsilon). h is discarded at
evaluation (the trainer evaluates against exactly re-encoded labels).

h(b) = b + W2 relu(W1 b + c1) + c2 with W2, c2 initialised to zero: an untrained corrector IS the stale
cache, so any gain is learned. The paper uses hidden 8192 on GPUs; here `corrector_hidden` (default 256)
keeps the per-step cost of mining through h (n * d * hidden per shard) CPU-sized. The cache's copy, h and its optimizer
live on the rank's device (CacheSpec.device), so on a GPU the batch is mined there (checkpoints are read back with map_location="cpu").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xc.sampling.cache_registry import CacheSpec, register_cache_source
from xc.sampling.label_cache import StaleCache, chunked_topk


class ResidualMLP(nn.Module):
    """h: (n, d) -> (n, d), identity at initialisation."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.inner = nn.Linear(dim, hidden)
        self.outer = nn.Linear(hidden, dim)
        nn.init.zeros_(self.outer.weight)
        nn.init.zeros_(self.outer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(F.relu(self.inner(x)))


def truncated_kl(q: torch.Tensor, target_rows: torch.Tensor, approx_rows: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(P_target || P_approx), softmaxes over the same set S.

    q (B, d); target_rows, approx_rows (S, d)."""
    log_p = F.log_softmax(q @ target_rows.t(), dim=1)
    log_a = F.log_softmax(q @ approx_rows.t(), dim=1)
    return (log_p.exp() * (log_p - log_a)).sum(1).mean()


def topk_overlap(q: torch.Tensor, target_rows: torch.Tensor, approx_rows: torch.Tensor, k: int) -> float:
    """Mean share of each query's top-k over S under target_rows that approx_rows also ranks top-k."""
    k = min(k, target_rows.shape[0])
    a = torch.topk(q @ target_rows.t(), k, dim=1).indices
    b = torch.topk(q @ approx_rows.t(), k, dim=1).indices
    return float((a.unsqueeze(2) == b.unsqueeze(1)).any(2).float().mean())


class CorrectorSource(StaleCache):
    """Frozen cache + residual MLP corrector; mining under the corrected scores."""

    def __init__(self, spec: CacheSpec):
        super().__init__(spec)
        cfg = spec.cfg
        # Seeded per shard (not from the global RNG), so h is the same whether the shard lives on rank 0
        # of one process or rank 1 of two.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed * 7919 + spec.shard)
            self.h = ResidualMLP(spec.dim, cfg.corrector_hidden).to(self.device)
        self.opt = torch.optim.Adam(self.h.parameters(), lr=cfg.corrector_lr)
        self.loss_kind, self.lam = cfg.corrector_loss, cfg.corrector_lambda
        self.steps = 0
        # corrector_mine_every > 1: the corrected table mined from, and h's weights and update count when made
        self.table: torch.Tensor | None = None
        self.table_h: dict | None = None
        self.table_at = -1
        self._mined: torch.Tensor | None = None  # the last mine()'s local ids, for corrector_max_others

    @torch.no_grad()
    def corrected(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """h(B[ids]) (or of every row), without gradient."""
        rows = self.cache_rows() if ids is None else self.cache_rows()[ids.to(self.device)]
        return self.h(rows)

    @torch.no_grad()
    def mine(self, query_emb: torch.Tensor, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        if k == 0:
            return torch.zeros((query_emb.shape[0], 0), dtype=torch.int64), None
        chunk, query = self.spec.cfg.cache_mine_chunk, query_emb.float().to(self.device)
        if self.spec.cfg.corrector_mine_every <= 1:
            _, ids = chunked_topk(query, self.cache_rows(), k, chunk, transform=self.h)
        else:
            _, ids = chunked_topk(query, self._corrected_table(), k, chunk)
        ids = ids.cpu()
        self._mined = ids
        return ids, None

    def _training_targets(self, sampled_ids: torch.Tensor, keep_ids: torch.Tensor | None) -> torch.Tensor:
        """Positions into sampled_ids h trains on: all; or (corrector_max_others m > 0) those in keep_ids (the
        step's positives) or mined by the last mine(), plus a sample of m others seeded by (seed, shard, update)."""
        m = self.spec.cfg.corrector_max_others
        if m <= 0:
            return torch.arange(sampled_ids.numel())
        kept = torch.zeros(sampled_ids.numel(), dtype=torch.bool)
        for ids in (keep_ids, self._mined):
            if ids is not None and ids.numel():
                kept |= torch.isin(sampled_ids, ids.reshape(-1))
        others = torch.nonzero(~kept).flatten()
        if len(others) > m:
            gen = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + self.spec.shard * 7919 + self.steps)
            others = others[torch.randperm(len(others), generator=gen)[:m]]
        return torch.sort(torch.cat([torch.nonzero(kept).flatten(), others])).values

    @torch.no_grad()
    def _corrected_table(self) -> torch.Tensor:
        """h(B) of every row, as of the last update at a multiple of corrector_mine_every; after a resume, rebuilt
        from the h weights recorded with it (what the interrupted run mined from)."""
        every = self.spec.cfg.corrector_mine_every
        made_at = self.steps - self.steps % every
        if self.table is not None and self.table_at == made_at:
            return self.table
        if self.table_h is not None and self.table_at == made_at:  # resumed: the recorded weights
            h = ResidualMLP(self.spec.dim, self.spec.cfg.corrector_hidden)
            h.load_state_dict(self.table_h)
            h.to(self.device)
        else:
            h, self.table_h = self.h, {k: v.detach().clone() for k, v in self.h.state_dict().items()}
        rows, chunk = self.cache_rows(), self.spec.cfg.cache_mine_chunk
        self.table = torch.cat([h(rows[s:s + chunk]) for s in range(0, rows.shape[0], chunk)])
        self.table_at = made_at
        return self.table

    def corrector_loss(self, query_emb: torch.Tensor, sampled_ids: torch.Tensor, fresh_emb: torch.Tensor) -> torch.Tensor:
        """L_h on one batch (differentiable in h only): query_emb (B, d), sampled_ids (S,), fresh_emb (S, d)."""
        q, target = query_emb.detach().float().to(self.device), fresh_emb.detach().float().to(self.device)
        approx = self.h(self.cache_rows()[sampled_ids.to(self.device)])
        if self.loss_kind == "mse":
            return ((approx - target) ** 2).sum(1).mean()
        p = F.softmax(q @ target.t(), dim=1)
        return -(p * F.log_softmax(q @ approx.t(), dim=1)).sum(1).mean()

    def observe(self, query_emb: torch.Tensor, sampled_ids: torch.Tensor, fresh_emb: torch.Tensor,
                diagnostics: bool = True, keep_ids: torch.Tensor | None = None) -> dict[str, float]:
        if sampled_ids.numel() == 0:
            return {}
        pick = self._training_targets(sampled_ids, keep_ids)
        if len(pick) < sampled_ids.numel():
            sampled_ids, fresh_emb = sampled_ids[pick], fresh_emb[pick]
        loss = self.corrector_loss(query_emb, sampled_ids, fresh_emb)
        self.opt.zero_grad(set_to_none=True)
        (self.lam * loss).backward()
        self.opt.step()
        self.steps += 1
        if not diagnostics:  # KL and top-5 agreement cost about a third of a token-bag step: only where logged
            return {"corrector_loss": float(loss.detach())}
        q, target = query_emb.detach().float().to(self.device), fresh_emb.detach().float().to(self.device)
        stale = self.cache_rows()[sampled_ids.to(self.device)]
        fixed = self.corrected(sampled_ids)
        return {"corrector_loss": float(loss.detach()), "kl_fresh_corrected": float(truncated_kl(q, target, fixed)),
                "kl_fresh_stale": float(truncated_kl(q, target, stale)),
                "top5_overlap_corrected": topk_overlap(q, target, fixed, 5),
                "top5_overlap_stale": topk_overlap(q, target, stale, 5)}

    def memory_bytes(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.h.parameters())
        return {**super().memory_bytes(), "corrector": params, "corrector_adam": 2 * params}

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "h": self.h.state_dict(), "h_opt": self.opt.state_dict(), "steps": self.steps}
        if self.table_h is not None:
            state.update(table_h=self.table_h, table_at=self.table_at)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.h.load_state_dict(state["h"])
        self.opt.load_state_dict(state["h_opt"])
        self.steps = int(state.get("steps", 0))
        self.table, self.table_h, self.table_at = None, state.get("table_h"), int(state.get("table_at", -1))


register_cache_source("corrector", CorrectorSource)
