"""tf-idf features for raw-text (LF) data, computed once at convert time and kept with the cache.

Raw text then trains on any machine: the bag-of-words encoder (`model=bow`) reads these features, the
kNN baseline and the instance memory (`xc/fitting/knn.py`) search them, and no transformer or GPU is needed.

The rule, fixed so that a cache directory means one thing (documented in docs/data.md, "Your own data"):

* tokens: lower-cased runs of two or more word characters (scikit-learn's default pattern);
* n-grams: unigrams and bigrams;
* vocabulary: the terms of the *training* texts that occur in at least ``min_df`` of them, where
  ``min_df = 2`` (a term seen once cannot generalise), keeping the ``MAX_FEATURES`` most frequent;
* values: sublinear tf (1 + log tf) times smooth idf (log((1 + N) / (1 + df)) + 1), each row
  L2-normalised. Test and label texts use the training vocabulary and idf.

Files written beside the texts: ``{train,test,label}.features.*`` (CSR, see ``sparse.py``),
``vocab.txt`` (one term per line, in feature-id order) and ``idf.npy`` ((F,) float32), so new text can
be featurised exactly as the training text was.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import DataFormatError
from .sparse import CSRWriter, SparseMatrix

NGRAM_MAX = 2
MIN_DF = 2
MAX_FEATURES = 1 << 19  # caps the encoder's embedding table (F x embed_dim) on corpora of millions of texts
_BLOCK_ROWS = 1 << 14


def _vectorizer(min_df: int):
    from sklearn.feature_extraction.text import TfidfVectorizer

    return TfidfVectorizer(ngram_range=(1, NGRAM_MAX), min_df=min_df, max_features=MAX_FEATURES,
                           sublinear_tf=True, dtype=np.float32)


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def fit_tfidf(train_texts: str, out_dir: str):
    """Fit the vocabulary and idf on the training texts (one per line); write ``vocab.txt`` and
    ``idf.npy`` into ``out_dir``. Returns the fitted vectorizer."""
    texts = _read_lines(train_texts)
    vec = _vectorizer(MIN_DF if len(texts) >= 2 * MIN_DF else 1)
    try:
        vec.fit(texts)
    except ValueError:  # no term survives (empty or punctuation-only texts): fall back to every term
        vec = _vectorizer(1)
        try:
            vec.fit(texts)
        except ValueError:
            return None
    terms = vec.get_feature_names_out()
    with open(os.path.join(out_dir, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in terms))
    np.save(os.path.join(out_dir, "idf.npy"), vec.idf_.astype(np.float32))
    return vec


def write_tfidf(vec, texts_path: str, out_dir: str, prefix: str) -> SparseMatrix:
    """Featurise every line of ``texts_path`` with ``vec`` into ``<prefix>.features.*`` (CSR, float32)."""
    num_features = len(vec.idf_)
    writer = CSRWriter(out_dir, prefix + ".features", num_features, with_values=True)
    try:
        texts = _read_lines(texts_path)
        for start in range(0, len(texts), _BLOCK_ROWS):
            m = vec.transform(texts[start:start + _BLOCK_ROWS]).tocsr()
            m.sort_indices()
            writer.append(np.diff(m.indptr).astype(np.int64), m.indices.astype(np.int32),
                          m.data.astype(np.float32))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def featurize_lf(out_dir: str, info: dict) -> dict:
    """Add tf-idf features to a converted LF directory (``info`` is its meta body, updated in place)."""
    vec = fit_tfidf(os.path.join(out_dir, info["train"]["texts"]), out_dir)
    if vec is None:  # no usable term at all: stay text-only
        return info
    for split in ("train", "test"):
        write_tfidf(vec, os.path.join(out_dir, info[split]["texts"]), out_dir, split)
        info[split]["features"] = True
    if info.get("label_texts"):
        write_tfidf(vec, os.path.join(out_dir, info["label_texts"]), out_dir, "label")
        info["label_features"] = True
    info["num_features"] = len(vec.idf_)
    info["text_features"] = {"kind": "tfidf", "ngram_max": NGRAM_MAX, "min_df": MIN_DF,
                             "max_features": MAX_FEATURES, "sublinear_tf": True}
    return info


class TfidfFeaturizer:
    """New text featurised exactly as the converted training text: the cache's ``vocab.txt`` and
    ``idf.npy`` in a vectorizer of the same rule (n-grams, sublinear tf, L2 rows); nothing is refitted."""

    def __init__(self, cache_dir: str):
        from sklearn.feature_extraction.text import TfidfVectorizer

        terms = _read_lines(os.path.join(cache_dir, "vocab.txt"))
        idf = np.load(os.path.join(cache_dir, "idf.npy"))
        if len(terms) != len(idf):
            raise DataFormatError(os.path.join(cache_dir, "vocab.txt"), 0, "vocabulary",
                                  f"{len(terms)} terms but idf.npy has {len(idf)} values")
        self.num_features = len(terms)
        self._vec = TfidfVectorizer(ngram_range=(1, NGRAM_MAX), vocabulary={t: i for i, t in enumerate(terms)},
                                    sublinear_tf=True, dtype=np.float32)
        self._vec.idf_ = idf.astype(np.float32)

    def transform(self, texts: list[str]) -> SparseMatrix:
        """(len(texts), F) float32 CSR tf-idf rows."""
        m = self._vec.transform(texts).tocsr()
        m.sort_indices()
        return SparseMatrix(m.indptr.astype(np.int64), m.indices.astype(np.int32), m.data.astype(np.float32),
                            self.num_features)
