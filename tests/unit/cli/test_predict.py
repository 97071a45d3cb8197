"""xc-predict's input checks (xc/cli/predict.py over xc/data/queries.py), without a trained run: the model is a stub."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _stub_model(input_kind: str):
    def predict(block, **kw):
        raise AssertionError("an input without queries must not reach the model")

    return SimpleNamespace(num_labels=10, num_features=0 if input_kind == "text" else 5, fusion=None,
                           input_kind=input_kind, run_dir="runs/x", checkpoint=SimpleNamespace(name="step-1"),
                           use_ann=None, predict=predict)


@pytest.mark.parametrize("input_kind", ["text", "features"])
def test_blank_lines_only_get_one_line_saying_there_are_no_queries(tmp_path, monkeypatch, capsys, input_kind):
    import xc.serve.load
    from xc.cli import predict

    monkeypatch.setattr(xc.serve.load, "load", lambda *a, **k: _stub_model(input_kind))
    rows = tmp_path / "rows.txt"
    rows.write_text("\n\n \n\n")
    assert predict.main([str(tmp_path), "--input", str(rows)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {rows}: input: holds no queries: 4 blank line(s)"), err
    assert "raw text" not in line.split("(")[0] and "Traceback" not in err
