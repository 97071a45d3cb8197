"""kNN fusion (`eval.knn_fusion`), one evaluator for one model, an ensemble and a dual run: the models'
probabilities averaged first, then fused once with the kNN vote over the training points.

    fused(x, l) = [(1 - lam) * mean_m p_m(x, l; T) + lam * mean_m vote_m(x, l)] * sigmoid(r(x, l)) ** gamma

p_m is model m's probability of l at temperature T (its softmax over the query's candidates, xc/fitting/fusion.py);
vote_m the kNN vote in model m's space: the tf-idf input space is the same for every model, the embedding space
is each model's own, "both" averages the two per model. One model is an ensemble of one. A query's candidates
are every model's top C labels and the averaged vote's top C. lam, k, the space and T are chosen on held-out
points, ties to the smaller lam: the models' shared validation split (memory: the points that trained them),
or, cross-fitted ensemble members, every member's own fold, scored by that member alone with its own training
points as the memory, the folds stacked (`choose_on_validation`). The test metrics report the fused model
under the plain keys, the averaged models (`model/...`, lam = 0) and the vote alone (`knn/...`, lam = 1).

Why average before fusing: on Bibtex, members' fused probabilities averaged were no better on validation
than the members themselves (43.51 against 43.45-43.68 mean P@k), while averaging the models and fusing
once lifted validation to 43.95; the models carry the seed-to-seed variance, the vote does not.

r is the lexical ranker (`xc/fitting/ranker.py`): one linear model per label on the input features (tf-idf of raw
text, sparse or dense rows), trained on the points that trained the model (cross-fitted members: each fold's
ranker on its member's points, the one fused at test on every point), once lam, k, the space and T are chosen;
gamma is then chosen with lam, k and the space on the same held-out points (gamma = 0 is the fusion without it, and ties keep the
smaller gamma). A product, not a third linear term: the ranker's probability is evidence of another kind, and
multiplying lets it veto a label the model and the vote agree on (debian-deps seed 0, validation mean P@k 48.11
against 47.90 for the best additive weight; docs/accuracy.md).

Every rank runs this (the model side is collective over label shards); the deterministic neighbour searches
bring every rank to the same choice without communicating it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from xc.arrays import unique_ints
from xc.distributed import all_reduce
from xc.eval.metrics import evaluate as evaluate_metrics
from xc.eval.metrics import hits_per_point, paired_gain, precision_at_k, true_labels
from xc.fitting.fusion import (Candidates, FusionChoice, choose, drop_repeats, fixed_choice, stack_candidates,
                               votes_for)
from xc.fitting.knn import (LabelVotes, MixedVotes, Neighbours, input_vectors, input_weights, labels_csr,
                            sparse_neighbours)
from xc.fitting.model_memory import ModelMemory
from xc.fitting.ranker import LexicalRanker, RankerParams, RankerSize, fit_ranker, sigmoid

log = logging.getLogger(__name__)


class FusionEvaluator:
    """The models' scorers and searchable spaces (module docstring); `models` are ModelMemory, the first one's
    evaluation settings rule."""

    def __init__(self, models: list[ModelMemory], dataset):
        self.models, self.dataset = models, dataset
        first = models[0]
        self.fc, self.ks, self.topk = first.fc, first.ks, first.topk
        self.width = max(self.fc.candidates, self.topk)
        features = dataset.train.features
        self.spaces = [s for s in self.fc.spaces if s == "embedding" or features is not None]
        self.weights = (input_weights(features, bool(dataset.meta.get("text_features")))
                        if features is not None else None)
        self.max_k = max(self.fc.ks + ([self.fc.k] if self.fc.k else []))
        self.rc, self.ranker = first.rc, None
        self.ctx = first.ctx
        self.validation_grid = self.validation_ranked = self.test_candidates = None  # the phases below keep them

    def ranker_size(self) -> RankerSize | None:
        """The lexical ranker's rule: how many neighbours' labels each training point pairs with and how many of its
        row's features the pairs keep, or None (no ranker). It needs input features (tf-idf of raw text, sparse rows,
        or dense ones, weighted as the kNN's input space reads them); one model or an ensemble. Its training size,
        estimated as points x (negatives + positives per point) x non-zeros per row, is held within
        `max_pair_features` by pairing each point with fewer of its neighbours' labels, as many as fit. Where the
        positives alone exceed it, the points pair with their positives and the model's hard negatives only (no
        neighbour search), each row keeping its f largest values, f = cap / (points x (positives + hard negatives per
        point)); the ranker is skipped only where not one feature a pair fits, or no negative is left to pair. Dense
        rows cost their full width per pair, so wide dense inputs on many points meet the bound first.

        Why narrow rather than skip: at 10^5 labels (the scale benchmark's 200k points) 100 negatives a point would be
        10^9 entries; narrowed to 15, the ranker lifted P@3 by 3.6 and P@5 by 6.0 over the model, and xc passed PECOS
        on P@1, P@3 and P@5 (docs/accuracy_synthetic.md). A skipped ranker is the whole of that lost. At 10^7 labels
        the positives alone are 2.2e8 entries: the cut rows keep each point's rarest features (docs/scale_1e7.md).
        The hard negatives are counted only where no neighbours' labels are paired (else their repeats stand in)."""
        if "_size" not in self.__dict__:  # decided (and logged) once per evaluator
            self._size = self._ranker_size()
        return self._size

    def _ranker_size(self) -> RankerSize | None:
        features, labels = self.dataset.train.features, self.dataset.train.labels
        if not self.rc.enabled or features is None or features.num_rows == 0:
            return None
        n = features.num_rows
        positives, per_row = labels.nnz / n, features.nnz / n
        cap, negatives = self.rc.max_pair_features, self.rc.negatives
        if not cap or n * (negatives + positives) * per_row <= cap:
            return RankerSize(negatives)
        fit = int(cap / (n * per_row) - positives)
        if fit >= 1:
            log.info("lexical ranker: %d of the neighbours' labels a point instead of %d, to stay within "
                     "eval.ranker.max_pair_features=%.2g (pair, feature) entries", fit, negatives, cap)
            return RankerSize(fit)
        hard = self.rc.hard_negatives if any(m.hard_negatives is not None for m in self.models) else 0
        row_features = int(cap / (n * (positives + hard)))
        if not hard or row_features < 1:
            log.info("lexical ranker skipped: its positives alone are about %.2g (pair, feature) entries, over "
                     "eval.ranker.max_pair_features=%.2g, and %s", n * positives * per_row, cap,
                     "the run has no hard negatives to pair" if not hard else "not one feature a pair fits")
            return None
        log.info("lexical ranker: its positives alone are about %.2g (pair, feature) entries, over "
                 "eval.ranker.max_pair_features=%.2g: each point pairs with its positives and %d hard negatives, each "
                 "row keeping its %d largest of about %.0f features", n * positives * per_row, cap, hard,
                 row_features, per_row)
        return RankerSize(0, row_features)

    def encode(self, inputs_of, rows: np.ndarray) -> list[torch.Tensor]:
        """Each model's (len(rows), d_m) embeddings; inputs_of(m) gives model m's InputFn."""
        return [model.scorer.encode(inputs_of(model), rows) for model in self.models]

    def neighbours(self, query_split, rows: np.ndarray, embs: list[torch.Tensor], memory_rows: np.ndarray,
                   spaces: list[str] | None = None) -> dict[str, list[Neighbours]]:
        """{"input": [shared neighbours], "embedding": [one per model]}, the spaces searched for `spaces` (default:
        every space the config tries)."""
        spaces = self.spaces if spaces is None else spaces
        found: dict[str, list[Neighbours]] = {}
        if any(s in ("input", "both") for s in spaces):
            queries = input_vectors(query_split.features, self.weights, rows)
            memory = input_vectors(self.dataset.train.features, self.weights, memory_rows)
            found["input"] = [sparse_neighbours(queries, memory, self.max_k)]
        if any(s in ("embedding", "both") for s in spaces):
            found["embedding"] = [model.embedding_neighbours(emb, memory_rows, self.max_k)
                                  for model, emb in zip(self.models, embs)]
        return found

    def votes(self, space: str, k: int, found: dict[str, list[Neighbours]],
              memory_rows: np.ndarray) -> LabelVotes | MixedVotes:
        memory = labels_csr(self.dataset.train.labels, memory_rows)
        L = self.dataset.num_labels
        if space == "input":
            return votes_for(found["input"][0], k, memory, L)
        per_model = [votes_for(n, k, memory, L) for n in found["embedding"]]
        if space == "both":
            shared = votes_for(found["input"][0], k, memory, L)
            per_model = [MixedVotes([shared, v]) for v in per_model]
        return per_model[0] if len(per_model) == 1 else MixedVotes(per_model)

    def exact_tops(self, embs: list[torch.Tensor], width: int | None = None,
                   queries: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each model's exact top `width` (scores (n, w), ids (n, w)), computed once for many candidate sets;
        `queries`: each model's (InputFn, rows) its embeddings came from (a model's lexical weights read them)."""
        width = max(self.width, width or 0)
        queries = queries or [None] * len(self.models)
        return [model.top(emb, width, q) for model, emb, q in zip(self.models, embs, queries)]

    def candidates(self, embs: list[torch.Tensor], votes, width: int | None = None,
                   tops: list[np.ndarray] | None = None,
                   found: list[tuple[np.ndarray, np.ndarray]] | None = None, queries: list | None = None) -> Candidates:
        """Every model's top `width` (exact: `found` from `exact_tops`, searched here when None; or the given
        `tops` (n, w) ids, e.g. from ANN indexes) and the vote's top `width` (none when `votes` is None), each
        scored by every model, averaged. A model's own exact top keeps the scores its search gave; the other
        blocks are scored block by block."""
        width = max(self.width, width or 0)
        exact = tops is None
        queries = queries or [None] * len(self.models)
        if exact and found is None:
            found = self.exact_tops(embs, width, queries)
        blocks = [ids for _, ids in found] if exact else list(tops)
        if votes is not None:
            blocks.append(votes.top(width)[1])
        ids = drop_repeats(np.concatenate(blocks, 1))
        p = np.zeros(ids.shape, np.float64)
        model_scores = []
        for m, (model, emb) in enumerate(zip(self.models, embs)):
            parts, at = [], 0
            for b, block in enumerate(blocks):
                kept = ids[:, at:at + block.shape[1]]
                parts.append(found[m][0] if exact and b == m else model.scorer.scores_of(emb, kept,
                                                                                          queries=queries[m]))
                at += block.shape[1]
            scores = np.where(ids >= 0, np.concatenate(parts, 1), -np.inf)
            p += np.where(ids >= 0, model.scorer.probabilities(scores), 0.0)
            model_scores.append(scores)
        votes_of = np.zeros(ids.shape, np.float32) if votes is None else votes.lookup(ids)
        return Candidates(ids, (p / len(self.models)).astype(np.float32), votes_of, tuple(model_scores),
                          self.models[0].scorer.loss)

    def fit_ranker(self, train_ids: np.ndarray | None = None, models: list[ModelMemory] | None = None) -> LexicalRanker:
        """This rank's part of a lexical ranker trained on training points `train_ids` (default: the points that
        trained the first model, its validation split held out), with the hard negatives of `models` (default: the
        first; a cross-fitted fold's ranker takes its own member's only)."""
        train_ids = self.models[0].train.train_ids if train_ids is None else train_ids
        models = self.models[:1] if models is None else models
        own = models[0].trained_ranker if len(models) == 1 else None
        if own is not None and self.ctx.world_size == 1 and np.array_equal(train_ids, models[0].train.train_ids):
            log.info("lexical ranker: the one its model's own run trained on these points, reused")
            return own()  # the same problem solved the same way: one process owns every block
        x = input_vectors(self.dataset.train.features, self.weights, train_ids)
        y = labels_csr(self.dataset.train.labels, train_ids)
        y.data[:] = 1.0
        tables = [m.hard_negatives[train_ids] for m in models if m.hard_negatives is not None]
        params = RankerParams.of(self.rc, self.ranker_size())
        return fit_ranker(x, y, params, self.ctx.rank, self.ctx.world_size, threads=torch.get_num_threads(),
                          hard_negatives=np.concatenate(tables, axis=1) if tables else None,
                          progress=self.ctx.rank == 0)

    def ranked(self, x, ids: np.ndarray, ranker: LexicalRanker | None = None) -> np.ndarray:
        """The lexical ranker's (default: the one fused at test) probabilities (n, c) of label ids (n, c) for query
        rows x (n, F) (`input_vectors`); every rank calls it (the ranks' parts are summed); 0 at pads."""
        part = (ranker or self.ranker).score_part(x, ids)
        if self.ctx.active:
            part = all_reduce(torch.from_numpy(part), self.ctx).numpy()
        return np.where(ids >= 0, sigmoid(part), 0.0).astype(np.float32)

    def with_ranker(self, cands: Candidates, x) -> Candidates:
        return replace(cands, ranked=self.ranked(x, cands.ids))

    def ranked_over_grid(self, grid: dict, parts: list[tuple]) -> dict:
        """{key: the ranker's probabilities (n, c) of grid[key].ids, 0 at pads} for candidates of stacked folds, each
        fold's rows (x_f (n_f, F), in order) scored by its own ranker_f, each distinct (row, label) pair scored once:
        the grid's entries share most of their candidates (every entry holds the model's own top), and scoring them
        entry by entry took 13 s of debian-deps' choice."""
        num_labels = self.dataset.num_labels
        ids = {key: c.ids for key, c in grid.items()}
        n = next(iter(ids.values())).shape[0]
        row = np.arange(n, dtype=np.int64)[:, None]
        pairs = unique_ints(np.concatenate([(row * num_labels + i)[i >= 0] for i in ids.values()]))
        if not len(pairs):
            return {key: np.zeros(i.shape, np.float32) for key, i in ids.items()}
        rows, labels = pairs // num_labels, pairs % num_labels
        starts = np.searchsorted(rows, np.arange(n + 1))
        slot = np.arange(len(pairs)) - starts[rows]
        padded = np.full((n, max(1, int(np.diff(starts).max(initial=0)))), -1, np.int64)
        padded[rows, slot] = labels
        probs, at = np.zeros(padded.shape, np.float32), 0
        for x, ranker in parts:
            probs[at:at + x.shape[0]] = self.ranked(x, padded[at:at + x.shape[0]], ranker)
            at += x.shape[0]
        scores = probs[rows, slot]
        out = {}
        for key, i in ids.items():
            where = np.searchsorted(pairs, row * num_labels + np.maximum(i, 0))
            out[key] = np.where(i >= 0, scores[np.minimum(where, len(pairs) - 1)], 0.0).astype(np.float32)
        return out

    def model(self, i: int) -> FusionEvaluator:
        """Model i alone, as an ensemble of one (its scorer and spaces are shared, not rebuilt)."""
        one = object.__new__(FusionEvaluator)
        one.__dict__.update(self.__dict__, models=[self.models[i]])
        return one

    def validation_folds(self) -> list[np.ndarray]:
        """The held-out rows: one split shared by every model, or each member's own fold (cross-fitted)."""
        folds = [model.train.valid_ids for model in self.models]
        return folds[:1] if all(np.array_equal(folds[0], f) for f in folds[1:]) else folds

    def _validation_grid(self) -> dict[tuple[str, int], Candidates]:
        """{(space, k): candidates of the held-out rows}: the averaged models on a shared split, the memory being
        the points that trained them."""
        train = self.models[0].train
        valid_rows, memory_rows = train.valid_ids, train.train_ids
        embs = self.encode(lambda model: model.train.split_inputs, valid_rows)
        queries = [(model.train.split_inputs, valid_rows) for model in self.models]
        found = self.neighbours(self.dataset.train, valid_rows, embs, memory_rows)
        tops = self.exact_tops(embs, queries=queries)
        return {(space, k): self.candidates(embs, self.votes(space, k, found, memory_rows), found=tops, queries=queries)
                for space in self.spaces for k in self.fc.ks}

    def choose_on_validation(self) -> tuple[FusionChoice, list]:
        """The fixed choice when `eval.knn_fusion` gives lam (or is off: lam 0), else the best grid point on
        the held-out rows: the models' shared split, or (cross-fitted members) every member's own fold, each
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
            parts = [self.model(i)._validation_grid() for i in range(len(self.models))]
            grid = {key: stack_candidates([p[key] for p in parts]) for key in parts[0]}
        rows = np.concatenate(folds)
        # kept for the score calibration (xc/fitting/final_eval.py `served_scores`): the held-out rows as served
        self.validation_grid, self.validation_ranked = (rows, grid), None
        indptr, indices = true_labels(self.dataset.train.labels, rows)

        def metric(ids: np.ndarray) -> float:
            return float(np.mean(list(precision_at_k(ids, indptr, indices, self.ks).values())))

        choice, tried = choose(grid, fc.lambdas, max(self.ks), metric, fc.temperatures)
        if self.rc.gamma != 0.0 and self.ranker_size() is not None:
            choice, tried = self._choose_ranker_weight(grid, choice, tried, metric, len(folds) > 1)
        return choice, tried

    def _choose_ranker_weight(self, grid: dict[tuple[str, int], Candidates], choice: FusionChoice, tried: list,
                              metric, crossfit: bool = False) -> tuple[FusionChoice, list]:
        """(space, k, lam, gamma) on the held-out rows at the chosen T, the ranker trained here; ties keep the
        earlier grid entry, the smaller gamma, then the smaller lam (gamma = 0 is the choice without the ranker).
        Space and k are chosen again because the vote that best complements the model alone is not the one that
        best complements the model and the ranker (debian-deps seed 0: k 50 rather than 20, validation 48.30
        against 48.11). Cross-fitted members (`crossfit`): each member's fold is scored by a ranker trained on that
        member's training points, as its model was, and the ranker fused at test, trained once gamma > 0 is
        chosen, learns from every training point, as the ensemble did."""
        start = time.perf_counter()
        if crossfit:
            folds = [(m.train.valid_ids, self.fit_ranker(m.train.train_ids, [m])) for m in self.models]
        else:
            self.ranker = self.fit_ranker()
            folds = [(self.models[0].train.valid_ids, self.ranker)]
        fixed = self.rc.gamma is not None
        best, best_value = choice, (-np.inf if fixed else max(t["value"] for t in tried))
        parts = [(input_vectors(self.dataset.train.features, self.weights, rows), ranker)  # once for every entry
                 for rows, ranker in folds]
        ranked = self.validation_ranked = self.ranked_over_grid(grid, parts)
        for (space, k), plain in grid.items():
            cands = replace(plain.at_temperature(choice.temperature), ranked=ranked[(space, k)])
            for gamma in [self.rc.gamma] if fixed else sorted(g for g in self.rc.gammas if g > 0):
                for lam in sorted(self.fc.lambdas):
                    value = metric(cands.fuse(lam, max(self.ks), gamma)[1])
                    tried.append({"space": space, "k": k, "temperature": choice.temperature,
                                  "lambda": lam, "gamma": gamma, "value": value})
                    if value > best_value + 1e-9:
                        best = replace(choice, space=space, k=k, lam=lam, gamma=gamma, ranker_parts=self.ctx.world_size)
                        best_value = value
        if crossfit and best.gamma:
            self.ranker = self.fit_ranker(np.arange(self.dataset.train.num_points, dtype=np.int64), self.models)
        log.info("lexical ranker: gamma %.2f, lambda %.2f, k %d, %s space (validation mean P@k %.2f; trained and "
                 "chosen in %.1fs)", best.gamma, best.lam, best.k, best.space, 100 * best_value,
                 time.perf_counter() - start)
        return best, tried

    def fused(self, choice: FusionChoice, query_split, rows: np.ndarray, embs: list[torch.Tensor],
              width: int | None = None, queries: list | None = None,
              memory_rows: np.ndarray | None = None) -> Candidates:
        """Candidates of queries `rows` of `query_split` (anything with `.features`, a SparseMatrix or None);
        memory = training points `memory_rows` (default every one). `width` (default: the configured one) is raised
        to at least it."""
        if memory_rows is None:
            memory_rows = np.arange(self.dataset.train.num_points, dtype=np.int64)
        found = self.neighbours(query_split, rows, embs, memory_rows, [choice.space])  # the chosen space only
        cands = self.candidates(embs, self.votes(choice.space, choice.k, found, memory_rows), width, queries=queries)
        cands = cands.at_temperature(choice.temperature)
        if not choice.gamma:
            return cands
        return self.with_ranker(cands, input_vectors(query_split.features, self.weights, rows))

    def test_metrics(self, choice: FusionChoice, rows: np.ndarray) -> dict[str, float]:
        """Metrics on test rows (rank 0; {} elsewhere): the fused models under the plain keys, `model/...`
        (lam 0: the averaged models) and `knn/...` (lam 1: the averaged votes) beside them, and the fused P@k's
        gain over the models' paired over the points with its standard error (`over_model/P@k`,
        `over_model_se/P@k`, in points). The fused top-k (scores, ids) stay in `self.test_predictions` (for
        `xc-eval --predictions`), the candidates in `self.test_candidates`."""
        dataset = self.dataset
        embs = self.encode(lambda model: model.test_inputs, rows)
        cands = self.fused(choice, dataset.test, rows, embs, queries=[(model.test_inputs, rows) for model in self.models])
        self.test_predictions = cands.fuse(choice.lam, self.topk, choice.gamma)
        self.test_candidates = cands
        if not self.models[0].ctx.is_main:
            return {}
        indptr, indices = true_labels(dataset.test.labels, rows)
        topk, inv = max(self.topk, max(self.ks)), self.models[0].inv_propensity

        def score(of: Candidates, lam: float, gamma: float = 0.0) -> dict[str, float]:
            return evaluate_metrics(of.fuse(lam, topk, gamma)[1], indptr, indices, inv, ks=self.ks)

        out = score(cands, choice.lam, choice.gamma)
        out.update({f"model/{k}": v for k, v in score(cands, 0.0).items()})
        # what serving adds to the model, paired over the same points (the model alone carries the rest)
        served, alone = (hits_per_point(cands.fuse(lam, topk, gamma)[1], indptr, indices)
                         for lam, gamma in ((choice.lam, choice.gamma), (0.0, 0.0)))
        for k in self.ks:
            gain, se = paired_gain(served[:, :k].mean(1), alone[:, :k].mean(1))
            out.update({f"over_model/P@{k}": gain, f"over_model_se/P@{k}": se})
        out.update({f"knn/{k}": v for k, v in score(cands, 1.0).items()})
        if choice.gamma:  # the ranker alone re-ranking the same candidates: 1 * sigmoid(r)
            alone = replace(cands, p_model=np.ones_like(cands.p_model))
            out.update({f"ranker/{k}": v for k, v in score(alone, 0.0, 1.0).items()})
        return out

    def predict(self, choice: FusionChoice, features, embs: list[torch.Tensor], k: int,
                queries: list | None = None, memory_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(fused scores (n, k), ids (n, k)) of new queries with feature rows `features` (None: embedding space);
        `queries` as `exact_tops` takes them; `memory_rows` as `fused`."""
        rows = np.arange(len(embs[0]), dtype=np.int64)
        cands = self.fused(choice, SimpleNamespace(features=features), rows, embs, k, queries, memory_rows)
        return cands.fuse(choice.lam, k, choice.gamma)

    def use_saved_ranker(self, run_dir, choice: FusionChoice) -> None:
        """The ranker training saved (RUN_DIR/ranker/), where `choice` fuses one, for serving in this process."""
        if choice is not None and choice.gamma:
            self.ranker = LexicalRanker.load(run_dir, choice.ranker_parts)
            if self.ctx.rank != 0:  # rank 0 holds every label; the ranks' scores are summed
                self.ranker.owned[:] = False

