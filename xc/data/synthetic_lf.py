"""Synthetic label-feature (LF) data with a known teacher, written in the LF raw-text layout.

So that `xc-train model.mode=dual` runs with no user data, and so that a dual encoder has a target it
can reach, the generator draws (all randomness from `seed`):

1. a vocabulary of `vocab` whole words taken from the tokenizer's own vocabulary (each word is ONE
   token, so a bag-of-token-ids tower sees the words themselves, not sub-word pieces);
2. label texts: `label_words` random words each;
3. a teacher: a random embedding table E (vocab, teacher_dim); a text's teacher vector is the mean of
   E over its words (a bag-of-words tower, the same family as the CPU student tower);
4. query texts: words borrowed from `seed_labels` random labels (about query_words / seed_labels of
   each) plus `noise_words` random words;
5. each query's labels: the `labels_per_query` labels with the highest teacher score <t(q), t(l)>.

The true label set is therefore a deterministic function of the query text through the teacher tower.
Files: trn.raw.txt, tst.raw.txt, lbl.raw.txt, trn_X_Y.txt, tst_X_Y.txt (read by data.kind=lf_raw).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from xc.errors import ConfigError
from xc.fsutil import exclusive_lock

GENERATOR_VERSION = 1
_FILES = ("trn.raw.txt", "tst.raw.txt", "lbl.raw.txt", "trn_X_Y.txt", "tst_X_Y.txt")


def whole_words(vocab_path: str, count: int, rng: np.random.Generator) -> list[str]:
    """`count` distinct lowercase alphabetic tokens of a WordPiece vocab.txt (no '##' pieces, >= 3 letters)."""
    with open(vocab_path, encoding="utf-8") as f:
        words = [w.strip() for w in f if w.strip().isalpha() and w.strip().islower() and len(w.strip()) >= 3]
    if len(words) < count:
        raise ConfigError("data.synthetic_lf.vocab", f"{count} words asked for, the tokenizer has {len(words)}")
    return [words[i] for i in np.sort(rng.choice(len(words), count, replace=False))]


def _teacher_topk(queries: np.ndarray, labels: np.ndarray, k: int, chunk: int = 2048) -> np.ndarray:
    """(N, k) label ids of the k best teacher scores per query; queries (N, t), labels (L, t)."""
    out = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, len(queries), chunk):
        scores = queries[start:start + chunk] @ labels.T
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        out[start:start + chunk] = np.sort(top, axis=1)
    return out


def generate(params: dict, vocab_path: str, out_dir: str) -> dict:
    """Write the five LF files into `out_dir`; returns summary figures (also written as synthetic_lf.json)."""
    p = dict(params)
    if p["labels_per_query"] > p["num_labels"] or p["seed_labels"] < 1 or p["query_words"] < p["seed_labels"]:
        raise ConfigError("data.synthetic_lf", f"inconsistent parameters {p}")
    rng = np.random.default_rng(p["seed"])
    words = np.array(whole_words(vocab_path, p["vocab"], rng))
    num_labels = p["num_labels"]
    label_tok = rng.integers(0, p["vocab"], size=(num_labels, p["label_words"]))
    teacher = rng.standard_normal((p["vocab"], p["teacher_dim"])).astype(np.float32)
    label_vec = teacher[label_tok].mean(1)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "lbl.raw.txt"), "w") as f:
        f.writelines(" ".join(words[row]) + "\n" for row in label_tok)
    per_seed = p["query_words"] // p["seed_labels"]
    summary = {"version": GENERATOR_VERSION, **p}
    for tag, n in (("trn", p["num_train"]), ("tst", p["num_test"])):
        seeds = rng.integers(0, num_labels, size=(n, p["seed_labels"]))
        picks = rng.integers(0, p["label_words"], size=(n, p["seed_labels"], per_seed))
        borrowed = label_tok[seeds[:, :, None], picks].reshape(n, -1)
        noise = rng.integers(0, p["vocab"], size=(n, p["noise_words"]))
        query_tok = np.concatenate([borrowed, noise], axis=1)
        query_tok = np.take_along_axis(query_tok, rng.permuted(np.tile(np.arange(query_tok.shape[1]), (n, 1)), axis=1), 1)
        truth = _teacher_topk(teacher[query_tok].mean(1), label_vec, p["labels_per_query"])
        with open(os.path.join(out_dir, f"{tag}.raw.txt"), "w") as f:
            f.writelines(" ".join(words[row]) + "\n" for row in query_tok)
        with open(os.path.join(out_dir, f"{tag}_X_Y.txt"), "w") as f:
            f.write(f"{n} {num_labels}\n")
            f.writelines(" ".join(f"{l}:1" for l in row) + "\n" for row in truth)
        summary[f"{tag}_seed_label_recall"] = float(np.mean([len(set(s) & set(t)) / len(s) for s, t in zip(seeds, truth)]))
    with open(os.path.join(out_dir, "synthetic_lf.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def ensure_synthetic_lf(params: dict, vocab_path: str, cache_dir: str) -> str:
    """The directory holding the LF files for `params` under `cache_dir` (generated once, atomically)."""
    key = hashlib.sha256(json.dumps({"v": GENERATOR_VERSION, **params}, sort_keys=True).encode()).hexdigest()[:16]
    target = os.path.join(os.path.abspath(cache_dir), f"synthetic_lf-raw-{key}")
    if all(os.path.exists(os.path.join(target, name)) for name in _FILES):
        return target
    import shutil
    import tempfile

    os.makedirs(cache_dir, exist_ok=True)
    with exclusive_lock(target + ".lock"):
        if all(os.path.exists(os.path.join(target, name)) for name in _FILES):
            return target
        tmp = tempfile.mkdtemp(prefix=os.path.basename(target) + ".tmp-", dir=os.path.dirname(target))
        try:
            generate(params, vocab_path, tmp)
            if os.path.lexists(target):
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
