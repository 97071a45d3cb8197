"""`xc.fit` trains from Python objects exactly as `xc-train` does from the same data in files."""

from __future__ import annotations

import json

import numpy as np
import pytest

import xc
from tests.conftest import REPO, run_cli, shared_dataset
from xc.data import load_dataset
from xc.errors import XCError

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = {"train__max_steps": 24, "train__epochs": 2, "train__batch_size": 128, "train__ensemble": 1,
        "logger__progress": False, "logger__wandb": "disabled", "seed": 3}


def test_fit_on_bibtex_arrays_gives_the_cli_figures(tmp_path):
    bibtex = shared_dataset("bibtex")
    ds = load_dataset("xc_sparse", str(bibtex), str(tmp_path / "arrays"))
    x, y = ds.train.features.to_scipy(), ds.train.labels.to_scipy()
    x_test, y_test = ds.test.features.to_scipy(), ds.test.labels.to_scipy()
    model = xc.fit(x, y, X_test=x_test, Y_test=y_test.toarray(), run_dir=str(tmp_path / "fit"),
                   data__cache_dir=str(tmp_path / "cache"), **TINY)
    cli = ["data=bibtex", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'cli'}",
           *(f"{k.replace('__', '.')}={str(v).lower() if isinstance(v, bool) else v}" for k, v in TINY.items())]
    run_cli(cli, cwd=REPO)
    fitted = json.loads((tmp_path / "fit" / "metrics.json").read_text())
    assert fitted["P@1"] > 30  # it learned: the comparison is not of empty models
    assert fitted == json.loads((tmp_path / "cli" / "metrics.json").read_text())
    preds = model.predict(x_test[:5], k=3)
    assert preds.ids.shape == (5, 3)
    again = xc.load(tmp_path / "fit").predict(x_test[:5], k=3)
    assert np.array_equal(preds.ids, again.ids)  # the returned model is the one xc.load serves


def test_fit_on_texts_and_label_names_holds_out_a_test_split_and_predicts_names(tmp_path):
    words = ["json", "yaml", "plot", "image", "audio", "video", "crypto", "network"]
    rng = np.random.default_rng(0)
    texts, tags = [], []
    for _ in range(400):
        picked = rng.choice(len(words), size=2, replace=False)
        texts.append(" ".join(f"{words[j]} library tool{j}" for j in picked))
        tags.append([words[j] for j in picked])
    model = xc.fit(texts, tags, run_dir=str(tmp_path / "fit"), data__cache_dir=str(tmp_path / "cache"), **TINY)
    meta = json.loads(next((tmp_path / "cache").glob("fit-*/jsonl-*/meta.json")).read_text())
    assert (meta["train"]["num_points"], meta["test"]["num_points"]) == (320, 80)  # a fifth held out
    rec = next(model.predict(["plot library tool2"], k=2).records())
    assert rec["names"][0] == "plot"


def test_fit_refuses_bad_inputs_with_one_line(tmp_path):
    with pytest.raises(XCError, match="Y has 3 rows, its inputs 2"):
        xc.fit(["a", "b"], [["x"], ["y"], ["z"]], run_dir=str(tmp_path / "r"), data__cache_dir=str(tmp_path / "c"))
    with pytest.raises(XCError, match="give X_test and Y_test together"):
        xc.fit(["a", "b"], [["x"], ["y"]], X_test=["c"], run_dir=str(tmp_path / "r"))
    with pytest.raises(XCError, match="unknown key"):
        xc.fit(["a", "b"], [["x"], ["y"]], train__epoch=3, run_dir=str(tmp_path / "r"))
