"""The ``xc-data`` command: convert sources into the cache, inspect datasets, generate synthetic data.

    xc-data convert  --kind xc_sparse --path data/bibtex --cache data_cache
    xc-data convert  --kind arff --path data/mulan-bibtex --cache data_cache    (also --kind libsvm)
    xc-data inspect  --kind lf_raw --path data/debian-deps [--cache data_cache] [--bins 12]
    xc-data inspect  --kind synthetic --path out/synth          (a directory made by `generate`)
    xc-data generate --out out/synth --num-labels 100000 --num-train 200000 --seed 3
    xc-data verify   .cache/xc-data      (every dataset below it, or one dataset directory: every file's whole-file
                                          hash, one line per dataset; exit 2 if any is damaged)

Counts go to stdout (``--json`` for a machine-readable dict), progress lines to stderr.

Malformed input is reported as ``error: <file>:<line>: <field>: <problem>`` on stderr with exit status
2 and no traceback (also bad arguments to the generator, and unreadable files).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from ..errors import XCError
from .cache import KINDS, load_dataset, open_dataset, verify_checksums
from .sparse import XCDataset
from .cache import generate_synthetic
from .synthetic import DEFAULTS


def _load(args) -> XCDataset:
    if args.kind == "synthetic":
        if not args.path:
            raise XCError("inspect --kind synthetic needs --path DIR of a dataset made by `xc-data generate`")
        return open_dataset(args.path)
    return load_dataset(args.kind, args.path, args.cache)


def frequency_histogram(counts: np.ndarray, width: int = 40) -> list[str]:
    """Text histogram of label frequencies ``counts`` ((L,) ints) over log2 bins 0, 1, 2-3, 4-7, ..."""
    counts = np.asarray(counts, dtype=np.int64)
    # bin 0 holds labels never seen; bin b >= 1 holds frequencies in [2^(b-1), 2^b).
    bins = np.zeros(counts.shape, dtype=np.int64)
    pos = counts > 0
    bins[pos] = np.floor(np.log2(counts[pos])).astype(np.int64) + 1
    hist = np.bincount(bins, minlength=1)
    top = max(int(hist.max()), 1) if hist.size else 1
    lines = []
    for b, n in enumerate(hist):
        label = "0" if b == 0 else (f"{2 ** (b - 1)}" if b == 1 else f"{2 ** (b - 1)}-{2 ** b - 1}")
        lines.append(f"  {label:>15} | {int(n):>9} {'#' * int(round(width * n / top))}")
    return lines


def dataset_stats(ds: XCDataset) -> dict:
    """Counts of a dataset as plain numbers: ``{"num_labels", "num_features", "train": {...}, "test": {...}}``
    with per split points, label nnz, averages, labels present, empty points and feature nnz."""
    out = {"num_labels": ds.num_labels, "num_features": ds.num_features, "label_texts": ds.label_texts_path}
    for split in (ds.train, ds.test):
        n, nnz = split.num_points, split.labels.nnz
        out[split.name] = {
            "points": n, "label_nnz": nnz, "avg_labels_per_point": nnz / max(n, 1),
            "avg_points_per_label": nnz / max(ds.num_labels, 1),
            "labels_present": int((split.labels.column_counts() > 0).sum()),
            "points_without_labels": int((split.labels.row_lengths() == 0).sum()),
            "feature_nnz": None if split.features is None else split.features.nnz,
            "texts": split.texts_path,
        }
    out.update({k: v for k, v in ds.meta.items() if k.startswith("oracle_")})
    return out


def describe(ds: XCDataset, bins_width: int = 40) -> str:
    """Counts per split plus the train label-frequency histogram, as printable text."""
    st = dataset_stats(ds)
    out = [f"labels: {ds.num_labels}   features: {ds.num_features}"
           + (f"   label texts: {ds.label_texts_path}" if ds.label_texts_path else "")]
    for name in ("train", "test"):
        s = st[name]
        line = (f"{name}: points {s['points']}  label nnz {s['label_nnz']}  "
                f"avg labels/point {s['avg_labels_per_point']:.2f}  "
                f"avg points/label {s['avg_points_per_label']:.2f}  labels present {s['labels_present']}  "
                f"points without labels {s['points_without_labels']}")
        if s["feature_nnz"] is not None:
            line += f"  feature nnz {s['feature_nnz']} (avg {s['feature_nnz'] / max(s['points'], 1):.1f}/point)"
        if s["texts"]:
            line += f"  texts {s['texts']}"
        out.append(line)
    out.append("train label frequency histogram (points per label, log2 bins):")
    out.extend(frequency_histogram(ds.train.labels.column_counts(), bins_width))
    out.extend(f"{k}: {v:.2f}" for k, v in st.items() if k.startswith("oracle_"))
    return "\n".join(out)


def _show(ds: XCDataset, args) -> None:
    print(json.dumps(dataset_stats(ds), indent=1) if args.json else describe(ds))


def _cmd_convert(args) -> int:
    t = time.perf_counter()
    ds = load_dataset(args.kind, args.path, args.cache)
    print(f"converted into {ds.meta['cache_dir']} in {time.perf_counter() - t:.2f}s", file=sys.stderr)
    _show(ds, args)
    return 0


def _cmd_inspect(args) -> int:
    if args.cache or args.kind == "synthetic":
        _show(_load(args), args)
        return 0
    with tempfile.TemporaryDirectory(prefix="xc-inspect-") as tmp:
        args.cache = tmp
        ds = _load(args)
        _show(ds, args)
        del ds  # drop the memmaps before the directory goes
    return 0


def _check_generate_target(out: str) -> None:
    """`generate` replaces only an empty directory or one an earlier `generate` made: a meta.json alone
    proves nothing (every checkpoint directory holds one), so it must be a generated dataset's."""
    if not os.path.isdir(out) or not os.listdir(out):
        return
    meta_path = os.path.join(out, "meta.json")
    try:
        with open(meta_path) as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        meta = None
    if not (isinstance(meta, dict) and meta.get("kind") == "synthetic" and "format_version" in meta
            and "train" in meta):
        raise XCError(f"--out {out} holds files that are not a dataset made by xc-data generate "
                          f"({'its meta.json is not a generated dataset' if os.path.exists(meta_path) else 'no meta.json'}); "
                          "refusing to replace it. Pass another --out")


def _cmd_generate(args) -> int:
    _check_generate_target(args.out)
    params = {k: getattr(args, k) for k in DEFAULTS}
    t = time.perf_counter()
    ds = generate_synthetic(args.out, **params)
    print(f"generated {args.out} in {time.perf_counter() - t:.2f}s", file=sys.stderr)
    _show(ds, args)
    return 0


def dataset_dirs(root: str) -> list[str]:
    """Every dataset directory (one holding a meta.json) at or below `root`, sorted. The cache root xc-train fills
    (`.cache/xc-data`) keeps each dataset two levels down, under its `data.name` (xc/datasets.py); a dataset's own
    folder is not searched further, and hidden folders (a conversion's `.tmp-*` in progress) are skipped."""
    found = []
    for here, subdirs, files in os.walk(root):
        if "meta.json" in files:
            found.append(here)
            subdirs.clear()
        else:
            subdirs[:] = [d for d in subdirs if not d.startswith(".")]
    return sorted(found)


def _cmd_verify(args) -> int:
    """Check the whole-file blake2b of every file of a dataset directory, or of every dataset in a cache directory."""
    root = os.path.abspath(args.path)
    if not os.path.isdir(root):
        raise XCError(f"verify: {root} is not a directory")
    dirs = dataset_dirs(root)
    if not dirs:
        raise XCError(f"verify: {root} holds no dataset directory (no meta.json at any depth)")
    damaged = 0
    for d in dirs:
        try:
            with open(os.path.join(d, "meta.json")) as handle:
                meta = json.load(handle)
        except (OSError, ValueError) as e:
            print(f"damaged: {d}/meta.json: unreadable ({e}); delete {d}", file=sys.stderr)
            damaged += 1
            continue
        if not isinstance(meta, dict) or not meta.get("checksums"):
            print(f"unverifiable: {d}: written before checksums (format_version "
                  f"{meta.get('format_version') if isinstance(meta, dict) else '?'}); nothing to compare")
            continue
        bad = verify_checksums(d, meta, full=True)
        for path, what in bad:
            print(f"damaged: {path}: {what}; delete {d}", file=sys.stderr)
        damaged += bool(bad)
        if not bad:
            print(f"ok: {d} ({len(meta['checksums'])} files)")
    print(f"{len(dirs) - damaged} of {len(dirs)} dataset(s) intact under {root}"
          + (f"; {damaged} damaged" if damaged else ""), file=sys.stderr)
    return 2 if damaged else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xc-data", description="Convert, inspect and generate XC datasets.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("convert", "convert a source into the memmap cache"),
                           ("inspect", "print counts and a label-frequency histogram")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--kind", required=True, choices=KINDS if name == "inspect" else KINDS[:-1])
        s.add_argument("--path", required=(name == "convert"), help="source dataset directory")
        s.add_argument("--cache", required=(name == "convert"),
                       help="cache directory (inspect: a temporary one when omitted)")
        s.add_argument("--json", action="store_true", help="print the counts as JSON instead of text")
    g = sub.add_parser("generate", help="generate a synthetic dataset (see xc/data/synthetic.py)")
    g.add_argument("--out", required=True, help="output directory (replaced if it holds a dataset)")
    for key, default in DEFAULTS.items():
        g.add_argument("--" + key.replace("_", "-"), dest=key, type=type(default), default=default,
                       help=f"default {default}")
    g.add_argument("--json", action="store_true", help="print the counts as JSON instead of text")
    v = sub.add_parser("verify", help="check every cached file against its whole-file hash in meta.json")
    v.add_argument("path", help="a dataset directory, or a cache directory holding several")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"convert": _cmd_convert, "inspect": _cmd_inspect, "generate": _cmd_generate, "verify": _cmd_verify}[args.command]
    try:
        return handler(args)
    except (XCError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
