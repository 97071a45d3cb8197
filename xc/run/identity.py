"""Run identity: what a run directory's checkpoints were trained on, checked before anything is written.

A run directory is resumed by default (`train.resume=auto`), so a command that points at another
dataset, or at another model shape, must not continue (or "evaluate only") the run that happens to
live there. The identity of a run is

* a fingerprint of the data *content*: the counts (labels, features, train and test points) and a
  sha256 over each label/feature array and text file: its size and three 1 MiB samples (head, middle,
  tail), read from the memmaps of the converted data. It does not depend on where the data lies
  (`data.path`, `data.cache_dir`), only on what it holds, so a moved dataset still resumes and a
  regenerated one (another generator seed, same L and F) does not;
* every config key that changes the model's structure or parameters: `model.*` except the training
  hyper-parameters (`lr_encoder`, dropouts, the initialisation scale), and the `data.*` keys that
  change what is trained on (`label_text_augmentation`, `max_len`, ...), but not locations or the
  run's name.

It is kept in `RUN_DIR/identity.json` and in every checkpoint's meta.json. `differences` compares
this run's identity with the stored one and names each difference with both values; xc/run/guard.py
calls it before config.json, log.jsonl or wandb are touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from xc.config import XCConfig, to_dict
from xc.errors import CheckpointError
from xc.fsutil import sampled_digest
from xc.run import checkpoint as ckpt

IDENTITY_FILE = "identity.json"
# Written by rank 0 right after it takes the run's lock (xc/run/lock.py), before anything else: a folder holding it
# is an xc run's even when a start crashed before identity.json (xc/run/guard.py `check_run_dir_is_ours`).
RUN_MARKER = ".xc-run"
VERSION = 1
_SAMPLE = 1 << 20  # bytes per sample of an array or file
# model.* keys that are training hyper-parameters (or the initialisation, or where the weights lie), not the
# model: a resume may change them. The rows' precision is among them: a checkpoint's rows load into any precision
# (ClassifierShard.load_state_dict), and runs from before `model.classifier_dtype: auto` recorded float32.
_MODEL_HYPER = ("lr_encoder", "dropout", "input_dropout", "classifier_init_std", "classifier_init",
                "classifier_init_scale", "path", "classifier_dtype", "classifier_master_fp32", "classifier_rounding")
# data.* keys that say where the data lies or what it is called, or that the content fingerprint covers.
_DATA_LOCATION = ("name", "path", "cache_dir", "synthetic", "synthetic_lf")


def _sample_digest(path: Path) -> str:
    """sha256 of a file's size and of 1 MiB at its head, middle and tail (cheap at any size)."""
    size = path.stat().st_size
    starts = sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)})
    return sampled_digest(path, hashlib.sha256(str(size).encode()), [(start, _SAMPLE) for start in starts])


def _array_digest(array) -> str:
    """The same for an array (a memmap is read only where sampled)."""
    flat = np.asarray(array).reshape(-1)
    per = max(1, _SAMPLE // max(1, flat.itemsize))
    digest = hashlib.sha256(f"{flat.dtype}:{flat.shape[0]}".encode())
    for start in sorted({0, max(0, flat.shape[0] // 2 - per // 2), max(0, flat.shape[0] - per)}):
        digest.update(np.ascontiguousarray(flat[start:start + per]).tobytes())
    return digest.hexdigest()


def data_fingerprint(dataset) -> dict[str, Any]:
    """Counts and a content digest of a loaded dataset: its label and feature arrays and its text files
    (not whatever else a cache directory may come to hold, such as derived caches)."""
    counts = {"num_labels": int(dataset.num_labels), "num_features": int(dataset.num_features),
              "num_train": int(dataset.train.num_points), "num_test": int(dataset.test.num_points)}
    digest = hashlib.sha256(json.dumps(counts, sort_keys=True).encode())
    for split in (dataset.train, dataset.test):
        for name in ("labels", "features"):
            matrix = getattr(split, name, None)
            for part in ("indptr", "indices", "values"):
                array = None if matrix is None else getattr(matrix, part, None)
                if array is not None:
                    digest.update(f"{split.name}.{name}.{part}\0{_array_digest(array)}".encode())
        if split.texts_path and Path(split.texts_path).is_file():
            digest.update(f"{split.name}.texts\0{_sample_digest(Path(split.texts_path))}".encode())
    if dataset.label_texts_path and Path(dataset.label_texts_path).is_file():
        digest.update(f"label_texts\0{_sample_digest(Path(dataset.label_texts_path))}".encode())
    return dict(counts, content=digest.hexdigest()[:32])


def config_identity(cfg: XCConfig) -> dict[str, Any]:
    """The config keys (dotted) that change what a checkpoint holds."""
    flat: dict[str, Any] = {}
    model = to_dict(cfg.model)
    for key, value in model.items():
        # lexical_features null, feature_weighting auto: the rule decides (a resumed run keeps its checkpoint's:
        # xc/train/plan.py), so a run given the rule resumes one trained with its answer, or from before the rule
        if key not in _MODEL_HYPER and not (key == "lexical_features" and value is None) \
                and not (key == "feature_weighting" and value == "auto"):
            flat[f"model.{key}"] = value
    for key, value in to_dict(cfg.data).items():
        if key not in _DATA_LOCATION:
            flat[f"data.{key}"] = value
    return flat


def run_identity(cfg: XCConfig, dataset) -> dict[str, Any]:
    return {"version": VERSION, "data": data_fingerprint(dataset), "config": config_identity(cfg)}


def stored_identity(run_dir: str | Path) -> dict[str, Any] | None:
    """The identity recorded for the run in `run_dir`: identity.json, else what the newest checkpoint's
    meta.json says (older checkpoints: only their config keys), else None."""
    file = Path(run_dir) / IDENTITY_FILE
    if file.is_file():
        try:
            return json.loads(file.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{file}: unreadable ({exc}); move it away to resume without the check") from exc
    for path in reversed(ckpt.list_checkpoints(run_dir)):
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue  # a damaged checkpoint: the resume will skip it and say so
        if isinstance(meta.get("identity"), dict):
            return meta["identity"]
        config = meta.get("config")
        if isinstance(config, dict) and isinstance(config.get("model"), dict):
            old = dict(config.get("model")), dict(config.get("data") or {})
            flat = {f"model.{k}": v for k, v in old[0].items() if k not in _MODEL_HYPER}
            flat.update({f"data.{k}": v for k, v in old[1].items() if k not in _DATA_LOCATION})
            layout = meta.get("layout") or {}
            data = {"num_labels": layout["num_labels"]} if "num_labels" in layout else {}
            return {"version": 0, "data": data, "config": flat}
    return None


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two identities (keys missing from either side are skipped:
    an older run directory records less)."""
    out = []
    old_data, new_data = stored.get("data") or {}, current.get("data") or {}
    words = {"num_labels": "labels", "num_features": "features", "num_train": "training points",
             "num_test": "test points"}
    for key, word in words.items():
        if key in old_data and key in new_data and old_data[key] != new_data[key]:
            out.append(f"it was trained on {old_data[key]} {word}, but this run's data has {new_data[key]}")
    if not out and "content" in old_data and "content" in new_data and old_data["content"] != new_data["content"]:
        out.append("the data has the same counts but other content (another dataset, generator seed or file)")
    old_cfg, new_cfg = stored.get("config") or {}, current.get("config") or {}
    for key in sorted(set(old_cfg) & set(new_cfg)):
        if old_cfg[key] != new_cfg[key]:
            out.append(f"{key} was {json.dumps(old_cfg[key])}, this run sets {json.dumps(new_cfg[key])}")
    return out


def write_identity(run_dir: str | Path, identity: dict[str, Any]) -> None:
    path = Path(run_dir) / IDENTITY_FILE
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(identity, indent=1))
    os.replace(tmp, path)


def is_identity(obj: Any) -> bool:
    """Whether `obj` (parsed identity.json) is an identity xc wrote, not a user's file of the same name."""
    return isinstance(obj, dict) and isinstance(obj.get("version"), int) and isinstance(obj.get("config"), dict) \
        and isinstance(obj.get("data"), dict)


def holds_identity(directory: str | Path) -> bool:
    """Whether `directory` holds an identity.json that xc wrote."""
    try:
        return is_identity(json.loads((Path(directory) / IDENTITY_FILE).read_text()))
    except (OSError, ValueError):
        return False


def write_run_marker(run_dir: str | Path, fresh: bool = False) -> None:
    """Mark `run_dir` as an xc run's (once; the lock holder calls it before writing anything else there), with a
    random run id that every checkpoint of the run records (`run_id`): a checkpoint of another run copied into
    this one is known by it. `fresh`: a new run in an old run's directory (train.resume=never) gets a new id."""
    path = Path(run_dir) / RUN_MARKER
    if fresh or not path.is_file() or run_id(run_dir) is None:
        path.write_text(json.dumps({"written_by": "xc", "what": "this folder holds an xc run",
                                    "run_id": uuid.uuid4().hex}) + "\n")


def run_id(run_dir: str | Path) -> str | None:
    """The run id in `run_dir`'s marker; None for a folder without one (a run from before run ids)."""
    try:
        found = json.loads((Path(run_dir) / RUN_MARKER).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def checkpoint_of_another_run(run_dir: str | Path, checkpoint: str | Path, meta: dict[str, Any]) -> str | None:
    """Why the checkpoint `checkpoint` (its validated meta.json `meta`), named for the run in `run_dir`, was trained
    by another run; None when it is that run's own. The run's kNN fusion, ranker and label prior were chosen for the
    run's own model, so xc-eval / xc-predict / xc.load apply them only then, and score another run's checkpoint
    alone. Another number of labels cannot be scored against this run at all: CheckpointError.

    Another run is a checkpoint that lies in another run directory's checkpoints/ (an ensemble's members are the
    run's own), that records another run id than its run directory's marker (a checkpoint copied in), or whose
    identity (data, model) differs from the run's."""
    run_dir, checkpoint = Path(run_dir).resolve(), Path(checkpoint).resolve()
    try:
        stored = stored_identity(run_dir)
    except CheckpointError:  # an unreadable identity.json: judged by the checkpoint's place alone
        stored = None
    run_labels = ((stored or {}).get("data") or {}).get("num_labels")
    ckpt_labels = (meta.get("layout") or {}).get("num_labels", ((meta.get("identity") or {}).get("data") or {})
                                                  .get("num_labels"))
    home = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if run_labels is not None and ckpt_labels is not None and int(run_labels) != int(ckpt_labels):
        own = f"; evaluate it in its own run directory ({home})" if home is not None else ""
        raise CheckpointError(f"checkpoint {checkpoint} has {ckpt_labels} labels and the run in {run_dir} has "
                              f"{run_labels}: it belongs to another run{own}")
    if home is not None and home != run_dir and not (home.parent.name == "members" and home.parent.parent == run_dir):
        return f"it lies in another run directory, {home}"
    expected, written = run_id(home or run_dir), meta.get("run_id")
    if expected is not None and written is not None and written != expected:
        return f"it was written by run {written}, and this run is {expected} (copied in from another run?)"
    if stored is not None and isinstance(meta.get("identity"), dict):
        diffs = differences(stored, meta["identity"])
        if diffs:
            return diffs[0]
    return None
