"""`xc.fit`: train from Python objects in this process, as `xc-train` would from files.

    model = xc.fit(X_train, Y_train)                              # scipy sparse / numpy features, 0/1 labels
    model = xc.fit(texts, tag_lists, X_test=..., Y_test=...)      # raw texts and label-name lists
    model = xc.fit(X, Y, sampler="uniform", train__epochs=5)      # hydra overrides: group=choice, a__b = a.b
    model.predict(X_new, k=5)

The inputs are written once, content-addressed, under ``DATA_CACHE/fit-sources/<hash>/`` (numpy arrays as the
``npz`` layout, texts as ``jsonl`` with a ``labels.txt``), then trained with the same hydra configs, data-derived
defaults, logs, run directory and progress bar as ``xc-train data.kind=... data.path=<that folder>``: the same
seed gives the same figures. Without a test split, a fifth of the points (at most 10,000, a permutation seeded
with 0) is held out as the test split, the rule of `xc.data.records.carve_test`. The returned model is what
``xc.load(run_dir)`` returns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from xc.cli.calibrate import load_run
from xc.cli.entry import CONF_DIR, absolute_paths, check_overrides, config_groups, register_resolvers
from xc.cli.train import run
from xc.config import XCConfig, build_config
from xc.data.records import carve_test
from xc.errors import XCError

_PLAIN = re.compile(r"[\w./:+-]*")


def _is_texts(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, str) for t in x) or (
        isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "UO")


def _features(x, what: str) -> sp.csr_matrix:
    """``(n, F)`` float32 CSR of a scipy sparse matrix or a 2-D numeric numpy array."""
    if sp.issparse(x):
        m = sp.csr_matrix(x, dtype=np.float32)
    elif isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype.kind in "biuf":
        m = sp.csr_matrix(x.astype(np.float32))
    else:
        raise XCError(f"xc.fit: {what} must be a scipy sparse matrix, a 2-D numeric numpy array or a list of texts, "
                      f"got {type(x).__name__}")
    if not np.isfinite(m.data).all():
        raise XCError(f"xc.fit: {what} holds NaN or infinite values")
    return m


def _labels(y, num_rows: int, what: str, names: dict[str, int]) -> sp.csr_matrix:
    """``(n, L)`` 0/1 CSR of a sparse / dense 0-1 matrix, or of per-row lists of label names (ints are names too),
    where ``names`` (name -> id, grown in order of first appearance) gives the ids."""
    if sp.issparse(y) or isinstance(y, np.ndarray) and y.ndim == 2:
        m = sp.csr_matrix(y)
        m.eliminate_zeros()
        m.data[:] = 1
        m = m.astype(np.float32)
    elif isinstance(y, (list, tuple)):
        rows, cols = [], []
        for i, row in enumerate(y):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
                raise XCError(f"xc.fit: {what}[{i}] must be a list of label names, got {row!r:.60}")
            for name in row:
                rows.append(i)
                cols.append(names.setdefault(str(name), len(names)))
        m = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(y), max(len(names), 1)))
        m.sum_duplicates()
        m.data[:] = 1
    else:
        raise XCError(f"xc.fit: {what} must be a sparse or dense 0/1 matrix or a list of label-name lists, "
                      f"got {type(y).__name__}")
    if m.shape[0] != num_rows:
        raise XCError(f"xc.fit: {what} has {m.shape[0]} rows, its inputs {num_rows}")
    return m


def _widen(m: sp.csr_matrix, cols: int) -> sp.csr_matrix:
    return m if m.shape[1] == cols else sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], cols))


def _write_sources(folder: Path, x_train, y_train, x_test, y_test, label_names: list[str] | None) -> str:
    """Write the splits into ``folder``; returns the data kind (``npz`` or ``jsonl``)."""
    names = {str(n): j for j, n in enumerate(label_names or ())}  # label-name lists take their ids from here
    texts = _is_texts(x_train)
    if x_test is None:  # the same carve-out rule as records data without a test file
        n = len(x_train) if texts else x_train.shape[0]
        y_all = _labels(y_train, n, "Y", names)
        held = carve_test(n)
        keep = np.setdiff1d(np.arange(n), held)
        x_train = x_train if texts else _features(x_train, "X")  # converted once, then split
        pick = (lambda x, r: [x[i] for i in r]) if texts else (lambda x, r: x[r])
        x_train, x_test, y_train, y_test = pick(x_train, keep), pick(x_train, held), y_all[keep], y_all[held]
    elif texts != _is_texts(x_test):
        raise XCError("xc.fit: X and X_test must both be texts or both be feature matrices")
    y_train = _labels(y_train, len(x_train) if texts else x_train.shape[0], "Y", names)
    y_test = _labels(y_test, len(x_test) if texts else x_test.shape[0], "Y_test", names)
    num_labels = max(y_train.shape[1], y_test.shape[1], len(label_names or ()))
    y_train, y_test = _widen(y_train, num_labels), _widen(y_test, num_labels)
    if names:  # label-name lists: their names, in id order
        label_names = list(names) + [str(j) for j in range(len(names), num_labels)]
    if label_names is not None and len(label_names) != num_labels:
        raise XCError(f"xc.fit: label_names has {len(label_names)} names for {num_labels} labels")
    if texts:
        every = label_names or [str(j) for j in range(num_labels)]
        for split, xs, ys in (("train", x_train, y_train), ("test", x_test, y_test)):
            with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for text, row in zip(xs, ys):
                    f.write(json.dumps({"text": str(text), "labels": [every[j] for j in row.indices]}) + "\n")
        (folder / "labels.txt").write_text("".join(n.replace("\t", " ") + "\n" for n in every), encoding="utf-8")
        return "jsonl"
    x_train, x_test = _features(x_train, "X"), _features(x_test, "X_test")
    num_features = max(x_train.shape[1], x_test.shape[1])
    for split, xs, ys in (("train", x_train, y_train), ("test", x_test, y_test)):
        sp.save_npz(folder / f"{split}_X.npz", _widen(xs, num_features), compressed=False)
        sp.save_npz(folder / f"{split}_Y.npz", ys, compressed=False)
    if label_names is not None:  # read back as the run's label names (xc.serve.model.label_names)
        (folder / "label_names.txt").write_text("".join(n + "\n" for n in label_names), encoding="utf-8")
    return "npz"


def stage_sources(cache_dir: str, x_train, y_train, x_test=None, y_test=None,
                  label_names: list[str] | None = None) -> tuple[str, str]:
    """Write the inputs under ``cache_dir/fit-sources/<hash of the files>/`` (kept if already there: the same
    inputs give the same folder, so the data cache converts them once); returns (kind, folder)."""
    root = Path(cache_dir) / "fit-sources"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        kind = _write_sources(tmp, x_train, y_train, x_test, y_test, label_names)
        digest = hashlib.sha256(kind.encode())
        for path in sorted(tmp.iterdir()):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        target = root / digest.hexdigest()[:16]
        if target.is_dir():
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, target)  # whole or not at all: a crashed fit leaves only a .tmp- folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kind, str(target)


def _override(key: str, value) -> str:
    key = key.replace("__", ".")
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = "[" + ",".join(_override("_", v).split("=", 1)[1] for v in value) + "]"
    else:
        text = str(value)
        if not _PLAIN.fullmatch(text):  # spaces, commas, quotes: hydra's quoted string
            text = "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return f"{key}={text}"


def compose_config(overrides: list[str]) -> XCConfig:
    """The typed config `xc-train` builds from the same overrides (conf/, its groups and resolvers)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    check_overrides(overrides, config_groups())
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="xc-fit"):
        raw = compose(config_name="config", overrides=overrides)
    return absolute_paths(build_config(OmegaConf.to_container(raw, resolve=True)))


def fit(X, Y, *, X_test=None, Y_test=None, label_names=None, run_dir=None, **overrides):  # noqa: N803
    """Train on Python objects; see the module docstring. Returns the trained model (`xc.load(run_dir)`).

    X: (n, F) scipy sparse or numpy features, or n texts; Y: (n, L) 0/1 sparse or dense, or n lists of label
    names; label_names: L names for matrix labels; overrides: hydra overrides, `a__b=v` for `a.b=v`."""
    if (X_test is None) != (Y_test is None):
        raise XCError("xc.fit: give X_test and Y_test together, or neither (a test split is then held out)")
    args = [_override(k, v) for k, v in overrides.items()]
    run_dir = run_dir or os.path.join("runs", time.strftime("fit-%Y%m%d-%H%M%S"))
    cfg = compose_config([*args, f"run_dir={run_dir}"])
    kind, folder = stage_sources(cfg.data.cache_dir, X, Y, X_test, Y_test,
                                 None if label_names is None else [str(n) for n in label_names])
    name = f"fit-{Path(folder).name}"
    cfg = dataclasses.replace(cfg, name=name, data=dataclasses.replace(cfg.data, kind=kind, path=folder, name=name))
    run(cfg)
    return load_run(cfg.run_dir)
