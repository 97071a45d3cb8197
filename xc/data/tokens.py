"""On-disk tokenization cache: texts tokenized once, then memory-mapped by every rank and worker.

Layout of a cache directory:
    ids.npy      (N, max_len) int32   token ids, right-padded with the tokenizer's pad id
    lengths.npy  (N,) int32           number of real tokens per row (incl. [CLS]/[SEP])
    meta.json    source file identity (path, size, mtime_ns), tokenizer path, max_len, N

The directory is built in a sibling temp directory and moved into place with os.replace,
so a cache directory that has a meta.json is complete. A sibling `<cache_dir>.lock` file
serialises builders (e.g. torchrun ranks on one node): the first builds, the rest wait
and re-use the result. flock is node-local on many network file systems, so ranks on
different nodes should use node-local cache directories.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import tempfile
from typing import Iterator

import numpy as np
import torch

from xc.errors import ConfigError, DataFormatError
from xc.fsutil import exclusive_lock

FORMAT_VERSION = 1
_CHUNK_LINES = 8192  # texts per tokenizer call: large enough to amortise the call overhead
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


class TokenCache:
    """Read-only view of a built cache directory (memory-mapped, cheap to open and to pickle).

    Attributes:
        num_rows: N, the number of texts.
        max_len: the padded width of `ids.npy`.
        pad_id: the id used in padding positions.
        meta: the parsed meta.json.
    """

    def __init__(self, cache_dir: str):
        self.cache_dir = str(cache_dir)
        meta_path = os.path.join(self.cache_dir, "meta.json")
        try:
            with open(meta_path, encoding="utf-8") as f:
                self.meta = json.load(f)
        except (OSError, ValueError) as e:
            raise DataFormatError(meta_path, 0, "meta", f"unreadable token cache metadata: {e}") from e
        self.ids = np.load(os.path.join(self.cache_dir, "ids.npy"), mmap_mode="r")
        self.lengths = np.load(os.path.join(self.cache_dir, "lengths.npy"), mmap_mode="r")
        self.num_rows = int(self.meta["num_rows"])
        self.max_len = int(self.meta["max_len"])
        self.pad_id = int(self.meta["pad_id"])
        if self.ids.shape != (self.num_rows, self.max_len) or self.lengths.shape != (self.num_rows,):
            raise DataFormatError(
                self.cache_dir, 0, "ids",
                f"arrays {self.ids.shape}/{self.lengths.shape} do not match meta.json "
                f"({self.num_rows} rows, max_len {self.max_len}); delete the directory to rebuild",
            )

    def __len__(self) -> int:
        return self.num_rows

    # A pickled np.memmap becomes a full in-memory copy; DataLoader workers (spawn) would
    # each get one. Pickle the directory instead and re-map on the other side.
    def __getstate__(self) -> dict:
        return {"cache_dir": self.cache_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["cache_dir"])

    def gather(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """Token batch for `rows`.

        Args:
            rows: (B,) integer row indices, any order, repeats allowed.

        Returns:
            "input_ids" (B, T_b) int64 and "attention_mask" (B, T_b) int64, where T_b is
            the longest length among the rows (columns beyond it are all padding).
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(f"row index out of range [0, {self.num_rows}) in token cache {self.cache_dir}")
        lengths = np.asarray(self.lengths[rows], dtype=np.int64)  # (B,)
        t_b = int(lengths.max()) if rows.size else 0
        ids = np.asarray(self.ids[rows, :t_b], dtype=np.int64)  # (B, T_b), a copy out of the map
        mask = (np.arange(t_b)[None, :] < lengths[:, None]).astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}


def _tokenizer_fingerprint(tokenizer_path: str) -> dict:
    """Sizes and mtimes of the tokenizer's files, so an edited tokenizer invalidates the cache."""
    out = {}
    for name in _TOKENIZER_FILES:
        p = os.path.join(tokenizer_path, name)
        if os.path.isfile(p):
            st = os.stat(p)
            out[name] = [st.st_size, st.st_mtime_ns]
    return out


def _expected_meta(texts_path: str, tokenizer_path: str, max_len: int) -> dict:
    try:
        st = os.stat(texts_path)
    except OSError as e:
        raise DataFormatError(texts_path, 0, "text", f"cannot read text file: {e.strerror}") from e
    return {
        "format": FORMAT_VERSION,
        "source": texts_path,
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "tokenizer": tokenizer_path,
        "tokenizer_files": _tokenizer_fingerprint(tokenizer_path),
        "max_len": int(max_len),
    }


def _is_current(cache_dir: str, expected: dict) -> bool:
    try:
        with open(os.path.join(cache_dir, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return all(meta.get(k) == v for k, v in expected.items())


def _count_lines(path: str) -> int:
    """Number of lines, splitting on b"\\n" only; a last line without newline counts."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def _read_texts(path: str) -> Iterator[list[str]]:
    """Chunks of decoded lines. Only "\\n" ends a line (str.splitlines would also split on
    \\x1c, \\u2028, ... and shift every later row against its labels); a trailing "\\r" and
    a UTF-8 BOM on line 1 are dropped."""
    chunk: list[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\n").removesuffix(b"\r")
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                chunk.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                problem = f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start} of the line)"
                raise DataFormatError(path, lineno, "text", problem) from None
            if len(chunk) == _CHUNK_LINES:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _build(texts_path: str, tokenizer, max_len: int, out_dir: str, meta: dict, progress: bool) -> None:
    """Write ids.npy, lengths.npy and (last) meta.json into `out_dir`."""
    from tqdm import tqdm

    n = _count_lines(texts_path)
    pad_id = tokenizer.pad_token_id
    # Call the Rust tokenizer directly: the transformers wrapper adds ~60% on short texts.
    # Same pipeline (normaliser, [CLS]/[SEP] post-processor, longest-first truncation);
    # padding is forced to the right, which gather() and the encoder's trimming assume.
    encode = _batch_encoder(tokenizer, max_len)
    ids = np.lib.format.open_memmap(os.path.join(out_dir, "ids.npy"), mode="w+", dtype=np.int32,
                                    shape=(n, max_len))
    lengths = np.zeros(n, dtype=np.int32)
    row = 0
    with tqdm(total=n, desc=f"tokenize {os.path.basename(texts_path)}", unit="text",
              disable=not progress, mininterval=1.0) as bar:
        for texts in _read_texts(texts_path):
            if row + len(texts) > n:
                raise DataFormatError(texts_path, row + len(texts), "text", "file grew while being tokenized")
            encs = encode(texts)
            ids[row:row + len(texts)] = np.array([e.ids for e in encs], dtype=np.int32)
            # Lengths from the mask, not by counting pad ids: a literal "[PAD]" in a text
            # tokenizes to the pad id but is a real token.
            masks = np.array([e.attention_mask for e in encs], dtype=np.int32)
            lengths[row:row + len(texts)] = masks.sum(axis=1)
            row += len(texts)
            bar.update(len(texts))
    if row != n:
        raise DataFormatError(texts_path, row, "text", "file shrank while being tokenized")
    ids.flush()
    del ids
    np.save(os.path.join(out_dir, "lengths.npy"), lengths)
    with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({**meta, "num_rows": n, "pad_id": int(pad_id), "dtype": "int32"}, f, indent=1)


def _batch_encoder(tokenizer, max_len: int):
    """The Rust tokenizer's batch encode with truncation and right padding to max_len (the cache's pipeline)."""
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.enable_truncation(max_len, strategy="longest_first", direction="right")
    backend.enable_padding(length=max_len, direction="right", pad_id=tokenizer.pad_token_id, pad_token=tokenizer.pad_token)
    return getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast skips offsets


class TextTokenizer:
    """New texts tokenized exactly as `tokenize_to_cache` tokenizes a file, straight into a batch."""

    def __init__(self, tokenizer_path: str, max_len: int):
        self._encode = _batch_encoder(_load_tokenizer(os.path.abspath(tokenizer_path), int(max_len)), int(max_len))

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """"input_ids" and "attention_mask" (B, T_b) int64, T_b the longest row (as TokenCache.gather)."""
        encs = self._encode(list(texts))
        masks = np.array([e.attention_mask for e in encs], dtype=np.int64).reshape(len(encs), -1)
        t_b = int(masks.sum(1).max()) if len(encs) else 0
        ids = np.array([e.ids for e in encs], dtype=np.int64).reshape(len(encs), -1)[:, :t_b]
        return {"input_ids": torch.from_numpy(np.ascontiguousarray(ids)),
                "attention_mask": torch.from_numpy(np.ascontiguousarray(masks[:, :t_b]))}


def tokenize_to_cache(texts_path: str, tokenizer_path: str, max_len: int, cache_dir: str,
                      progress: bool = True) -> TokenCache:
    """Tokenize a one-text-per-line UTF-8 file into `cache_dir`, or re-use it if current.

    The cache is current when meta.json records the same source path, size and mtime,
    tokenizer path (and tokenizer file sizes/mtimes) and max_len; otherwise it is rebuilt.
    Texts longer than max_len tokens are truncated (keeping [SEP] at the end).

    Args:
        texts_path: the text file; row i (0-based) of the cache holds its line i + 1.
        tokenizer_path: local Hugging Face directory with a fast tokenizer.
        max_len: padded width, >= 2, at most the tokenizer's model_max_length.
        cache_dir: directory to (re)create; its parent is created if needed.
        progress: show a tqdm bar while tokenizing.

    Raises:
        DataFormatError: the text file is missing or a line is not UTF-8 (names the line).
        ConfigError: bad max_len or tokenizer directory.
    """
    texts_path = os.path.abspath(texts_path)
    tokenizer_path = os.path.abspath(tokenizer_path)
    cache_dir = os.path.abspath(cache_dir)
    if int(max_len) < 2:
        raise ConfigError("data.max_len", f"{max_len!r} leaves no room for the [CLS] and [SEP] tokens")
    max_len = int(max_len)
    parent, base = os.path.split(cache_dir)
    os.makedirs(parent, exist_ok=True)

    with exclusive_lock(cache_dir + ".lock"):
        expected = _expected_meta(texts_path, tokenizer_path, max_len)
        if _is_current(cache_dir, expected):
            return TokenCache(cache_dir)

        tokenizer = _load_tokenizer(tokenizer_path, max_len)
        # Holding the lock means no one else is building: temp dirs left here were
        # orphaned by a crashed builder.
        for stale in glob.glob(os.path.join(parent, glob.escape(base) + ".tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=base + ".tmp-", dir=parent)
        try:
            _build(texts_path, tokenizer, max_len, tmp, expected, progress)
            if os.path.lexists(cache_dir):
                # os.replace cannot overwrite a non-empty directory: move the old one aside
                # first. Readers that mapped its files keep valid maps (POSIX unlink semantics).
                old = tmp + ".old"
                os.replace(cache_dir, old)
                os.replace(tmp, cache_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, cache_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return TokenCache(cache_dir)


def _load_tokenizer(tokenizer_path: str, max_len: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError("model.encoder.path", f"cannot load a tokenizer from {tokenizer_path!r}: {e}") from e
    if not tok.is_fast:
        raise ConfigError("model.encoder.path", f"{tokenizer_path!r} has no fast (Rust) tokenizer")
    if tok.pad_token_id is None:
        raise ConfigError("model.encoder.path", f"tokenizer at {tokenizer_path!r} has no pad token")
    if max_len > tok.model_max_length:
        raise ConfigError("data.max_len",
                          f"{max_len} exceeds the model's limit of {tok.model_max_length} tokens")
    return tok
