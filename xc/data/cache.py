"""Convert-once cache: every source becomes a directory of .npy files that later runs just memmap.

Layout of ``cache_dir``::

    <kind>-<source dir name>-<8 hex: source identity>-<12 hex: key>/   (synthetic: synthetic-<16 hex key>/)
        meta.json                      written last; readers trust a directory only through it. Its "checksums"
                                       give every .npy/.txt file's size, sampled blake2b (checked at every open)
                                       and whole-file blake2b (`xc-data verify`)
        {train,test}.labels.indptr.npy    int64 (N+1,)
        {train,test}.labels.indices.npy   int32 (nnz,)      label ids, sorted within each row
        {train,test}.features.{indptr,indices,values}.npy   int64 / int32 / float32   (BoW data)
        {train,test}.texts.txt + .texts.txt.offsets.npy     LF texts, one per line, int64 (N+1,) offsets
        label_texts.txt + label_texts.txt.offsets.npy       LF label texts
        label.features.*, vocab.txt, idf.npy                LF: tf-idf of the texts (text_features.py)
    .<name>.lock                       fcntl lock serialising conversion of <name> across processes

The key hashes the format version, kind, absolute source path and every source file's size and
mtime_ns (synthetic: the normalised generator parameters), so a changed source lands in a new
directory; older directories of the same source are deleted once the new one is complete.
Conversion writes into ``.tmp-<name>-*`` beside the target, fsyncs, then renames it into place.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile

import logging

import numpy as np

from ..errors import ConfigError, DataFormatError
from ..fsutil import exclusive_lock, fsync_dir, sampled_digest, storage_error
from .records import KINDS as RECORD_KINDS
from .records import RecordFields
from .sources import KINDS as SOURCE_KINDS
from .sources import convert_source, source_files
from .sparse import XCDataset, XCSplit, load_csr
from .synthetic import DEFAULTS as SYNTHETIC_DEFAULTS
from .synthetic import normalize_params, synthetic_key, write_synthetic

FORMAT_VERSION = 3  # 2: lf_raw directories carry tf-idf features (text_features.py); 3: per-file checksums
# A cache directory of an earlier version is stale (rebuilt from its source); a directory opened by path (one made by
# `xc-data generate`) of version 2 is still read, without verification, since it has no source to rebuild from.
READABLE_VERSIONS = (2, FORMAT_VERSION)
_SAMPLE_EDGE = 1 << 20  # the sampled hash reads the first and last MiB ...
_SAMPLE_BLOCK = 1 << 16  # ... and this many bytes at _SAMPLE_COUNT evenly spaced offsets in between
_SAMPLE_COUNT = 8
KINDS = SOURCE_KINDS + ("synthetic",)
log = logging.getLogger(__name__)


class CacheDamagedError(DataFormatError):
    """A cached file whose size or sampled hash differs from the one meta.json recorded when it was written."""

    def __init__(self, path: str, directory: str, what: str):
        self.directory, self.what = directory, what
        super().__init__(path, 0, "checksum", f"{what}: the file is damaged; delete {directory} and convert (or "
                         "generate) the dataset again")


def _sampled_hash(path: str, size: int) -> str:
    """blake2b of the size, the first and last MiB and a few evenly spaced 64 KiB blocks (the whole file when small):
    what opening a cache directory checks, cheap at any size."""
    if size <= 2 * _SAMPLE_EDGE + _SAMPLE_COUNT * _SAMPLE_BLOCK:
        spans = [(0, size)]
    else:
        offsets = [0] + [_SAMPLE_EDGE + (size - 2 * _SAMPLE_EDGE - _SAMPLE_BLOCK) * i // (_SAMPLE_COUNT - 1)
                         for i in range(_SAMPLE_COUNT)] + [size - _SAMPLE_EDGE]
        spans = zip(offsets, [_SAMPLE_EDGE] + [_SAMPLE_BLOCK] * _SAMPLE_COUNT + [_SAMPLE_EDGE])
    return sampled_digest(path, hashlib.blake2b(str(size).encode(), digest_size=16), spans)


def _full_hash(path: str) -> str:
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _checksum_files(directory: str) -> list[str]:
    """Every .npy and .txt file under ``directory``, as sorted relative paths."""
    out = []
    for root, _, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(root, f), directory) for f in files if f.endswith((".npy", ".txt"))]
    return sorted(out)


def file_checksums(directory: str) -> dict:
    """{relative path: {"size", "sample" (sampled blake2b), "blake2b" (whole file)}} of the arrays and texts."""
    out = {}
    for rel in _checksum_files(directory):
        path = os.path.join(directory, rel)
        size = os.path.getsize(path)
        out[rel] = {"size": size, "sample": _sampled_hash(path, size), "blake2b": _full_hash(path)}
    return out


def verify_checksums(directory: str, meta: dict, full: bool = False) -> list[tuple[str, str]]:
    """[(file, what is wrong)] of the files meta.json's checksums name: sizes and sampled hashes, or (``full``)
    whole-file hashes. Empty when all agree (or when the directory predates checksums)."""
    bad = []
    for rel, want in sorted((meta.get("checksums") or {}).items()):
        path = os.path.join(directory, rel)
        if os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            bad.append((path, "names a path outside the directory"))
            continue
        try:
            size = os.path.getsize(path)
            if size != want["size"]:
                bad.append((path, f"size {size} bytes, meta.json recorded {want['size']}"))
            elif full and _full_hash(path) != want["blake2b"]:
                bad.append((path, "contents differ from the blake2b meta.json recorded"))
            elif not full and _sampled_hash(path, size) != want["sample"]:
                bad.append((path, "contents differ from the sampled hash meta.json recorded"))
        except FileNotFoundError:
            bad.append((path, "missing"))
        except (OSError, KeyError, TypeError) as e:
            bad.append((path, f"cannot be checked ({e})"))
    return bad


def _remove_dir(path: str) -> None:
    """Delete a directory so that it vanishes atomically (rename first, then remove at leisure)."""
    trash = tempfile.mkdtemp(prefix=".trash-", dir=os.path.dirname(os.path.abspath(path)))
    os.rename(path, os.path.join(trash, "d"))
    shutil.rmtree(trash, ignore_errors=True)


def build_atomically(target: str, fill, extra: dict, replace_foreign: bool = True) -> dict:
    """Run ``fill(tmp_dir) -> meta`` in a fresh sibling of ``target`` and rename it into place.

    ``extra`` is merged into the meta written as ``meta.json`` (last, via temp file + fsync). An
    existing ``target`` is replaced; if it holds files but no meta.json it is only replaced when
    ``replace_foreign`` (cache directories), never a user's unrelated directory.
    """
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    foreign = os.path.lexists(target) and not (
        os.path.isdir(target) and (not os.listdir(target) or os.path.exists(os.path.join(target, "meta.json"))))
    if foreign and not replace_foreign:
        raise ConfigError("out", f"{target} exists and is not an empty directory or a generated dataset")
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(target)}-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared with other users' runs
        meta = dict(fill(tmp), format_version=FORMAT_VERSION, **extra)
        meta["checksums"] = file_checksums(tmp)  # read back once, while the files are still in the page cache
        with open(os.path.join(tmp, "meta.json.part"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(tmp, "meta.json.part"), os.path.join(tmp, "meta.json"))
        fsync_dir(tmp)
        if os.path.lexists(target):
            _remove_dir(target)
        os.rename(tmp, target)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _read_meta(directory: str, versions: tuple = (FORMAT_VERSION,)) -> dict:
    path = os.path.join(directory, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataFormatError(path, 0, "meta.json", "missing: not a converted dataset directory") from None
    except (OSError, ValueError) as e:
        raise DataFormatError(path, 0, "meta.json", f"unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") not in versions:
        raise DataFormatError(path, 0, "meta.json",
                              f"format_version is not {' or '.join(map(str, versions))}")
    return meta


def open_dataset(directory: str) -> XCDataset:
    """Memmap a converted (or generated) dataset directory; nothing is read beyond meta.json and
    the .npy headers."""
    directory = os.path.abspath(directory)
    meta = _read_meta(directory, READABLE_VERSIONS)
    bad = verify_checksums(directory, meta)
    if bad:
        path, what = bad[0]
        raise CacheDamagedError(path, directory, what)
    try:
        splits = {}
        for name in ("train", "test"):
            s = meta[name]
            labels = load_csr(directory, f"{name}.labels", meta["num_labels"])
            feats = load_csr(directory, f"{name}.features", meta["num_features"]) if s["features"] else None
            texts = os.path.join(directory, s["texts"]) if s["texts"] else None
            if labels.num_rows != s["num_points"] or (feats is not None and feats.num_rows != labels.num_rows):
                raise ValueError(f"{name} row counts disagree with meta.json")
            splits[name] = XCSplit(name, labels, feats, texts)
    except (KeyError, TypeError, OSError, ValueError) as e:
        raise DataFormatError(os.path.join(directory, "meta.json"), 0, "meta.json",
                              f"dataset files incomplete or inconsistent ({e})") from None
    label_texts = os.path.join(directory, meta["label_texts"]) if meta.get("label_texts") else None
    label_features = (load_csr(directory, "label.features", meta["num_features"])
                      if meta.get("label_features") else None)
    extra = dict(meta.get("meta") or {})
    if meta.get("text_features"):
        extra["text_features"] = meta["text_features"]
    extra.update(kind=meta.get("kind"), source=meta.get("source"), cache_dir=directory)
    return XCDataset(splits["train"], splits["test"], int(meta["num_labels"]), int(meta["num_features"]),
                     label_texts, extra, label_features)


def _identity(kind: str, path: str | None, synthetic: dict | None, fields: RecordFields | None = None):
    """(directory name, key, stale-sibling glob or None, source description) of a load request."""
    if kind == "synthetic":
        key = synthetic_key(synthetic)
        return f"synthetic-{key[:16]}", key, None, {"generator": normalize_params(synthetic)}
    if not path:
        raise ConfigError("data.path", f"required for dataset kind {kind!r}")
    src = os.path.abspath(path)
    stats = []
    for f in source_files(kind, src):
        try:
            st = os.stat(f)
            stats.append([os.path.basename(f), st.st_size, st.st_mtime_ns])
        except OSError:
            stats.append([os.path.basename(f), None, None])  # conversion will report it missing
    ident_body = {"v": FORMAT_VERSION, "kind": kind, "src": src, "files": stats}
    if fields is not None:  # which fields are read decides the converted arrays
        ident_body["fields"] = fields.__dict__
    blob = json.dumps(ident_body, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()
    ident = hashlib.sha256(f"{kind}\0{src}".encode()).hexdigest()[:8]
    stem = f"{kind}-{os.path.basename(src.rstrip(os.sep)) or 'root'}-{ident}"
    return f"{stem}-{key[:12]}", key, glob.escape(stem) + "-*", {"path": src, "files": stats}


def _try_open(target: str, key: str, say_damage: bool = True) -> XCDataset | None:
    """The cached dataset at ``target`` when it is complete, of this version and undamaged, else None (a damaged
    one is said in one warning where `say_damage`: the caller converts it again from the source). The second look,
    under the conversion lock, says nothing: the first already did, and the user has nothing to delete."""
    try:
        if _read_meta(target).get("key") == key:
            return open_dataset(target)
    except CacheDamagedError as e:
        if say_damage:
            log.warning("dataset cache damaged (%s: %s); converting the dataset again from its source into %s",
                        e.path, e.what, e.directory)
    except DataFormatError:
        pass
    return None


def load_dataset(kind: str, path: str | None, cache_dir: str, synthetic: dict | None = None,
                 fields: RecordFields | None = None) -> XCDataset:
    """Load ``kind`` data from ``path`` through the cache in ``cache_dir`` (converting it on first use).

    kind: ``xc_sparse`` | ``lf_raw`` | ``npz`` | ``arff`` | ``libsvm`` | ``jsonl`` | ``csv`` | ``tsv`` (``path`` =
    source directory, see ``formats`` and ``records``; ``fields`` names the records' text and labels fields) or
    ``synthetic`` (``synthetic`` = generator parameters, defaults filled in; ``path`` ignored, except
    that ``synthetic=None`` with a ``path`` opens a directory made by ``xc-data generate``).
    Safe to call from several processes at once: one converts under a lock, the others wait and read.
    Raises DataFormatError for malformed sources, ConfigError for bad arguments.
    """
    if kind not in KINDS:
        raise ConfigError("data.kind", f"unknown dataset kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == "synthetic" and synthetic is None and path:
        return open_dataset(path)
    fields = (fields or RecordFields()) if kind in RECORD_KINDS else None
    name, key, stale_glob, source = _identity(kind, path, synthetic, fields)
    target = os.path.join(os.path.abspath(cache_dir), name)
    ds = _try_open(target, key)
    if ds is not None:
        return ds
    try:
        return _convert_into_cache(kind, path, cache_dir, synthetic, fields, name, key, stale_glob, source, target)
    except OSError as exc:  # a read-only cache (mount or permissions), a full disk or quota: one line, not a traceback
        where = os.path.abspath(str(exc.filename)) if exc.filename else None
        error = storage_error(exc, f"could not write the dataset cache {cache_dir} (converting {name})",
                              "data.cache_dir must be a writable folder with free space: free some, fix its "
                              "permissions, or pass another data.cache_dir=")
        # a source file that cannot be read is not the cache's fault: its own error names it
        outside = where is not None and os.path.commonpath([where, os.path.abspath(cache_dir)]) != \
            os.path.abspath(cache_dir)
        if error is exc or outside:
            raise
        raise error from None


def _convert_into_cache(kind, path, cache_dir, synthetic, fields, name, key, stale_glob, source,
                        target) -> XCDataset:
    """load_dataset's conversion, under the cache's per-dataset lock (one process converts, the others wait)."""
    os.makedirs(cache_dir, exist_ok=True)
    with exclusive_lock(os.path.join(cache_dir, f".{name}.lock")):  # released also if we crash
        ds = _try_open(target, key, say_damage=False)  # someone else may have converted while we waited
        if ds is not None:
            return ds
        for dead in glob.glob(os.path.join(glob.escape(cache_dir), glob.escape(f".tmp-{name}-") + "*")):
            shutil.rmtree(dead, ignore_errors=True)  # we hold the lock, so its writer is gone
        if kind == "synthetic":
            fill = lambda tmp: write_synthetic(tmp, synthetic)  # noqa: E731
        else:
            fill = lambda tmp: convert_source(kind, path, tmp, fields)  # noqa: E731
        build_atomically(target, fill, {"kind": kind, "key": key, "source": source})
        if stale_glob:
            for old in glob.glob(os.path.join(glob.escape(cache_dir), stale_glob)):
                if os.path.abspath(old) != target and len(os.path.basename(old)) == len(name):
                    _remove_dir(old)  # a memmap still open on old files keeps working on Linux
        return open_dataset(target)


def read_texts(path: str, rows: np.ndarray | None = None) -> list[str]:
    """Texts of a ``texts_path``/``label_texts_path`` file: all lines, or those at ``rows``
    (random access through the ``.offsets.npy`` file written beside it, when present)."""
    offsets_path = path + ".offsets.npy"
    if rows is None or not os.path.exists(offsets_path):
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last line, it does not start a new one
        return lines if rows is None else [lines[int(r)] for r in rows]
    offsets = np.load(offsets_path, mmap_mode="r")
    data = np.memmap(path, dtype=np.uint8, mode="r") if offsets[-1] > 0 else np.zeros(0, np.uint8)
    out = []
    for r in np.asarray(rows, dtype=np.int64).reshape(-1):
        out.append(bytes(data[offsets[r] : offsets[r + 1] - 1]).decode("utf-8"))
    return out


def generate_synthetic(out_dir: str, *, num_train: int = SYNTHETIC_DEFAULTS["num_train"],
                       num_test: int = SYNTHETIC_DEFAULTS["num_test"], num_labels: int = SYNTHETIC_DEFAULTS["num_labels"],
                       num_features: int = SYNTHETIC_DEFAULTS["num_features"], avg_labels: float = SYNTHETIC_DEFAULTS["avg_labels"],
                       max_labels: int = SYNTHETIC_DEFAULTS["max_labels"], zipf_alpha: float = SYNTHETIC_DEFAULTS["zipf_alpha"],
                       label_noise: float = SYNTHETIC_DEFAULTS["label_noise"],
                       signature_size: int = SYNTHETIC_DEFAULTS["signature_size"],
                       signature_keep: float = SYNTHETIC_DEFAULTS["signature_keep"],
                       background_features: float = SYNTHETIC_DEFAULTS["background_features"],
                       feature_alpha: float = SYNTHETIC_DEFAULTS["feature_alpha"],
                       seed: int = SYNTHETIC_DEFAULTS["seed"], family_size: int = SYNTHETIC_DEFAULTS["family_size"],
                       family_shared: int = SYNTHETIC_DEFAULTS["family_shared"],
                       xor_pairs: int = SYNTHETIC_DEFAULTS["xor_pairs"],
                       family_adjacent: int = SYNTHETIC_DEFAULTS["family_adjacent"]) -> XCDataset:
    """Generate a dataset into ``out_dir`` (atomically replacing an earlier generated one there; a
    non-empty directory that is not a dataset is refused) and return it memmapped."""
    params = normalize_params(dict(
        num_train=num_train, num_test=num_test, num_labels=num_labels, num_features=num_features,
        avg_labels=avg_labels, max_labels=max_labels, zipf_alpha=zipf_alpha, label_noise=label_noise,
        signature_size=signature_size, signature_keep=signature_keep,
        background_features=background_features, feature_alpha=feature_alpha, seed=seed,
        family_size=family_size, family_shared=family_shared, xor_pairs=xor_pairs, family_adjacent=family_adjacent))
    build_atomically(out_dir, lambda tmp: write_synthetic(tmp, params),
                     {"kind": "synthetic", "key": synthetic_key(params)}, replace_foreign=False)
    return open_dataset(out_dir)
