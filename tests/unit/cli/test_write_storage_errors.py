"""Storage failures (EROFS, EACCES, ENOSPC, EDQUOT, EFBIG) on the remaining write paths: checkpoint publishing, xc-predict's
--out, xc-eval's --predictions and --out: one line naming the path, the cause and the fix, never a traceback."""

from __future__ import annotations

import builtins
import errno
import os
from types import SimpleNamespace

import numpy as np
import pytest

from xc.errors import CheckpointError

FAILURES = {"EROFS": "read-only file system", "EACCES": "permission denied", "ENOSPC": "no space left on the device",
            "EDQUOT": "disk quota exceeded",
            "EFBIG": "file too large (over the file size limit, ulimit -f, or the file system's largest file)"}


def _oserror(name, path=None):
    code = getattr(errno, name)
    return OSError(code, os.strerror(code), path)


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_publishing_a_checkpoint_on_failing_storage_is_one_line(tmp_path, monkeypatch, name):
    import torch

    from xc.run import checkpoint as ckpt

    crcs = ckpt.write_rank_files(tmp_path, 4, 0, {"w": torch.zeros(4)}, None)
    real_replace = os.replace

    def failing(src, dst, *a, **k):
        if str(dst).endswith("step-00000004"):
            raise _oserror(name, str(src))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(ckpt.os, "replace", failing)
    with pytest.raises(CheckpointError) as info:
        ckpt.publish(tmp_path, 4, 1, {}, keep=2, crc32=crcs)
    message = str(info.value)
    assert f"could not publish the checkpoint {tmp_path / 'checkpoints' / 'step-00000004'}" in message
    assert FAILURES[name] in message and "run the same command to resume" in message and "\n" not in message


class _Preds:
    def records(self):
        return [{"ids": [1], "scores": [0.5]}]


def _fake_model():
    return SimpleNamespace(num_labels=10, num_features=5, fusion=None, input_kind="features", run_dir="runs/x",
                           checkpoint=SimpleNamespace(name="step-1"), use_ann=None,
                           predict=lambda block, **kw: _Preds())


@pytest.mark.parametrize("name", sorted(FAILURES))
@pytest.mark.parametrize("where", ["open", "write"])
def test_xc_predict_out_on_failing_storage_is_one_line(tmp_path, monkeypatch, capsys, name, where):
    import xc.serve.load
    from xc.cli import predict

    monkeypatch.setattr(xc.serve.load, "load", lambda *a, **k: _fake_model())
    rows = tmp_path / "rows.txt"
    rows.write_text("1:0.5 2:1.0\n3:1.0\n")
    out = tmp_path / "preds.jsonl"
    real_open = builtins.open

    class Failing:
        def __init__(self, handle):
            self.handle = handle

        def write(self, data):
            raise _oserror(name)

        def flush(self):
            self.handle.flush()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

    def failing_open(path, *a, **k):
        if str(path) == str(out) or os.path.basename(path).startswith(f".{out.name}.part-"):
            if where == "open":
                raise _oserror(name, str(path))
            return Failing(real_open(path, *a, **k))
        return real_open(path, *a, **k)

    monkeypatch.setattr(predict, "open", failing_open, raising=False)
    code = predict.main([str(tmp_path), "--input", str(rows), "--format", "sparse", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and line[0].startswith(f"error: could not write --out {out}") and "Traceback" not in err
    assert FAILURES[name] in line[0] and "pass another --out FILE" in line[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.txt"]  # no partial --out file left


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_xc_eval_predictions_on_failing_storage_prints_the_metrics_then_one_line(tmp_path, monkeypatch, capsys, name):
    from xc.cli import evaluate

    def fake_evaluate(run_dir, checkpoint, topk, max_points, predictions, *rest):
        metrics = {"P@1": 50.0}
        evaluate._save_predictions(predictions, metrics, ids=np.zeros((2, 3), np.int32),
                                   scores=np.zeros((2, 3), np.float32))
        return metrics

    def failing_savez(handle, **arrays):
        handle.write(b"partial")
        raise _oserror(name)

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", fake_evaluate)
    monkeypatch.setattr(evaluate.np, "savez", failing_savez)
    preds, out = tmp_path / "p.npz", tmp_path / "m.json"
    code = evaluate.main([str(tmp_path), "--predictions", str(preds), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "P@1=50.00" in captured.out and out.exists()  # the metrics are not lost
    assert captured.err.strip() == (f"error: could not write --predictions {preds}: {FAILURES[name]}; free some "
                                    "space, fix the folder's permissions, or pass another --predictions FILE")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no half-written file left


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_xc_eval_out_on_failing_storage_is_one_line_after_the_metrics(tmp_path, monkeypatch, capsys, name):
    from pathlib import Path

    from xc.cli import evaluate

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a: {"P@1": 50.0})

    def failing_write(self, *a, **k):
        raise _oserror(name, str(self))

    monkeypatch.setattr(Path, "write_text", failing_write)
    out = tmp_path / "m.json"
    code = evaluate.main([str(tmp_path), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "P@1=50.00" in captured.out
    assert captured.err.strip() == (f"error: could not write {out}: {FAILURES[name]}; the metrics are above: free "
                                    "some space, fix the folder's permissions, or pass another --out FILE")
