"""A trained run as a Python object: `xc.load(run_dir)` -> `TrainedModel`, which encodes and predicts.

    import xc
    model = xc.load("runs/debian_deps-astra")            # newest valid checkpoint, on the CPU
    out = model.predict(["python library for fast json parsing"], k=5)
    out.ids, out.scores, out.names                     # (n, 5), (n, 5), n lists of 5 label names
    emb = model.encode(rows)                           # (n, d) float32 query embeddings

Inputs: a list of raw texts, a dense (n, F) array, a scipy-sparse matrix or a `SparseMatrix`. Raw text is
featurised as the run's data was: tf-idf with the vocabulary kept in the data cache (bag-of-words runs on
raw text) or the text encoder's tokenizer (MiniLM, dual token-bag). Both modes load (`model.mode=dual`: the
label table is every label text through the label tower, plus the free vectors), from a checkpoint of any
world size: classifier rows are stitched by label id from the rank files, as `xc-eval` does, and served by
one process holding every label shard. Where training chose a label prior (RUN_DIR/prior.json,
xc/fitting/label_prior.py), scores include it. Where training chose a kNN fusion (RUN_DIR/fusion.json), `predict`
applies it, with the lexical ranker where it chose one (RUN_DIR/ranker/; scores are then fused probabilities,
`Predictions.fused`); `fusion=False` gives the model without them. ANN serving (`use_ann`) serves the plain model
(no prior, no fusion), as `xc-eval --ann` does.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch

from xc.run import checkpoint as ckpt
from xc.run.identity import checkpoint_of_another_run
from xc.run.readers import reading
from xc.run.resume import load_serving_weights
from xc.ann.base import NEIGHBOURS
from xc.config import XCConfig, build_config
from xc.data import read_texts
from xc.data.inputs import dense_inputs, idf_weights, sparse_inputs
from xc.data.queries import QueryBlock, features_from_array
from xc.data.sparse import SparseMatrix
from xc.data.text_features import TfidfFeaturizer
from xc.data.tokens import TextTokenizer
from xc.datasets import load_configured_dataset
from xc.distributed import DistContext
from xc.errors import ConfigError, DataFormatError
from xc.data.records import read_label_names
from xc.models.classifier import ClassifierShard
from xc.models.text_encoder import default_minilm_path
from xc.models.towers import DualTowers
from xc.serve.ann import AnnSearcher, SavedIndexes
from xc.serve.neighbours import neighbour_searcher
from xc.serve.calibration import Calibration, apply_threshold, score_source
from xc.shards import ShardLayout
from xc.eval.inference import ExactSearcher, encode_rows, lexical_depth, lexical_topk, sharded_topk
from xc.fitting.fusion import FusionChoice
from xc.fitting.label_prior import install_for_run
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory
from xc.train.components import build_components, text_inputs
from xc.train.modes.dual.memory import dual_model_memory
from xc.train.precision import autocast_dtype

log = logging.getLogger(__name__)
LABEL_NAME_FILES = ("lbl.raw.txt", "Y.txt", "lbl_names.txt", "label_names.txt", "Yf.txt")


@dataclass
class Predictions:
    """Top-k labels per input row: ids (n, k) int64 (best first, -1 pads), scores (n, k) float32 (the
    model's scores, or fused probabilities when `fused`), names: n lists of k label names (None without);
    with a threshold, probs (n, k) float32 calibrated probabilities and the labels below it padded."""

    ids: np.ndarray
    scores: np.ndarray
    names: list[list[str | None]] | None
    fused: bool = False
    probs: np.ndarray | None = None  # (n, k) calibrated probabilities, where a threshold was asked for

    def __len__(self) -> int:
        return len(self.ids)

    def records(self) -> Iterator[dict]:
        """One JSON-ready dict per row: {"ids", "scores", and "names" where the run has label names}."""
        for i in range(len(self.ids)):
            keep = self.ids[i] >= 0
            rec = {"ids": self.ids[i][keep].tolist(), "scores": [round(float(s), 6) for s in self.scores[i][keep]]}
            if self.probs is not None:
                rec["probs"] = [round(float(p), 4) for p in self.probs[i][keep]]
            if self.names is not None:
                rec["names"] = [n for n, k in zip(self.names[i], keep) if k]
            yield rec


def check_knn_memory(knn_memory, num_train: int) -> np.ndarray | None:
    """`predict`'s `knn_memory` as sorted unique int64 training point ids, or a ConfigError that says what is wrong
    with it (None stays None: every training point)."""
    if knn_memory is None:
        return None
    ids = np.asarray(knn_memory)
    if ids.ndim != 1 or not (ids.dtype.kind in "iu" or (ids.size == 0 and ids.dtype.kind == "f")):
        raise ConfigError("knn_memory", f"must be a 1-d array of training point ids (integers), got "
                                        f"{ids.ndim}-d {ids.dtype}")
    if ids.size == 0:
        raise ConfigError("knn_memory", "is empty: the kNN vote needs at least one training point")
    bad = ids[(ids < 0) | (ids >= num_train)]
    if bad.size:
        raise ConfigError("knn_memory", f"holds {bad.size} ids outside the {num_train} training points [0, "
                                        f"{num_train}), e.g. {int(bad[0])}")
    return np.unique(ids.astype(np.int64))


def foreign_checkpoint_note(run_dir: Path, checkpoint: Path, meta: dict) -> str | None:
    """Why the named `checkpoint` is another run's than `run_dir`'s (said in one log line: it is scored alone,
    without the run's kNN fusion, ranker and label prior), None for the run's own; CheckpointError when the label
    counts differ (xc/run/identity.py `checkpoint_of_another_run`)."""
    why = checkpoint_of_another_run(run_dir, checkpoint, meta)
    if why:
        log.warning("checkpoint %s is another run's than %s (%s): scored alone, without that run's kNN fusion, "
                    "ranker and label prior", checkpoint, run_dir, why)
    return why


def restore_config(meta: dict, device: str | None = None) -> XCConfig:
    """The checkpoint's own config, set up for inference: its label layout, no wandb, fp16 autocast
    dropped off CUDA (fp16 autocast needs CUDA; the encoder then runs in fp32)."""
    raw = json.loads(json.dumps(meta["config"]))
    raw["parallel"]["num_label_shards"] = meta["num_label_shards"]
    raw["logger"]["wandb"] = "disabled"
    if device:
        raw["train"]["device"] = device
    cfg = build_config(raw)
    if cfg.train.amp == "fp16" and not (torch.cuda.is_available() and cfg.train.device != "cpu"):
        cfg = replace(cfg, train=replace(cfg.train, amp="none"))
    return cfg


def open_run_data(cfg: XCConfig):
    """The run's dataset through its cache (converted at training time; re-converted if missing). The cache is
    keyed by the source files, so a source folder moved or deleted since training stops serving: said in one line
    that names the folder and the way out (an export holds all that serving reads)."""
    try:
        return load_configured_dataset(cfg)
    except DataFormatError as exc:
        if not cfg.data.path or os.path.exists(exc.path) or exc.field not in ("file", "path"):
            raise
        raise DataFormatError(exc.path, 0, "file", f"not found: serving a run reads the data it trained on (its "
                              f"label names, tf-idf vocabulary and kNN memory), from {cfg.data.path} (data.path) "
                              "through the data cache; put the data back there, or run xc-export RUN_DIR DEST where "
                              "the data is and serve DEST, which needs no data") from None


def label_names(dataset, data_path: str | None) -> list[str] | None:
    """Label names: the names records data (jsonl/csv/tsv) gave, else the data's label texts (LF layout), else
    the first of LABEL_NAME_FILES beside the
    source data with exactly one line per label; None when there are none."""
    if dataset.meta.get("cache_dir"):  # records data: the names the user wrote, counted against the labels
        names = read_label_names(dataset.meta["cache_dir"], dataset.meta, dataset.num_labels)
        if names is not None:
            return names
    if dataset.label_texts_path:
        return read_texts(dataset.label_texts_path)
    for name in LABEL_NAME_FILES if data_path else ():
        path = os.path.join(data_path, name)
        if os.path.isfile(path):
            names = read_texts(path)
            if len(names) == dataset.num_labels:
                return names
            log.warning("%s has %d lines for %d labels: not used as label names", path, len(names), dataset.num_labels)
    return None


class TrainedModel:
    """A checkpoint restored in this process for inference (see the module docstring)."""

    def __init__(self, run_dir: str | Path, checkpoint: str | Path | None = None, device: str = "cpu",
                 batch_size: int | None = None):
        self.run_dir = Path(run_dir)
        # a trainer still running there prunes old checkpoints: the files are held while they are read
        with reading(run_dir, checkpoint) as held:
            self._restore(held.path, held.meta, held.files, device, batch_size)
        # why the checkpoint (named, or one copied into the run's checkpoints/) is another run's: scored alone then
        self.foreign = foreign_checkpoint_note(self.run_dir, self.checkpoint, self.meta)
        self.prior_beta = self.use_prior(checkpoint is None)  # chosen for the final checkpoint
        self.searcher = ExactSearcher(self.shard)
        self.fusion = self._fusion_choice()
        self._memory = None

    # ------------------------------------------------------------------ restoring
    def _restore(self, path: Path, meta: dict, files: Path, device: str, batch_size: int | None) -> None:
        """Restore the checkpoint `path` (its meta.json `meta`) from `files`, the directory its files are held in
        (xc/run/readers.py)."""
        self.checkpoint, self.meta = path, meta
        self.cfg = restore_config(self.meta, device)
        dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.ctx = DistContext(device=dev)
        self.mode = self.meta.get("mode", "classifier")
        self.batch_size = batch_size or self.cfg.eval.batch_size
        self.dataset = open_run_data(self.cfg)
        self.num_labels = self.dataset.num_labels
        self.label_names = label_names(self.dataset, self.cfg.data.path)
        self._tokenizer = self._featurizer = None
        self.components = None
        if self.mode == "dual":
            self._restore_dual(files)
        else:
            self._restore_classifier(files)

    def _restore_classifier(self, files: Path) -> None:
        c = build_components(self.cfg, self.ctx, self.dataset, optimizers=False)
        # mapped, not read: the optimiser state stays on disk
        load_serving_weights(files, self.meta, c.encoder, c.shard)
        self.components, self.encoder, self.shard, self.layout = c, c.encoder, c.shard, c.layout
        self.text_encoder = self.cfg.model.encoder == "transformer"
        self.feature_weights = None
        if self.cfg.model.feature_weighting == "idf" and not self.text_encoder:
            self.feature_weights = idf_weights(self.dataset.train.features)

    def _restore_dual(self, files: Path) -> None:
        cfg, L = self.cfg, self.num_labels
        towers = DualTowers(cfg.model).to(self.ctx.device)
        towers.load_state_dict(ckpt.load_state_file(files / "rank0.pt", mmap=True)["towers"])
        towers.eval()
        # the precision training evaluated in (train.amp=bf16), so served scores match training's figures
        towers.query.autocast = towers.label.autocast = autocast_dtype(cfg.train.amp, self.ctx.device)
        self.layout = ShardLayout.build(L, self.meta["num_label_shards"], cfg.parallel.shard_multiple)
        lo, hi = self.layout.rank_range(0, 1)
        # The label table is what the dual trainer's evaluation scores: g(text_l) (+ w_l), every label re-encoded.
        table = encode_rows(towers.label, text_inputs(cfg, self.dataset.label_texts_path, "labels"),
                            np.arange(L, dtype=np.int64), 4096, self.ctx)
        if cfg.model.free_vectors:
            table = table + ckpt.load_classifier_rows(files, self.meta, 0, L, L, section="free").float()
        self.shard = ClassifierShard(lo, hi, L, towers.out_dim, 0.0, cfg.seed, self.ctx.device)
        self.shard.weight[:L] = table.to(self.ctx.device)
        self.encoder, self.text_encoder, self.feature_weights = towers.query, True, None

    def use_prior(self, on: bool = True, beta: float | None = None) -> float | None:
        """Score with the label prior training chose for the final checkpoint (RUN_DIR/prior.json, classifier mode;
        on at load unless a checkpoint was named) or without it (the plain model, e.g. to compare with ANN
        serving, which serves plain scores). Exact search and fusion then score as training's final evaluation
        did; `beta` overrides the recorded one (an ensemble's members score under the ensemble's). Returns the beta
        in use (None: none)."""
        if not on or self.mode == "dual" or self.foreign:  # another run's prior does not fit this model
            beta = 0.0
        train = getattr(self.components, "train", None)
        self.prior_beta = install_for_run(self.shard, self.run_dir, self.dataset.train.labels,
                                          train.train_ids if train else None, self.num_labels, beta)
        return self.prior_beta

    def _fusion_choice(self):
        return None if self.foreign else FusionChoice.read(self.run_dir)  # chosen for the run's own model only

    # ------------------------------------------------------------------ inputs
    @property
    def input_kind(self) -> str:
        """"text" when the model reads raw text only, "features" when it reads feature rows (and raw text
        through the run's tf-idf vocabulary, where the data was raw text)."""
        return "text" if self.text_encoder else "features"

    @property
    def num_features(self) -> int:
        return 0 if self.text_encoder else self.dataset.num_features

    def _features_of_texts(self, texts: list[str]) -> SparseMatrix:
        if self._featurizer is None:
            cache_dir = self.dataset.meta.get("cache_dir", "")
            if not self.dataset.meta.get("text_features") or not os.path.exists(os.path.join(cache_dir, "vocab.txt")):
                raise DataFormatError("<input>", 0, "format", f"raw text, but this model reads feature rows of "
                                      f"{self.cfg.data.kind} data (no tf-idf vocabulary in its data cache)")
            self._featurizer = TfidfFeaturizer(cache_dir)
        return self._featurizer.transform(texts)

    def _as_block(self, data) -> QueryBlock:
        if isinstance(data, QueryBlock):
            return data
        if isinstance(data, str):
            data = [data]
        if isinstance(data, (list, tuple)) and all(isinstance(t, str) for t in data):
            return QueryBlock(1, texts=list(data))
        if isinstance(data, SparseMatrix):
            return QueryBlock(1, features=data)
        return QueryBlock(1, features=features_from_array(data, self.num_features or None))

    def _inputs(self, block: QueryBlock):
        """(InputFn over 0..n-1, the block's feature matrix or None) for the encoder."""
        if self.text_encoder:
            if block.texts is None:
                raise DataFormatError("<input>", block.first_line, "format",
                                      "feature rows, but this model reads raw text (its encoder is a text encoder)")
            if self._tokenizer is None:
                self._tokenizer = TextTokenizer(self.cfg.model.path or default_minilm_path(), self.cfg.data.max_len)
            texts = block.texts
            return (lambda rows: self._tokenizer([texts[int(r)] for r in rows])), None
        features = block.features if block.features is not None else self._features_of_texts(block.texts)
        if features.num_cols != self.dataset.num_features:
            raise DataFormatError("<input>", block.first_line, "shape",
                                  f"{features.num_cols} feature columns, but the model reads {self.dataset.num_features}")
        make = dense_inputs if self.cfg.model.encoder == "dense" else sparse_inputs
        return make(features, self.feature_weights), features

    # ------------------------------------------------------------------ the API
    def encode(self, data) -> np.ndarray:
        """Query embeddings (n, d) float32 of texts or feature rows."""
        block = self._as_block(data)
        fn, _ = self._inputs(block)
        return encode_rows(self.encoder, fn, np.arange(len(block), dtype=np.int64), self.batch_size, self.ctx).numpy()

    def _training_embeddings(self) -> torch.Tensor | None:
        """(N, d) float32: the training points' embeddings, encoded as `xc-eval --ann neighbours` encodes them (a run's
        own training inputs; an export's stored embeddings, else its stored feature rows); None for a dual run or an
        export holding neither."""
        if self.mode == "dual":
            return None
        if self.components is not None:
            points = np.arange(self.dataset.train.num_points, dtype=np.int64)
            return encode_rows(self.encoder, self.components.train.split_inputs, points, self.batch_size, self.ctx)
        stored = getattr(self, "train_embeddings", None)
        if stored is not None:
            return stored.float()
        features = getattr(self.dataset.train, "features", None)
        return None if features is None or self.text_encoder else torch.from_numpy(self.encode(features))

    def use_ann(self, backend: str | None, save_index: bool = False, **ann_overrides):
        """Serve top-k from ANN indexes over the label rows (`backend` None: back to exact search). Saved
        indexes under RUN_DIR/serving/<backend>/ are reused when their fingerprint matches; `save_index`
        writes freshly built ones there. Returns the searcher (`.reused`, `.build_seconds`)."""
        if backend is None:
            self.searcher = ExactSearcher(self.shard)
            return self.searcher
        if backend == NEIGHBOURS:  # the labels of the query's nearest training points (xc/serve/neighbours.py)
            ann = replace(self.cfg.miner.ann, **ann_overrides).validate()
            self.searcher = neighbour_searcher(ann, self.shard, self.dataset.train.labels, self._training_embeddings,
                                               save_index)
            return self.searcher
        ann = replace(self.cfg.miner.ann, backend=backend, **ann_overrides)
        store = SavedIndexes(self.run_dir, backend, {"checkpoint": self.checkpoint.name,
                                                     "global_step": int(self.meta["global_step"])})
        self.searcher = AnnSearcher(self.shard, self.layout, self.layout.shards_of_rank(0, 1), ann,
                                    store=store, save=save_index)
        return self.searcher

    def predict(self, data, k: int = 10, fusion: bool = True, threshold: float | None = None,
                knn_memory: np.ndarray | None = None) -> Predictions:
        """Top-k labels of texts or feature rows (see `Predictions`); kNN fusion as training chose it
        unless `fusion=False` or an ANN searcher is in use. `threshold` p: of those, only the labels whose
        calibrated probability (RUN_DIR/calibration.json) is at least p (raise k to allow more). `knn_memory`: the
        training points the kNN vote reads (default every one); where the inputs are training points themselves,
        leave them out, or each votes for its own labels."""
        if k < 1:
            raise ConfigError("k", f"must be >= 1, got {k}")
        memory_rows = None if knn_memory is None else check_knn_memory(knn_memory, self.dataset.train.num_points)
        preds = self._predict(data, k, fusion, every_candidate=False, memory_rows=memory_rows)
        if threshold is not None:
            apply_threshold(preds, Calibration.read(self.run_dir), threshold, self.run_dir,
                            score_source(self, preds.fused))
            preds.names = self._names(preds.ids)
        return preds

    def candidates(self, data, fusion: bool = True) -> Predictions:
        """Every candidate label of each row, best first: with kNN fusion, the model's top C and the vote's
        top C (C = eval.knn_fusion.candidates; repeats dropped, -1 pads) under their fused probabilities, the
        very lists training's final evaluation scored (what an ensemble averages); else the top C by score."""
        return self._predict(data, max(self.cfg.eval.knn_fusion.candidates, self.cfg.eval.topk), fusion,
                             every_candidate=True)

    @torch.no_grad()
    def _predict(self, data, k: int, fusion: bool, every_candidate: bool,
                 memory_rows: np.ndarray | None = None) -> Predictions:
        block = self._as_block(data)
        fn, features = self._inputs(block)
        rows = np.arange(len(block), dtype=np.int64)
        emb = encode_rows(self.encoder, fn, rows, self.batch_size, self.ctx)
        fused = fusion and self.fusion is not None and isinstance(self.searcher, ExactSearcher)
        if fused:
            scores, ids = self._fused(block, features, rows, emb, k, every_candidate, (fn, rows), memory_rows)
        elif getattr(self.shard, "lexical", None) is not None:  # model.lexical_features: dense + lexical scores
            depth = lexical_depth(k, self.searcher)
            s, i = sharded_topk(emb.to(self.ctx.device), self.searcher, depth, self.ctx)
            s, i = lexical_topk(self.shard.lexical, self.shard, self.searcher, fn, rows, emb, s, i, k, depth, self.ctx)
            scores, ids = s.numpy(), i.numpy()
        else:
            s, i = sharded_topk(emb.to(self.ctx.device), self.searcher, k, self.ctx)
            scores, ids = s.cpu().numpy(), i.cpu().numpy()
        return Predictions(ids.astype(np.int64), scores.astype(np.float32), self._names(ids), fused)

    def _fused(self, block: QueryBlock, features, rows, emb, k, every_candidate: bool = False, queries=None,
               memory_rows: np.ndarray | None = None):
        if self._memory is None:
            model = (ModelMemory.of(self.cfg, self.components, self.dataset, self.ctx) if self.components is not None
                     else self._dual_model_memory())
            self._memory = FusionEvaluator([model], self.dataset)
            self._memory.use_saved_ranker(self.run_dir, self.fusion)
        if self.fusion.needs_features and features is None and block.texts is not None:
            features = self._features_of_texts(block.texts)  # a dual run's text, through the data's tf-idf
        if self.fusion.needs_features and features is None:
            raise DataFormatError("<input>", block.first_line, "format", "kNN fusion in the input space and the "
                                  "lexical ranker need feature rows; pass fusion=False (--no-fusion)")
        cands = self._memory.fused(self.fusion, SimpleNamespace(features=features), rows, [emb], k, [queries],
                                   memory_rows)
        return cands.fuse(self.fusion.lam, cands.ids.shape[1] if every_candidate else k, self.fusion.gamma)

    def _dual_model_memory(self):
        """What kNN fusion reads of a dual run: the query tower, the label table as rows, and the training
        texts (the memory) with the run's validation split (xc/train/modes/dual/memory.py)."""
        cfg, data = self.cfg, self.dataset
        return dual_model_memory(cfg, data, self.encoder, self.shard, text_inputs(cfg, data.train.texts_path, "train"),
                                 text_inputs(cfg, data.test.texts_path, "test"), None, self.ctx)

    def _names(self, ids: np.ndarray) -> list[list[str | None]] | None:
        if self.label_names is None:
            return None
        names = self.label_names
        return [[names[j] if j >= 0 else None for j in row] for row in ids.tolist()]

    def __repr__(self) -> str:
        return (f"<TrainedModel {self.run_dir} {self.checkpoint.name} mode={self.mode} labels={self.num_labels} "
                f"reads={self.input_kind} fusion={self.fusion.as_dict() if self.fusion else None}>")
