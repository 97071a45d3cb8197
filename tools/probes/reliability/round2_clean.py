"""The second round's 11 probes that were clean then (docs/reliability.md): SIGTERM to two ranks and a
bit-identical resume, two trainers or two miners on one run, a path-traversing manifest, a code-running pickle,
six malformed data files."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import zlib
from pathlib import Path

from tools.probes.reliability.common import (CLEAN, FAILED, LOSS, PY, SILENT, TRACEBACK, child_env, classify,
                                             error_line, file_hashes, find_tracebacks, probe, run, xc)
from tools.probes.reliability.fixtures import (Ctx, checkpoints, final_state, metrics, torchrun_cmd, train_cmd,
                                               write_xc_sparse)


# ---- round 2: the 11 that were clean

@probe("r2_sigterm_two_ranks_resume", 2, SILENT,
       "SIGTERM to torchrun (forwarded to 2 gloo ranks) mid-epoch, re-run: bit-identical to an uninterrupted run")
def _r2_sigterm_two_ranks_resume(ctx: Ctx):
    import torch

    d = ctx.tmp("r2_sigterm_two_ranks_resume")
    over = ["train.checkpoint_every_steps=4"]
    straight, signalled = d / "straight", d / "signalled"
    p0 = run(torchrun_cmd(2, straight, ctx.cache, *over), d, timeout=400)
    if p0.rc != 0:
        return classify(p0.rc, p0.text, failed=f"uninterrupted 2-rank run failed: {error_line(p0.text)}")
    env = {"XC_FAULT_SIGNAL_AT_STEP": "6", "XC_FAULT_SIGNAL": "TERM", "XC_FAULT_SIGNAL_TARGET": "parent"}
    p1 = run(torchrun_cmd(2, signalled, ctx.cache, *over), d, env=env, timeout=400)
    said = [r for r in p1.err.splitlines() if "stopped by SIGTERM after global step 6" in r]
    tb1 = find_tracebacks(p1.text)
    if tb1:
        return classify(p1.rc, p1.text)
    if not said or (signalled / "metrics.json").exists():
        return FAILED, f"signalled run: exit {p1.rc}, no 'stopped by SIGTERM' line: {error_line(p1.text)}"
    p2 = run(torchrun_cmd(2, signalled, ctx.cache, *over), d, timeout=400)
    if p2.rc != 0:
        return classify(p2.rc, p2.text, failed=f"resume failed: {error_line(p2.text)}")
    a, b = final_state(straight, 2), final_state(signalled, 2)
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    same_metrics = metrics(straight) == metrics(signalled)
    wrong = None
    if diff or not same_metrics:
        wrong = f"resumed model differs from the uninterrupted one ({len(diff)} tensors, metrics equal: {same_metrics})"
    return classify(p2.rc, p1.text + p2.text, wrong=wrong,
                    clean=f"stopped at step 6 (exit {p1.rc}), resumed: {len(a)} tensors torch.equal, metrics equal")


@probe("r2_two_trainers_refused", 2, LOSS, "a second xc-train on a run directory a live trainer holds")
def _r2_two_trainers_refused(ctx: Ctx):
    d = ctx.tmp("r2_two_trainers_refused")
    run_dir = d / "run"
    cmd = train_cmd(run_dir, ctx.cache, "train.epochs=200")
    first = subprocess.Popen(cmd, cwd=d, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and first.poll() is None:
            time.sleep(0.3)
        if first.poll() is not None:
            return FAILED, f"the first trainer ended early (exit {first.returncode})"
        keep = {k: v for k, v in file_hashes(run_dir).items() if k in ("config.json", "identity.json", ".xc-run")}
        second = run(cmd, d, timeout=120)
        after = file_hashes(run_dir)
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            out1, _ = first.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()
            out1, _ = first.communicate()
    refused = second.rc == 2 and "in use by pid" in second.text and str(first.pid) in second.text
    return classify(second.rc, second.text, before=keep, after=after,
                    wrong=None if refused else "the second trainer was not refused",
                    clean=f"exit 2: {error_line(second.text)[:150]}")


@probe("r2_two_miners_refused", 2, LOSS, "a second xc-miner on a run one xc-miner serves")
def _r2_two_miners_refused(ctx: Ctx):
    d = ctx.tmp("r2_two_miners_refused")
    run_dir = ctx.copy_of("A", d / "run")
    cmd = [xc("xc-miner"), "--run-dir", run_dir, "--workers", "1"]
    first = subprocess.Popen([str(c) for c in cmd], cwd=d, env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lease = run_dir / "handoff" / "control" / "miner.lease"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not lease.exists() and first.poll() is None:
            time.sleep(0.2)
        second = run([*cmd, "--once"], d, timeout=120)
    finally:
        (run_dir / "handoff" / "control").mkdir(parents=True, exist_ok=True)
        (run_dir / "handoff" / "control" / "stop").touch()
        try:
            out1, _ = first.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            first.kill()
            out1, _ = first.communicate()
    refused = second.rc == 2 and f"xc-miner pid {first.pid}" in second.text
    text = second.text + out1
    if refused and first.returncode != 0:
        return classify(first.returncode, text, failed=f"the first miner ended with exit {first.returncode}")
    return classify(second.rc, text, wrong=None if refused else "the second miner was not refused",
                    clean=f"exit 2 naming the first: {error_line(second.text)[:120]}; the first stopped, exit 0")


@probe("r2_path_traversing_manifest", 2, SILENT,
       "a checkpoint's meta.json naming a file outside its directory (../../outside.pt)")
def _r2_path_traversing_manifest(ctx: Ctx):
    d = ctx.tmp("r2_path_traversing_manifest")
    run_dir = ctx.copy_of("A", d / "run")
    newest = checkpoints(run_dir)[-1]
    outside = d / "outside.pt"
    shutil.copy(newest / "rank0.pt", outside)
    (newest / "rank0.pt").unlink()
    meta = json.loads((newest / "meta.json").read_text())
    rel = os.path.relpath(outside, newest)
    meta["files"][rel] = meta["files"].pop("rank0.pt")
    meta["crc32"][rel] = meta["crc32"].pop("rank0.pt")
    (newest / "meta.json").write_text(json.dumps(meta))
    (run_dir / "selection.json").unlink(missing_ok=True)
    p = run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d)
    skipped = "skipping damaged checkpoint" in p.text or "outside" in p.text
    used_newest = f"{newest.name}" in p.text and not skipped
    return classify(p.rc, p.text,
                    wrong=None if skipped else f"the escaping path was not refused (used {newest.name}: {used_newest})",
                    clean=f"exit {p.rc}: {next((r.strip() for r in p.text.splitlines() if 'skipping' in r), '')[:170]}")


PICKLE_SRC = """
import os, pickle, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
open(sys.argv[1], "wb").write(pickle.dumps({"encoder": Evil()}, protocol=2))
"""


def plant_pickle(run_dir: Path, marker: Path) -> Path:
    """The newest checkpoint's rank0.pt replaced by a code-running pickle, with its size and CRC-32 in meta.json
    recomputed (as an attacker would), so that the loader reaches torch.load."""
    newest = checkpoints(run_dir)[-1]
    target = newest / "rank0.pt"
    subprocess.run([PY, "-c", PICKLE_SRC, str(target), str(marker)], check=True)
    data = target.read_bytes()
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["rank0.pt"] = len(data)
    meta.setdefault("crc32", {})["rank0.pt"] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    meta.pop("sha256", None)
    (newest / "meta.json").write_text(json.dumps(meta))
    (run_dir / "selection.json").unlink(missing_ok=True)
    return newest


@probe("r2_code_running_pickle_never_runs", 2, LOSS,
       "a checkpoint .pt replaced by a code-running pickle (meta.json recomputed): xc-eval, xc-predict, xc.load")
def _r2_code_running_pickle_never_runs(ctx: Ctx):
    d = ctx.tmp("r2_code_running_pickle_never_runs")
    run_dir = ctx.copy_of("A", d / "run")
    marker = d / "PWNED"
    plant_pickle(run_dir, marker)
    outs = [run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d),
            run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="1:0.5 5:1.0\n"),
            run([PY, "-c", f"import xc; m = xc.load({str(run_dir)!r}); print(len(m.predict(['1:0.5 5:1.0'], k=3)))"],
                d)]
    if marker.exists():
        return LOSS, "the pickle's code ran (it could have overwritten any file)"
    raised = (find_tracebacks(outs[2].text) or ["-"])[-1]
    return CLEAN, "the pickle's code never ran (xc-eval exit {}, xc-predict exit {}; xc.load raised {})".format(
        outs[0].rc, outs[1].rc, raised[:170])


@probe("r2_bad_data_short_header", 2, TRACEBACK, "xc_sparse train.txt with a header of two numbers")
def _r2_bad_data_short_header(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_short_header", lambda t: t.replace(t.splitlines()[0], "200 50", 1))


@probe("r2_bad_data_truncated", 2, TRACEBACK, "xc_sparse train.txt with fewer rows than its header says")
def _r2_bad_data_truncated(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_truncated", lambda t: "\n".join(t.splitlines()[:-5]) + "\n")


@probe("r2_bad_data_label_out_of_range", 2, TRACEBACK, "xc_sparse row with label id 99 of 20")
def _r2_bad_data_label_out_of_range(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_label_out_of_range", lambda t: _edit_row(t, 7, lambda r: "99" + r[r.index(" "):]))


@probe("r2_bad_data_nan_value", 2, TRACEBACK, "xc_sparse row with a feature value nan")
def _r2_bad_data_nan_value(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_nan_value", lambda t: _edit_row(t, 9, lambda r: r + " 3:nan"))


@probe("r2_bad_data_not_utf8", 2, TRACEBACK, "xc_sparse train.txt with bytes that are not UTF-8")
def _r2_bad_data_not_utf8(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_not_utf8", None, raw=lambda b: _bytes_row(b, 11))


@probe("r2_bad_data_test_header_disagrees", 2, TRACEBACK, "xc_sparse test.txt whose header names 51 features, train 50")
def _r2_bad_data_test_header_disagrees(ctx: Ctx):
    return _bad_data(ctx, "r2_bad_data_test_header_disagrees", lambda t: t.replace(" 50 20\n", " 51 20\n", 1),
                     file="test.txt")


def _edit_row(text: str, row: int, fn) -> str:
    lines = text.splitlines()
    lines[row] = fn(lines[row])
    return "\n".join(lines) + "\n"


def _bytes_row(data: bytes, row: int) -> bytes:
    lines = data.split(b"\n")
    lines[row] = lines[row] + b" \xff\xfe:1.0"
    return b"\n".join(lines)


def _bad_data(ctx: Ctx, name: str, edit, raw=None, file: str = "train.txt"):
    d = ctx.tmp(name)
    data = write_xc_sparse(d / "data")
    path = data / file
    if raw is not None:
        path.write_bytes(raw(path.read_bytes()))
    else:
        path.write_text(edit(path.read_text()))
    p = run([xc("xc-train"), "data.kind=xc_sparse", f"data.path={data}", f"data.cache_dir={d / 'cache'}",
             f"run_dir={d / 'run'}", "train.epochs=1", "train.ensemble=1", "logger.wandb=disabled",
             "logger.progress=false"], d)
    line = error_line(p.text)
    names = re.search(r"\.txt:\d+:", line) is not None
    wrong = "the bad file was accepted" if p.rc == 0 else None
    failed = None if (p.rc == 2 and names) else f"exit {p.rc}, no file:line: field line: {line[:150]}"
    return classify(p.rc, p.text, wrong=wrong, failed=failed, clean=line[:180])
