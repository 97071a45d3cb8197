"""An export's manifest and the checks every file it names passes before anything of it is served.

`xc-export` writes DIR/export.json last (`seal`): the format and version, what was exported, and every file's
bytes and sha256, then a sha256 of the manifest itself (`manifest_sha256`, over the canonical JSON of the other
fields). `read_manifest` refuses, in one line naming the file and the field, a manifest that is not what `seal`
writes, a file name that could reach outside DIR (absolute, "..", a symlink anywhere on the way: an export is
handed between parties, and its manifest must not make the reader serve another folder's files), and a file whose
size or checksum differs. The loaders below then check each file's structure (JSON fields and their types,
safetensors keys, dtypes kinds and shapes against the manifest), so an edited file whose checksums were recomputed
is still one line, not a traceback from deep inside torch or safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from xc.data.sparse import SparseMatrix
from xc.errors import CheckpointError, XCError
from xc.fitting.fusion import FusionChoice
from xc.fsutil import sha256_file
from xc.serve.model import restore_config

FORMAT, VERSION, MANIFEST = "xc-export", 3, "export.json"
# versions this xc reads: 3 added the labels' lexical weights (lexical.* in model.safetensors); 2 is 3 without them
READS_VERSIONS = (2, 3)
SELF_CHECKSUM = "manifest_sha256"
# a file name inside an export: plain parts of letters, digits, '.', '_' and '-', none of them "." or ".."
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MODEL_FOLDER = re.compile(r"model|members/m[0-9]+")
# the manifest's fields and their types (bool is kept apart from int: JSON true is no count)
FIELDS = {"format": str, "version": int, "kind": str, "source": str, "models": list, "num_labels": int,
          "num_features": int, "text_features": bool, "memory_points": int, "files": dict}


def is_export(path) -> bool:
    """Whether `path` is a folder `xc-export` wrote (its manifest names the format; any version)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def seal(folder: Path, fields: dict) -> dict:
    """Write `folder`/export.json: `fields`, every file under `folder` with its bytes and sha256, and the manifest's
    own sha256. Returns the manifest."""
    manifest = dict(fields, files={p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size,
                                                                      "sha256": sha256_file(p)}
                                   for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST})
    manifest[SELF_CHECKSUM] = hashlib.sha256(_canonical(manifest)).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return manifest


def fail(file, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{file}: {field}: {problem}; export the run again")


def check_name(folder: Path, name) -> Path:
    """`folder`/`name` where `name` is a plain relative path inside the folder (no absolute path, no "..", no
    symlink on the way); else CheckpointError naming the manifest's entry."""
    if not isinstance(name, str) or not name or not all(_PART.fullmatch(p) for p in name.split("/")):
        raise fail(folder / MANIFEST, "files", f"{name!r} is not a plain file name inside the export (no absolute "
                   "path, no '..')")
    path = folder
    for part in name.split("/"):
        path = path / part
        if path.is_symlink():
            raise fail(folder / MANIFEST, "files", f"{name} is a symbolic link ({path} -> {os.readlink(path)}): an "
                       "export holds its own files")
    if not path.resolve().is_relative_to(folder.resolve()):
        raise fail(folder / MANIFEST, "files", f"{name} lies outside the export")
    return path


def read_manifest(folder: Path) -> dict:
    """The manifest of export `folder`: its fields, names and own checksum checked, then every file it lists
    against its size and sha256."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the export's manifest ({exc})") from None
    if not isinstance(manifest, dict):
        raise fail(path, "(top level)", f"a JSON object expected, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT or manifest.get("version") not in READS_VERSIONS:
        raise CheckpointError(f"{folder}: export format {manifest.get('format')} version {manifest.get('version')}; "
                              f"this xc reads {FORMAT} version {VERSION}: export the run again")
    if manifest.get(SELF_CHECKSUM) != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise fail(path, SELF_CHECKSUM, "the manifest was changed after it was written (its sha256 differs)")
    for key, kind in FIELDS.items():
        value = manifest.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise fail(path, key, f"{kind.__name__} expected, found {json.dumps(value)}")
    for key in ("num_labels", "num_features", "memory_points"):
        if manifest[key] < (1 if key == "num_labels" else 0):
            raise fail(path, key, f"{manifest[key]} is out of range")
    kind, models = manifest["kind"], manifest["models"]
    if kind not in ("model", "ensemble") or not models or (kind == "model" and models != ["model"]) or \
            not all(isinstance(m, str) and MODEL_FOLDER.fullmatch(m) for m in models) or len(set(models)) < len(models):
        raise fail(path, "models", f"{json.dumps(models)} is not the model folders of a {kind!r} export "
                   "(\"model\", or \"members/m0\", \"members/m1\", ...)")
    for name, want in manifest["files"].items():
        file = check_name(folder, name)
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int) or \
                not isinstance(want.get("sha256"), str):
            raise fail(path, f"files.{name}", "{\"bytes\": int, \"sha256\": str} expected")
        if not file.is_file() or file.stat().st_size != want["bytes"] or sha256_file(file) != want["sha256"]:
            raise CheckpointError(f"{file}: missing or damaged (its size or sha256 is not what {MANIFEST} records)")
    for model in models:
        for name in ("config.json", "model.safetensors"):
            if f"{model}/{name}" not in manifest["files"]:
                raise fail(path, "files", f"{model}/{name} is not listed")
    return manifest


def listed(folder: Path, manifest: dict, name: str) -> Path | None:
    """`folder`/`name` where the manifest lists it (checked by `read_manifest`), else None: a file the manifest does
    not name is never read, whatever lies in the folder."""
    return folder / name if name in manifest["files"] else None


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc}); export the run again") from None


def field(body, path: Path, key: str, kind, optional: bool = False):
    """body[key] of type `kind` (a type or tuple; bool never counts as a number), else a one-line CheckpointError."""
    if not isinstance(body, dict):
        raise fail(path, "(top level)", f"a JSON object expected, found {type(body).__name__}")
    if optional and body.get(key) is None:
        return None
    value = body.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise fail(path, key, f"{names} expected, found {json.dumps(value) if key in body else 'nothing'}")
    return value


_KINDS = {"f": ("floating point", lambda t: t.is_floating_point),
          "i": ("integer", lambda t: not t.is_floating_point and not t.is_complex and t != torch.bool),
          "b": ("bool", lambda t: t == torch.bool)}


def read_tensors(path: Path, spec: dict[str, tuple[tuple, str]], optional: tuple[str, ...] = ()) -> dict:
    """The tensors of safetensors file `path`: each key of `spec` present (unless in `optional`), of its (shape,
    kind): a shape whose None axes take any size, and "f" floating point, "i" integer or "b" bool. An unreadable
    file, or one that is not safetensors (a pickle put in its place is never unpickled), is a one-line
    CheckpointError naming the file, and a key of the wrong shape or kind one naming the key."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with open(path, "rb") as handle:
            head = handle.read(9)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    # safetensors opens with its JSON header's length (8 bytes, little-endian), then the header, "{" first
    if len(head) < 9 or int.from_bytes(head[:8], "little") > os.path.getsize(path) - 8 or head[8:9] != b"{":
        raise CheckpointError(f"{path}: not a safetensors file; export the run again")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0]}); "
                              "export the run again") from None
    for key, (shape, kind) in spec.items():
        if key not in tensors:
            if key in optional:
                continue
            raise fail(path, key, "missing")
        got = tuple(tensors[key].shape)
        if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
            raise fail(path, key, f"shape {got} where the manifest makes it {want}")
        name, ok = _KINDS[kind]
        if not ok(tensors[key].dtype):
            raise fail(path, key, f"{name} values expected, found {tensors[key].dtype}")
    return tensors


# ---------------------------------------------------------------------------------------------------- files
def csr_matrix(arrays: dict, path: Path, name: str, rows: int, num_cols: int):
    """CSR matrix `name` of `arrays` (read from `path`), checked to have `rows` rows and indices in [0, num_cols)."""
    if f"{name}.indptr" not in arrays:
        return None
    indptr, indices = arrays[f"{name}.indptr"].numpy(), arrays.get(f"{name}.indices")
    if indptr.shape != (rows + 1,) or indices is None or indices.dim() != 1 or indices.is_floating_point():
        raise fail(path, name, f"a CSR matrix of {rows} rows ({name}.indptr ({rows + 1},), {name}.indices (nnz,) "
                   "integers) expected")
    indices, values = indices.numpy(), arrays.get(f"{name}.values")
    if indptr[0] != 0 or indptr[-1] != len(indices) or (np.diff(indptr) < 0).any() or \
            (len(indices) and (indices.min() < 0 or indices.max() >= num_cols)) or \
            (values is not None and tuple(values.shape) != (len(indices),)):
        raise fail(path, name, f"not a valid CSR matrix of {rows} x {num_cols}")
    return SparseMatrix(indptr, indices, None if values is None else values.numpy(), num_cols)


def fusion_choice(path: Path | None) -> FusionChoice | None:
    if path is None:
        return None
    body = read_json(path)
    choice = FusionChoice(float(field(body, path, "lambda", (int, float))), field(body, path, "k", int),
                          field(body, path, "space", str),
                          float(field(body, path, "temperature", (int, float), optional=True) or 1.0),
                          float(field(body, path, "gamma", (int, float), optional=True) or 0.0),
                          field(body, path, "ranker_parts", int, optional=True) or 0)
    for name, bad in (("lambda", not 0.0 <= choice.lam <= 1.0), ("k", choice.k < 1),
                      ("space", choice.space not in ("input", "embedding", "both")),
                      ("temperature", not choice.temperature > 0), ("gamma", not choice.gamma >= 0)):
        if bad:
            raise fail(path, name, f"{body[name]} is out of range")
    return choice


def member_info(path: Path) -> dict:
    """A model folder's config.json, its fields checked (what `_write_member` writes)."""
    info = read_json(path)
    field(info, path, "config", dict)
    field(info, path, "checkpoint", str)
    field(info, path, "global_step", int)
    field(info, path, "prior_beta", (int, float), optional=True)
    if field(info, path, "num_label_shards", int) < 1:
        raise fail(path, "num_label_shards", f"{info['num_label_shards']} is out of range")
    field(info, path, "resolve", dict)
    field(info["resolve"], path, "num_points", int)
    field(info["resolve"], path, "features_per_row", (int, float))
    return info


def member_config(info: dict, path: Path, device: str):
    try:
        return restore_config(info, device)
    except XCError as exc:
        raise fail(path, "config", str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a section missing or of the wrong type
        raise fail(path, "config", f"not a run's config ({type(exc).__name__}: {exc})") from None
