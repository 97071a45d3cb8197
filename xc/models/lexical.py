"""LexicalRows: a sparse weight vector per label over the input features, scored beside the classifier rows.

A label's score is <phi(x), w_l> + sum_s v[l, s] x[f[l, s]]: the dense row of the classifier plus S weights on
the label's own support f[l, :], the S features with the largest summed input value (tf-idf, L2-normalised a
row, as the encoder reads it) over the label's training points, fixed before training. The dense rows are
shared capacity: at 10^6 labels with a handful of points each, a 1024-wide embedding does not keep what tells
a label with one or two points apart (docs/negatives_that_pay.md, "Where the model's P@3 gap lies"), while the
label's own features do. The combination of the two is what XR-Transformer's final ranker learns on the
concatenation of tf-idf and neural features ("Fast Multi-Resolution Transformer Fine-tuning for Extreme
Multi-label Text Classification"); here both parts train together, in the same step, on the same candidates.

The values live in a ClassifierShard of width S (zeros at the start, float32), so the row optimiser
(xc.train.optim.SparseRowSGD), its checkpoints and its accumulators serve them as they serve the rows.
A step costs O(B x C x S) for the per-query candidates and O(B x c x S) for a shared pool, whatever L.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from xc.arrays import csr_rows, find_sorted
from xc.models.classifier import ClassifierShard
from xc.models.lexical_rank import FeatureLists, lexical_of, rerank_block_each, sorted_queries

# labels whose supports are summed at a time
_SUPPORT_LABELS = 1 << 18
# sparse lexical scores held at once in inference (8 B each: 256 MiB)
_SCORE_ENTRIES = 1 << 25


def label_supports(features: sp.csr_matrix, labels: sp.spmatrix, lo: int, hi: int, width: int,
                   sums: np.ndarray | None = None, explained: sp.csr_matrix | None = None) -> np.ndarray:
    """(hi - lo, width) int32: for each label in [lo, hi), the `width` features with the largest summed value
    over the training points carrying it, largest first (ties to the lower feature id); -1 pads a label with
    fewer features (or no training point). `sums`, where given ((hi - lo, width) float32), receives those summed
    values (0 at the pads).

    features (N, F) the training points' inputs as the encoder reads them; labels (N, >= hi) their labels. Labels
    are summed a block at a time (a block's sums: about its labels' positives x features a point, 12 B each).
    `explained` ((N, F), `explained_inputs`): each label's summed value of a feature is its share of it instead, the
    label's mean value times its sum of `explained` (one EM step of a mixture of the points' labels)."""
    out = np.full((hi - lo, width), -1, dtype=np.int32)
    if sums is not None:
        sums[:] = 0.0
    by_label = sp.csc_matrix(labels[:, lo:hi], dtype=np.float64)
    for start in range(0, hi - lo, _SUPPORT_LABELS):
        block = by_label[:, start:start + _SUPPORT_LABELS]
        totals = (block.T.tocsr() @ features).tocsr()  # (labels in the block, F)
        totals.sum_duplicates()
        if explained is not None:
            totals.data = _explained_totals(totals, block, explained)
        rows = np.repeat(np.arange(totals.shape[0]), np.diff(totals.indptr))
        order = np.lexsort((totals.indices, -totals.data, rows))  # by row, then value descending, then feature id
        rank = np.arange(order.size) - totals.indptr[rows[order]]
        keep = rank < width
        out[start + rows[order[keep]], rank[keep]] = totals.indices[order[keep]]
        if sums is not None:
            sums[start + rows[order[keep]], rank[keep]] = totals.data[order[keep]]
    return out


def _row_keys(m: sp.csr_matrix, width: int) -> np.ndarray:
    """(nnz,) int64 row * width + column of a CSR matrix's entries: sorted where its indices are."""
    return np.repeat(np.arange(m.shape[0], dtype=np.int64), np.diff(m.indptr)) * width + m.indices


def _explained_totals(totals: sp.csr_matrix, block: sp.csc_matrix, explained: sp.csr_matrix) -> np.ndarray:
    """(nnz of totals,) float64: totals[l, f] / n_l * (block^T explained)[l, f], the shares of a block's labels."""
    width = totals.shape[1]
    mean = totals.data / np.maximum(np.repeat(np.diff(block.indptr), np.diff(totals.indptr)), 1)
    share = (block.T.tocsr() @ explained).tocsr()
    share.sum_duplicates()
    at, found = find_sorted(_row_keys(share, width), _row_keys(totals, width))
    return np.where(found, mean * share.data[at] if share.nnz else 0.0, 0.0)


def explained_inputs(features: sp.csr_matrix, labels: sp.spmatrix) -> sp.csr_matrix:
    """(N, F) float64 with the pattern of `features`: x[p, f] / (sum over p's labels l of mean_l[f] + b[f]), where
    mean_l is label l's training points' mean input and b the mean input over every point (what no label explains).

    A label's summed inputs over its points count every feature of those points, the features its co-occurring
    labels put there too; with one or two points a label, those are most of its sum. Summed through this
    (`label_supports(..., explained=)`), a label keeps of each feature its share mean_l[f] / (sum of the point's
    labels' means + b[f]): the features a frequent co-label explains go mostly to it. One EM step of a mixture of
    the points' labels and a background, started at the plain means. Needs non-negative inputs (a ValueError
    otherwise). Works a block of labels at a time, as `label_supports` does."""
    features = sp.csr_matrix(features, copy=True)
    features.sum_duplicates()
    features.eliminate_zeros()  # so that every (label, feature) pair a point gives has a nonzero total
    if features.nnz and features.data.min() < 0:
        raise ValueError("the explained start needs non-negative inputs")
    by_label = sp.csc_matrix(labels, dtype=np.float64)
    num_features, positions = features.shape[1], np.arange(features.nnz, dtype=np.int64)
    predicted = np.zeros(features.nnz)
    for start in range(0, by_label.shape[1], _SUPPORT_LABELS):
        block = by_label[:, start:start + _SUPPORT_LABELS]
        totals = (block.T.tocsr() @ features).tocsr()
        totals.sum_duplicates()
        means = totals.data / np.maximum(np.repeat(np.diff(block.indptr), np.diff(totals.indptr)), 1)
        # every (point, label in the block, feature of the point): where the point's entry lies in `features`
        label_of_pair = np.repeat(np.arange(block.shape[1], dtype=np.int64), np.diff(block.indptr))
        pair_ptr, pos = csr_rows(features.indptr, positions, block.indices)
        keys = np.repeat(label_of_pair, np.diff(pair_ptr)) * num_features + features.indices[pos]
        at = np.searchsorted(_row_keys(totals, num_features), keys)  # every key is there: totals sums these pairs
        predicted += np.bincount(pos, weights=means[at], minlength=features.nnz)
    background = np.asarray(features.sum(axis=0)).ravel() / max(features.shape[0], 1)
    denominator = predicted + background[features.indices]
    out = sp.csr_matrix((np.divide(features.data, denominator, out=np.zeros(features.nnz), where=denominator > 0),
                         features.indices.copy(), features.indptr.copy()), shape=features.shape)
    return out


def centroid_weights(sums: np.ndarray, scale: float) -> np.ndarray:
    """(n, S) float32 start of the weights from their supports' summed values `sums` (n, S): each label's sums
    scaled to norm `scale` (a label without training points stays 0). A query x then scores a label
    scale * <x_f, unit(sum of its points' x_f)> on its support f: for its one training point, scale times the norm
    of the point's tf-idf on those features."""
    out = np.asarray(sums, dtype=np.float32)  # float32 sums are scaled in place: at 10^7 labels and S = 32, 1.2 GiB
    norms = np.linalg.norm(out, axis=1)
    out *= np.where(norms > 0, scale / np.maximum(norms, 1e-30), 0.0).astype(np.float32)[:, None]
    return out


def csr_of_inputs(batches) -> sp.csr_matrix:
    """Stack encoder input dicts ({"feat_ids", "feat_offsets", "feat_values"}, xc.data.inputs.sparse_inputs) into
    one CSR matrix; `batches` yields (dict, num_features)."""
    parts = []
    for batch, num_features in batches:
        ids, offsets, values = (batch[k].numpy() for k in ("feat_ids", "feat_offsets", "feat_values"))
        indptr = np.append(offsets, ids.size)
        parts.append(sp.csr_matrix((values, ids, indptr), shape=(offsets.size, num_features)))
    return sp.vstack(parts, format="csr")


class BatchFeatures:
    """A batch's sparse inputs laid out for lookups: dense (B, U + 1) over the U distinct features it holds (the
    last column zeros, where a label's support misses the batch), and those features sorted (U,)."""

    def __init__(self, feat_ids: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, batch_size: int,
                 lookup: torch.Tensor | None = None):
        self.features, column = torch.unique(feat_ids, return_inverse=True)
        self.lookup = lookup
        lengths = torch.diff(torch.cat([offsets, offsets.new_tensor([feat_ids.numel()])]))
        row = torch.repeat_interleave(torch.arange(batch_size, device=feat_ids.device), lengths)
        self.dense = torch.zeros(batch_size, self.features.numel() + 1, device=values.device)
        self.dense.index_put_((row, column), values.float(), accumulate=True)

    def columns(self, support: torch.Tensor) -> torch.Tensor:
        """support (U, S) feature ids (-1 pads) -> (U, S) int64 columns of `dense` (the zero column where absent)."""
        feats = support.long()
        if self.features.numel() == 0:
            return torch.zeros_like(feats)
        if self.lookup is not None:  # (F + 1,) all "absent" (-1 pads read the last entry): set, read, reset
            absent = self.lookup[-1].item()
            self.lookup[self.features] = torch.arange(self.features.numel(), device=feats.device)
            found = self.lookup[feats]
            self.lookup[self.features] = absent
            return torch.where(found == absent, self.features.numel(), found)
        pos = torch.searchsorted(self.features, feats.clamp(min=0)).clamp(max=self.features.numel() - 1)
        hit = (self.features[pos] == feats) & (feats >= 0)
        return torch.where(hit, pos, self.features.numel())

    def pair_scores(self, columns: torch.Tensor, values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """Per-query candidates: columns, values (U, S) of the gathered labels; inverse (B, C) -> scores (B, C)."""
        batch, cand = inverse.shape
        flat = inverse.reshape(-1)
        width = columns.shape[1]
        x = self.dense.gather(1, columns.index_select(0, flat).view(batch, cand * width)).view(batch, cand, width)
        return (x * values.index_select(0, flat).view(batch, cand, width)).sum(-1)

    def shared_scores(self, columns: torch.Tensor, values: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        """Labels every query scores (a shared pool): picks (c,) into columns, values (U, S) -> scores (B, c).
        Only the support features the batch holds are read: a pool's (B, c, S) block would be mostly zeros."""
        cols = columns.index_select(0, picks)  # (c, S)
        present = cols != self.features.numel()
        label, slot = present.nonzero(as_tuple=True)
        weights = values.index_select(0, picks)[label, slot]  # (K,)
        contrib = self.dense.index_select(1, cols[label, slot]) * weights  # (B, K)
        return contrib.new_zeros(self.dense.shape[0], picks.numel()).index_add(1, label, contrib)


class LexicalRows:
    """support (hi - lo, S) int32 feature ids (-1 pads) of labels [lo, hi); values a ClassifierShard (hi - lo, S)
    of their weights, float32 (zeros at the start, or their labels' centroids: `build`)."""

    def __init__(self, support: torch.Tensor, values: ClassifierShard, num_features: int):
        if tuple(support.shape) != (values.num_rows, values.dim):
            raise ValueError(f"support {tuple(support.shape)} does not match the values' "
                             f"({values.num_rows}, {values.dim})")
        self.support, self.values, self.num_features = support, values, num_features
        # feature id -> column of a batch's features, -1 (absent) between steps (BatchFeatures.columns)
        self.lookup = torch.full((num_features + 1,), -1, dtype=torch.int64, device=support.device)
        self._by_feature: FeatureLists | None = None
        self._by_feature_version: tuple[int, int] | None = None

    @classmethod
    def build(cls, support: np.ndarray, lo: int, hi: int, num_labels: int, num_features: int, seed: int,
              device: torch.device, start: np.ndarray | None = None) -> "LexicalRows":
        """`start` (support's shape) float32: the weights' start (xc.models.lexical.centroid_weights); None: 0."""
        values = ClassifierShard(lo, hi, num_labels, support.shape[1], 0.0, seed, device)
        padded = np.full((hi - lo, support.shape[1]), -1, dtype=np.int32)
        padded[:support.shape[0]] = support
        if start is not None and start.size:
            values.weight[:start.shape[0]] = torch.from_numpy(start).to(device=device, dtype=values.weight.dtype)
        return cls(torch.from_numpy(padded).to(device), values, num_features)

    @property
    def width(self) -> int:
        return self.values.dim

    def batch_features(self, inputs: dict[str, torch.Tensor], batch_size: int) -> BatchFeatures:
        """The batch's encoder inputs (feat_ids, feat_offsets, feat_values) laid out for this table's lookups."""
        return BatchFeatures(inputs["feat_ids"], inputs["feat_offsets"], inputs["feat_values"], batch_size,
                             self.lookup)

    def gather(self, unique: torch.Tensor, batch: BatchFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns (U, S) into batch.dense, values (U, S) differentiable leaf) of local labels `unique` (U,)."""
        leaf = self.values.weight.index_select(0, unique).float().detach().requires_grad_(True)
        return batch.columns(self.support.index_select(0, unique)), leaf

    # ------------------------------------------------------------------ inference
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(support (n_real, S) int32, weights (n_real, S) float32) as numpy: views of CPU tensors."""
        n = self.values.num_real_rows
        return self.support[:n].cpu().numpy(), self.values.weight[:n].detach().float().cpu().numpy()

    def by_feature(self) -> FeatureLists:
        """The non-zero weights by feature, largest first (xc/models/lexical_rank.py); rebuilt after training changes
        them (an in-place write bumps a tensor's version counter)."""
        version = (self.values.weight._version, self.support._version)
        if self._by_feature is None or self._by_feature_version != version:
            self._by_feature, self._by_feature_version = FeatureLists.build(*self._arrays(), self.num_features), version
        return self._by_feature

    def forget_inference_cache(self) -> None:
        self._by_feature = None

    def query_scores(self, batch: dict[str, torch.Tensor]) -> sp.csr_matrix:
        """(M, n_real) sparse lexical scores of the queries in `batch` (encoder inputs) for all this shard's labels:
        the reference the ranking is tested against (the ranking itself scores only the labels that can enter)."""
        support, weights = self._arrays()
        keep = (support >= 0) & (weights != 0)
        by_feature = sp.csr_matrix((weights[keep], (support[keep].astype(np.int64), np.nonzero(keep)[0])),
                                   shape=(self.num_features, support.shape[0]))
        return (csr_of_inputs([(batch, self.num_features)]) @ by_feature).tocsr()

    def pair_scores(self, batch: dict[str, torch.Tensor], ids: np.ndarray) -> np.ndarray:
        """(M, c) float32 lexical scores of given global label ids (M, c) for the queries of `batch`; ids outside
        this shard's labels (and -1 pads) score 0."""
        queries = sorted_queries(csr_of_inputs([(batch, self.num_features)]))
        support, weights = self._arrays()
        lo = self.values.lo
        rows, cols = np.nonzero((ids >= lo) & (ids < lo + support.shape[0]))
        out = np.zeros(ids.shape, np.float32)
        out[rows, cols] = lexical_of(queries, support, weights, rows, ids[rows, cols] - lo)
        return out

    def rerank(self, batch: dict[str, torch.Tensor], embeddings: torch.Tensor, dense_scores: torch.Tensor,
               dense_ids: torch.Tensor, k: int, dense_of) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The top-k (scores, ids) (M, k) of dense + lexical scores for the queries of `batch`, from their dense top
        K' > k (xc/models/lexical_rank.py), and exact (M,) bool: whether that depth settled the query's top k."""
        return self.rerank_each(batch, embeddings, [(dense_scores, dense_ids, dense_of)], k)[0]

    def rerank_each(self, batch: dict[str, torch.Tensor], embeddings: torch.Tensor, rankings: list[tuple], k: int
                    ) -> list[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
        """`rerank` of several dense rankings [(scores (M, K'), ids (M, K'), dense_of)] of the same queries (one
        per label-prior beta), a block of queries at a time: a block's unsettled queries may score every label
        sharing a feature with them (at most `_SCORE_ENTRIES` pairs a block)."""
        queries = csr_of_inputs([(batch, self.num_features)])
        support, weights = self._arrays()
        lists = self.by_feature()
        per_feature = np.diff(lists.ptr)  # labels with a weight on each feature
        starts = np.minimum(queries.indptr[:-1], queries.nnz - 1)
        bound = np.add.reduceat(per_feature[queries.indices], starts) if queries.nnz else None
        ends = query_blocks(bound, queries.indptr, _SCORE_ENTRIES)
        parts: list[list] = [[] for _ in rankings]
        for start, end in zip([0] + ends[:-1], ends):
            block = sorted_queries(queries[start:end])
            ranked = rerank_block_each(block, support, weights, lists, self.values.lo, embeddings[start:end],
                                       [(s[start:end], i[start:end], dense_of) for s, i, dense_of in rankings], k)
            for part, result in zip(parts, ranked):
                part.append(result)
        out = []
        for part, (dense_scores, dense_ids, _) in zip(parts, rankings):
            if not part:
                out.append((dense_scores[:, :k], dense_ids[:, :k], np.ones(dense_ids.shape[0], bool)))
                continue
            out.append((torch.cat([p[0] for p in part]), torch.cat([p[1] for p in part]),
                        np.concatenate([p[2] for p in part])))
        return out

    def state_dict(self) -> dict:
        return {"support": self.support.cpu(), "values": self.values.state_dict()}

    def load_state_dict(self, state: dict, copy=None) -> None:
        """`copy(dst, src)`: as for ClassifierShard.load_state_dict."""
        if tuple(state["support"].shape) != tuple(self.support.shape):
            raise ValueError(f"the checkpoint's lexical support is {tuple(state['support'].shape)}, this run's "
                             f"{tuple(self.support.shape)}")
        (copy or torch.Tensor.copy_)(self.support, state["support"])
        self.values.load_state_dict(state["values"], copy)
        self.forget_inference_cache()


def query_blocks(bound: np.ndarray | None, indptr: np.ndarray, budget: int) -> list[int]:
    """Ends of consecutive query blocks whose summed `bound` (M,) stays within `budget` (a block holds at least one
    query); a query without features (an empty row: reduceat reads the next row's value) bounds at 0."""
    m = indptr.size - 1
    if bound is None or m == 0:
        return [m] if m else []
    bound = np.where(np.diff(indptr) > 0, bound, 0)
    ends, total = [], 0
    for q, b in enumerate(bound.tolist()):
        if total and total + b > budget:
            ends.append(q)
            total = 0
        total += b
    ends.append(m)
    return ends
