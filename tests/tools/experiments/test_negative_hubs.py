"""tools/experiments/negative_hubs.py: the concentration of a generation's negatives, checked on a table counted by
hand."""

from __future__ import annotations

import json

import numpy as np

from xc.config import XCConfig, to_dict
from xc.handoff import FORMAT_VERSION, handoff_root

from tools.experiments.negative_hubs import hub_report


def test_hub_report_counts_a_hand_made_table(tmp_path):
    # 8 labels in families of 4 ({0..3}, {4..7}); label frequencies 3, 1, 0, 0, 1, 1, 0, 2
    cache = tmp_path / "cache"
    data = cache / "tiny" / "synthetic-0"
    data.mkdir(parents=True)
    positives = [[0, 1], [0], [4, 7], [0, 5, 7]]  # one row per training point
    np.save(data / "train.labels.indptr.npy", np.cumsum([0] + [len(p) for p in positives]))
    np.save(data / "train.labels.indices.npy", np.concatenate(positives))
    (data / "meta.json").write_text(json.dumps({"num_labels": 8, "meta": {}}))
    raw = to_dict(XCConfig())
    raw["data"].update(name="tiny", cache_dir=str(cache), valid_fraction=0.0)
    raw["data"]["synthetic"]["family_size"] = 4
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(raw))
    gen = handoff_root(run_dir) / "negatives" / "gen-000003"
    gen.mkdir(parents=True)
    (gen / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "k_keep": 2, "k_per_shard": 3,
                                                   "query_rows": None}))
    # the third column lies beyond k_keep and must not count
    table = np.array([[2, 4, 6], [2, -1, 6], [2, 3, 6], [2, 1, 6]], np.int32)
    table.tofile(gen / "neg.shard0.int32")

    report = hub_report(run_dir)

    assert report["generation"] == 3 and report["queries"] == 4 and report["negatives_per_query"] == 2
    assert report["slots"] == 7 and report["distinct_labels"] == 4  # labels 2 (x4), 4, 3, 1
    assert report["share_top100"] == 1.0 and report["share_top1000"] == 1.0
    # negatives' training points: 2 -> 0 (x4), 4 -> 1, 3 -> 0, 1 -> 1; median of [0,0,0,0,0,1,1] is 0
    assert report["median_train_points_of_a_negative"] == 0.0
    assert report["median_train_points_of_a_label"] == 1.0  # of [3, 1, 0, 0, 1, 1, 0, 2]
    # in a positive's family: row 0 (family 0): 2 yes, 4 no; row 1: 2 yes; row 2 (family 1): 2 no, 3 no;
    # row 3 (families 0 and 1): 2 yes, 1 yes -> 4 of 7
    assert report["share_in_a_positive_family"] == round(4 / 7, 4)
