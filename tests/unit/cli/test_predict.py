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


@pytest.mark.parametrize("cli", ["predict", "evaluate"])
def test_neighbours_serving_with_save_index_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys, cli):
    """`--ann neighbours` builds no index: `--save-index` beside it is refused at once, naming the fix."""
    import importlib

    import xc.serve.load

    def no_load(*a, **k):
        raise AssertionError("the arguments must be refused before the model loads")

    monkeypatch.setattr(xc.serve.load, "load", no_load)
    module = importlib.import_module(f"xc.cli.{cli}")
    extra = ["--input", str(tmp_path / "rows.txt")] if cli == "predict" else []
    assert module.main([str(tmp_path), *extra, "--ann", "neighbours", "--save-index"]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "--ann neighbours builds no index to save" in line and "drop --save-index" in line
    assert "Traceback" not in err
