"""kNN fusion over an ensemble: the members' probabilities averaged first, then fused once with the vote.

    fused(x, l) = (1 - lam) * mean_m p_m(x, l; T) + lam * mean_m vote_m(x, l)

p_m is member m's probability of l at temperature T (its softmax over the query's candidates, as
`xc/eval/fusion.py` has it);
vote_m the kNN vote in member m's space: the tf-idf input space is the same for every member, the
embedding space is each member's own, "both" averages the two per member. A query's candidates are every
member's top C labels and the averaged vote's top C, so the ensemble of one member scores exactly the
candidates the member's own fusion scores. lam, k, the space and T are chosen on held-out points, ties to the
smaller lam, as for one model: the members' shared validation split (memory: the points that trained them),
or, cross-fitted, every member's own fold, scored by that member alone with its own training points as the
memory, the folds stacked (`choose_on_validation`).

Why average before fusing: on Bibtex, members' fused probabilities averaged were no better on validation
than the members themselves (43.51 against 43.45-43.68 mean P@k), while averaging the models and fusing
once lifted validation to 43.95; the models carry the seed-to-seed variance, the vote does not.

Every member is a `xc.serve.model.TrainedModel` in this process (any world size wrote its checkpoints).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from xc.eval.fusion import Candidates, FusionChoice, choose, drop_repeats, fixed_choice, votes_for
from xc.eval.knn import LabelVotes, MixedVotes, Neighbours, labels_csr
from xc.eval.memory import MemoryEvaluation
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import inverse_propensities, precision_at_k, true_labels


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


class EnsembleMemory:
    """The members' scorers and searchable spaces (see the module docstring); `members` are TrainedModels."""

    def __init__(self, members: list, dataset):
        self.members, self.dataset = members, dataset
        self.mems = [MemoryEvaluation(m.cfg, m.components, dataset, m.ctx) for m in members]
        first = self.mems[0]
        self.cfg, self.fc, self.width, self.spaces = first.cfg, first.fc, first.width, first.spaces
        self.max_k = first.max_k

    # ----------------------------------------------------------------- pieces
    def encode(self, inputs_of, rows: np.ndarray) -> list[torch.Tensor]:
        """Each member's (len(rows), d_m) embeddings; inputs_of(m) gives member m's InputFn."""
        return [mem.scorer.encode(inputs_of(i), rows) for i, mem in enumerate(self.mems)]

    def neighbours(self, query_split, rows: np.ndarray, embs: list[torch.Tensor],
                   memory_rows: np.ndarray) -> dict[str, list[Neighbours]]:
        """{"input": [shared neighbours], "embedding": [one per member]}, the spaces the config searches."""
        found: dict[str, list[Neighbours]] = {}
        if any(s in ("input", "both") for s in self.spaces):
            found["input"] = [self.mems[0]._search("input", query_split, rows, embs[0], memory_rows)]
        if any(s in ("embedding", "both") for s in self.spaces):
            found["embedding"] = [mem._search("embedding", query_split, rows, emb, memory_rows)
                                  for mem, emb in zip(self.mems, embs)]
        return found

    def votes(self, space: str, k: int, found: dict[str, list[Neighbours]],
              memory_rows: np.ndarray) -> LabelVotes | MixedVotes:
        memory = labels_csr(self.dataset.train.labels, memory_rows)
        L = self.dataset.num_labels
        if space == "input":
            return votes_for(found["input"][0], k, memory, L)
        per_member = [votes_for(n, k, memory, L) for n in found["embedding"]]
        if space == "both":
            shared = votes_for(found["input"][0], k, memory, L)
            per_member = [MixedVotes([shared, v]) for v in per_member]
        return per_member[0] if len(per_member) == 1 else MixedVotes(per_member)

    def candidates(self, embs: list[torch.Tensor], votes, width: int | None = None,
                   tops: list[np.ndarray] | None = None) -> Candidates:
        """Every member's top `width` (exact, or the given `tops` (n, w) ids, e.g. from ANN indexes) and the
        vote's top `width` (none when `votes` is None), each scored by every member, averaged."""
        width = max(self.width, width or 0)
        if tops is None:
            tops = [mem.scorer.top(emb, width)[1] for mem, emb in zip(self.mems, embs)]
        extra = [] if votes is None else [votes.top(width)[1]]
        ids = drop_repeats(np.concatenate([*tops, *extra], 1))
        p = np.zeros(ids.shape, np.float64)
        member_scores = []
        for mem, emb in zip(self.mems, embs):
            scores = np.where(ids >= 0, mem.scorer.scores_of(emb, ids), -np.inf)
            p += np.where(ids >= 0, mem.scorer.probabilities(scores), 0.0)
            member_scores.append(scores)
        votes_of = np.zeros(ids.shape, np.float32) if votes is None else votes.lookup(ids)
        return Candidates(ids, (p / len(self.mems)).astype(np.float32), votes_of, tuple(member_scores),
                          self.mems[0].scorer.loss)

    def member(self, i: int) -> EnsembleMemory:
        """Member i alone, as an ensemble of one (its scorer and spaces are shared, not rebuilt)."""
        one = object.__new__(EnsembleMemory)
        one.__dict__.update(self.__dict__, members=[self.members[i]], mems=[self.mems[i]])
        return one

    def validation_folds(self) -> list[np.ndarray]:
        """The held-out rows: one split shared by every member, or each member's own fold (cross-fitted)."""
        folds = [m.components.train.valid_ids for m in self.members]
        return folds[:1] if all(np.array_equal(folds[0], f) for f in folds[1:]) else folds

    def _validation_grid(self) -> dict[tuple[str, int], Candidates]:
        """{(space, k): candidates of the held-out rows}: the averaged members on a shared split, the memory being
        the points that trained them."""
        train = self.members[0].components.train
        valid_rows, memory_rows = train.valid_ids, train.train_ids
        embs = self.encode(lambda i: self.members[i].components.train.split_inputs, valid_rows)
        found = self.neighbours(self.dataset.train, valid_rows, embs, memory_rows)
        return {(space, k): self.candidates(embs, self.votes(space, k, found, memory_rows))
                for space in self.spaces for k in self.fc.ks}

    # ----------------------------------------------------------------- phases
    def choose_on_validation(self) -> tuple[FusionChoice, list]:
        """The fixed choice when `eval.knn_fusion` gives lam (or is off: lam 0), else the best grid point on
        the held-out rows: the members' shared split, or (cross-fitted members) every member's own fold, each
        fold scored by the one member that never saw it, with the points that trained that member as memory;
        the folds' candidates are stacked and judged together."""
        fc = self.fc
        if not fc.enabled:
            return FusionChoice(0.0, min(fc.ks), "embedding"), []
        if fc.lam is not None:
            return fixed_choice(fc, self.spaces), []
        folds = self.validation_folds()
        if len(folds) == 1:
            grid = self._validation_grid()
        else:
            parts = [self.member(i)._validation_grid() for i in range(len(self.members))]
            grid = {key: stack_candidates([p[key] for p in parts]) for key in parts[0]}
        indptr, indices = true_labels(self.dataset.train.labels, np.concatenate(folds))
        ks = tuple(self.cfg.eval.ks)

        def metric(ids: np.ndarray) -> float:
            return float(np.mean(list(precision_at_k(ids, indptr, indices, ks).values())))

        return choose(grid, fc.lambdas, max(ks), metric, fc.temperatures)

    def fused(self, choice: FusionChoice, query_split, rows: np.ndarray, embs: list[torch.Tensor],
              width: int | None = None) -> Candidates:
        """Candidates of queries `rows` of `query_split` (anything with `.features`); memory = every training point."""
        memory_rows = np.arange(self.dataset.train.num_points, dtype=np.int64)
        found = self.neighbours(query_split, rows, embs, memory_rows)
        cands = self.candidates(embs, self.votes(choice.space, choice.k, found, memory_rows), width)
        return cands.at_temperature(choice.temperature)

    def test_metrics(self, choice: FusionChoice, rows: np.ndarray) -> dict[str, float]:
        """The fused ensemble on test rows under the plain keys; `model/...` (lam 0: the averaged models) and
        `knn/...` (lam 1: the averaged votes) beside them."""
        dataset = self.dataset
        embs = self.encode(lambda i: self.members[i].components.test_inputs, rows)
        cands = self.fused(choice, dataset.test, rows, embs)
        indptr, indices = true_labels(dataset.test.labels, rows)
        ks, topk = tuple(self.cfg.eval.ks), max(self.cfg.eval.topk, max(self.cfg.eval.ks))
        inv = inverse_propensities(dataset.train, self.cfg.eval.propensity_a, self.cfg.eval.propensity_b)

        def score(lam: float) -> dict[str, float]:
            return evaluate_metrics(cands.fuse(lam, topk)[1], indptr, indices, inv, ks=ks)

        out = score(choice.lam)
        out.update({f"model/{k}": v for k, v in score(0.0).items()})
        out.update({f"knn/{k}": v for k, v in score(1.0).items()})
        return out

    def predict(self, choice: FusionChoice, features, embs: list[torch.Tensor], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(fused scores (n, k), ids (n, k)) of new queries with feature rows `features` (None: embedding space)."""
        rows = np.arange(len(embs[0]), dtype=np.int64)
        cands = self.fused(choice, SimpleNamespace(features=features), rows, embs, k)
        return cands.fuse(choice.lam, k)
