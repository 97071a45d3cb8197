"""The second round's 7 probes that were not clean then (docs/reliability.md): `run_dir=` a user's folder or
`/`, a full disk at a checkpoint, a read-only run directory, live readers, a rank SIGKILLed without restarts, a
replaced pickle's messages and fallback."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tools.probes.reliability.common import (FAILED, LOSS, SILENT, SKIPPED, TRACEBACK, UNSHARE, child_env, classify,
                                             error_line, file_hashes, hash_changes, probe, read_only, run, shown, xc)
from tools.probes.reliability.fixtures import SMALL, Ctx, checkpoints, torchrun_cmd, train_cmd
from tools.probes.reliability.round2_clean import plant_pickle


# ---- round 2: the 7 that were not clean

def _user_folder(d: Path, sub: str | None = None) -> Path:
    folder = d / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"my": "settings, not xc\'s"}\n')
    (folder / "metrics.json").write_text('{"accuracy": 0.93}\n')
    if sub is None:
        (folder / "log.jsonl").write_text('{"note": "my own log"}\n')
    else:
        (folder / sub).mkdir()
        (folder / sub / "notes.txt").write_text("mine\n")
    return folder


def user_folder_probe(ctx: Ctx, name: str, sub: str | None):
    d = ctx.tmp(name)
    folder = _user_folder(d, sub)
    before = file_hashes(folder)
    p = run(train_cmd(folder, ctx.cache), d)
    after = file_hashes(folder)
    _, _, added = hash_changes(before, after)
    wrong = None
    if p.rc == 0:
        wrong = f"xc-train exit 0 into the user's folder (wrote {', '.join(added[:4])})"
    elif added:
        wrong = f"wrote {', '.join(added[:4])} before refusing"
    failed = None if (p.rc == 2 and "holds no xc run" in p.text) else f"exit {p.rc}: {error_line(p.text)[:150]}"
    return classify(0 if added else p.rc, p.text, before=before, after=after, wrong=wrong, failed=failed,
                    clean=f"exit 2, files byte-identical, nothing added: {error_line(p.text)[:110]}")


@probe("r2_run_dir_users_folder", 2, LOSS,
       "run_dir= a folder of the user's config.json, metrics.json, log.jsonl that never held a run")
def _r2_run_dir_users_folder(ctx: Ctx):
    return user_folder_probe(ctx, "r2_run_dir_users_folder", None)


@probe("r2_run_dir_root", 2, SILENT, "run_dir=/ (in a mount namespace where / is read-only)")
def _r2_run_dir_root(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m (a sandbox where / is read-only): not run on the real root"
    d = Path(tempfile.mkdtemp(prefix="xc-probe-root-", dir="/dev/shm"))
    try:
        cmd = [xc("xc-train"), *SMALL, "run_dir=/", f"data.cache_dir={d / 'cache'}"]
        script = 'mount -o remount,bind,ro / && cd "$1" && shift && exec "$@"'
        p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", script, "_", d, *cmd], d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    tried_write = "read-only file system" in p.text.lower() or "Errno 30" in p.text
    refused = p.rc == 2 and ("run_dir" in error_line(p.text)) and not tried_write
    return classify(p.rc, p.text, wrong=None if refused or p.rc != 0 else "run_dir=/ accepted",
                    failed=None if refused else f"not refused up front (tried to write at /: {tried_write}): "
                    f"{error_line(p.text)[:140]}", clean=f"exit 2: {error_line(p.text)[:160]}")


DISK_FULL_SCRIPT = r"""
set -u
mnt="$1"; out="$2"; shift 2
mount -t tmpfs -o size=64m tmpfs "$mnt" || exit 90
mkdir -p "$mnt/run"
# leave about 3 MB: the lock, config.json and the log fit, a checkpoint (13 MB) does not
head -c $((61*1024*1024)) /dev/zero > "$mnt/filler" 2>/dev/null
"$@" > "$out/first.txt" 2>&1; echo $? > "$out/first.rc"
find "$mnt/run" \( -name '*.part' -o \( -name '*.tmp' -not -empty \) \) > "$out/first.left"
find "$mnt/run" -name '*.tmp' -empty > "$out/first.empty"
find "$mnt/run" -ls > "$out/first.ls" 2>&1
"$@" > "$out/second.txt" 2>&1; echo $? > "$out/second.rc"
find "$mnt/run" \( -name '*.part' -o \( -name '*.tmp' -not -empty \) -o -name '.lock' \) > "$out/second.left"
ls -la "$mnt/run" > "$out/second.ls" 2>&1
rm -f "$mnt/filler"
"$@" > "$out/third.txt" 2>&1; echo $? > "$out/third.rc"
test -f "$mnt/run/metrics.json" && echo yes > "$out/third.done"
"""


@probe("r2_disk_full_at_checkpoint", 2, TRACEBACK,
       "a full disk (tmpfs) while a checkpoint is written; the same command again; again after freeing space")
def _r2_disk_full_at_checkpoint(ctx: Ctx):
    if not UNSHARE:
        return SKIPPED, "needs unshare -m to mount a small tmpfs"
    d = ctx.tmp("r2_disk_full_at_checkpoint")
    mnt, out = d / "mnt", d / "out"
    mnt.mkdir()
    out.mkdir()
    ctx.shared("A")  # the cache is built, so only the run directory is on the small disk
    cmd = [xc("xc-train"), *SMALL, f"run_dir={mnt / 'run'}", f"data.cache_dir={ctx.cache}"]
    p = run(["unshare", "-m", "--propagation", "private", "bash", "-c", DISK_FULL_SCRIPT, "_", mnt, out, *cmd], d,
            timeout=600)
    if p.rc == 90:
        return SKIPPED, "could not mount a tmpfs"
    texts = {k: shown((out / f"{k}.txt").read_text(errors="replace")) if (out / f"{k}.txt").exists() else ""
             for k in ("first", "second", "third")}
    rcs = {k: int((out / f"{k}.rc").read_text()) if (out / f"{k}.rc").exists() else None for k in texts}
    left1 = (out / "first.left").read_text().split() if (out / "first.left").exists() else []
    left2 = (out / "second.left").read_text().split() if (out / "second.left").exists() else []
    empty1 = (out / "first.empty").read_text().split() if (out / "first.empty").exists() else []
    allout = "\n".join(texts.values())
    problems = []
    for k in ("first", "second"):
        if rcs[k] == 0:
            problems.append(f"{k} run exit 0 on a full disk")
        elif "no space left" not in error_line(texts[k]).lower():
            problems.append(f"{k} run: {error_line(texts[k])[:100]}")
    if left1:
        problems.append(f"left behind after the first: {', '.join(Path(x).name for x in left1[:3])}")
    if rcs["third"] != 0 or not (out / "third.done").exists():
        problems.append(f"after freeing space: exit {rcs['third']}: {error_line(texts['third'])[:100]}")
    return classify(rcs["first"], allout, failed="; ".join(problems) or None,
                    clean=f"exit {rcs['first']}/{rcs['second']} in one line ({error_line(texts['first'])[:90]}); "
                          f"no file left{'' if not left2 else ' but ' + ','.join(Path(x).name for x in left2)}"
                          f"{' (an empty ' + Path(empty1[0]).name + '/ stays, swept at the next start)' if empty1 else ''}"
                          f"; space freed: the same command exit 0")


@probe("r2_read_only_run_dir_eval", 2, TRACEBACK, "xc-eval on a finished run on a read-only mount (eval.json)")
def _r2_read_only_run_dir_eval(ctx: Ctx):
    d = ctx.tmp("r2_read_only_run_dir_eval")
    run_dir = ctx.copy_of("A", d / "run")
    p, how = read_only(run_dir, [xc("xc-eval"), run_dir], d)
    if p is None:
        return SKIPPED, how
    printed = "P@1=" in p.text
    failed = None
    if not printed:
        failed = f"no metrics printed (exit {p.rc}): {error_line(p.text)[:140]}"
    elif p.rc not in (0, 2):
        failed = f"exit {p.rc}"
    return classify(p.rc, p.text, failed=failed,
                    clean=f"[{how}] metrics printed, exit {p.rc}: {error_line(p.text)[:120]}")


def live_readers(ctx: Ctx, name: str, tries: int):
    """A trainer checkpointing every 5 steps (default keep_checkpoints), xc-eval / xc-predict tried while it
    trains; the trainer is stopped with SIGTERM when the tries are done."""
    d = ctx.tmp(name)
    run_dir = d / "run"
    ctx.shared("A")
    cmd = train_cmd(run_dir, ctx.cache, "train.checkpoint_every_steps=5", "train.epochs=100000",
                    "eval.select_epoch_patience=0")  # no early stop: it trains until the tries are done
    trainer = subprocess.Popen(cmd, cwd=d, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and trainer.poll() is None:
            time.sleep(0.2)
        for i in range(tries):
            if trainer.poll() is not None:
                break
            if i % 2 == 0:
                p = run([xc("xc-eval"), run_dir, "--out", d / f"eval{i}.json"], d, timeout=120)
            else:
                p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="1:0.5 5:1.0\n3:1.0\n",
                        timeout=120)
            ok = p.rc == 0 and (("P@1=" in p.text) if i % 2 == 0 else len(p.out.strip().splitlines()) == 2)
            results.append((("xc-eval", "xc-predict")[i % 2], ok, p))
    finally:
        alive = trainer.poll() is None
        trainer.send_signal(signal.SIGTERM)
        try:
            tout, _ = trainer.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
            tout, _ = trainer.communicate()
    if not results:
        return FAILED, f"the trainer ended before any reader ran (exit {trainer.returncode})"
    bad = [(tool, p) for tool, ok, p in results if not ok]
    text = "\n".join(p.text for _, _, p in results)
    note = "" if alive else f" (the trainer ended by itself, exit {trainer.returncode}: {error_line(tout)[:80]})"
    failed = None
    if bad:
        tool, p = bad[0]
        failed = f"{len(bad)} of {len(results)} tries failed{note}; first: {tool} exit {p.rc}: {error_line(p.text)[:120]}"
    return classify(bad[0][1].rc if bad else 0, text, failed=failed,
                    clean=f"{len(results)} of {len(results)} tries answered while it trained{note}")


@probe("r2_live_readers", 2, TRACEBACK, "xc-eval / xc-predict on a run while it trains (3 tries)")
def _r2_live_readers(ctx: Ctx):
    return live_readers(ctx, "r2_live_readers", 3)


@probe("r2_sigkill_rank1_no_restarts", 2, TRACEBACK, "SIGKILL of rank 1 of 2 under torchrun without --max-restarts")
def _r2_sigkill_rank1_no_restarts(ctx: Ctx):
    d = ctx.tmp("r2_sigkill_rank1_no_restarts")
    run_dir = d / "run"
    env = {"XC_FAULT_KILL_AT_STEP": "6", "XC_FAULT_KILL_RANK": "1"}
    p = run(torchrun_cmd(2, run_dir, ctx.cache, "train.checkpoint_every_steps=4"), d, env=env, timeout=400)
    fired = (run_dir / "fault-kill-fired").exists()
    ours = [r for r in p.err.splitlines() if r.startswith("error: rank 0:")]
    named = bool(ours) and "rank 1 (pid" in ours[0]
    stopped = "stopped" in p.err.lower()
    failed = None
    if not fired:
        failed = "the fault did not fire"
    elif p.rc == 0:
        failed = "the job exited 0"
    elif not (named or stopped):
        failed = f"no line naming the dead rank: {error_line(p.err)[:140]}"
    return classify(p.rc, p.text, failed=failed, clean=(ours[0] if ours else error_line(p.err))[:180]
                    + " (torchrun's own ChildFailedError summary not counted)")


@probe("r2_pickle_messages_and_fallback", 2, TRACEBACK,
       "a checkpoint .pt replaced by a pickle: xc-eval's message; xc-train falls back to the previous checkpoint")
def _r2_pickle_messages_and_fallback(ctx: Ctx):
    d = ctx.tmp("r2_pickle_messages_and_fallback")
    run_dir = ctx.copy_of("A", d / "run")
    newest = plant_pickle(run_dir, d / "PWNED")
    pe = run([xc("xc-eval"), run_dir, "--out", d / "eval.json"], d)
    pt = run(train_cmd(run_dir, ctx.cache, "train.epochs=3"), d)
    text = pe.text + pt.text
    problems = []
    if "weights_only=False" in text:
        problems.append("torch's advice to retry with weights_only=False is shown")
    if pe.rc not in (0, 2):
        problems.append(f"xc-eval exit {pe.rc}")
    if pt.rc != 0 or "skipping damaged checkpoint" not in pt.text:
        problems.append(f"xc-train did not fall back (exit {pt.rc}: {error_line(pt.text)[:100]})")
    return classify(pe.rc, text, failed="; ".join(problems) or None,
                    clean=f"xc-eval exit {pe.rc}: {error_line(pe.text)[:160]}; xc-train skipped {newest.name}, "
                          f"resumed from the previous, exit 0")
