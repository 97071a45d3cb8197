"""Records with label names (data.kind=jsonl|csv) train exactly as the same data in LF raw files does, and
xc-predict answers with the names the user wrote."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli, shared_dataset

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

ARGS = ["train.max_steps=24", "train.epochs=2", "train.batch_size=128", "train.warmup_steps=3", "model.embed_dim=64",
        "logger.wandb=disabled", "logger.progress=false", "seed=3", "eval.ranker.enabled=false"]
NUM_TRAIN, NUM_TEST = 1500, 400


def _lines(path, n=None) -> list[str]:
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    return lines if n is None else lines[:n]


def _write_sources(src, out):
    """The first points of debian-deps as LF files, as JSON lines and as CSV, with every label named by its
    package (the part of its text before ':') and described by its full text in labels.txt."""
    label_texts = _lines(src / "lbl.raw.txt")
    names = [t.split(":")[0] for t in label_texts]
    for d in ("lf", "jsonl", "csv"):
        (out / d).mkdir(parents=True)
    (out / "lf" / "lbl.raw.txt").write_text("".join(t + "\n" for t in label_texts), encoding="utf-8")
    for d in ("jsonl", "csv"):
        (out / d / "labels.txt").write_text("".join(f"{n}\t{t}\n" for n, t in zip(names, label_texts)),
                                            encoding="utf-8")
    for tag, split, n in (("trn", "train", NUM_TRAIN), ("tst", "test", NUM_TEST)):
        texts = _lines(src / f"{tag}.raw.txt", n)
        label_lines = _lines(src / f"{tag}_X_Y.txt", n + 1)[1:]
        (out / "lf" / f"{tag}.raw.txt").write_text("".join(t + "\n" for t in texts), encoding="utf-8")
        (out / "lf" / f"{tag}_X_Y.txt").write_text(f"{n} {len(names)}\n" + "".join(x + "\n" for x in label_lines))
        rows = [[names[int(p.split(":")[0])] for p in line.split()] for line in label_lines]
        with open(out / "jsonl" / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"id": i, "text": t, "labels": r}) + "\n" for i, (t, r) in enumerate(zip(texts, rows)))
        with open(out / "csv" / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["package", "description", "depends"])
            writer.writerows([i, t, "|".join(r)] for i, (t, r) in enumerate(zip(texts, rows)))
    return names


def test_jsonl_and_csv_train_like_the_lf_files_and_predict_names(tmp_path):
    names = _write_sources(shared_dataset("debian-deps"), tmp_path / "src")
    kinds = {"lf": ["data.kind=lf_raw"], "jsonl": ["data.kind=jsonl"],
             "csv": ["data.kind=csv", "+data.records.text_field=description", "+data.records.labels_field=depends",
                     "+data.records.label_delimiter=|"]}
    metrics = {}
    for d, over in kinds.items():
        run_dir = tmp_path / f"run-{d}"
        proc = run_cli(["data=debian_deps", *ARGS, *over, f"data.path={tmp_path / 'src' / d}", f"data.name=deb-{d}",
                        f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={run_dir}"], cwd=REPO)
        assert "final P@1=" in proc.stdout, proc.stdout[-2000:]
        metrics[d] = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["lf"]["P@1"] > 5  # it learned something: the comparison is not of empty models
    assert metrics["jsonl"] == metrics["lf"]
    assert metrics["csv"] == metrics["lf"]
    proc = subprocess.run([sys.executable, "-m", "xc.cli.predict", str(tmp_path / "run-jsonl"), "--input", "-",
                           "--k", "3"], input="library for parsing json in python\n", capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(proc.stdout.splitlines()[0])
    assert len(rec["ids"]) == 3 and rec["names"] == [names[i] for i in rec["ids"]]
