"""Classifier rows started at their labels' training points (`model.classifier_init: centroid`, and `auto` where
labels have under one training point on average).

    w_l = s * unit(sum_{i : l in y_i} e(x_i)) / mean_i |e(x_i)|        (labels with training rows; others random)

e is the query encoder as initialised (eval mode: no dropout), over every training row that trains the model
(the validation points never). At the first step the model then scores a query by s * cos(e(x), centroid_l) *
|e(x)| / mean |e|: a centroid classifier in the encoder's space, which for a bag-of-words encoder (a random
projection of the tf-idf) ranks as a similarity-weighted vote of the training points that carry the label.

Why: a step updates only the rows of the labels it samples, so where labels have few training points a row
learns from its positives once an epoch; started at random, the 10^6- and 10^7-label models spend their first
epochs finding the direction its few positives already give (docs/row_init.md has the figures). Started at the
centroid, training refines a ranking that is already the kNN's, rather than building it.

The scale s = 2 ln C, C the candidates a query's loss sees (the sampler's positives, hard and random negatives;
every label for a full loss): a positive whose cosine with the query exceeds the negatives' by 0.5 then takes
about half the softmax mass over C. Smaller scales leave the first Adagrad steps (lr sqrt(d) long) to overwrite
the direction; larger ones change little (docs/row_init.md).

The ranks share the encoding, every rank gathers every training row's embedding and sets its own labels [lo, hi), so
the rows do not depend on the shard layout (the same values as one process; tests/unit/train/test_row_init.py). A
resumed run loads its checkpoint's rows over these.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import scipy.sparse as sp
import torch

from xc.distributed import DistContext
from xc.eval.inference import encode_rows

log = logging.getLogger(__name__)

ENCODE_BLOCK = 8192  # training rows a rank encodes at a time
LABEL_BLOCK = 1 << 16  # labels whose sums are formed at a time: (LABEL_BLOCK, d) float32


# model.classifier_init=auto starts the rows at their centroids below this many positives a label on average
CENTROID_BELOW_POSITIVES = 1.0


def rows_start_at_centroids(choice: str, label_counts: np.ndarray) -> bool:
    """`model.classifier_init` resolved: auto is centroid where the training points' positives per label
    (label_counts (L,): each label's training points) average under CENTROID_BELOW_POSITIVES; logged."""
    if choice != "auto":
        return choice == "centroid"
    per_label = float(np.sum(label_counts, dtype=np.float64)) / max(1, len(label_counts))
    centroid = len(label_counts) > 0 and per_label < CENTROID_BELOW_POSITIVES
    log.info("model.classifier_init=auto: %s (%.3g positives a label on average, %s %g: a row sees %s one positive "
             "an epoch)", "centroid" if centroid else "random", per_label, "under" if centroid else "at least",
             CENTROID_BELOW_POSITIVES, "under" if centroid else "at least")
    return centroid


def centroid_scale(candidates: int) -> float:
    """s = 2 ln C: the row norm (relative to the mean embedding norm) at which a cosine margin of 0.5 over the
    C - 1 other candidates gives the positive half the softmax mass."""
    return 2.0 * math.log(max(2, candidates))


def label_point_matrix(train, lo: int, hi: int) -> sp.csr_matrix:
    """(hi - lo, num_rows) 0/1 CSR: row l - lo marks the training rows that carry label l."""
    n = train.num_rows
    indptr, indices = train.labels(np.arange(n, dtype=np.int64))
    owner = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    keep = (indices >= lo) & (indices < hi)
    return sp.csr_matrix((np.ones(int(keep.sum()), np.float32), (indices[keep] - lo, owner[keep])),
                         shape=(hi - lo, n))


@torch.no_grad()
def centroid_rows(encoder, train, shard, scale: float, ctx: DistContext, label_bias: bool = False,
                  batch_size: int = ENCODE_BLOCK) -> int:
    """Set the rows of `shard` (ClassifierShard, labels [lo, hi)) whose labels have training rows to
    scale * unit(sum of their embeddings) / mean embedding norm; returns how many were set. With `label_bias` the
    embedding's last coordinate is the constant 1: the rows' bias column starts at 0 and the direction is the rest.
    `batch_size`: training rows encoded at a time (the run passes `sampler.mining_batch_size`, what the refresh encodes
    its queries with: a transformer pads a batch to its longest text, so 8,192 texts at once ran at nearly max_len)."""
    t0 = time.time()
    # the ranks split the encoding and each gathers every row (xc.eval.inference.encode_rows, eval mode)
    emb = encode_rows(encoder, train.inputs, np.arange(train.num_rows, dtype=np.int64), batch_size, ctx).numpy()
    real_hi = min(shard.hi, shard.num_labels)
    if real_hi <= shard.lo or emb.shape[0] == 0:
        return 0
    width = emb.shape[1] - int(label_bias)
    mean_norm = float(np.linalg.norm(emb[:, :width], axis=1).mean())
    if not mean_norm > 0:  # an encoder that maps everything to 0 gives no direction
        log.warning("classifier rows: the encoder's initial embeddings are all zero; rows keep their random start")
        return 0
    members = label_point_matrix(train, shard.lo, real_hi)
    done = 0
    for a in range(0, real_hi - shard.lo, LABEL_BLOCK):
        sums = np.asarray(members[a:a + LABEL_BLOCK] @ emb, dtype=np.float32)  # (b, d)
        sums[:, width:] = 0.0
        norms = np.linalg.norm(sums, axis=1)
        have = np.nonzero(norms > 0)[0]
        if have.size:
            rows = sums[have] * (scale / mean_norm / norms[have])[:, None]
            shard.write_rows(torch.from_numpy(have + a), torch.from_numpy(rows).to(shard.weight.device), 0)
            done += int(have.size)
    log.info("classifier rows: %d of labels [%d, %d) start at their %d training rows' mean embedding (scale %.2f = "
             "model.classifier_init_scale or 2 ln C, over a mean embedding norm of %.3g; the others at random; "
             "model.classifier_init=random starts them all at random) in %.1fs",
             done, shard.lo, real_hi, train.num_rows, scale, mean_norm, time.time() - t0)
    return done
