"""The served model as plain files that load without running code: `xc-export RUN DIR` writes it, `xc.load(DIR)`
serves it, and nothing on the way is unpickled (no torch.load, no np.load of objects, no pickle).

Layout of DIR (every array in safetensors, everything else JSON or text):

    export.json                  the manifest: format and version, what was exported, every file's bytes and sha256,
                                 and its own sha256 (xc/serve/export_files.py checks them and every file's fields)
    model/ or members/m{i}/      one folder per model (an ensemble has one per member):
        config.json              the run's config as its checkpoint recorded it, the checkpoint's name and step,
                                 the label prior's beta in use and what the encoder's sizes were derived from
        model.safetensors        encoder.* (the encoder's state dict), classifier.weight (L, d) in the run's dtype,
                                 classifier.log_counts (L,) float32 log(1 + training count), input.feature_weights
                                 (F,) float32 where the encoder reads idf-weighted rows, memory.train_embeddings
                                 (N, d) float32 where the kNN vote searches the embedding space; lexical.support
                                 (L, S) int32 feature ids (-1 pads) and lexical.weight (L, S) float32 where the run
                                 trained lexical weights (model.lexical_features = S)
    fusion.json, prior.json      the kNN fusion training chose (lambda, k, space, T, gamma) and the label prior's beta
    calibration.json             the served score's map to a probability (thresholds), where the run fitted one
    memory.safetensors           the kNN memory: train_labels.* and train_features.* (CSR: indptr (N + 1,) int64,
                                 indices (nnz,) int32, values (nnz,) float32 where stored)
    ranker.safetensors           the lexical ranker: keys (W,) int64, weights (W,) float32, bias (L,) float32,
                                 owned (L,) bool
    tfidf_vocab.txt, tfidf.safetensors   the tf-idf vocabulary (one term per line) and idf (F,) float32 (raw-text data)
    label_names.json             one name per label, where the data has them

Why: a checkpoint is a torch pickle, loaded through torch's restricted unpickler; safetensors holds only tensors and
a JSON header, so a model handed from one party to another cannot carry code. The files hold the model as it is
served (the prior's bias from the counts it was chosen with, the training embeddings fusion searches, the ranker
merged from its rank parts), so the export predicts exactly what `xc.load(RUN)` predicts, without the data cache.
Dual-mode and text-encoder (MiniLM) runs read their tokenizer and pretrained tower from outside the run: not exported.
An exported ensemble's members predict alone without fusion (the ensemble fuses, as it does from its run).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from xc.data.text_features import NGRAM_MAX, TfidfFeaturizer
from xc.defaults import features_per_row, resolve
from xc.distributed import DistContext
from xc.errors import DataFormatError, XCError
from xc.eval.inference import ExactSearcher
from xc.fitting.label_prior import install, training_log_counts
from xc.fitting.memory import FusionEvaluator
from xc.fitting.model_memory import ModelMemory
from xc.fitting.ranker import LexicalRanker
from xc.models import ClassifierShard, build_encoder
from xc.models.lexical import LexicalRows
from xc.run.lock import live_holder
from xc.serve.calibration import CALIBRATION_FILE, Calibration, score_source
from xc.serve.ensemble import EnsembleModel
from xc.serve.export_files import (FORMAT, MANIFEST, VERSION, csr_matrix, fail, fusion_choice,  # noqa: F401
                                   is_export, listed, member_config, member_info, read_json, read_manifest,
                                   read_tensors, seal)
from xc.serve.export_publish import check_destination, publish  # noqa: F401 (xc-export and the tests import them)
from xc.serve.model import TrainedModel
from xc.shards import ShardLayout
from xc.train.precision import autocast_dtype

log = logging.getLogger("xc.serve.export")
# what a run writes once training ends: an export of a run still training would go out without them
FINISHED_FILES = ("fusion.json", "prior.json", CALIBRATION_FILE)


def refuse_running(run_dir, allow: bool = False) -> None:
    """Refuse, in one line, to export a run a live trainer still holds (RUN_DIR/.lock): its fusion, label prior and
    calibration are written when training ends, so its export would serve a bare checkpoint. With `allow`, a
    warning names what the export goes without."""
    holder = live_holder(run_dir)
    if holder is None:
        return
    missing = [name for name in FINISHED_FILES if not (Path(run_dir) / name).exists()]
    what = (f"{', '.join(missing)} not written yet" if missing else "its files may still change")
    who = f"pid {holder.get('pid')} on {holder.get('host')}"
    if not allow:
        raise XCError(f"{run_dir} is still training ({who}; {what}): export it when training ends, or pass "
                      "--allow-running to export the newest checkpoint as it is")
    log.warning("%s is still training (%s): exporting its newest checkpoint without what training ends with (%s)",
                run_dir, who, what)


# ---------------------------------------------------------------------------------------------------- writing
def export_model(model, dest, check=None, allow_running: bool = False) -> dict:
    """Write `model` (an `xc.load` result of a run: TrainedModel or EnsembleModel) into folder `dest` and return
    the manifest. `check(folder)` (optional) is called on the complete export before it is published; what it
    raises leaves `dest` as it was. Raises XCError for what cannot be exported, a `dest` that is not empty and
    not an earlier export (or an earlier export holding files it did not write), or a run still training (unless
    `allow_running`)."""
    if isinstance(model, ExportedModel) or is_export(model.run_dir):
        raise XCError(f"{model.run_dir} is already an export: copy the folder instead")
    refuse_running(model.run_dir, allow_running)
    ensemble = isinstance(model, EnsembleModel)
    members = model.members if ensemble else [model]
    for m in members:
        if m.mode != "classifier" or m.text_encoder:
            raise XCError(f"{m.run_dir}: model.mode={m.mode}, model.encoder={m.cfg.model.encoder} reads its tokenizer "
                          "and pretrained text tower from outside the run; xc-export writes bag-of-words and dense "
                          "models only (serve this run with xc.load or xc-predict)")
    check_destination(Path(dest))
    fusion, evaluator = model.fusion, None
    if ensemble:
        evaluator = model.memory
    elif fusion is not None:
        if model._memory is None:  # built as TrainedModel._fused builds it, and kept for its own predictions
            model._memory = FusionEvaluator([ModelMemory.of(model.cfg, model.components, model.dataset, model.ctx)],
                                            model.dataset)
            model._memory.use_saved_ranker(model.run_dir, fusion)
        evaluator = model._memory
    searches_embeddings = fusion is not None and fusion.space in ("embedding", "both")

    def write(folder: Path) -> dict:
        names = [f"members/m{i}" for i in range(len(members))] if ensemble else ["model"]
        for i, (name, m) in enumerate(zip(names, members)):
            train_emb = evaluator.models[i].train_embeddings() if searches_embeddings else None
            _write_member(folder / name, m, train_emb)
        dataset = members[0].dataset
        if fusion is not None:
            _json(folder / "fusion.json", fusion.as_dict())
            memory = _csr("train_labels", dataset.train.labels)
            if dataset.train.features is not None:
                memory.update(_csr("train_features", dataset.train.features))
            _safetensors(folder / "memory.safetensors", memory)
            if fusion.gamma:
                r = evaluator.ranker
                _safetensors(folder / "ranker.safetensors",
                             {"keys": r.keys, "weights": r.weights, "bias": r.bias, "owned": r.owned})
        beta = members[0].prior_beta
        _json(folder / "prior.json", {"beta": beta or 0.0})
        calibration = Calibration.read(model.run_dir)  # predict(..., threshold=p) on the export as on the run
        if calibration is not None:
            differs = calibration.differs(score_source(model, fusion is not None))
            if differs is None:
                _json(folder / CALIBRATION_FILE, calibration.as_dict())
            else:  # the map fits another checkpoint's (or prior's) scores: thresholds on the export would be wrong
                log.warning("%s/%s not exported: %s", model.run_dir, CALIBRATION_FILE, differs)
        if members[0].label_names is not None:
            _json(folder / "label_names.json", members[0].label_names)
        cache_dir = dataset.meta.get("cache_dir", "")
        text_features = bool(dataset.meta.get("text_features"))
        if text_features and os.path.exists(os.path.join(cache_dir, "vocab.txt")):
            shutil.copyfile(os.path.join(cache_dir, "vocab.txt"), folder / "tfidf_vocab.txt")
            # the cache's own idf.npy (float32, no objects) becomes the export's safetensors
            idf = np.load(os.path.join(cache_dir, "idf.npy"), allow_pickle=False)
            _safetensors(folder / "tfidf.safetensors", {"idf": idf})
        manifest = seal(folder, {  # last: a folder without it was never an export
            "format": FORMAT, "version": VERSION, "kind": "ensemble" if ensemble else "model",
            "source": str(Path(model.run_dir).resolve()), "models": names,
            "num_labels": int(members[0].num_labels), "num_features": int(dataset.num_features),
            "text_features": text_features, "memory_points": int(dataset.train.num_points) if fusion is not None else 0})
        if check is not None:
            check(folder)
        return manifest

    return publish(Path(dest), write)


def _write_member(folder: Path, m, train_emb: torch.Tensor | None) -> None:
    folder.mkdir(parents=True)
    train_ids = m.components.train.train_ids
    tensors = {f"encoder.{k}": v for k, v in m.encoder.state_dict().items()}
    tensors["classifier.weight"] = m.shard.weight[:m.num_labels]
    # the counts the prior's bias is beta times (the validation split left out), so any beta can be served again
    tensors["classifier.log_counts"] = training_log_counts(m.dataset.train.labels, train_ids, m.num_labels)
    if m.feature_weights is not None:
        tensors["input.feature_weights"] = torch.from_numpy(m.feature_weights)
    lexical = getattr(m.shard, "lexical", None)
    if lexical is not None:  # model.lexical_features: each label's weights on its own features
        tensors["lexical.support"] = lexical.support[:m.num_labels]
        tensors["lexical.weight"] = lexical.values.weight[:m.num_labels].float()
    if train_emb is not None:
        tensors["memory.train_embeddings"] = train_emb
    _safetensors(folder / "model.safetensors", tensors)
    _json(folder / "config.json", {
        "config": m.meta["config"], "num_label_shards": m.meta["num_label_shards"],
        "checkpoint": m.checkpoint.name, "global_step": int(m.meta["global_step"]), "prior_beta": m.prior_beta,
        # what build_components derived the encoder's sizes from (xc/defaults/ resolve), to build the same one
        "resolve": {"num_points": int(m.dataset.train.num_points), "features_per_row": features_per_row(m.dataset)}})


def _csr(name: str, matrix) -> dict[str, np.ndarray]:
    out = {f"{name}.indptr": np.asarray(matrix.indptr, np.int64), f"{name}.indices": np.asarray(matrix.indices)}
    if matrix.values is not None:
        out[f"{name}.values"] = np.asarray(matrix.values)
    return out


def _safetensors(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    # safetensors stores contiguous, unshared tensors: each is copied out of its module, memmap or view
    save_file({k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v.detach().cpu().contiguous().clone()
               for k, v in tensors.items()}, str(path))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # safetensors creates its files owner-only; an export is shared as other files are


def _json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------- reading
class ExportedTfidf(TfidfFeaturizer):
    """New text featurised as the run's training text was (the data cache's `TfidfFeaturizer`, its `transform`),
    from the exported vocabulary and idf instead of the cache's files."""

    def __init__(self, terms: list[str], idf: np.ndarray):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.num_features = len(terms)
        self._vec = TfidfVectorizer(ngram_range=(1, NGRAM_MAX), vocabulary={t: i for i, t in enumerate(terms)},
                                    sublinear_tf=True, dtype=np.float32)
        self._vec.idf_ = idf.astype(np.float32)


def load_export(path, checkpoint=None, device: str = "cpu", batch_size: int | None = None):
    """An export as `xc.load` serves it: an ExportedModel, or an EnsembleModel of ExportedModel members."""
    path = Path(path)
    if checkpoint is not None:
        raise XCError(f"{path} is an export: it holds one model, not checkpoints to choose from")
    manifest = read_manifest(path)
    L, F, N = manifest["num_labels"], manifest["num_features"], manifest["memory_points"]
    fusion = fusion_choice(listed(path, manifest, "fusion.json"))
    train = SimpleNamespace(features=None, labels=None, num_points=N)
    if fusion is not None:
        file = listed(path, manifest, "memory.safetensors")
        if file is None:
            raise fail(path / MANIFEST, "files", "fusion.json without memory.safetensors (the kNN memory)")
        memory = read_tensors(file, {})
        train.labels, train.features = csr_matrix(memory, file, "train_labels", N, L), \
            csr_matrix(memory, file, "train_features", N, F)
        if train.labels is None or (fusion.needs_features and train.features is None):
            raise fail(file, "train_labels" if train.labels is None else "train_features", "missing")
    dataset = SimpleNamespace(num_labels=L, num_features=F, train=train, label_texts_path=None,
                              meta={"text_features": manifest["text_features"]})
    ranker = None
    if fusion is not None and fusion.gamma:
        file = listed(path, manifest, "ranker.safetensors")
        if file is None:
            raise fail(path / "fusion.json", "gamma", "a lexical ranker, but the export lists no ranker.safetensors")
        r = {k: v.numpy() for k, v in read_tensors(file, {"keys": ((None,), "i"), "weights": ((None,), "f"),
                                                         "bias": ((L,), "f"), "owned": ((L,), "b")}).items()}
        if r["keys"].shape != r["weights"].shape:
            raise fail(file, "weights", f"shape {r['weights'].shape} where keys make it {r['keys'].shape}")
        ranker = LexicalRanker(r["keys"], r["weights"], r["bias"], r["owned"], F)
    featurizer = None
    vocab = listed(path, manifest, "tfidf_vocab.txt")
    if vocab is not None:
        terms = vocab.read_text(encoding="utf-8").split("\n")
        terms = terms[:-1] if terms and terms[-1] == "" else terms
        idf = listed(path, manifest, "tfidf.safetensors")
        if len(terms) != F or idf is None:
            raise fail(vocab, "terms", f"{len(terms)} terms (and the idf in tfidf.safetensors) where the manifest "
                       f"has {F} features")
        featurizer = ExportedTfidf(terms, read_tensors(idf, {"idf": ((F,), "f")})["idf"].numpy())
    names = None
    if (file := listed(path, manifest, "label_names.json")) is not None:
        names = read_json(file)
        if not isinstance(names, list) or len(names) != L or not all(isinstance(n, str) for n in names):
            raise fail(file, "(top level)", f"a list of {L} label names (strings) expected")
    shared = SimpleNamespace(dataset=dataset, label_names=names, featurizer=featurizer)
    models = [ExportedModel(path / name, shared, device, batch_size, fusion) for name in manifest["models"]]
    evaluator = _evaluator(models, dataset, ranker)
    if manifest["kind"] == "model":
        model = models[0]
        model.run_dir, model.fusion = path, fusion
        model._memory = evaluator if fusion is not None else None
        return model
    ensemble = object.__new__(EnsembleModel)  # EnsembleModel.__init__ reads a run; here its parts are given
    first = models[0]
    ensemble.run_dir, ensemble.members, ensemble.memory, ensemble.fusion = path, models, evaluator, fusion
    ensemble.cfg, ensemble.dataset, ensemble.mode = first.cfg, dataset, first.mode
    ensemble.num_labels, ensemble.label_names = L, names
    ensemble.checkpoint = SimpleNamespace(name=f"export of an ensemble of {len(models)} "
                                               f"({', '.join(m.checkpoint.name for m in models)})")
    return ensemble


def _evaluator(models: list[ExportedModel], dataset, ranker):
    """The models' side of fusion (xc/fitting/memory.py) with the exported memory: training embeddings given, not
    encoded from the data, and the ranker given, not read from rank parts."""
    memories = []
    for m in models:
        mm = ModelMemory(m.cfg.eval, m.cfg.sampler.loss, m.encoder, m.shard, None, None, None, dataset, m.ctx)
        mm._train_emb = m.train_embeddings
        memories.append(mm)
    evaluator = FusionEvaluator(memories, dataset)
    evaluator.ranker = ranker
    return evaluator


class ExportedModel(TrainedModel):
    """One exported model, served as `TrainedModel` serves its run (the same predict, encode, ANN serving)."""

    def __init__(self, folder: Path, shared, device: str = "cpu", batch_size: int | None = None, fusion=None):
        info, L, F = member_info(folder / "config.json"), shared.dataset.num_labels, shared.dataset.num_features
        self.run_dir, self.meta = folder, {"global_step": info["global_step"]}
        self.checkpoint = SimpleNamespace(name=info["checkpoint"])
        self.cfg = cfg = member_config(info, folder / "config.json", device)
        dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.ctx = DistContext(device=dev)
        self.mode, self.components, self.text_encoder = "classifier", None, False
        self.batch_size = batch_size or cfg.eval.batch_size
        self.dataset, self.label_names, self._featurizer = shared.dataset, shared.label_names, shared.featurizer
        self.num_labels = L
        self._tokenizer = None
        try:  # the encoder's sizes as build_components derived them (a no-op for a resolved config)
            model_cfg = resolve(cfg, info["resolve"]["num_points"], L, F, dev.type, 1,
                                info["resolve"]["features_per_row"]).model
            with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten: the caller's RNG stays
                self.encoder = build_encoder(model_cfg, F).to(dev)
        except (XCError, ValueError, TypeError, RuntimeError) as exc:
            raise fail(folder / "config.json", "config.model", f"builds no encoder ({exc})") from None
        d, N = self.encoder.out_dim, shared.dataset.train.num_points
        embeddings = fusion is not None and fusion.space in ("embedding", "both")
        file = folder / "model.safetensors"
        S = cfg.model.lexical_features or 0
        tensors = read_tensors(file, {"classifier.weight": ((L, d), "f"), "classifier.log_counts": ((L,), "f"),
                                      "input.feature_weights": ((F,), "f"), "memory.train_embeddings": ((N, d), "f"),
                                      "lexical.support": ((L, S), "i"), "lexical.weight": ((L, S), "f")},
                               optional=("input.feature_weights",) + (() if embeddings else ("memory.train_embeddings",))
                               + (() if S else ("lexical.support", "lexical.weight")))
        self.encoder.autocast = autocast_dtype(cfg.train.amp, dev)
        try:
            self.encoder.load_state_dict({k[len("encoder."):]: v for k, v in tensors.items() if k.startswith("encoder.")})
        except RuntimeError as exc:  # missing, unexpected or mis-shaped keys: torch lists them over many lines
            raise fail(file, "encoder.*", f"not the encoder config.json describes ({' '.join(str(exc).split())[:300]})") \
                from None
        self.layout = ShardLayout.build(self.num_labels, info["num_label_shards"], cfg.parallel.shard_multiple)
        lo, hi = self.layout.rank_range(0, 1)
        rows = tensors["classifier.weight"]
        self.shard = ClassifierShard(lo, hi, self.num_labels, rows.shape[1], 0.0, cfg.seed, dev, rows.dtype)
        self.shard.weight[:self.num_labels] = rows.to(dev)
        if S:  # model.lexical_features: each label's weights on its own features, scored with the rows
            self.shard.lexical = _lexical_rows(file, tensors, lo, hi, L, F, cfg.seed, dev)
        self.log_counts = tensors["classifier.log_counts"]
        weights = tensors.get("input.feature_weights")
        self.feature_weights = None if weights is None else weights.numpy()
        self.train_embeddings = tensors.get("memory.train_embeddings")
        self._exported_beta = info["prior_beta"]
        self.use_prior(True)
        self.searcher = ExactSearcher(self.shard)
        self.fusion, self._memory = None, None  # an ensemble member's; load_export sets a single model's

    def use_prior(self, on: bool = True, beta: float | None = None) -> float | None:
        """As `TrainedModel.use_prior`, from the exported counts; `beta` None: the beta the export was served with."""
        beta = 0.0 if not on else (self._exported_beta if beta is None else beta)
        install(self.shard, beta or 0.0, self.log_counts)
        self.prior_beta = beta or None
        return self.prior_beta

    def _features_of_texts(self, texts: list[str]):
        if self._featurizer is None:
            raise DataFormatError("<input>", 0, "format", "raw text, but this model reads feature rows (the export "
                                  "holds no tf-idf vocabulary)")
        return self._featurizer.transform(texts)

    def __repr__(self) -> str:
        return (f"<ExportedModel {self.run_dir} {self.checkpoint.name} labels={self.num_labels} "
                f"reads={self.input_kind} fusion={self.fusion.as_dict() if self.fusion else None}>")


def _lexical_rows(file: Path, tensors: dict, lo: int, hi: int, num_labels: int, num_features: int, seed: int,
                  device: torch.device) -> LexicalRows:
    """The exported lexical weights (lexical.support (L, S) feature ids, -1 pads; lexical.weight (L, S)) as the
    run's LexicalRows: ids outside [-1, F) or weights that are not finite are refused, naming the field."""
    support, weight = tensors["lexical.support"], tensors["lexical.weight"]
    if support.numel() and (int(support.min()) < -1 or int(support.max()) >= num_features):
        raise fail(file, "lexical.support", f"feature ids in [{int(support.min())}, {int(support.max())}], outside "
                   f"[-1, {num_features}) (-1 pads)")
    if not bool(torch.isfinite(weight).all()):
        raise fail(file, "lexical.weight", "holds values that are not finite")
    rows = LexicalRows.build(support.to(torch.int32).numpy(), lo, hi, num_labels, num_features, seed, device)
    rows.values.weight[:num_labels] = weight.to(device)
    return rows
