"""The fourth round's 12 probes of storage errors and rough edges: a file size limit (`ulimit -f`) under
`xc-train`, `xc-export`, `xc-predict --out` and `xc-eval --predictions`; `xc-export` onto a full disk, below a
read-only folder, and Ctrl-C while it writes; `--ann --save-index` on a read-only export; a damaged cache's
warning, an input of blank lines, test labels no training point has, a records run whose source folder moved."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from typing import Callable

from tools.probes.reliability.common import (FAILED, LOSS, SILENT, SKIPPED, TRACEBACK, UNSHARE, Proc, child_env,
                                             classify, error_line, file_hashes, one_line_refusal, probe, read_only,
                                             run, said_line, shown, xc)
from tools.probes.reliability.fixtures import Ctx, records_text, train_cmd
from tools.probes.reliability.round4_exports import QUERIES, export_copy


# ---- storage errors: a file size limit (ulimit -f), a full disk, an unwritable parent

def fsize_limit(limit: int) -> Callable[[], None]:
    """A child's RLIMIT_FSIZE (`ulimit -f`), with SIGXFSZ ignored as Python does, so a write past it is EFBIG."""
    def preexec():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


NO_BYTECODE = {"PYTHONDONTWRITEBYTECODE": "1"}  # under the limit, Python would rename a truncated .pyc into place


def _efbig(p: Proc, leftovers: list[str], what: str, clean_extra: str = "") -> tuple[str, str]:
    line = error_line(p.text)
    ok = p.rc == 2 and line.startswith("error:") and "file too large" in line and not leftovers
    return classify(p.rc, p.text, wrong=f"{what}: exit 0 under the limit" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {leftovers[:3]}: {line[:140]}",
                    clean=f"exit 2{clean_extra}: {line[:160]}")


@probe("r4_efbig_xc_train", 4, TRACEBACK, "xc-train under ulimit -f 1 MB (the checkpoint is bigger)")
def _r4_efbig_xc_train(ctx: Ctx):
    d = ctx.tmp("r4_efbig_xc_train")
    ctx.shared("A")  # the cache is built: only the run directory is written under the limit
    p = run(train_cmd(d / "run", ctx.cache), d, env=NO_BYTECODE, preexec=fsize_limit(1 << 20))
    left = [str(x.relative_to(d)) for x in (d / "run").rglob("*.part")] if (d / "run").exists() else []
    return _efbig(p, left, "a run")


@probe("r4_efbig_xc_export", 4, TRACEBACK, "xc-export under ulimit -f 1 MB: one line, no staging folder left")
def _r4_efbig_xc_export(ctx: Ctx):
    d = ctx.tmp("r4_efbig_xc_export")
    p = run([xc("xc-export"), ctx.shared("A"), d / "exp"], d, env=NO_BYTECODE, preexec=fsize_limit(1 << 20))
    return _efbig(p, [x.name for x in d.iterdir()], "an export", ", nothing left")


@probe("r4_efbig_predict_out", 4, TRACEBACK, "xc-predict --out under ulimit -f 64 KB: one line, no partial file")
def _r4_efbig_predict_out(ctx: Ctx):
    d = ctx.tmp("r4_efbig_predict_out")
    rows = d / "rows.txt"
    rows.write_text("".join(f"{i % 500}:1.0 {(7 * i) % 500}:0.5\n" for i in range(3000)))
    out = d / "preds.jsonl"
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", rows, "--k", "20", "--out", out], d, env=NO_BYTECODE,
            preexec=fsize_limit(64 << 10))
    return _efbig(p, [x.name for x in d.iterdir() if x.name != rows.name], "a partial --out", ", no file left")


@probe("r4_efbig_eval_predictions", 4, TRACEBACK,
       "xc-eval --predictions under ulimit -f 32 KB: the metrics printed, one line, no partial file")
def _r4_efbig_eval_predictions(ctx: Ctx):
    d = ctx.tmp("r4_efbig_eval_predictions")
    p = run([xc("xc-eval"), ctx.shared("A"), "--out", d / "eval.json", "--topk", "100", "--predictions",
             d / "preds.npz"], d, env=NO_BYTECODE, preexec=fsize_limit(32 << 10))
    left = [x.name for x in d.iterdir() if x.name != "eval.json"]
    if p.rc == 2 and "P@1" not in p.text:
        left.append("(no metrics printed)")
    return _efbig(p, left, "predictions", ", metrics printed first")


EXPORT_DISK_FULL = r"""
set -u
mnt="$1"; out="$2"; shift 2
mount -t tmpfs -o size=3m tmpfs "$mnt" || exit 90
"$@" > "$out/export.txt" 2>&1; echo $? > "$out/export.rc"
ls -A "$mnt" > "$out/left"
"""


@probe("r4_export_full_disk", 4, TRACEBACK, "xc-export onto a full disk (a 3 MB tmpfs): one line, nothing left")
def _r4_export_full_disk(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m to mount a small tmpfs"
    d = ctx.tmp("r4_export_full_disk")
    mnt, out = d / "mnt", d / "out"
    mnt.mkdir()
    out.mkdir()
    cmd = [xc("xc-export"), ctx.shared("A"), mnt / "exp"]
    p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", EXPORT_DISK_FULL, "_", mnt, out, *cmd], d)
    if p.rc == 90:
        return SKIPPED, "could not mount a tmpfs"
    text = shown((out / "export.txt").read_text(errors="replace"))
    rc = int((out / "export.rc").read_text())
    left = (out / "left").read_text().split()
    line = error_line(text)
    ok = rc == 2 and "no space left" in line.lower() and not left
    return classify(rc, text, wrong="exit 0 on a full disk" if rc == 0 else None,
                    failed=None if ok else f"exit {rc}, left {left}: {line[:140]}",
                    clean=f"exit 2, nothing left on the disk: {line[:150]}")


@probe("r4_export_unwritable_parent", 4, TRACEBACK, "xc-export into a folder below a read-only one")
def _r4_export_unwritable_parent(ctx: Ctx):
    d = ctx.tmp("r4_export_unwritable_parent")
    locked = d / "locked"
    locked.mkdir()
    p, how = read_only(locked, [xc("xc-export"), ctx.shared("A"), locked / "sub" / "exp"], d)
    if p is None:
        return SKIPPED, how
    left = [x.name for x in locked.iterdir()]
    line = error_line(p.text)
    ok = p.rc == 2 and line.startswith("error:") and "locked" in line and not left
    return classify(p.rc, p.text, wrong="exit 0 under a read-only folder" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {line[:140]}",
                    clean=f"[{how}] exit 2: {line[:160]}")


@probe("r4_ann_save_index_read_only_export", 4, TRACEBACK,
       "xc-predict EXPORT --ann faiss_hnsw --save-index on a read-only export: served, one warning")
def _r4_ann_save_index_read_only_export(ctx: Ctx):
    d = ctx.tmp("r4_ann_save_index_read_only_export")
    folder = export_copy(ctx, d)
    before = file_hashes(folder)
    queries = d / "queries.txt"
    queries.write_text(QUERIES)
    p, how = read_only(folder, [xc("xc-predict"), folder, "--ann", "faiss_hnsw", "--save-index", "--input", queries,
                                "--k", "3"], d)
    if p is None:
        return SKIPPED, how
    rows = [r for r in p.out.splitlines() if r.startswith("{")]
    warned = said_line(p.text, "could not save")
    failed = None if (p.rc == 0 and len(rows) == 2 and warned) else \
        f"exit {p.rc}, {len(rows)} rows, warned: {bool(warned)}: {error_line(p.text)[:130]}"
    return classify(p.rc, p.text, before=before, after=file_hashes(folder), failed=failed,
                    clean=f"[{how}] 2 rows served; {warned[:150]}")


@probe("r4_export_ctrl_c", 4, LOSS,
       "Ctrl-C (SIGINT) during xc-export over an earlier export: it stays whole, no staging folder left")
def _r4_export_ctrl_c(ctx: Ctx):
    d = ctx.tmp("r4_export_ctrl_c")
    folder = export_copy(ctx, d)
    before = file_hashes(folder)
    proc = subprocess.Popen([xc("xc-export"), str(ctx.shared("A")), str(folder)], cwd=d, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, staged = time.monotonic() + 120, False
    while time.monotonic() < deadline and proc.poll() is None:
        if any(x.name.startswith(".") for x in d.iterdir()):  # the staging folder: it is writing now
            staged = True
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    text = shown(out + "\n" + err)
    left = [x.name for x in d.iterdir() if x.name != folder.name]
    if not staged:
        return FAILED, f"the export ended (exit {proc.returncode}) before its staging folder was seen: not interrupted"
    line = next((r for r in text.splitlines() if "interrupted" in r), error_line(text))
    ok = proc.returncode == 130 and "interrupted" in line and not left
    return classify(proc.returncode, text, before=before, after=file_hashes(folder),
                    failed=None if ok else f"exit {proc.returncode}, left {left}: {line[:140]}",
                    clean=f"SIGINT while staging: exit 130, the earlier export byte-identical, nothing left: "
                          f"{line[:110]}")


# ---- rough edges

@probe("r4_cache_rebuild_warning_once", 4, SILENT,
       "a damaged cached .npy: the warning is printed once and does not ask to delete what is being rebuilt")
def _r4_cache_rebuild_warning_once(ctx: Ctx):
    import numpy as np

    d = ctx.tmp("r4_cache_rebuild_warning_once")
    ctx.shared("A")
    cache = d / "cache"
    shutil.copytree(ctx.cache, cache)
    (target,) = list(cache.glob("synthetic/*/train.features.values.npy"))
    arr = np.load(target, mmap_mode="r")
    header, shape, dtype = target.stat().st_size - arr.nbytes, arr.shape, arr.dtype
    del arr
    with open(target, "r+b") as f:
        f.seek(header)
        f.write(np.zeros(shape, dtype).tobytes())
    p = run(train_cmd(d / "run", cache), d)
    said = [r for r in p.text.splitlines() if "damaged" in r]
    problems = []
    if len(said) != 1:
        problems.append(f"said {len(said)} times")
    if any("delete" in r for r in said):
        problems.append("asks to delete what it rebuilds")
    if p.rc != 0:
        problems.append(f"exit {p.rc}: {error_line(p.text)[:100]}")
    return classify(p.rc, p.text, failed="; ".join(problems) or None,
                    clean=f"rebuilt, said once: {said_line(p.text, 'damaged')[:170]}")


@probe("r4_predict_blank_lines_only", 4, SILENT, "xc-predict of an input holding only blank lines")
def _r4_predict_blank_lines_only(ctx: Ctx):
    d = ctx.tmp("r4_predict_blank_lines_only")
    rows = d / "rows.txt"
    rows.write_text("\n\n \n\n")
    p = run([xc("xc-predict"), ctx.shared("A"), "--input", rows], d)
    line = error_line(p.text)
    if p.rc == 2 and "raw text" in line.split("(")[0]:
        return classify(p.rc, p.text, failed=f"blamed on raw text: {line[:150]}")
    return one_line_refusal(p, "holds no queries", what="blank lines answered")


@probe("r4_test_labels_never_in_training", 4, SILENT,
       "xc-train on records whose test split holds a label no training record has: one log line says so")
def _r4_test_labels_never_in_training(ctx: Ctx):
    _, _, text = ctx.records_run()
    said = said_line(text, "never occur in training")
    return classify(0, text, wrong=None if said else "no line says a test label never occurs in training",
                    clean=said[:180])


@probe("r4_records_run_source_moved", 4, TRACEBACK,
       "xc-predict of a records run whose source folder was moved away")
def _r4_records_run_source_moved(ctx: Ctx):
    d = ctx.tmp("r4_records_run_source_moved")
    run_dir, src, _ = ctx.records_run()
    moved = src.with_name(src.name + "-moved")
    src.rename(moved)
    try:
        p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin=records_text(3, 900) + "\n")
    finally:
        moved.rename(src)
    return one_line_refusal(p, "serving a run reads the data it trained on", "xc-export",
                             what="served without its source")
