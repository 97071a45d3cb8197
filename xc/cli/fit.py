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
_CONTROL = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")  # tabs, line breaks and the like


def _is_texts(x, what: str) -> bool:
    """Whether ``x`` is a list of texts (True) or a feature matrix (False); anything else is refused here, in one
    line, before a row is written."""
    if isinstance(x, (list, tuple)) or isinstance(x, np.ndarray) and x.ndim == 1 and x.dtype.kind in "UO":
        for i, t in enumerate(x):
            if not isinstance(t, str):
                raise XCError(f"xc.fit: {what}[{i}] is {type(t).__name__}, not a text: {what} is a list of texts "
                              "(str) or an (n, F) feature matrix")
        if not len(x):
            raise XCError(f"xc.fit: {what} has no rows")
        return True
    if sp.issparse(x) or isinstance(x, np.ndarray) and x.ndim == 2 and x.dtype.kind in "biuf":
        if not x.shape[0]:
            raise XCError(f"xc.fit: {what} has no rows")
        return False
    got = f"a {x.ndim}-D {x.dtype} array" if isinstance(x, np.ndarray) else type(x).__name__
    raise XCError(f"xc.fit: {what} must be a scipy sparse matrix, a 2-D numeric numpy array or a list of texts, "
                  f"got {got}")


def _is_name_lists(y, what: str) -> bool:
    """Whether ``y`` is per-row lists of label names (True) or a 0/1 matrix (False); anything else is refused."""
    if sp.issparse(y) or isinstance(y, np.ndarray) and y.ndim == 2:
        if y.dtype.kind not in "biuf":
            raise XCError(f"xc.fit: {what} has dtype {y.dtype}: a label matrix holds 0/1 numbers or bools")
        return False
    if isinstance(y, (list, tuple)):
        return True
    got = f"a {y.ndim}-D array" if isinstance(y, np.ndarray) else type(y).__name__
    raise XCError(f"xc.fit: {what} must be an (n, L) sparse or dense 0/1 matrix or n lists of label names, got {got}")


def _label_name(name, where: str) -> str:
    """A label name as stored (``str``, stripped as records data strips it); a blank one, or one holding a tab or a
    line break (which the label files cannot hold: one name a line, name<TAB>text), is refused."""
    text = str(name)
    if not text.strip():
        raise XCError(f"xc.fit: {where} is a blank label name")
    if _CONTROL.search(text):
        raise XCError(f"xc.fit: {where} {text[:60]!r} holds a tab, a line break or another control character, "
                      "which label names cannot hold")
    return text.strip()


def _check_label_names(label_names) -> list[str] | None:
    """``label_names`` as a list of distinct stored names; a duplicate would shift every later label's name."""
    if label_names is None:
        return None
    if isinstance(label_names, (str, bytes)) or not hasattr(label_names, "__iter__"):
        raise XCError(f"xc.fit: label_names must be a list of names, got {type(label_names).__name__}")
    names: dict[str, int] = {}
    for j, name in enumerate(label_names):
        text = _label_name(name, f"label_names[{j}]")
        if text in names:
            raise XCError(f"xc.fit: label_names[{j}] {text!r} repeats label_names[{names[text]}]: each label needs "
                          "its own name")
        names[text] = j
    return list(names)


def _features(x, what: str) -> sp.csr_matrix:
    """``(n, F)`` float32 CSR of a scipy sparse matrix or a 2-D numeric numpy array (`_is_texts` checked it)."""
    m = sp.csr_matrix(x, dtype=np.float32) if sp.issparse(x) else sp.csr_matrix(x.astype(np.float32))
    if not np.isfinite(m.data).all():
        raise XCError(f"xc.fit: {what} holds NaN or infinite values")
    return m


def _label_matrix(y, what: str) -> sp.csr_matrix:
    """``(n, L)`` 0/1 float32 CSR of a sparse or dense matrix whose every entry is 0 or 1 (or a bool): any other
    value (a -1/+1 matrix, scores, NaN) is refused rather than binarised into a different problem."""
    coo = sp.coo_matrix(y)  # a dense matrix keeps its nonzeros (NaN included); duplicates are not summed yet
    bad = np.flatnonzero((coo.data != 0) & (coo.data != 1))
    if bad.size:
        value = coo.data[bad[0]].item()
        hint = " (for a -1/+1 matrix, pass Y > 0)" if value == -1 else ""
        raise XCError(f"xc.fit: {what}[{coo.row[bad[0]]}, {coo.col[bad[0]]}] is {value!r}: label entries are 0 or 1 "
                      f"(or bool){hint}")
    keep = coo.data != 0
    m = sp.csr_matrix((np.ones(int(keep.sum()), np.float32), (coo.row[keep], coo.col[keep])), shape=coo.shape)
    m.sum_duplicates()
    m.data[:] = 1
    return m


def _labels(y, num_rows: int, what: str, names: dict[str, int] | None, fixed: bool) -> sp.csr_matrix:
    """``(n, L)`` 0/1 CSR of a 0/1 matrix (``names`` None), or of per-row lists of label names (ints are names too),
    where ``names`` (name -> id, grown in order of first appearance unless ``fixed`` by label_names) gives the ids."""
    if names is None:
        m = _label_matrix(y, what)
    else:
        rows, cols, known = [], [], {}  # known: each name as given -> its id, checked once
        for i, row in enumerate(y):
            if isinstance(row, (str, bytes)) or not hasattr(row, "__iter__"):
                raise XCError(f"xc.fit: {what}[{i}] must be a list of label names, got {row!r:.60}")
            for name in map(str, row):
                label_id = known.get(name)
                if label_id is None:
                    text = _label_name(name, f"{what}[{i}] label")
                    if fixed and text not in names:
                        raise XCError(f"xc.fit: {what}[{i}] names the label {text!r}, which is not in label_names")
                    label_id = known[name] = names.setdefault(text, len(names))
                rows.append(i)
                cols.append(label_id)
        m = sp.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(y), max(len(names), 1)))
        m.sum_duplicates()
        m.data[:] = 1
    if m.shape[0] != num_rows:
        raise XCError(f"xc.fit: {what} has {m.shape[0]} rows, its inputs {num_rows}")
    return m


def _widen(m: sp.csr_matrix, cols: int) -> sp.csr_matrix:
    return m if m.shape[1] == cols else sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], cols))


def _write_sources(folder: Path, x_train, y_train, x_test, y_test, label_names: list[str] | None) -> str:
    """Write the splits into ``folder``; returns the data kind (``npz`` or ``jsonl``). Every input is checked
    before anything is written: the errors name xc.fit's arguments, never the files staged from them."""
    texts = _is_texts(x_train, "X")
    lists = _is_name_lists(y_train, "Y")
    if x_test is not None and texts != _is_texts(x_test, "X_test"):
        raise XCError("xc.fit: X and X_test must both be texts or both be feature matrices")
    if y_test is not None and lists != _is_name_lists(y_test, "Y_test"):
        raise XCError("xc.fit: Y and Y_test must both be 0/1 matrices or both be lists of label names")
    label_names = _check_label_names(label_names)
    # label-name lists take their ids from here: label_names' order, else the order of first appearance
    names = {n: j for j, n in enumerate(label_names or ())} if lists else None
    fixed = label_names is not None
    rows = (lambda x: len(x)) if texts else (lambda x: x.shape[0])
    if x_test is None:  # the same carve-out rule as records data without a test file
        n = rows(x_train)
        y_all = _labels(y_train, n, "Y", names, fixed)
        try:
            held = carve_test(n)
        except XCError as exc:
            raise XCError(f"xc.fit: {getattr(exc, 'problem', exc)}") from None
        keep = np.setdiff1d(np.arange(n), held)
        x_train = x_train if texts else _features(x_train, "X")  # converted once, then split
        pick = (lambda x, r: [x[i] for i in r]) if texts else (lambda x, r: x[r])
        x_train, x_test, y_train, y_test = pick(x_train, keep), pick(x_train, held), y_all[keep], y_all[held]
    else:
        y_train = _labels(y_train, rows(x_train), "Y", names, fixed)
        y_test = _labels(y_test, rows(x_test), "Y_test", names, fixed)
    num_labels = max(y_train.shape[1], y_test.shape[1])
    if lists:  # label-name lists: their names, in id order
        if not names:
            raise XCError("xc.fit: Y names no label")
        label_names, num_labels = list(names), len(names)
    elif label_names is not None and len(label_names) != num_labels:
        raise XCError(f"xc.fit: label_names has {len(label_names)} names for the {num_labels} label columns of Y")
    y_train, y_test = _widen(y_train, num_labels), _widen(y_test, num_labels)
    if texts:
        every = label_names or [str(j) for j in range(num_labels)]
        for split, xs, ys in (("train", x_train, y_train), ("test", x_test, y_test)):
            with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for text, row in zip(xs, ys):
                    f.write(json.dumps({"text": str(text), "labels": [every[j] for j in row.indices]}) + "\n")
        (folder / "labels.txt").write_text("".join(n + "\n" for n in every), encoding="utf-8")
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
    kind, folder = stage_sources(cfg.data.cache_dir, X, Y, X_test, Y_test, label_names)
    name = f"fit-{Path(folder).name}"
    cfg = dataclasses.replace(cfg, name=name, data=dataclasses.replace(cfg.data, kind=kind, path=folder, name=name))
    run(cfg)
    return load_run(cfg.run_dir)
