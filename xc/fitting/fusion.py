"""Instance memory at inference: fuse a trained model's label scores with a kNN vote over training points.

    fused(x, l) = [(1 - lam) * p_model(x, l; T) + lam * vote_k(x, l)] * sigmoid(r(x, l)) ** gamma

p_model is the model's probability for l at temperature T (the sigmoid of its score / T for BCE-trained
models, a softmax of score / T over the query's candidates for softmax-trained ones); vote_k is the
similarity-weighted share of x's k nearest training points that carry l (`xc/fitting/knn.py`), searched in the
data's tf-idf input space, in the encoder's embedding space, or in both with the two votes averaged; r is the
sparse linear ranker over the input tf-idf (`xc/fitting/ranker.py`, gamma = 0 where the data has no sparse
features). Candidates are the model's top C labels plus the vote's top C, so the cost per query is O(C d)
beyond plain inference, whatever L is.

lam, k, the space and T are chosen on the validation split carved from the training data
(`data.valid_fraction`): the grid point with the best mean P@k over `eval.ks`, ties to T = 1 and the
smaller lam, so a memory that does not help is switched off (lam = 0 gives exactly the plain model, at
any T: tempering keeps each query's order; for an ensemble T also sets how its members' probabilities average).

Why a temperature: the model's probabilities and the vote are mixed linearly, so how much each counts
depends on how peaked the model is, which is a property of training (loss, epochs, data size), not of
the data's labels. A softmax model trained to convergence on a few thousand points is over-confident:
its top candidate takes most of the mass, and a vote can move it only at large lam, where the vote also
reorders the ranks below. Validation chose T > 1 on every set measured (Bibtex, Delicious, the dense
set; docs/accuracy_defaults.md), lifting P@3/P@5 most; T -> infinity tends to a linear blend of raw scores and votes. The memory
searched for validation queries holds the other training points only; at test time it holds all of them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from xc.arrays import top_order
from xc.distributed import DistContext, all_gather_no_grad
from xc.errors import CheckpointError
from xc.eval.inference import ExactSearcher, encode_rows, lexical_depth, lexical_topk, sharded_topk
from xc.fitting.knn import LabelVotes, Neighbours

log = logging.getLogger(__name__)


@dataclass
class FusionChoice:
    lam: float
    k: int
    space: str
    temperature: float = 1.0  # the model's probabilities at scores / temperature
    gamma: float = 0.0  # the lexical ranker's exponent (xc/fitting/ranker.py); 0: no ranker
    ranker_parts: int = 0  # RUN_DIR/ranker/ holds one part per rank of the run that trained it

    @property
    def needs_features(self) -> bool:
        """Whether serving this choice reads the queries' input features (the input-space vote or the ranker)."""
        return self.space in ("input", "both") or self.gamma > 0

    def as_dict(self) -> dict:
        out = {"lambda": self.lam, "k": self.k, "space": self.space, "temperature": self.temperature}
        return dict(out, gamma=self.gamma, ranker_parts=self.ranker_parts) if self.gamma else out

    @classmethod
    def read(cls, run_dir) -> "FusionChoice | None":
        """The choice training recorded in RUN_DIR/fusion.json, None where it chose none."""
        path = Path(run_dir) / "fusion.json"
        if not path.exists():
            return None
        chosen = json.loads(path.read_text())
        if "mu" in chosen:  # the ranker's earlier, additive form
            raise CheckpointError(f"{path}: written by an earlier xc that added the lexical ranker with a weight "
                                  "'mu'; this version multiplies it in (gamma): retrain the run")
        # runs written before the temperature existed fused at T = 1
        return cls(float(chosen["lambda"]), int(chosen["k"]), str(chosen["space"]),
                   float(chosen.get("temperature", 1.0)), float(chosen.get("gamma", 0.0)),
                   int(chosen.get("ranker_parts", 0)))


# the inputs a block of queries was encoded from: (InputFn, dataset rows (M,)); the lexical weights read them
Queries = tuple


class ModelScorer:
    """The trained model's side of fusion: encode rows, take its top candidates, score given labels.

    Every rank calls every method (they are collective over the label shards)."""

    def __init__(self, encoder, shard, ctx: DistContext, batch_size: int, loss: str):
        self.encoder, self.shard, self.ctx, self.batch_size, self.loss = encoder, shard, ctx, batch_size, loss

    def encode(self, inputs, rows: np.ndarray) -> torch.Tensor:
        """(len(rows), d) float32 CPU embeddings."""
        return encode_rows(self.encoder, inputs, rows, self.batch_size, self.ctx)

    def _lexical(self, queries):
        """The shard's lexical weights (model.lexical_features), which need the queries' inputs; None without."""
        lexical = getattr(self.shard, "lexical", None)
        if lexical is not None and queries is None:
            raise ValueError("a model with lexical weights scores its queries with their inputs (queries=)")
        return lexical

    def top(self, emb: torch.Tensor, k: int, queries: Queries | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Model scores (M, k) and label ids (M, k) of each query's best k labels (exact, all shards); `queries` the
        (InputFn, rows) the embeddings were encoded from, read where the model has lexical weights."""
        searcher, lexical = ExactSearcher(self.shard), self._lexical(queries)
        depth = k if lexical is None else lexical_depth(k, searcher)
        scores, ids = sharded_topk(emb.to(self.ctx.device), searcher, depth, self.ctx)
        if lexical is not None:
            inputs, rows = queries
            scores, ids = lexical_topk(lexical, self.shard, searcher, inputs, rows, emb, scores, ids, k, depth, self.ctx)
        return scores.cpu().numpy(), ids.cpu().numpy()

    @torch.no_grad()
    def scores_of(self, emb: torch.Tensor, ids: np.ndarray, block: int = 1024, queries: Queries | None = None) -> np.ndarray:
        """Model scores (M, c) float32 of given label ids (M, c); -1 pads score -inf. Each rank scores the
        ids in its own rows [lo, hi), and the ranks' parts are summed; with lexical weights, theirs added (`top`)."""
        lexical = self._lexical(queries)
        lo, hi = self.shard.lo, self.shard.lo + self.shard.num_real_rows
        out = np.zeros(ids.shape, np.float32)
        for start in range(0, len(ids), block):
            part = torch.from_numpy(ids[start:start + block])
            mine = (part >= lo) & (part < hi)
            local = torch.where(mine, part - lo, 0).to(self.shard.weight.device)
            rows = self.shard.weight[local].float()  # (b, c, d)
            q = emb[start:start + block].to(rows.device).float()
            s = torch.einsum("bcd,bd->bc", rows, q)
            # the label prior (xc/fitting/label_prior.py), added as ExactSearcher adds it
            if getattr(self.shard, "score_bias", None) is not None:
                s = s + self.shard.score_bias.to(rows.device)[local]
            s = s * mine.to(rows.device)
            if lexical is not None:
                inputs, query_rows = queries
                s = s + torch.from_numpy(lexical.pair_scores(inputs(query_rows[start:start + block]),
                                                             ids[start:start + block])).to(s.device)
            if self.ctx.active:
                s = all_gather_no_grad(s.contiguous(), self.ctx).view(self.ctx.world_size, *s.shape).sum(0)
            out[start:start + block] = s.cpu().numpy()
        out[ids < 0] = -np.inf
        return out

    def probabilities(self, scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
        return model_probabilities(scores, self.loss, temperature)


def model_probabilities(scores: np.ndarray, loss: str, temperature: float = 1.0) -> np.ndarray:
    """(M, c) probabilities of model scores (M, c) (-inf pads give 0) at a temperature: a softmax over each
    query's candidates for softmax-trained models (shift-invariant logits), else the sigmoid."""
    z = scores / temperature
    if loss == "softmax":
        z = z - z.max(1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(1, keepdims=True)
    return 1.0 / (1.0 + np.exp(-np.clip(z, -50, 50)))


@dataclass
class Candidates:
    """Each query's candidate labels with the signals fusion mixes: ids (M, c) (-1 pads, repeats marked -1),
    p_model (M, c) at temperature 1, votes (M, c), the lexical ranker's probabilities (M, c) where it scored
    them (`ranked`); and, to temper p_model, the raw model scores (M, c) of each averaged model
    (`member_scores`, -inf at pads) under `loss`."""

    ids: np.ndarray
    p_model: np.ndarray
    votes: np.ndarray
    member_scores: tuple[np.ndarray, ...] = ()
    loss: str = "softmax"
    ranked: np.ndarray | None = None
    # ranked ** gamma in float64 by gamma: the choice on validation fuses each grid entry at every lam for one gamma
    _powers: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def at_temperature(self, temperature: float) -> "Candidates":
        """The same candidates with p_model the models' mean probability at `temperature` (self at 1)."""
        if temperature == 1.0 or not self.member_scores:
            return self
        p = sum(np.where(self.ids >= 0, model_probabilities(s, self.loss, temperature), 0.0)
                for s in self.member_scores) / len(self.member_scores)
        return replace(self, p_model=p.astype(np.float32))

    def fuse(self, lam: float, topk: int, gamma: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(scores (M, topk), ids (M, topk)) by fused score [(1 - lam) p_model + lam votes] * ranked ** gamma;
        lam = gamma = 0 keeps the model's order."""
        fused = (1.0 - lam) * self.p_model + lam * self.votes
        if gamma:  # in float64: sigmoid ** gamma reaches 1e-40 at a label with no evidence
            if gamma not in self._powers:
                self._powers[gamma] = self.ranked.astype(np.float64) ** gamma
            fused = fused.astype(np.float64) * self._powers[gamma]
        fused = np.where(self.ids >= 0, fused, -np.inf)
        order = top_order(fused, topk)
        return np.take_along_axis(fused, order, 1), np.take_along_axis(self.ids, order, 1)


def drop_repeats(ids: np.ndarray) -> np.ndarray:
    """ids (M, c) with every repeat of a label within a row after its first slot set to -1 (a pad)."""
    order = np.argsort(ids, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(ids, order, 1)
    repeat = np.zeros_like(sorted_ids, dtype=bool)
    repeat[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    dup = np.zeros_like(repeat)
    np.put_along_axis(dup, order, repeat, 1)
    return np.where(dup, -1, ids)


def stack_candidates(parts: list[Candidates]) -> Candidates:
    """The rows of `parts` one after another, narrower ones padded (id -1, p 0, vote 0) to the widest."""
    width = max(p.ids.shape[1] for p in parts)

    def pad(a: np.ndarray, value) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)

    members = {len(p.member_scores) for p in parts}
    # cross-fitted folds are each scored by their one member: one stacked score matrix tempers them all
    scores = (np.concatenate([pad(p.member_scores[0], -np.inf) for p in parts]),) if members == {1} else ()
    return Candidates(np.concatenate([pad(p.ids, -1) for p in parts]),
                      np.concatenate([pad(p.p_model, 0.0) for p in parts]),
                      np.concatenate([pad(p.votes, 0.0) for p in parts]), scores, parts[0].loss)


def build_candidates(scorer: ModelScorer, emb: torch.Tensor, model_scores: np.ndarray, model_ids: np.ndarray,
                     votes: LabelVotes, width: int) -> Candidates:
    """Union of the model's top candidates (given, best first) and the vote's top `width` labels."""
    _, vote_ids = votes.top(width)
    extra_scores = scorer.scores_of(emb, vote_ids)
    ids = drop_repeats(np.concatenate([model_ids, vote_ids], 1))  # a label in both keeps its model-side slot
    scores = np.concatenate([model_scores, extra_scores], 1)
    scores = np.where(ids >= 0, scores, -np.inf)
    p = scorer.probabilities(scores)
    p = np.where(ids >= 0, p, 0.0)
    return Candidates(ids, p.astype(np.float32), votes.lookup(ids), (scores,), scorer.loss)


def choose(grid: dict[tuple[str, int], Candidates], lambdas: list[float], topk: int, metric,
           temperatures: list[float] = (1.0,)) -> tuple[FusionChoice, list]:
    """Best (space, k, T, lam) on validation candidates by `metric(ids) -> float` (higher is better);
    ties go to T = 1, then the smaller lam, then the earlier grid entry. Returns the choice and every
    tried point."""
    tried, best, best_value = [], None, -np.inf
    ordered = sorted(temperatures, key=lambda t: (t != 1.0, t))  # T = 1 first: a tie keeps the plain model
    for (space, k), plain in grid.items():
        for t in ordered:
            cands = plain.at_temperature(t)
            for lam in sorted(lambdas):
                value = metric(cands.fuse(lam, topk)[1])
                tried.append({"space": space, "k": k, "temperature": t, "lambda": lam, "value": value})
                tie = abs(value - best_value) <= 1e-9 and best is not None and lam < best.lam
                if value > best_value + 1e-9 or tie:
                    best, best_value = FusionChoice(lam, k, space, t), value
    return best, tried


def fixed_choice(fc, spaces: list[str]) -> FusionChoice:
    """The choice `eval.knn_fusion` fixes (lam given): k 10 and the first searchable space unless given."""
    return FusionChoice(fc.lam, fc.k or 10, fc.space or spaces[0], fc.temperature or 1.0)


def votes_for(nbrs: Neighbours, k: int, memory_labels, num_labels: int) -> LabelVotes:
    return LabelVotes(nbrs.first(k), memory_labels, num_labels)
