"""`xc-export RUN DIR`: the exported folder (safetensors and JSON) predicts exactly what the run predicts, through
`xc.load` and `xc-predict`, with pickle unusable; a user's folder is refused. Feature rows of a fused run (lexical
ranker and label prior chosen), raw text through the exported tf-idf vocabulary, and an ensemble."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

import xc
from tests.conftest import REPO, run_cli
from tests.integration.test_predict import TINY, _module, _test_rows, _write_xc_file
from tests.integration.test_text_knn import COMMON, _write_lf
from xc.serve.export import export_model

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 1-rank synthetic run whose training chose kNN fusion with the lexical ranker and a label prior."""
    root = tmp_path_factory.mktemp("export")
    run_dir = root / "run"
    run_cli([*TINY, f"data.cache_dir={root / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    return run_dir


def _assert_identical(got, want) -> None:
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_array_equal(got.scores, want.scores)  # equal, not close: the same computation
    assert got.fused == want.fused


def test_exported_folder_predicts_what_the_run_predicts(tiny_run, tmp_path):
    dest = tmp_path / "exported"
    proc = _module(["xc.cli.export", str(tiny_run), str(dest)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the first 256 test rows predict exactly as the run does" in proc.stderr

    run, exported = xc.load(tiny_run), xc.load(dest)
    assert run.fusion.gamma > 0 and run.prior_beta, "the run fuses the lexical ranker and scores with a prior"
    assert exported.fusion == run.fusion and exported.prior_beta == run.prior_beta
    rows = _test_rows(run)
    for fusion in (True, False):
        _assert_identical(exported.predict(rows, k=5, fusion=fusion), run.predict(rows, k=5, fusion=fusion))
    np.testing.assert_array_equal(exported.encode(rows), run.encode(rows))

    # xc-predict serves the folder as it serves the run: the JSON lines of the run's own predictions
    data, out = tmp_path / "rows.txt", tmp_path / "preds.jsonl"
    _write_xc_file(rows, run.dataset.test.labels, data)
    proc = _module(["xc.cli.predict", str(dest), "--input", str(data), "--k", "5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = run.predict(rows, k=5)
    assert out.read_text() == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in want.records())

    assert exported.use_prior(False) is None  # the plain model, from the exported counts, as the run gives it
    run.use_prior(False)
    _assert_identical(exported.predict(rows, k=5), run.predict(rows, k=5))


def test_exported_folder_loads_with_pickle_unusable(tiny_run, tmp_path, monkeypatch):
    run = xc.load(tiny_run)
    rows = _test_rows(run)
    want_fused, want_plain = run.predict(rows, k=5), run.predict(rows, k=5, fusion=False)
    dest = tmp_path / "exported"
    export_model(run, dest)

    def refuse(*args, **kwargs):
        raise AssertionError("an export must load without unpickling anything")

    class NoUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load"),
                         (torch.serialization, "load"), (np, "load")):
        monkeypatch.setattr(module, name, NoUnpickler if name == "Unpickler" else refuse)
    with pytest.raises(AssertionError, match="without unpickling"):
        xc.load(tiny_run)  # the run's checkpoint is a torch pickle: the patches bite
    exported = xc.load(dest)
    _assert_identical(exported.predict(rows, k=5), want_fused)
    _assert_identical(exported.predict(rows, k=5, fusion=False), want_plain)


def test_a_users_folder_is_refused_and_an_earlier_export_replaced(tiny_run, tmp_path):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("do not touch")
    proc = _module(["xc.cli.export", str(tiny_run), str(users)])
    assert proc.returncode == 2 and proc.stderr == f"error: {users} is not empty and not an earlier export; name a " \
        "new or empty folder\n"
    assert [p.name for p in users.iterdir()] == ["thesis.tex"]

    dest = tmp_path / "exported"
    run = xc.load(tiny_run)
    export_model(run, dest)
    first = json.loads((dest / "export.json").read_text())

    def failing_check(folder):
        raise RuntimeError("the check failed")

    with pytest.raises(RuntimeError):
        export_model(run, dest, check=failing_check)
    assert json.loads((dest / "export.json").read_text()) == first  # the earlier export, untouched
    export_model(run, dest)  # an earlier export is replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "mine"]  # no temporary siblings left
    with pytest.raises(Exception, match="already an export"):
        export_model(xc.load(dest), tmp_path / "again")


def test_raw_text_export_predicts_what_the_run_predicts(tmp_path):
    """A bag-of-words run on raw text, fusing in both spaces (the training embeddings are exported as the kNN
    memory): new texts go through the exported tf-idf vocabulary exactly as through the data cache's."""
    data = _write_lf(tmp_path / "lf")
    run_dir = tmp_path / "run"
    run_cli([*COMMON, "data.kind=lf_raw", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
             f"run_dir={run_dir}", "eval.knn_fusion.lam=0.5", "eval.knn_fusion.space=both", "eval.knn_fusion.k=10"],
            cwd=REPO)
    dest = tmp_path / "exported"
    proc = _module(["xc.cli.export", str(run_dir), str(dest)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(feature rows and raw texts)" in proc.stderr
    run, exported = xc.load(run_dir), xc.load(dest)
    assert exported.fusion.space == "both" and (dest / "tfidf_vocab.txt").exists()
    texts = (data / "tst.raw.txt").read_text().split("\n")[:150] + ["w3 w4 n1 something never seen"]
    for fusion in (True, False):
        got, want = exported.predict(texts, k=5, fusion=fusion), run.predict(texts, k=5, fusion=fusion)
        _assert_identical(got, want)
        assert got.names == want.names and got.names[0][0].startswith("label ")
    proc = _module(["xc.cli.predict", str(dest), "--input", "-", "--k", "3"], stdin=texts[0] + "\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ids"] == run.predict(texts[:1], k=3).ids[0].tolist()


def test_ensemble_export_predicts_what_the_ensemble_predicts(tmp_path):
    data = _write_lf(tmp_path / "lf", seed=2)
    run_dir = tmp_path / "run"
    run_cli([*COMMON, "data.kind=lf_raw", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
             f"run_dir={run_dir}", "train.ensemble=2", "train.epochs=2"], cwd=REPO)
    run = xc.load(run_dir)
    dest = tmp_path / "exported"
    export_model(run, dest)
    exported = xc.load(dest)
    assert type(exported).__name__ == "EnsembleModel" and len(exported.members) == 2
    assert exported.fusion == run.fusion
    texts = (data / "tst.raw.txt").read_text().split("\n")[:150]
    for fusion in (True, False):
        _assert_identical(exported.predict(texts, k=5, fusion=fusion), run.predict(texts, k=5, fusion=fusion))


def test_an_export_serves_from_the_nearest_training_points_as_its_run_does(tiny_run, tmp_path):
    """`use_ann("neighbours")` on the export searches its stored training points: the run's answer."""
    dest = tmp_path / "exported"
    assert _module(["xc.cli.export", str(tiny_run), str(dest)]).returncode == 0
    run, exported = xc.load(tiny_run), xc.load(dest)
    rows = _test_rows(run)
    for model in (run, exported):
        model.use_ann("neighbours")
    got, want = exported.predict(rows, k=5), run.predict(rows, k=5)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
