"""Synthetic XC data from a known generating model, streamed to memmapped CSR files.

Model (all randomness from ``seed``; rank r = 0 is the most popular label):

1. Label popularity is Zipf: a draw picks rank r with probability proportional to ``(r+1)^-zipf_alpha``;
   a fixed random permutation maps ranks to label ids, so popularity is not visible in the ids.
2. A point draws ``k = 1 + Poisson(avg_labels - 1)`` (capped at ``max_labels``) labels; repeats
   are merged, giving its *generating* labels.
3. Each label has a signature of ``signature_size`` feature ids obtained by hashing (seed, label, j), so
   no label x feature table exists. Each signature feature of each generating label is emitted with
   probability ``signature_keep`` with a term count ``1 + Poisson(0.5)``; then ``Poisson(background_features)``
   background words are drawn from a Zipf(``feature_alpha``) vocabulary with count 1. Repeated feature
   ids in a point are summed. Feature values are these raw term counts (float32).
   With ``family_size`` F > 1, labels l and l' with l // F == l' // F form a family whose members share their
   first ``family_shared`` signature slots (hashed from the family, not the label): siblings are told apart
   only by their other slots, so a sibling of a point's label is a confusable ("hard") negative, as
   near-duplicate labels are in real XC data. F = 1 (the default) leaves every signature the label's own.
   Families take random popularity ranks like any label, so most siblings of a head label are tail labels;
   ``family_adjacent`` = 1 gives each family F adjacent ranks instead (families permuted, members in order), so
   siblings are about as popular as each other: a head label's siblings are head labels, confusable and each
   with data enough to be learned, as a popular product's variants are popular.
   With ``xor_pairs`` = 1 (the non-linear family), labels 2m and 2m+1 are twins over four half-signatures
   A, A', B, B' of pair m: for each point, a fair coin c picks the first half (A if c = 0, else A') and the
   second half is B where c XOR (label & 1) is 0, else B'. Label 2m thus emits A+B or A'+B', label 2m+1
   A+B' or A'+B. Popularity is Zipf over the pairs and twins are equally popular (a point draws a pair, then
   a twin). Every feature then has the same rate under both twins, and so has the label, so a model linear in
   the features scores them alike on average and cannot beat a coin between them, while which halves
   co-occur decides the label: a conjunction a non-linear encoder (or a neighbour vote) can learn.
4. The observed labels drop each generating label independently with probability ``label_noise``
   (like the missing labels of real XC data); nothing is ever added.

Because a dropped label is unpredictable from the features and no other label can be observed, no
predictor beats ``1 - label_noise`` expected P@1. ``meta["oracle_p1"]`` (and p3/p5, in percent) is what
the predictor that knows the generating labels gets on the generated test split when it ranks them
first, most popular first; ``meta["oracle_p1_expected"] = 100 * (1 - label_noise)``. A bag-of-words
encoder with a linear classifier can approach it for labels it has seen often enough (signatures are
linearly separable), so the gap to the oracle measures what the trainer leaves on the table.

Generation works in blocks of ``block_points(params)`` points (about 2M sampled entries each) with
O(nnz) work per block, plus one O(L) and one O(F) table (popularity CDFs and permutations, ~12 bytes
per label or feature): 10^7 labels and 10^7 points need a few hundred MB of RAM.
"""

from __future__ import annotations

import numpy as np

from ..arrays import unique_ints
from ..errors import ConfigError
from .sparse import CSRWriter

GENERATOR_VERSION = 1
_BLOCK_ENTRIES = 1 << 21  # target sampled entries per block; a block's temporaries take ~40 B each
_SIG_STRIDE = 1024  # signature slot j of label l hashes the integer l * _SIG_STRIDE + j

DEFAULTS = dict(
    num_train=20_000, num_test=5_000, num_labels=10_000, num_features=20_000,
    avg_labels=5.0, max_labels=50, zipf_alpha=1.0, label_noise=0.1,
    signature_size=8, signature_keep=0.8, background_features=20.0, feature_alpha=1.0, seed=0,
    family_size=1, family_shared=0, xor_pairs=0, family_adjacent=0,
)
_INTS = {"num_train", "num_test", "num_labels", "num_features", "max_labels", "signature_size", "seed",
         "family_size", "family_shared", "xor_pairs", "family_adjacent"}
# added after version 1 without changing what the defaults generate: left out of the cache key at their defaults,
# so datasets generated before them keep their key
_LATER_KEYS = ("family_size", "family_shared", "xor_pairs", "family_adjacent")


def normalize_params(params: dict | None) -> dict:
    """Fill defaults, coerce types and validate; raises ConfigError naming ``synthetic.<key>``."""
    params = dict(params or {})
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"synthetic.{sorted(unknown)[0]}",
                          f"unknown parameter (known: {', '.join(DEFAULTS)})")
    out = {}
    for key, default in DEFAULTS.items():
        v = params.get(key, default)
        try:
            out[key] = int(v) if key in _INTS else float(v)
        except (TypeError, ValueError):
            raise ConfigError(f"synthetic.{key}", f"not a number: {v!r}") from None
        if key in _INTS and out[key] != v and not isinstance(v, str):
            raise ConfigError(f"synthetic.{key}", f"must be an integer, got {v!r}")
    checks = [
        ("num_train", out["num_train"] >= 1, ">= 1"), ("num_test", out["num_test"] >= 1, ">= 1"),
        ("num_labels", 1 <= out["num_labels"] < 2**31, "in [1, 2^31)"),
        ("num_features", 1 <= out["num_features"] < 2**31, "in [1, 2^31)"),
        ("avg_labels", 1.0 <= out["avg_labels"] <= out["max_labels"], ">= 1 and <= max_labels"),
        ("zipf_alpha", 0.0 <= out["zipf_alpha"] <= 5.0, "in [0, 5]"),
        ("feature_alpha", 0.0 <= out["feature_alpha"] <= 5.0, "in [0, 5]"),
        ("label_noise", 0.0 <= out["label_noise"] < 1.0, "in [0, 1)"),
        ("signature_size", 1 <= out["signature_size"] < _SIG_STRIDE, f"in [1, {_SIG_STRIDE})"),
        ("signature_keep", 0.0 < out["signature_keep"] <= 1.0, "in (0, 1]"),
        ("background_features", out["background_features"] >= 0.0, ">= 0"),
        ("seed", 0 <= out["seed"] < 2**63, "in [0, 2^63)"),
        ("family_size", out["family_size"] >= 1, ">= 1"),
        ("family_shared", 0 <= out["family_shared"] < out["signature_size"], "in [0, signature_size)"),
        ("xor_pairs", out["xor_pairs"] in (0, 1), "0 or 1"),
        ("xor_pairs", not out["xor_pairs"] or out["signature_size"] >= 2, "0 where signature_size < 2"),
        ("xor_pairs", not out["xor_pairs"] or out["num_labels"] % 2 == 0, "0 where num_labels is odd"),
        ("xor_pairs", not out["xor_pairs"] or out["family_size"] == 1, "0 where family_size > 1"),
        ("family_adjacent", out["family_adjacent"] in (0, 1), "0 or 1"),
        ("family_adjacent", not out["family_adjacent"] or out["family_size"] > 1, "0 where family_size is 1"),
    ]
    for key, ok, what in checks:
        if not ok:
            raise ConfigError(f"synthetic.{key}", f"must be {what}, got {out[key]!r}")
    return out


def block_points(p: dict) -> int:
    """Points per generation block: a power of two keeping a block near _BLOCK_ENTRIES entries.

    Part of the model (the block index seeds each block's random stream), so it depends only on params.
    """
    per_point = p["avg_labels"] * (p["signature_size"] + 1) + p["background_features"]
    return 1 << int(np.log2(max(1024, _BLOCK_ENTRIES // max(int(per_point), 1))))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic is intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def label_signatures(labels: np.ndarray, seed: int, signature_size: int, num_features: int,
                     family_size: int = 1, family_shared: int = 0) -> np.ndarray:
    """Signature feature ids of ``labels`` (``(n,)`` ints): ``(n, signature_size)`` int64; with families, the
    first ``family_shared`` slots are the family's (``label // family_size``)."""
    base = _mix(np.array([seed], np.uint64))[0]
    slots = np.asarray(labels, np.uint64)[:, None] * np.uint64(_SIG_STRIDE)
    slots = slots + np.arange(signature_size, dtype=np.uint64)
    out = _mix(slots + base) % np.uint64(num_features)
    if family_size > 1 and family_shared > 0:
        family_base = _mix(np.array([seed ^ 0xFA111E5], np.uint64))[0]
        family = (np.asarray(labels, np.uint64) // np.uint64(family_size))[:, None] * np.uint64(_SIG_STRIDE)
        shared = _mix(family + np.arange(family_shared, dtype=np.uint64) + family_base) % np.uint64(num_features)
        out[:, :family_shared] = shared
    return out.astype(np.int64)


def xor_signatures(labels: np.ndarray, coins: np.ndarray, seed: int, signature_size: int,
                   num_features: int) -> np.ndarray:
    """Signature feature ids of ``labels`` (``(n,)`` ints) under the twins' coins ``(n,)`` in {0, 1}:
    ``(n, signature_size)`` int64. Slots [0, s // 2) are half A (coin 0) or A' (coin 1) of pair ``label // 2``,
    the rest half B or B' by ``coin XOR (label & 1)``; each variant hashes from its own base."""
    labels = np.asarray(labels, np.int64)
    coins = np.asarray(coins, np.int64)
    half = signature_size // 2
    slot = np.arange(signature_size)
    variant = np.where(slot < half, coins[:, None], (coins ^ (labels & 1))[:, None])  # (n, s) in {0, 1}
    bases = _mix(np.array([seed ^ 0x7A1C0, seed ^ 0x7A1C1], np.uint64))
    keys = (labels // 2).astype(np.uint64)[:, None] * np.uint64(_SIG_STRIDE) + slot.astype(np.uint64)
    return (_mix(keys + bases[variant]) % np.uint64(num_features)).astype(np.int64)


def _zipf_cdf(n: int, alpha: float) -> np.ndarray:
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
    return cdf / cdf[-1]


def _adjacent_family_ranks(num_labels: int, family_size: int, rng: np.random.Generator) -> np.ndarray:
    """rank -> label id (num_labels,) int32 where family f (labels [f F, f F + F)) holds F adjacent ranks: the full
    families in a random order, a member's place in its family by rank; a last partial family keeps the last ranks."""
    full = num_labels // family_size
    ranks = np.arange(num_labels, dtype=np.int64)
    out = ranks.copy()  # the partial family's labels keep their ranks
    head = ranks[: full * family_size]
    out[: len(head)] = rng.permutation(full)[head // family_size] * family_size + head % family_size
    return out.astype(np.int32)


class _Tables:
    """The O(L) + O(F) tables shared by every block."""

    def __init__(self, p: dict):
        rng = np.random.default_rng([p["seed"], 0xC0FFEE])
        if p["xor_pairs"]:  # Zipf over the pairs; rank 2j + b is twin b of the j-th most popular pair
            pairs = p["num_labels"] // 2
            self.label_cdf = _zipf_cdf(pairs, p["zipf_alpha"])
            self.rank_to_label = (2 * np.repeat(rng.permutation(pairs), 2) + np.tile([0, 1], pairs)).astype(np.int32)
        else:
            self.label_cdf = _zipf_cdf(p["num_labels"], p["zipf_alpha"])
            if p["family_adjacent"]:
                self.rank_to_label = _adjacent_family_ranks(p["num_labels"], p["family_size"], rng)
            else:
                self.rank_to_label = rng.permutation(p["num_labels"]).astype(np.int32)
        self.feature_cdf = _zipf_cdf(p["num_features"], p["feature_alpha"])
        self.rank_to_feature = rng.permutation(p["num_features"]).astype(np.int32)


def _draw_labels(p: dict, t: _Tables, rng: np.random.Generator, n: int):
    """A block's generating labels, drawn first from its stream (the features follow from the same ``rng``).
    Returns (rows, ranks, labels, kept), each (M,), sorted by point, then by popularity rank: the point of each
    generating label, its popularity rank, its id, and whether it is observed (not dropped by the label noise)."""
    L = p["num_labels"]
    k = np.minimum(1 + rng.poisson(p["avg_labels"] - 1.0, n), p["max_labels"])
    rows = np.repeat(np.arange(n, dtype=np.int64), k)
    ranks = np.minimum(np.searchsorted(t.label_cdf, rng.random(rows.size), side="right"), t.label_cdf.size - 1)
    if p["xor_pairs"]:  # twins are equally popular, so a label's prior cannot tell them apart either
        ranks = 2 * ranks + rng.integers(0, 2, ranks.size)
    key = unique_ints(rows * L + ranks)  # merge repeats; sorts by row, then by popularity rank
    rows, ranks = key // L, key % L
    labels = t.rank_to_label[ranks].astype(np.int64)
    kept = rng.random(labels.size) >= p["label_noise"]
    return rows, ranks, labels, kept


def _block(p: dict, t: _Tables, split_id: int, block: int, n: int):
    """Generate ``n`` points. Returns (label_counts, label_ids int32, feat_counts, feat_ids int32,
    feat_values float32, oracle_hits (3,) float64 = sums over points of P@1, P@3, P@5 numerators/k)."""
    L, F, s = p["num_labels"], p["num_features"], p["signature_size"]
    rng = np.random.default_rng([p["seed"], split_id, block])
    rows, ranks, labels, kept = _draw_labels(p, t, rng, n)
    true_counts = np.bincount(rows, minlength=n)
    # Oracle: the generating labels in popularity order; position of each within its point.
    pos = np.arange(labels.size) - np.repeat(np.cumsum(true_counts) - true_counts, true_counts)
    hits = np.array([np.count_nonzero(kept & (pos < c)) / c for c in (1, 3, 5)])
    obs = np.sort(rows[kept] * L + labels[kept])
    lab_counts, lab_ids = np.bincount(obs // L, minlength=n), (obs % L).astype(np.int32)
    # Features: kept signature slots of every generating label (dropped labels still shaped the text).
    if p["xor_pairs"]:
        sig = xor_signatures(labels, rng.integers(0, 2, labels.size), p["seed"], s, F).reshape(-1)
    else:
        sig = label_signatures(labels, p["seed"], s, F, p["family_size"], p["family_shared"]).reshape(-1)
    on = rng.random(sig.size) < p["signature_keep"]
    sig_rows, sig = np.repeat(rows, s)[on], sig[on]
    sig_vals = 1.0 + rng.poisson(0.5, sig.size)
    nb = rng.poisson(p["background_features"], n)
    bg_rows = np.repeat(np.arange(n, dtype=np.int64), nb)
    bg_ranks = np.searchsorted(t.feature_cdf, rng.random(bg_rows.size), side="right")
    bg = t.rank_to_feature[np.minimum(bg_ranks, F - 1)]
    fkey, inv = np.unique(np.concatenate([sig_rows * F + sig, bg_rows * F + bg]), return_inverse=True)
    weights = np.concatenate([sig_vals, np.ones(bg.size)])
    vals = np.bincount(inv.reshape(-1), weights=weights, minlength=fkey.size)
    feat_counts = np.bincount(fkey // F, minlength=n)
    return lab_counts, lab_ids, feat_counts, (fkey % F).astype(np.int32), vals.astype(np.float32), hits


def write_synthetic(out_dir: str, params: dict) -> dict:
    """Generate both splits into ``out_dir`` (files as in the cache layout); returns the meta.json body."""
    p = normalize_params(params)
    tables = _Tables(p)
    info = {"num_labels": p["num_labels"], "num_features": p["num_features"], "label_texts": None}
    for split_id, (split, n) in enumerate((("train", p["num_train"]), ("test", p["num_test"]))):
        lw = CSRWriter(out_dir, f"{split}.labels", p["num_labels"], with_values=False)
        fw = CSRWriter(out_dir, f"{split}.features", p["num_features"], with_values=True)
        hits, chunk = np.zeros(3), block_points(p)
        try:
            for block, start in enumerate(range(0, n, chunk)):
                lc, li, fc, fi, fv, h = _block(p, tables, split_id, block, min(chunk, n - start))
                lw.append(lc, li)
                fw.append(fc, fi, fv)
                hits += h
        except BaseException:  # e.g. disk full or Ctrl-C: close the files, the caller drops the dir
            lw.abort(), fw.abort()
            raise
        lw.close(), fw.close()
        info[split] = {"num_points": n, "features": True, "texts": None}
        if split == "test":
            info["meta"] = {
                "oracle_p1": round(100.0 * hits[0] / n, 4),
                "oracle_p3": round(100.0 * hits[1] / n, 4),
                "oracle_p5": round(100.0 * hits[2] / n, 4),
                "oracle_p1_expected": round(100.0 * (1.0 - p["label_noise"]), 4),
                "generator": dict(p, version=GENERATOR_VERSION, block_points=block_points(p)),
            }
    return info


def generating_labels(params: dict, split: str) -> dict:
    """Every point's generating labels (the observed ones and those the label noise dropped), drawn as
    `write_synthetic` draws them, without the features. ``split`` is "train" or "test". Returns {"indptr": (n+1,)
    int64, "labels": (M,) int64, "ranks": (M,) int64 popularity ranks (0 the most popular), "kept": (M,) bool}: point
    i's labels are ``labels[indptr[i]:indptr[i+1]]``, most popular first; the kept ones are its observed labels."""
    p = normalize_params(params)
    if split not in ("train", "test"):
        raise ConfigError("split", f"{split!r}: expected 'train' or 'test'")
    n, split_id = (p["num_train"], 0) if split == "train" else (p["num_test"], 1)
    tables, chunk, parts, counts = _Tables(p), block_points(p), [], []
    for block, start in enumerate(range(0, n, chunk)):
        m = min(chunk, n - start)
        rows, ranks, labels, kept = _draw_labels(p, tables, np.random.default_rng([p["seed"], split_id, block]), m)
        parts.append((labels, ranks, kept))
        counts.append(np.bincount(rows, minlength=m))
    labels, ranks, kept = (np.concatenate(x) for x in zip(*parts)) if parts else (np.zeros(0, np.int64),) * 3
    indptr = np.concatenate([[0], np.cumsum(np.concatenate(counts) if counts else [])]).astype(np.int64)
    return {"indptr": indptr, "labels": labels, "ranks": ranks, "kept": kept.astype(bool)}


def synthetic_key(params: dict) -> str:
    """Cache key of a parameter set: changes with any parameter or with the generator's version."""
    import hashlib
    import json

    p = {k: v for k, v in normalize_params(params).items() if not (k in _LATER_KEYS and v == DEFAULTS[k])}
    blob = json.dumps({"v": GENERATOR_VERSION, "b": _BLOCK_ENTRIES, "p": p}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
