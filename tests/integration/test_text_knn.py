"""Raw text trains on CPU through its tf-idf features; the kNN baseline and kNN fusion end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, ranked, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)


def _write_lf(root, num_labels=40, num_train=600, num_test=150, seed=0):
    """A small LF dataset: each label owns three words; a text mixes its labels' words with noise."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(3 * num_labels)]
    noise = [f"n{i}" for i in range(200)]

    def split(n, tag):
        texts, rows = [], []
        for _ in range(n):
            labels = sorted(set(rng.choice(num_labels, size=rng.integers(1, 3), replace=False).tolist()))
            toks = [words[3 * l + rng.integers(0, 3)] for l in labels for _ in range(2)]
            toks += rng.choice(noise, size=3).tolist()
            rng.shuffle(toks)
            texts.append(" ".join(toks))
            rows.append(" ".join(f"{l}:1" for l in labels))
        (root / f"{tag}.raw.txt").write_text("\n".join(texts) + "\n")
        (root / f"{tag}_X_Y.txt").write_text(f"{n} {num_labels}\n" + "\n".join(rows) + "\n")

    root.mkdir(parents=True, exist_ok=True)
    split(num_train, "trn")
    split(num_test, "tst")
    (root / "lbl.raw.txt").write_text("\n".join(f"label {l} {' '.join(words[3 * l:3 * l + 3])}"
                                                for l in range(num_labels)) + "\n")
    return root


def _module(args, cwd=REPO):
    env = dict(os.environ, XC_THREADS="1", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


COMMON = ["logger.wandb=disabled", "logger.progress=false", "train.epochs=3", "train.batch_size=64",
          "train.warmup_steps=5", "model.embed_dim=64", "sampler.k_random=16", "sampler.k_hard=4"]


def test_raw_text_trains_on_tfidf_and_fusion_is_reproduced_by_eval(tmp_path):
    data = _write_lf(tmp_path / "lf")
    run_dir = tmp_path / "run"
    args = [*COMMON, "data.kind=lf_raw", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
            f"run_dir={run_dir}"]
    run_cli(args, cwd=REPO)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    fusion = json.loads((run_dir / "fusion.json").read_text())
    assert {"P@1", "model/P@1", "knn/P@1"} <= metrics.keys()
    assert fusion["space"] in ("input", "embedding") and 0.0 <= fusion["lambda"] <= 1.0
    assert fusion["valid_points"] == 60  # data.valid_fraction 0.1 of 600
    assert metrics["knn/P@1"] > 60 and metrics["model/P@1"] > 30, metrics  # words identify labels
    # xc-eval applies the same choice and reproduces the final metrics; --no-fusion gives the plain model
    out = tmp_path / "eval.json"
    assert _module(["xc.cli.evaluate", str(run_dir), "--out", str(out)]).returncode == 0
    assert json.loads(out.read_text()) == ranked(metrics)
    plain = _module(["xc.cli.evaluate", str(run_dir), "--no-fusion", "--out", str(out)])
    assert plain.returncode == 0, plain.stderr
    assert json.loads(out.read_text())["P@1"] == metrics["model/P@1"]


def test_fixed_lambda_one_is_the_knn_baseline_and_zero_the_plain_model(tmp_path):
    data = _write_lf(tmp_path / "lf", seed=1)
    base = [*COMMON, "data.kind=lf_raw", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}"]
    knn_run, plain_run = tmp_path / "knn", tmp_path / "plain"
    fixed = ["eval.knn_fusion.k=10", "eval.knn_fusion.space=input"]
    run_cli([*base, f"run_dir={knn_run}", "eval.knn_fusion.lam=1.0", *fixed], cwd=REPO)
    out = tmp_path / "baseline.json"
    proc = _module(["xc.cli.baseline", "knn", "--k", "10", "--out", str(out), "data.kind=lf_raw", f"data.path={data}",
                    f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 0, proc.stderr
    baseline = json.loads(out.read_text())
    fused = json.loads((knn_run / "metrics.json").read_text())
    for key in ("P@1", "P@3", "P@5", "PSP@5"):
        assert fused[key] == pytest.approx(baseline[key], abs=1e-9), key
    run_cli([*base, f"run_dir={plain_run}", "eval.knn_fusion.lam=0.0", *fixed], cwd=REPO)
    plain = json.loads((plain_run / "metrics.json").read_text())
    for key in ("P@1", "P@3", "P@5"):
        assert plain[key] == plain[f"model/{key}"]
    events = [json.loads(line) for line in (plain_run / "log.jsonl").read_text().splitlines()]
    # lambda 0 is exactly the model alone: its last evaluation, under the label prior where one was chosen
    last_eval = [e for e in events if e["event"] in ("eval", "eval_prior")][-1]
    assert last_eval["P@1"] == plain["P@1"]


def test_baseline_reads_sparse_data_and_names_bad_arguments(tmp_path):
    bad = _module(["xc.cli.baseline", "knn", "--k", "0", "data=bibtex"])
    assert bad.returncode == 2 and "--k" in bad.stderr and "Traceback" not in bad.stderr
    typo = _module(["xc.cli.baseline", "knn", "data.pth=/x"])
    assert typo.returncode == 2 and "Traceback" not in typo.stderr


def test_fusion_is_skipped_above_max_train_points(tmp_path):
    data = _write_lf(tmp_path / "lf", num_train=300, seed=2)
    run_dir = tmp_path / "run"
    proc = run_cli([*COMMON, "train.epochs=1", "data.kind=lf_raw", f"data.path={data}",
                    f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}",
                    "eval.knn_fusion.max_train_points=100"], cwd=REPO)
    assert "kNN fusion skipped: 300 training points exceed" in proc.stdout + proc.stderr
    assert not (run_dir / "fusion.json").exists()
    assert "model/P@1" not in json.loads((run_dir / "metrics.json").read_text())


def test_popular_labels_rank_by_training_count_ties_to_the_lower_id():
    from xc.cli.baseline import popular_labels

    # counts: label 0 -> 1, 1 -> 3, 2 -> 3, 3 -> 0, 4 -> 2
    assert popular_labels(np.bincount([1, 2, 4, 1, 2, 0, 4, 2, 1], minlength=5), 4).tolist() == [1, 2, 4, 0]
    assert popular_labels(np.bincount([3], minlength=5), 10).tolist() == [3, 0, 1, 2, 4]


def test_popularity_baseline_scores_one_list_for_every_test_point(tmp_path):
    """On the lf_raw set: P@1 is the share of test points that carry the most frequent training label, P@k
    the mean share of the top k they carry, counted here by hand from the same files."""
    from xc.cli.baseline import popular_labels

    data = _write_lf(tmp_path / "lf", seed=4)
    out = tmp_path / "pop.json"
    proc = _module(["xc.cli.baseline", "popularity", "--out", str(out), "data.kind=lf_raw", f"data.path={data}",
                    f"data.cache_dir={tmp_path / 'cache'}"])
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads(out.read_text())

    def labels_of(name):  # "n L" then one "label:1 label:1" row per point
        return [{int(tok.split(":")[0]) for tok in line.split()} for line in (data / name).read_text().splitlines()[1:]]

    train, test = labels_of("trn_X_Y.txt"), labels_of("tst_X_Y.txt")
    top = popular_labels(np.bincount([l for ls in train for l in ls], minlength=40), 5)
    for k in (1, 3, 5):
        expected = 100 * np.mean([len(set(top[:k].tolist()) & t) / k for t in test])
        assert metrics[f"P@{k}"] == pytest.approx(expected, abs=1e-9), k
    bad = _module(["xc.cli.baseline", "popularity", "--k", "5", "data=bibtex"])
    assert bad.returncode == 2 and "--k" in bad.stderr and "Traceback" not in bad.stderr
