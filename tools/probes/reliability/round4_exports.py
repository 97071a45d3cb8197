"""The fourth round's 14 probes of exports, thresholds and `xc-data verify`: an export whose manifest names a
file outside it, whose `models` names another export, holding a link out, with its JSON or safetensors header
edited (every checksum recomputed, `reseal`) or a code-running pickle for its weights; `xc-export` over the user's
file, over a read-only export, of a run still training; a threshold after `use_prior(False)`, on another
checkpoint, not a number; `xc-data verify` on the cache root."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tools.probes.reliability.common import (CLEAN, FAILED, LOSS, PY, SILENT, SKIPPED, TRACEBACK, api_refusal,
                                             child_env, classify, error_line, file_hashes, one_line_refusal, probe,
                                             read_only, run, said_line, xc)
from tools.probes.reliability.fixtures import Ctx, checkpoints, train_cmd
from tools.probes.reliability.round2_clean import PICKLE_SRC


def reseal(folder: Path) -> None:
    """Recompute every checksum of the export's manifest (the files it lists, wherever they lead, and its own),
    as someone editing an export by hand would: what the loader then reads is what its checks must refuse."""
    manifest = json.loads((folder / "export.json").read_text())
    for name, entry in manifest["files"].items():
        path = Path(name) if os.path.isabs(name) else folder / name
        if path.is_file():
            data = path.read_bytes()
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    manifest["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    (folder / "export.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))


QUERIES = "1:0.5 5:1.0\n3:1.0\n"


def export_copy(ctx: Ctx, d: Path, name: str = "exp") -> Path:
    return Path(shutil.copytree(ctx.export("A"), d / name, symlinks=True))


def _tampered_export(ctx: Ctx, name: str, edit, words: list[str], what: str):
    """A copy of the shared export, EDIT(folder, d) applied and resealed, served by xc-predict: refused in one line
    holding WORDS, never served (SILENT) and never a traceback."""
    d = ctx.tmp(name)
    folder = export_copy(ctx, d)
    edit(folder, d)
    reseal(folder)
    p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
    return one_line_refusal(p, *words, what=what)


def _name_outside(manifest_name):
    def edit(folder: Path, d: Path):
        outside = d / "queries.txt"
        outside.write_text("1:0.5 5:1.0\n")
        manifest = json.loads((folder / "export.json").read_text())
        manifest["files"][manifest_name(outside, folder)] = {"bytes": 0, "sha256": ""}
        (folder / "export.json").write_text(json.dumps(manifest))
    return edit


@probe("r4_export_manifest_names_parent_file", 4, SILENT,
       "an export whose manifest lists ../queries.txt (checksums recomputed): xc-predict EXPORT")
def _r4_export_manifest_names_parent_file(ctx: Ctx):
    return _tampered_export(ctx, "r4_export_manifest_names_parent_file", _name_outside(lambda o, f: "../queries.txt"),
                            ["export.json", "not a plain file name"], "a file outside the export listed and served")


@probe("r4_export_manifest_names_absolute_path", 4, SILENT,
       "an export whose manifest lists an absolute path (checksums recomputed): xc-predict EXPORT")
def _r4_export_manifest_names_absolute_path(ctx: Ctx):
    return _tampered_export(ctx, "r4_export_manifest_names_absolute_path", _name_outside(lambda o, f: str(o)),
                            ["export.json", "not a plain file name"], "an absolute path listed and served")


@probe("r4_export_models_name_another_export", 4, SILENT,
       "an export whose manifest's models names ../another-run/model (checksums recomputed)")
def _r4_export_models_name_another_export(ctx: Ctx):
    def edit(folder: Path, d: Path):
        export_copy(ctx, d, "another-run")
        manifest = json.loads((folder / "export.json").read_text())
        manifest["models"] = ["../another-run/model"]
        (folder / "export.json").write_text(json.dumps(manifest))
    return _tampered_export(ctx, "r4_export_models_name_another_export", edit, ["models"],
                            "another folder's weights served under this export's fusion and prior")


@probe("r4_export_symlink_out", 4, SILENT,
       "an export whose prior.json is a symbolic link to a file outside it (checksums recomputed)")
def _r4_export_symlink_out(ctx: Ctx):
    def edit(folder: Path, d: Path):
        outside = d / "elsewhere-prior.json"
        outside.write_text('{"beta": 0.9}\n')
        (folder / "prior.json").unlink()
        (folder / "prior.json").symlink_to(outside)
    return _tampered_export(ctx, "r4_export_symlink_out", edit, ["prior.json", "symbolic link"],
                            "a link out of the export followed")


@probe("r4_export_json_edited", 4, TRACEBACK,
       "an export's model/config.json (global_step \"five\") and fusion.json (k \"fifty\") edited, checksums "
       "recomputed")
def _r4_export_json_edited(ctx: Ctx):
    d = ctx.tmp("r4_export_json_edited")
    results = []
    for file, key, value in (("model/config.json", "global_step", "five"), ("fusion.json", "k", "fifty")):
        folder = d / f"exp-{key}"
        shutil.copytree(ctx.export("A"), folder)
        body = json.loads((folder / file).read_text())
        body[key] = value
        (folder / file).write_text(json.dumps(body))
        reseal(folder)
        p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
        results.append(one_line_refusal(p, file.split("/")[-1], key, what=f"{file} with {key}={value!r} served"))
    bad = [r for r in results if r[0] != CLEAN]
    return bad[0] if bad else (CLEAN, " | ".join(r[1] for r in results))


def _edit_header(path: Path, how: str) -> None:
    """model.safetensors' header edited in place: its length past the file's end, or a tensor's shape."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if how == "length":
        data[:8] = (len(data) * 4).to_bytes(8, "little")
    else:
        header = json.loads(data[8:8 + n])
        shape = header["classifier.weight"]["shape"]
        header["classifier.weight"]["shape"] = [shape[0] // 2, shape[1]]
        text = json.dumps(header, separators=(",", ":")).encode()
        data[8:8 + n] = text + b" " * (n - len(text))  # the same length: the offsets still point at the data
    path.write_bytes(bytes(data))


@probe("r4_export_safetensors_header_edited", 4, TRACEBACK,
       "an export's model.safetensors header edited (its length; a tensor's shape), checksums recomputed")
def _r4_export_safetensors_header_edited(ctx: Ctx):
    d = ctx.tmp("r4_export_safetensors_header_edited")
    results = []
    for how in ("length", "shape"):
        folder = d / f"exp-{how}"
        shutil.copytree(ctx.export("A"), folder)
        _edit_header(folder / "model" / "model.safetensors", how)
        reseal(folder)
        p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
        results.append(one_line_refusal(p, "model.safetensors", what=f"a header with its {how} edited served"))
    bad = [r for r in results if r[0] != CLEAN]
    return bad[0] if bad else (CLEAN, " | ".join(r[1] for r in results))


@probe("r4_export_pickle_for_safetensors", 4, LOSS,
       "a code-running pickle in place of an export's model.safetensors (checksums recomputed): xc-predict, xc.load")
def _r4_export_pickle_for_safetensors(ctx: Ctx):
    d = ctx.tmp("r4_export_pickle_for_safetensors")
    folder = export_copy(ctx, d)
    marker = d / "PWNED"
    subprocess.run([PY, "-c", PICKLE_SRC, str(folder / "model" / "model.safetensors"), str(marker)], check=True)
    reseal(folder)
    p = run([xc("xc-predict"), folder, "--input", "-", "--k", "3"], d, stdin=QUERIES)
    q = run([PY, "-c", LOAD_SCRIPT, folder], d)
    if marker.exists():
        return LOSS, "the pickle's code ran (it could have overwritten any file)"
    first = one_line_refusal(p, "model.safetensors", "not a safetensors file", what="a pickle served")
    if first[0] != CLEAN:
        return first
    second = api_refusal(q, ["model.safetensors"], "xc.load took a pickle")
    return second if second[0] != CLEAN else (CLEAN, f"never unpickled; xc-predict {first[1]}; xc.load: {second[1]}")


LOAD_SCRIPT = """
import json, sys
import scipy.sparse
import xc
from xc.errors import XCError
try:
    m = xc.load(sys.argv[1])
    rows = scipy.sparse.csr_matrix(([0.5, 1.0], ([0, 0], [1, 5])), shape=(1, m.num_features))
    print(json.dumps({"ids": m.predict(rows, k=3).ids.tolist()}))
except XCError as exc:
    print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
    sys.exit(2)
"""


@probe("r4_export_keeps_users_file", 4, LOSS,
       "xc-export into an earlier export holding a file of the user's (NOTES.md)")
def _r4_export_keeps_users_file(ctx: Ctx):
    d = ctx.tmp("r4_export_keeps_users_file")
    folder = export_copy(ctx, d)
    (folder / "NOTES.md").write_text("# my notes on this model\n")
    before = file_hashes(folder)
    p = run([xc("xc-export"), ctx.shared("A"), folder], d)
    after = file_hashes(folder)
    left = [x.name for x in d.iterdir() if x.name.startswith(".")]
    ok = p.rc == 2 and "NOTES.md" in error_line(p.text) and not left
    return classify(p.rc, p.text, before=before, after=after,
                    wrong="exported over the user's file" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {error_line(p.text)[:140]}",
                    clean=f"exit 2, NOTES.md and the export byte-identical: {error_line(p.text)[:130]}")


@probe("r4_reexport_read_only_export", 4, TRACEBACK,
       "xc-export again into an earlier export on a read-only mount: one line, no hidden staging folder left")
def _r4_reexport_read_only_export(ctx: Ctx):
    d = ctx.tmp("r4_reexport_read_only_export")
    folder = export_copy(ctx, d)
    before = file_hashes(folder)
    p, how = read_only(folder, [xc("xc-export"), ctx.shared("A"), folder], d)
    if p is None:
        return SKIPPED, how
    left = [x.name for x in d.iterdir() if x.name != folder.name]
    ok = p.rc == 2 and error_line(p.text).startswith("error:") and not left
    return classify(p.rc, p.text, before=before, after=file_hashes(folder),
                    wrong="exit 0 over a read-only export" if p.rc == 0 else None,
                    failed=None if ok else f"exit {p.rc}, left {left}: {error_line(p.text)[:140]}",
                    clean=f"[{how}] exit 2, nothing left beside it: {error_line(p.text)[:130]}")


@probe("r4_export_live_run", 4, SILENT, "xc-export of a run that is still training")
def _r4_export_live_run(ctx: Ctx):
    d = ctx.tmp("r4_export_live_run")
    run_dir = d / "run"
    ctx.shared("A")
    trainer = subprocess.Popen(train_cmd(run_dir, ctx.cache, "train.epochs=200"), cwd=d, env=child_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not checkpoints(run_dir) and trainer.poll() is None:
            time.sleep(0.3)
        if trainer.poll() is not None:
            return FAILED, f"the trainer ended early (exit {trainer.returncode})"
        p = run([xc("xc-export"), run_dir, d / "exp"], d)
    finally:
        trainer.send_signal(signal.SIGTERM)
        try:
            trainer.wait(timeout=120)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait()
    if (d / "exp").exists() and p.rc == 0:
        return classify(0, p.text, wrong="a live run exported without a word")
    return one_line_refusal(p, "still training", "--allow-running", what="a live run exported")


THRESHOLD_SCRIPT = """
import json, sys
import scipy.sparse
import xc
from xc.errors import XCError
m = xc.load(sys.argv[1])
{setup}
rows = scipy.sparse.csr_matrix(([0.5, 1.0, 1.0], ([0, 0, 1], [1, 5, 3])), shape=(2, m.num_features))
try:
    out = m.predict(rows, k=5, threshold={threshold})
except XCError as exc:
    print(json.dumps({{"error": str(exc), "type": type(exc).__name__}}))
    sys.exit(2)
print(json.dumps({{"ids": out.ids.tolist()}}))
"""


@probe("r4_threshold_after_use_prior_false", 4, SILENT,
       "xc.load(RUN).use_prior(False), then predict(..., threshold=0.5): the map was fitted on scores with the prior")
def _r4_threshold_after_use_prior_false(ctx: Ctx):
    d = ctx.tmp("r4_threshold_after_use_prior_false")
    p = run([PY, "-c", THRESHOLD_SCRIPT.format(setup="m.use_prior(False)", threshold="0.5"), ctx.shared("A")], d)
    return api_refusal(p, ["does not fit these scores", "no label prior"],
                        "the calibration applied to scores it was not fitted on")


@probe("r4_threshold_other_checkpoint", 4, SILENT,
       "xc-predict RUN --checkpoint step-N (not the one calibrated) --min-score 0.5")
def _r4_threshold_other_checkpoint(ctx: Ctx):
    d = ctx.tmp("r4_threshold_other_checkpoint")
    run_dir = ctx.shared("A")
    older = checkpoints(run_dir)[0]
    p = run([xc("xc-predict"), run_dir, "--checkpoint", older, "--min-score", "0.5", "--input", "-", "--k", "5"], d,
            stdin=QUERIES)
    return one_line_refusal(p, "does not fit these scores", older.name,
                             what="the calibration applied to another checkpoint's scores")


@probe("r4_threshold_not_a_number", 4, TRACEBACK, "xc.load(RUN).predict(..., threshold=\"abc\")")
def _r4_threshold_not_a_number(ctx: Ctx):
    d = ctx.tmp("r4_threshold_not_a_number")
    p = run([PY, "-c", THRESHOLD_SCRIPT.format(setup="", threshold="'abc'"), ctx.shared("A")], d)
    return api_refusal(p, ["threshold", "a probability in [0, 1]"], "a threshold of 'abc' taken")


@probe("r4_data_verify_cache_root", 4, TRACEBACK, "xc-data verify on the cache root (datasets two levels down)")
def _r4_data_verify_cache_root(ctx: Ctx):
    d = ctx.tmp("r4_data_verify_cache_root")
    ctx.shared("A")
    ctx.records_run()
    p = run([xc("xc-data"), "verify", ctx.cache], d)
    oks = [r for r in p.out.splitlines() if r.startswith("ok: ")]
    said = said_line(p.text, "intact")
    failed = None if (p.rc == 0 and len(oks) >= 2 and said) else \
        f"exit {p.rc}, {len(oks)} ok: {error_line(p.text)[:140]}"
    return classify(p.rc, p.text, failed=failed, clean=f"exit 0, {len(oks)} datasets: {said[:150]}")
