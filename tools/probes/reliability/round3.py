"""The third round's 18 probes (docs/reliability.md): a user's folder with `archive/`, `handoff/` or
`checkpoints/`; another run's checkpoint named, copied in or given to `xc-predict`; empty feature rows four ways;
read-only run and cache directories; a damaged cache two ways; live readers; the same run through two directories
and two launchers; an unquoted path with spaces."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tools.probes.reliability.common import (LOSS, PY, SILENT, SKIPPED, TRACEBACK, Proc, classify, error_line, probe,
                                             read_only, run, xc)
from tools.probes.reliability.fixtures import Ctx, checkpoints, metrics, train_cmd, write_xc_sparse
from tools.probes.reliability.round2_unclean import live_readers, user_folder_probe


# ---- round 3

@probe("r3_users_folder_with_archive", 3, LOSS, "run_dir= the user's config.json, metrics.json and archive/")
def _r3_users_folder_with_archive(ctx: Ctx):
    return user_folder_probe(ctx, "r3_users_folder_with_archive", "archive")


@probe("r3_users_folder_with_handoff", 3, LOSS, "run_dir= the user's config.json, metrics.json and handoff/")
def _r3_users_folder_with_handoff(ctx: Ctx):
    return user_folder_probe(ctx, "r3_users_folder_with_handoff", "handoff")


@probe("r3_users_folder_with_checkpoints", 3, LOSS, "run_dir= the user's config.json, metrics.json and checkpoints/")
def _r3_users_folder_with_checkpoints(ctx: Ctx):
    return user_folder_probe(ctx, "r3_users_folder_with_checkpoints", "checkpoints")


def _foreign(p: Proc, out_json: Path | None) -> tuple[str | None, str]:
    """(wrong, clean) for a command run on run A with run B's checkpoint."""
    said = "another run" in p.text
    fused = False
    if out_json is not None and out_json.exists():
        fused = any(k.startswith(("knn/", "ranker/", "model/")) for k in json.loads(out_json.read_text()))
    if p.rc == 2 and "Traceback" not in p.text:
        return None, f"refused: {error_line(p.text)[:150]}"
    if p.rc == 0 and said and not fused:
        line = re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "",
                      next(r.strip() for r in p.text.splitlines() if "another run" in r))
        return None, f"scored alone, said: {line[:150]}"
    if p.rc == 0:
        return (f"exit 0, run A's fusion applied to run B's checkpoint ({'fused keys in the output' if fused else 'no'}"
                f"{'' if said else ', no word'})"), ""
    return None, ""


@probe("r3_foreign_checkpoint_eval", 3, SILENT, "xc-eval runs/A --checkpoint runs/B/checkpoints/step-…")
def _r3_foreign_checkpoint_eval(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_eval")
    a, b = ctx.shared("A"), ctx.shared("B")
    p = run([xc("xc-eval"), a, "--checkpoint", checkpoints(b)[-1], "--out", d / "eval.json"], d)
    wrong, clean = _foreign(p, d / "eval.json")
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_foreign_checkpoint_copied_in", 3, SILENT,
       "run B's newest checkpoint copied over run A's (same step, the one A's selection names), xc-eval A")
def _r3_foreign_checkpoint_copied_in(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_copied_in")
    a = ctx.copy_of("A", d / "A")
    b = ctx.shared("B")
    src = checkpoints(b)[-1]
    dest = a / "checkpoints" / src.name  # A's newest (and selected) checkpoint replaced by B's of the same step
    shutil.rmtree(dest)
    shutil.copytree(src, dest)
    p = run([xc("xc-eval"), a, "--out", d / "eval.json"], d)
    wrong, clean = _foreign(p, d / "eval.json")
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_foreign_checkpoint_predict", 3, SILENT, "xc-predict runs/A --checkpoint runs/B/checkpoints/step-…")
def _r3_foreign_checkpoint_predict(ctx: Ctx):
    d = ctx.tmp("r3_foreign_checkpoint_predict")
    a, b = ctx.shared("A"), ctx.shared("B")
    p = run([xc("xc-predict"), a, "--checkpoint", checkpoints(b)[-1], "--input", "-", "--k", "3"], d,
            stdin="1:0.5 5:1.0\n")
    wrong, clean = _foreign(p, None)
    if wrong is None and not clean and p.rc == 0:
        wrong = "exit 0 without a word that the checkpoint is another run's"
    return classify(p.rc, p.text, wrong=wrong, clean=clean,
                    failed=None if (wrong or clean) else f"exit {p.rc}: {error_line(p.text)[:150]}")


def _predict_rows(ctx: Ctx, name: str, text: str):
    d = ctx.tmp(name)
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", "-", "--k", "5"], d, stdin=text)
    rows = [r for r in p.out.splitlines() if r.strip().startswith("{")]
    wrong = None
    if p.rc == 0 and len(rows) != 2:
        wrong = f"{len(rows)} output rows for 2 input rows"
    elif p.rc == 0 and not json.loads(rows[1])["ids"]:
        wrong = "the empty row got no labels"
    failed = None if p.rc == 0 else f"exit {p.rc}: {error_line(p.text)[:150]}"
    return classify(p.rc, p.text, wrong=wrong, failed=failed,
                    clean=f"2 rows answered; the empty one: ids {json.loads(rows[1])['ids'] if len(rows) == 2 else ''}")


@probe("r3_empty_row_trailing_blank_line", 3, TRACEBACK, "printf '1:0.5 5:1.0\\n\\n' | xc-predict RUN --input -")
def _r3_empty_row_trailing_blank_line(ctx: Ctx):
    return _predict_rows(ctx, "r3_empty_row_trailing_blank_line", "1:0.5 5:1.0\n\n")


@probe("r3_empty_row_last_zero", 3, TRACEBACK, "xc-predict with a last row 3:0.0")
def _r3_empty_row_last_zero(ctx: Ctx):
    return _predict_rows(ctx, "r3_empty_row_last_zero", "1:0.5 5:1.0\n3:0.0\n")


XC_LOAD_EMPTY = """
import json, sys
import numpy as np
import xc
from xc.data.sparse import SparseMatrix
m = xc.load(sys.argv[1])
rows = SparseMatrix(np.array([0, 2, 2]), np.array([1, 5], np.int32), np.array([0.5, 1.0], np.float32), m.num_features)
empty = SparseMatrix(np.array([0, 0]), np.zeros(0, np.int32), np.zeros(0, np.float32), m.num_features)
got, alone = m.predict(rows, k=5), m.predict(empty, k=5)
print(json.dumps({"n": len(got), "last": got.ids[-1].tolist(), "alone": alone.ids[0].tolist()}))
"""


@probe("r3_empty_row_xc_load_predict", 3, TRACEBACK, "xc.load(RUN).predict of rows whose last has no features")
def _r3_empty_row_xc_load_predict(ctx: Ctx):
    d = ctx.tmp("r3_empty_row_xc_load_predict")
    p = run([PY, "-c", XC_LOAD_EMPTY, ctx.shared("A")], d)
    wrong = clean = None
    if p.rc == 0:
        res = json.loads(p.out.strip().splitlines()[-1])
        if res["n"] != 2 or res["last"] != res["alone"]:
            wrong = f"{res['n']} rows; the empty row's answer {res['last']} is not the empty query's {res['alone']}"
        clean = f"2 rows; the empty one answered as an empty query ({res['last']})"
    return classify(p.rc, p.text, wrong=wrong, clean=clean or "",
                    failed=None if p.rc == 0 else f"exit {p.rc}: {error_line(p.text)[:150]}")


@probe("r3_empty_test_row_trains", 3, TRACEBACK, "xc-train on own data whose last test row has no features")
def _r3_empty_test_row_trains(ctx: Ctx):
    d = ctx.tmp("r3_empty_test_row_trains")
    data = write_xc_sparse(d / "data", n_train=600, n_test=80, features=100, labels=20, empty_last_test=True)
    run_dir = d / "run"
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={data}", f"data.cache_dir={d / 'cache'}",
             f"run_dir={run_dir}", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    done = (run_dir / "metrics.json").exists()
    failed = None if (p.rc == 0 and done) else f"exit {p.rc}, metrics.json {'written' if done else 'missing'}: " \
                                                f"{error_line(p.text)[:130]}"
    final = next((r for r in p.out.splitlines() if r.startswith("final P@1")), "")
    return classify(p.rc, p.text, failed=failed, clean=f"exit 0, metrics.json written: {final[:120]}")


@probe("r3_read_only_run_dir_train", 3, TRACEBACK, "xc-train on an existing run on a read-only mount")
def _r3_read_only_run_dir_train(ctx: Ctx):
    d = ctx.tmp("r3_read_only_run_dir_train")
    run_dir = ctx.copy_of("A", d / "run")
    p, how = read_only(run_dir, train_cmd(run_dir, ctx.cache, "train.epochs=3"), d)
    if p is None:
        return SKIPPED, how
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "read-only" in line) else f"exit {p.rc}: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0 on a read-only run directory" if p.rc == 0 else None,
                    failed=failed, clean=f"[{how}] exit 2: {line[:150]}")


@probe("r3_read_only_cache_new_dataset", 3, TRACEBACK, "a new dataset into a read-only data.cache_dir")
def _r3_read_only_cache_new_dataset(ctx: Ctx):
    d = ctx.tmp("r3_read_only_cache_new_dataset")
    cache = d / "cache"
    cache.mkdir()
    p, how = read_only(cache, train_cmd(d / "run", cache, "data.synthetic.seed=5"), d)
    if p is None:
        return SKIPPED, how
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "read-only" in line and "cache" in line) else f"exit {p.rc}: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0 with a read-only cache" if p.rc == 0 else None,
                    failed=failed, clean=f"[{how}] exit 2: {line[:150]}")


def _damaged_cache(ctx: Ctx, name: str, fill: str):
    """The shared cache copied, train.features.values.npy overwritten in place (same size, header kept)
    with NaN bytes or zeros; then a new run on it."""
    import numpy as np

    d = ctx.tmp(name)
    ctx.shared("A")
    cache = d / "cache"
    shutil.copytree(ctx.cache, cache)
    (target,) = list(cache.glob("synthetic/*/train.features.values.npy"))  # the shared run's dataset
    arr = np.load(target, mmap_mode="r")
    header = target.stat().st_size - arr.nbytes
    size = target.stat().st_size
    body = (np.full(arr.shape, np.nan, arr.dtype) if fill == "nan" else np.zeros(arr.shape, arr.dtype)).tobytes()
    with open(target, "r+b") as f:
        f.seek(header)
        f.write(body)
    assert target.stat().st_size == size
    run_dir = d / "run"
    p = run(train_cmd(run_dir, cache), d)
    named = target.name in p.text or "train.features.values" in p.text
    wrong = None if named else "trained on the damaged cache without a word about it"
    failed = None
    if named and p.rc != 0 and not error_line(p.text).startswith("error:"):
        failed = f"exit {p.rc}: {error_line(p.text)[:150]}"
    said = re.sub(r"^\d\d:\d\d:\d\d \[rank\d+\] \w+ [\w.]+: ", "",
                  next((r.strip() for r in p.text.splitlines() if "train.features.values" in r), ""))
    return classify(p.rc, p.text, wrong=wrong, failed=failed, clean=f"exit {p.rc}: {said[:170]}")


@probe("r3_damaged_cache_nan_bytes", 3, SILENT, "a cached .npy overwritten in place with NaN bytes (same size)")
def _r3_damaged_cache_nan_bytes(ctx: Ctx):
    return _damaged_cache(ctx, "r3_damaged_cache_nan_bytes", "nan")


@probe("r3_damaged_cache_zeroed", 3, SILENT, "a cached .npy overwritten in place with zeros (same size)")
def _r3_damaged_cache_zeroed(ctx: Ctx):
    return _damaged_cache(ctx, "r3_damaged_cache_zeroed", "zero")


@probe("r3_live_readers", 3, TRACEBACK, "xc-eval / xc-predict on a run while it trains (10 tries)")
def _r3_live_readers(ctx: Ctx):
    return live_readers(ctx, "r3_live_readers", 10)


@probe("r3_same_figures_two_directories", 3, SILENT,
       "the defaults (small-data ensemble), xc-train twice in two run and cache directories: identical figures")
def _r3_same_figures_two_directories(ctx: Ctx):
    one, two = ctx.launcher_run("xc-train:1"), ctx.launcher_run("xc-train:2")
    m1, m2 = metrics(one), metrics(two)
    diff = sorted(k for k in m1 if m1.get(k) != m2.get(k))
    return classify(0, "", wrong=f"{len(diff)} figures differ, e.g. {diff[0]}: {m1[diff[0]]} vs {m2.get(diff[0])}"
                    if diff else None, clean=f"{len(m1)} figures identical (P@1 {m1.get('P@1'):.2f})")


@probe("r3_same_figures_two_launchers", 3, SILENT,
       "the same, with python -m xc.cli.train in two more directories: identical to xc-train's")
def _r3_same_figures_two_launchers(ctx: Ctx):
    ref = metrics(ctx.launcher_run("xc-train:1"))
    problems = []
    for n in ("1", "2"):
        m = metrics(ctx.launcher_run(f"python-m:{n}"))
        diff = sorted(k for k in ref if ref.get(k) != m.get(k))
        if diff:
            problems.append(f"python -m run {n}: {len(diff)} differ, e.g. {diff[0]}: {ref[diff[0]]} vs {m.get(diff[0])}")
    return classify(0, "", wrong="; ".join(problems) or None,
                    clean=f"{len(ref)} figures identical across both launchers, 4 directories")


@probe("r3_path_with_spaces_unquoted", 3, TRACEBACK, "xc-train data.path=/a folder/with spaces, unquoted")
def _r3_path_with_spaces_unquoted(ctx: Ctx):
    d = ctx.tmp("r3_path_with_spaces_unquoted")
    data = write_xc_sparse(d / "my data")
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={d}/my", "data", f"run_dir={d / 'run'}",
             f"data.cache_dir={d / 'cache'}", "train.ensemble=1", "train.epochs=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    line = error_line(p.text)
    failed = None if (p.rc == 2 and "quote" in line) else f"exit {p.rc}, no hint to quote: {line[:150]}"
    return classify(p.rc, p.text, wrong="exit 0" if p.rc == 0 else None, failed=failed,
                    clean=f"exit 2: {line[:170]} ({data.name})")
