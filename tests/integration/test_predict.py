"""Using a trained model: `xc.load(...).predict` and `xc-predict` equal `xc-eval --predictions` (1- and
2-rank checkpoints, fused and plain), raw text through the run's tf-idf vocabulary, the dual mode, saved
DiskANN serving indexes reused and rebuilt when stale."""

from __future__ import annotations

import json
import zlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import xc
from tests.conftest import REPO, SHARED_DATA, ranked, run_cli
from xc.data.sparse import SparseMatrix
from xc.eval.metrics import evaluate

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

TINY = ["data.synthetic.num_train=3000", "data.synthetic.num_test=400", "data.synthetic.num_labels=800",
        "data.synthetic.num_features=2000", "train.epochs=2", "train.batch_size=128", "logger.progress=false",
        "train.warmup_steps=5", "logger.wandb=disabled", "model.dropout=0.0"]


def _module(args, stdin: str | None = None):
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          input=stdin, timeout=600)


def _test_rows(model) -> SparseMatrix:
    f = model.dataset.test.features
    return SparseMatrix(np.asarray(f.indptr), np.asarray(f.indices), None if f.values is None else np.asarray(f.values),
                        f.num_cols)


def _write_xc_file(matrix: SparseMatrix, labels, path) -> None:
    """The rows as an XC-repository data file (header, labels, id:value pairs), as a user would pass it."""
    lines = [f"{matrix.num_rows} {matrix.num_cols} 800"]
    for i in range(matrix.num_rows):
        ids, vals = matrix.row(i)
        vals = np.ones(len(ids)) if vals is None else vals
        lab = ",".join(str(int(x)) for x in labels.row(i)[0])
        lines.append(lab + " " + " ".join(f"{int(a)}:{float(v)!r}" for a, v in zip(ids, vals)))
    path.write_text("\n".join(lines) + "\n")


def _eval_predictions(run_dir, out, *extra) -> dict:
    proc = _module(["xc.cli.evaluate", str(run_dir), "--predictions", str(out), "--out", str(out) + ".json", *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def _assert_same(pred, ref) -> None:
    np.testing.assert_array_equal(pred.ids, ref["ids"])
    np.testing.assert_allclose(pred.scores, ref["scores"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nproc", [1, 2])
def test_load_predict_equals_eval_predictions(tmp_path, nproc):
    run_dir = tmp_path / "run"
    run_cli([*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO, nproc=nproc)
    meta = json.loads(sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1].joinpath("meta.json").read_text())
    assert meta["world_size"] == nproc
    fused_ref = _eval_predictions(run_dir, tmp_path / "fused.npz")
    plain_ref = _eval_predictions(run_dir, tmp_path / "plain.npz", "--no-fusion")

    model = xc.load(run_dir)  # one process, whatever world size wrote the checkpoint
    assert model.fusion is not None, "training chose a kNN fusion on validation (fusion.json)"
    rows = _test_rows(model)
    fused = model.predict(rows, k=5)
    plain = model.predict(rows, k=5, fusion=False)
    assert fused.fused and not plain.fused
    _assert_same(fused, fused_ref)
    _assert_same(plain, plain_ref)
    # ... and they are the metrics training reported (computed there by nproc ranks)
    labels = model.dataset.test.labels
    indptr = np.asarray(labels.indptr, np.int64)
    truth = np.asarray(labels.indices, np.int64)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    got = evaluate(plain.ids, indptr, truth, None, ks=(1, 3, 5))
    assert abs(got["P@1"] - metrics["model/P@1"]) < 1e-6 and abs(got["P@5"] - metrics["model/P@5"]) < 1e-6
    assert model.encode(rows).shape == (rows.num_rows, model.shard.dim)

    if nproc == 2:  # the CLI on an XC data file (header and labels skipped) gives the same JSON lines
        data = tmp_path / "test.txt"
        _write_xc_file(rows, labels, data)
        out = tmp_path / "preds.jsonl"
        proc = _module(["xc.cli.predict", str(run_dir), "--input", str(data), "--k", "5", "--out", str(out),
                        "--block-rows", "150"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "queries/s" in proc.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == rows.num_rows
        np.testing.assert_array_equal(np.array([r["ids"] for r in records]), fused_ref["ids"])
        np.testing.assert_allclose(np.array([r["scores"] for r in records]), fused_ref["scores"], atol=1e-5)


def test_lexical_weights_serve_as_training_scored_them(tmp_path):
    """model.lexical_features: xc-eval and xc.load rank with the labels' lexical weights as training's final
    evaluation did, fused and plain; the run's export predicts exactly as the run, and an export whose weights were
    edited (feature ids out of range, not finite, missing) is refused in one line naming the file and field."""
    run_dir = tmp_path / "run"
    run_cli([*TINY, "model.lexical_features=8", "train.ensemble=1", f"data.cache_dir={tmp_path / 'cache'}",
             f"run_dir={run_dir}"], cwd=REPO)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (run_dir / "fusion.json").exists() and "model/P@1" in metrics
    ref = _eval_predictions(run_dir, tmp_path / "eval.npz")
    plain_ref = _eval_predictions(run_dir, tmp_path / "plain.npz", "--no-fusion")
    evaluated = json.loads((tmp_path / "eval.npz.json").read_text())
    assert all(abs(evaluated[k] - metrics[k]) < 1e-6 for k in ("P@1", "P@3", "P@5"))
    model = xc.load(run_dir)
    assert model.shard.lexical is not None and model.shard.lexical.values.weight.abs().sum() > 0
    rows = _test_rows(model)
    _assert_same(model.predict(rows, k=5), ref)
    plain = model.predict(rows, k=5, fusion=False)
    _assert_same(plain, plain_ref)
    labels = model.dataset.test.labels
    got = evaluate(plain.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                   ks=(1, 3, 5))
    assert abs(got["P@1"] - metrics["model/P@1"]) < 1e-6 and abs(got["P@5"] - metrics["model/P@5"]) < 1e-6
    dense_only = model.shard.lexical
    model.shard.lexical = None
    assert not np.array_equal(model.predict(rows, k=5, fusion=False).ids, plain.ids)  # the weights change the ranking
    model.shard.lexical = dense_only
    dest = tmp_path / "export"
    proc = _module(["xc.cli.export", str(run_dir), str(dest)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = xc.load(dest)
    assert exported.shard.lexical is not None
    for fusion in (True, False):
        got, want = exported.predict(rows, k=5, fusion=fusion), model.predict(rows, k=5, fusion=fusion)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_array_equal(got.scores, want.scores)
    _write_xc_file(rows, model.dataset.test.labels, tmp_path / "rows.txt")
    _edited_lexical_exports_are_refused(dest, tmp_path, tmp_path / "rows.txt")


def _edited_lexical_exports_are_refused(dest, tmp_path, rows_file) -> None:
    """Each edit of an export's lexical weights, resealed as a hand edit would be: one line naming file and field."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tools.probes.reliability.round4_exports import reseal

    edits = {"lexical.support": lambda t: t.update({"lexical.support": t["lexical.support"] + 10**6}),
             "lexical.weight": lambda t: t["lexical.weight"].view(-1).__setitem__(0, float("nan")),
             "missing": lambda t: t.pop("lexical.weight")}
    for field, edit in edits.items():
        folder = tmp_path / f"edited-{field}"
        shutil.copytree(dest, folder)
        file = folder / "model" / "model.safetensors"
        tensors = dict(load_file(str(file)))
        edit(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
        reseal(folder)
        proc = _module(["xc.cli.predict", str(folder), "--input", str(rows_file), "--k", "3"])
        want = "lexical.weight: missing" if field == "missing" else field
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert str(file) in proc.stderr and want in proc.stderr, proc.stderr[-2000:]


def _debian_subset(root, train=3000, test=300):
    """The first rows of debian-deps (all 37960 labels and their texts): trains in about half a minute."""
    src = SHARED_DATA / "debian-deps"
    root.mkdir(parents=True)
    for name, n in (("trn", train), ("tst", test)):
        texts = (src / f"{name}.raw.txt").read_text(encoding="utf-8").split("\n")[:n]
        (root / f"{name}.raw.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
        xy = (src / f"{name}_X_Y.txt").read_text().split("\n")
        (root / f"{name}_X_Y.txt").write_text(f"{n} {xy[0].split()[1]}\n" + "\n".join(xy[1:n + 1]) + "\n")
    (root / "lbl.raw.txt").write_bytes((src / "lbl.raw.txt").read_bytes())
    return root


def test_raw_text_on_stdin_prints_label_names(tmp_path):
    if not (SHARED_DATA / "debian-deps").is_dir():
        pytest.skip(f"benchmark data {SHARED_DATA / 'debian-deps'} not present")
    data = _debian_subset(tmp_path / "deb")
    run_dir = tmp_path / "run"
    run_cli(["data.kind=lf_raw", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}",
             "train.max_steps=30", "train.batch_size=128", "logger.progress=false", "logger.wandb=disabled"], cwd=REPO)
    proc = _module(["xc.cli.predict", str(run_dir), "--input", "-", "--k", "5"],
                   stdin="python library for fast json parsing\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    rec = json.loads(lines[0])
    label_texts = (data / "lbl.raw.txt").read_text(encoding="utf-8").split("\n")
    assert len(rec["names"]) == 5 and [label_texts[i] for i in rec["ids"]] == rec["names"]
    assert any(name.startswith("python3:") for name in rec["names"]), rec["names"]
    # the new text is featurised with the cache's vocabulary exactly as at convert time
    model = xc.load(run_dir)
    cached = model.dataset.test.features
    again = model._features_of_texts((data / "tst.raw.txt").read_text(encoding="utf-8").split("\n")[:300])
    np.testing.assert_array_equal(again.indptr, np.asarray(cached.indptr))
    np.testing.assert_array_equal(again.indices, np.asarray(cached.indices))
    np.testing.assert_allclose(again.values, np.asarray(cached.values), rtol=1e-6)


def test_dual_mode_checkpoint_predicts_what_training_evaluated(tmp_path):
    from tests.distributed.test_dual_equivalence import TINY as DUAL

    run_dir = tmp_path / "dual"
    args = [a for a in DUAL if not a.startswith("parallel.")] + ["model.free_vectors=true"]
    run_cli([*args, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO, nproc=2)
    model = xc.load(run_dir)
    assert model.mode == "dual" and model.input_kind == "text" and model.fusion is not None  # dual runs fuse too
    from xc.data import read_texts

    texts = read_texts(model.dataset.test.texts_path)
    labels = model.dataset.test.labels
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for fusion, prefix in ((False, "model/"), (True, "")):  # the plain dual model, then fused as training chose
        pred = model.predict(texts, k=5, fusion=fusion)
        assert pred.fused == fusion
        got = evaluate(pred.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                       ks=(1, 5))
        assert abs(got["P@1"] - metrics[prefix + "P@1"]) < 1e-6, (fusion, got, metrics)
        assert abs(got["P@5"] - metrics[prefix + "P@5"]) < 1e-6, (fusion, got, metrics)
    assert pred.names is not None and len(pred.names[0]) == 5
    # xc-eval takes dual checkpoints too (through xc.load): training's fused and plain figures again
    from xc.cli.evaluate import evaluate_checkpoint

    for fusion, prefix in ((True, ""), (False, "model/")):
        evaluated = evaluate_checkpoint(str(run_dir), fusion=fusion)
        assert all(abs(evaluated[k] - metrics[prefix + k]) < 1e-6 for k in ("P@1", "P@3", "P@5", "PSP@5")), fusion


def test_saved_diskann_index_is_reused_and_rebuilt_when_stale(tmp_path):
    run_dir = tmp_path / "run"
    run_cli([*TINY, "train.prune_when_done=false",  # an older checkpoint too: an index saved for another is stale
             f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    ckpts = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))
    assert len(ckpts) >= 2
    saved = _module(["xc.cli.evaluate", str(run_dir), "--ann", "diskann", "--save-index", "--out", str(tmp_path / "a.json")])
    assert saved.returncode == 0, saved.stderr[-3000:]
    manifest = json.loads((run_dir / "serving" / "diskann" / "manifest.json").read_text())
    assert manifest["origin"]["checkpoint"] == ckpts[-1].name and manifest["shards"]["0"]["rows_sha256"]
    assert not list((run_dir / "serving").glob(".tmp-*"))

    first = json.loads((tmp_path / "a.json").read_text())
    again = _module(["xc.cli.evaluate", str(run_dir), "--ann", "diskann", "--out", str(tmp_path / "b.json")])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reusing saved diskann index" in again.stdout + again.stderr and "build skipped" in again.stdout + again.stderr
    second = json.loads((tmp_path / "b.json").read_text())
    assert {k: v for k, v in second.items() if "seconds" not in k} == {k: v for k, v in first.items() if "seconds" not in k}

    rows = _test_rows(xc.load(run_dir))
    model = xc.load(run_dir)
    assert model.use_ann("diskann").reused
    reused = model.predict(rows, k=5)
    model.use_ann(None)
    model.use_prior(False)  # ANN serving serves the plain scores: compare with the plain exact top-k
    exact = model.predict(rows, k=5, fusion=False)
    assert np.mean(reused.ids == exact.ids) > 0.9  # ANN top-k close to exact

    # another checkpoint: the saved index is stale, rebuilt (and not saved over without --save-index)
    old = xc.load(run_dir, checkpoint=ckpts[-2])
    searcher = old.use_ann("diskann")
    assert not searcher.reused
    stale = _module(["xc.cli.predict", str(run_dir), "--checkpoint", str(ckpts[-2]), "--input", "-", "--ann", "diskann",
                     "--format", "sparse", "--k", "3"], stdin="0:1 5:1\n")
    assert stale.returncode == 0, stale.stderr[-3000:]
    assert f"it was built for checkpoint {ckpts[-1].name}" in stale.stderr, stale.stderr[-2000:]
    assert json.loads(stale.stdout.splitlines()[0])["ids"], stale.stdout  # diskann's own prints stay off stdout


def test_malformed_sparse_input_names_file_line_and_field(tmp_path):
    run_dir = tmp_path / "run"
    run_cli([*TINY, "train.epochs=1", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    bad = tmp_path / "bad.txt"
    bad.write_text("3:1 7:0.5\n4:1 9:x\n")
    proc = _module(["xc.cli.predict", str(run_dir), "--input", str(bad), "--format", "sparse"])
    assert proc.returncode == 2
    assert f"error: {bad}:2: feature 2 value:" in proc.stderr, proc.stderr[-2000:]
    bad.write_text("3:1 999999:1\n")
    proc = _module(["xc.cli.predict", str(run_dir), "--input", str(bad)])
    assert proc.returncode == 2 and f"{bad}:1: feature 2 id: 999999 is out of range" in proc.stderr, proc.stderr[-2000:]


def test_xc_predict_is_a_console_script_and_import_xc_stays_light():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["xc-predict"] == "xc.cli.predict:main"
    probe = "import sys, xc; print(sorted(m for m in ('torch', 'xc.serve.model', 'numpy') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_fused_run_ranks_its_test_split_under_the_prior_once(tmp_path):
    """With kNN fusion after the prior, the model under its prior is ranked by the fused evaluation alone: its
    `eval_prior` event holds metrics.json's `model/...` figures, which are the exact ranking by score + beta * log(1 +
    training count) (brute force here)."""
    run_dir = tmp_path / "run"
    run_cli([*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}", "eval.knn_fusion.lam=0.5",
             "eval.label_prior.beta=0.5"], cwd=REPO)
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    priors = [e for e in events if e["event"] == "eval_prior"]
    assert len(priors) == 1 and priors[0]["beta"] == 0.5
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["P@1"] != metrics["model/P@1"] or metrics["P@5"] != metrics["model/P@5"]  # fused: not the model
    model = xc.load(run_dir)
    rows = _test_rows(model)
    emb = torch.from_numpy(model.encode(rows))
    train_labels = model.dataset.train.labels
    indptr, indices = np.asarray(train_labels.indptr), np.asarray(train_labels.indices)
    counts = np.zeros(model.num_labels)
    for i in model.components.train.train_ids:
        np.add.at(counts, indices[indptr[i]:indptr[i + 1]], 1)
    brute = emb @ model.shard.weight[:model.num_labels].T + 0.5 * torch.log1p(torch.from_numpy(counts).float())
    labels = model.dataset.test.labels
    exact = evaluate(torch.topk(brute, 5, dim=1).indices.numpy(), np.asarray(labels.indptr, np.int64),
                     np.asarray(labels.indices, np.int64), None, ks=(1, 3, 5))
    for key in ("P@1", "P@3", "P@5"):
        assert priors[0][key] == metrics[f"model/{key}"]
        assert abs(exact[key] - metrics[f"model/{key}"]) < 1e-6, key


def test_label_prior_is_what_training_xc_eval_and_load_score_with(tmp_path):
    """A fixed beta (the same path as a chosen one): training's final metrics, `xc-eval` and `xc.load` all
    rank by score + beta * log(1 + training count); prior.json keeps the plain model's test figures."""
    run_dir = tmp_path / "run"
    run_cli([*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}", "eval.knn_fusion.enabled=false",
             "eval.label_prior.beta=0.5"], cwd=REPO)
    assert json.loads((run_dir / "prior.json").read_text())["beta"] == 0.5
    metrics = json.loads((run_dir / "metrics.json").read_text())
    evals = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if '"event": "eval"' in line]
    recorded = json.loads((run_dir / "prior.json").read_text())["test_plain"]
    assert recorded["P@1"] == evals[-1]["P@1"], "prior.json keeps the plain model's test figures"

    model = xc.load(run_dir)
    assert model.prior_beta == 0.5
    rows = _test_rows(model)
    pred = model.predict(rows, k=5)
    emb = torch.from_numpy(model.encode(rows))
    train_labels = model.dataset.train.labels
    indptr, indices = np.asarray(train_labels.indptr), np.asarray(train_labels.indices)
    counts = np.zeros(model.num_labels)
    for i in model.components.train.train_ids:  # the validation split's points are not counted
        np.add.at(counts, indices[indptr[i]:indptr[i + 1]], 1)
    brute = emb @ model.shard.weight[:model.num_labels].T + 0.5 * torch.log1p(torch.from_numpy(counts).float())
    np.testing.assert_array_equal(pred.ids, torch.topk(brute, 5, dim=1).indices.numpy())
    labels = model.dataset.test.labels
    got = evaluate(pred.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                   ks=(1, 3, 5))
    assert abs(got["P@1"] - metrics["P@1"]) < 1e-6 and abs(got["P@5"] - metrics["P@5"]) < 1e-6
    ref = _eval_predictions(run_dir, tmp_path / "eval.npz")
    np.testing.assert_array_equal(pred.ids, ref["ids"])
    assert json.loads((tmp_path / "eval.npz.json").read_text()) == ranked(metrics)  # xc-eval reproduces metrics.json


def test_xc_eval_errors_are_one_line_and_lose_no_metrics(tmp_path):
    """An --out that cannot be written: the metrics are printed first, then one line (exit 2); xc-predict makes its
    --out folder, refuses a directory, and says once that --k exceeds the labels. A checkpoint holding
    a pickle of objects (its checksums redone, so it validates): one line naming the file, never torch's advice to
    load it with weights_only=False."""
    import hashlib
    import pickle

    run_dir = tmp_path / "run"
    run_cli([*TINY, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    # /dev/full: every write fails with "No space left on device", as on a full disk
    proc = _module(["xc.cli.evaluate", str(run_dir), "--no-fusion", "--out", "/dev/full"])
    assert proc.returncode == 2 and "P@1=" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "error: could not write /dev/full: no space left on the device" in proc.stderr
    assert "Traceback" not in proc.stderr

    # xc-predict: --out into a folder that does not exist yet is made; --k above the labels is said once
    model = xc.load(run_dir)
    data = tmp_path / "rows.txt"
    _write_xc_file(_test_rows(model), model.dataset.test.labels, data)
    out = tmp_path / "new" / "folder" / "preds.jsonl"
    proc = _module(["xc.cli.predict", str(run_dir), "--input", str(data), "--k", "100000", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("--k 100000 is more than the run's 800 labels: every row gets all 800") == 1
    first = json.loads(out.read_text().splitlines()[0])
    assert len(first["ids"]) == 800
    proc = _module(["xc.cli.predict", str(run_dir), "--input", str(data), "--out", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: --out {tmp_path} is a directory; name a file for " \
        "the JSON lines"

    newest = sorted((run_dir / "checkpoints").glob("step-*[0-9]"))[-1]
    evil = pickle.dumps({"x": slice(1, 2)})  # an object torch's weights_only loader refuses
    (newest / "rank0.pt").write_bytes(evil)
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["rank0.pt"] = len(evil)
    meta["crc32"]["rank0.pt"] = f"{zlib.crc32(evil):08x}"
    (newest / "meta.json").write_text(json.dumps(meta))
    (run_dir / "selection.json").unlink(missing_ok=True)
    proc = _module(["xc.cli.evaluate", str(run_dir), "--checkpoint", str(newest), "--out", str(tmp_path / "e.json")])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank0.pt: cannot load" in proc.stderr and "weights_only" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_lexical_ranker_is_trained_alike_on_one_and_two_ranks_and_served_as_training_scored(tmp_path):
    """A run fusing the lexical ranker (xc/fitting/ranker.py; gamma fixed so the tiny set cannot leave it out): the
    2-rank run trains each block of labels on one rank and the parts load as the 1-rank run's ranker (both runs split
    the labels into 2 shards, so the model's hard negatives the ranker pairs, 8 of each shard's table, are the same);
    `xc.load`, `xc-eval` and the metrics training reported agree."""
    extra = ["train.ensemble=1", "eval.ranker.gamma=1.0", "eval.ranker.block_labels=300",  # 800 labels: 3 blocks
             "parallel.num_label_shards=2"]
    runs = {}
    for nproc in (1, 2):
        run_dir = runs[nproc] = tmp_path / f"run{nproc}"
        proc = run_cli([*TINY, *extra, f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO,
                       nproc=nproc)
        assert "and 16 of the model's hard negatives" in proc.stdout + proc.stderr
        choice = json.loads((run_dir / "fusion.json").read_text())
        assert choice["gamma"] == 1.0 and choice["ranker_parts"] == nproc
        assert sorted(p.name for p in (run_dir / "ranker").iterdir()) == [f"part{r}-of{nproc}.npz" for r in range(nproc)]
    from xc.fitting.ranker import LexicalRanker

    one, two = LexicalRanker.load(runs[1], 1), LexicalRanker.load(runs[2], 2)
    np.testing.assert_array_equal(one.keys, two.keys)  # the same problems, solved by whichever rank owns them
    # equal to float32 rounding carried through the solve: the ranks' BLAS threads sum L-BFGS's float32 products with
    # its curvature pairs in another order (differences of 3e-5 of the largest weight; 1e-7 with float64 pairs)
    scale = float(np.abs(one.weights).max())
    np.testing.assert_allclose(one.weights, two.weights, rtol=0, atol=2e-4 * scale)
    np.testing.assert_allclose(one.bias, two.bias, rtol=0, atol=2e-4 * scale)

    run_dir = runs[2]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert "ranker/P@1" in metrics and metrics["ranker/P@1"] > 0
    ref = _eval_predictions(run_dir, tmp_path / "fused.npz")
    model = xc.load(run_dir)
    assert model.fusion.gamma == 1.0
    pred = model.predict(_test_rows(model), k=5)
    _assert_same(pred, ref)
    labels = model.dataset.test.labels
    got = evaluate(pred.ids, np.asarray(labels.indptr, np.int64), np.asarray(labels.indices, np.int64), None,
                   ks=(1, 3, 5))
    assert abs(got["P@1"] - metrics["P@1"]) < 1e-6 and abs(got["P@5"] - metrics["P@5"]) < 1e-6
    data, out = tmp_path / "test.txt", tmp_path / "preds.jsonl"  # the CLI on an XC data file, as a user runs it
    _write_xc_file(_test_rows(model), labels, data)
    proc = _module(["xc.cli.predict", str(run_dir), "--input", str(data), "--k", "5", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    np.testing.assert_array_equal(np.array([json.loads(line)["ids"] for line in out.read_text().splitlines()]),
                                  ref["ids"])


def test_neighbour_serving_reaches_the_recall_target_and_the_api_serves_as_xc_eval(tmp_path):
    """`xc-eval --ann neighbours` reports recall against exact and the tuned breadth; `use_ann("neighbours")` ranks
    the same labels (the plain model's, the prior `xc.load` installs left out, as by every `--ann` search); the
    plain exact model's P@1 is kept within a point."""
    run_dir = tmp_path / "run"
    run_cli([*TINY, "train.epochs=1", f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
    out = tmp_path / "nbr.npz"
    pred = _eval_predictions(run_dir, out, "--ann", "neighbours")
    metrics = json.loads((tmp_path / "nbr.npz.json").read_text())
    assert metrics["ann_recall@5"] >= 90.0 and metrics["ann_breadth"] >= 32, metrics
    assert abs(metrics["P@1"] - metrics["exact/P@1"]) <= 1.0, metrics
    model = xc.load(run_dir)
    searcher = model.use_ann("neighbours")
    api = model.predict(_test_rows(model), k=pred["ids"].shape[1])
    assert searcher.tuning.chosen == metrics["ann_breadth"]
    assert np.mean(api.ids == pred["ids"]) > 0.99  # the same search; float sums may swap a tie
