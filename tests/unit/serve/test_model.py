"""What serving a run reads from its data: the label names records data gave, the source folder itself, and the
training points a kNN vote may read."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from xc.cli.fit import compose_config
from xc.data import load_dataset
from xc.data.records import LABEL_NAMES
from xc.errors import ConfigError, DataFormatError
from xc.serve.model import check_knn_memory, label_names, open_run_data


def _records(src, names):
    src.mkdir()
    (src / "train.jsonl").write_text("".join(json.dumps({"text": f"item {j}", "labels": [n]}) + "\n"
                                             for j, n in enumerate(names)), encoding="utf-8")


def test_a_moved_source_folder_is_named_with_the_way_out(tmp_path):
    src = tmp_path / "src"
    _records(src, [f"tag{j % 3}" for j in range(20)])
    cfg = compose_config(["data=jsonl", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
                          "data.name=tags"])
    assert open_run_data(cfg).num_labels == 3
    shutil.move(src, tmp_path / "elsewhere")
    with pytest.raises(DataFormatError) as err:
        open_run_data(cfg)
    assert err.value.path == str(src) and "\n" not in str(err.value)
    assert "serving a run reads the data it trained on" in str(err.value)
    assert f"from {src} (data.path)" in str(err.value) and "xc-export RUN_DIR DEST" in str(err.value)


def test_served_names_are_the_records_names_one_per_label(tmp_path):
    names = ["a", "two\nlines", "c"]
    _records(tmp_path / "src", names * 4)
    ds = load_dataset("jsonl", str(tmp_path / "src"), str(tmp_path / "cache"))
    assert label_names(ds, str(tmp_path / "src")) == names
    # a cache whose names file does not count the labels (an earlier xc wrote a name a line) is refused by name
    legacy = SimpleNamespace(meta={k: v for k, v in ds.meta.items() if k != "label_names_format"},
                             num_labels=ds.num_labels, label_texts_path=ds.label_texts_path)
    (tmp_path / "cache").joinpath(ds.meta["cache_dir"], LABEL_NAMES).write_text("a\ntwo\nlines\nc\n")
    with pytest.raises(DataFormatError, match=f"{LABEL_NAMES}: file: 4 lines for the data's 3 labels"):
        label_names(legacy, str(tmp_path / "src"))


def test_a_knn_memory_is_training_point_ids_or_a_one_line_error():
    assert check_knn_memory(None, 5) is None
    out = check_knn_memory([4, 1, 1, 0], 5)
    assert out.dtype == np.int64 and out.tolist() == [0, 1, 4]
    for bad, says in (([[0, 1]], "1-d array"), ([0.5, 1.0], "integers"), (np.array([], np.int64), "is empty"),
                      ([], "is empty"), ([0, 5], "outside the 5 training points"), ([-1], "e.g. -1"),
                      (["a"], "integers")):
        with pytest.raises(ConfigError, match=says) as err:
            check_knn_memory(bad, 5)
        assert err.value.key == "knn_memory" and "\n" not in str(err.value)
