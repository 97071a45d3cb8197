"""E-hard: hard negatives mined from an index over the encoder's label-text embeddings (ASTRA Table 5)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

WORDS = ["apple", "river", "stone", "cloud", "piano", "tiger", "lemon", "train", "glass", "maple",
         "ocean", "pepper", "violin", "desert", "candle", "rocket", "garden", "silver", "winter", "falcon"]


def _write_lf(root, num_train=96, num_test=32, seed=0):
    rng = np.random.default_rng(seed)
    labels = len(WORDS)

    def split(n):
        texts, rows = [], []
        for _ in range(n):
            chosen = sorted(set(rng.choice(labels, size=rng.integers(1, 3), replace=False).tolist()))
            texts.append(" ".join(WORDS[c] for c in chosen) + " thing")
            rows.append(" ".join(f"{c}:1" for c in chosen))
        return texts, rows

    for name, n in (("trn", num_train), ("tst", num_test)):
        texts, rows = split(n)
        (root / f"{name}.raw.txt").write_text("\n".join(texts) + "\n")
        (root / f"{name}_X_Y.txt").write_text(f"{n} {labels}\n" + "\n".join(rows) + "\n")
    (root / "lbl.raw.txt").write_text("\n".join(f"about {w}" for w in WORDS) + "\n")


def test_ehard_mines_from_label_text_embeddings(tmp_path):
    data = tmp_path / "tinylf"
    data.mkdir()
    _write_lf(data)
    run = tmp_path / "run"
    run_cli(["model=minilm", "data.kind=lf_raw", f"data.path={data}", "data.name=tinylf", "data.max_len=8",
             f"data.cache_dir={tmp_path / 'cache'}", "data.label_text_augmentation=false",
             "sampler=ehard", "sampler.k_hard=4", "sampler.k_random=8", "sampler.start_epoch=1",
             "train.epochs=2", "train.batch_size=16", "train.warmup_steps=1", "eval.batch_size=32",
             f"run_dir={run}", "logger.wandb=disabled", "logger.progress=false", "train.resume=never"], cwd=REPO)
    events = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    mined = [e for e in events if e["event"] == "negatives"]
    assert mined and mined[0]["generation"] == 1
    assert json.loads((run / "metrics.json").read_text())["P@1"] > 0


def test_ehard_without_label_texts_is_a_clear_error(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_cli(["sampler=ehard", "data.name=tiny", "data.synthetic.num_train=500", "data.synthetic.num_test=100",
                 "data.synthetic.num_labels=200", f"data.cache_dir={tmp_path / 'cache'}",
                 f"run_dir={tmp_path / 'run'}", "logger.wandb=disabled"], cwd=REPO)
    assert "sampler.hard_source" in str(err.value) and "no label texts" in str(err.value)
