"""`xc-train data.kind=arff|libsvm data.path=...` trains exactly as the same data in the XC format does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import REPO, run_cli
from tests.format_writers import write_all
from xc.data import generate_synthetic

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

# A tiny, fixed run: 24 steps on 1350 training points (150 held out for validation), kNN fusion included.
ARGS = ["train.max_steps=24", "train.epochs=3", "train.batch_size=128", "train.warmup_steps=3", "model.embed_dim=64",
        "model.hidden_dims=[32]", "logger.wandb=disabled", "logger.progress=false", "seed=3"]


def _compact(splits):
    """Keep only the label and feature columns that occur, so that no format can disagree on the counts
    (libsvm without a header infers them as the largest id + 1)."""
    out = dict(splits)
    for k in (0, 1):
        used = np.unique(np.concatenate([m[k].indices for m in splits.values()]))
        for s, pair in out.items():
            pair = list(pair)
            pair[k] = sp.csr_matrix(pair[k][:, used])
            out[s] = tuple(pair)
    return out


def test_arff_and_libsvm_train_like_xc_sparse(tmp_path):
    synth = generate_synthetic(str(tmp_path / "synth"), num_train=1500, num_test=300, num_labels=300,
                               num_features=800, seed=1)
    splits = _compact({s: (getattr(synth, s).labels.to_scipy().tocsr(), getattr(synth, s).features.to_scipy().tocsr())
                       for s in ("train", "test")})
    dirs = write_all(tmp_path / "src", splits)
    metrics = {}
    for kind, path in dirs.items():
        run_dir = tmp_path / f"run-{kind}"
        proc = run_cli([*ARGS, f"data.kind={kind}", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                        f"run_dir={run_dir}"], cwd=REPO)
        assert "final P@1=" in proc.stdout, proc.stdout[-2000:]
        metrics[kind] = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["xc_sparse"]["P@1"] > 5  # it learned something: the comparison is not of empty models
    assert metrics["arff"] == metrics["xc_sparse"]
    assert metrics["libsvm"] == metrics["xc_sparse"]
    meta = json.loads(next((tmp_path / "cache" / "arff").glob("arff-*/meta.json")).read_text())
    assert meta["label_texts"] == "label_texts.txt" and meta["num_labels"] == splits["train"][0].shape[1]


@pytest.mark.parametrize("num_labels, kind", [(2, "arff"), (10, "libsvm"), (45, "arff")])
def test_a_few_labels_train_with_the_defaults(tmp_path, num_labels, kind):
    """Fewer labels than the 80 negatives a query draws (MULAN/MEKA-sized sets): the defaults switch to the exact
    loss over all labels (xc/defaults/) and train; the model beats ranking the labels by popularity."""
    synth = generate_synthetic(str(tmp_path / "synth"), num_train=400, num_test=150, num_labels=num_labels,
                               num_features=300, seed=1, avg_labels=min(5.0, max(1.0, num_labels / 4)))
    splits = {s: (getattr(synth, s).labels.to_scipy().tocsr(), getattr(synth, s).features.to_scipy().tocsr())
              for s in ("train", "test")}
    path = write_all(tmp_path / "src", splits)[kind]
    run_dir = tmp_path / "run"
    proc = run_cli([f"data.kind={kind}", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                    f"run_dir={run_dir}", "logger.wandb=disabled", "logger.progress=false"], cwd=REPO)
    out = proc.stdout + proc.stderr
    assert f"sampler.name=full (the data's {num_labels} labels" in out, out[-3000:]
    model_p1 = json.loads((run_dir / "metrics.json").read_text())["P@1"]
    y_train, y_test = splits["train"][0], splits["test"][0]
    top = int(np.asarray(y_train.sum(0)).ravel().argmax())
    popularity_p1 = 100.0 * float(np.asarray(y_test[:, top].todense()).ravel().mean())
    if num_labels > 2:
        assert model_p1 > popularity_p1 + 5, (model_p1, popularity_p1)
    else:  # two labels: one of them on most points
        assert model_p1 >= popularity_p1, (model_p1, popularity_p1)
