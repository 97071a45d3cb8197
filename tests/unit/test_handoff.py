"""The trainer <-> miner contract: atomic publish, verification, confinement, pruning."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xc.handoff import (
    HandoffError, Stage, gen_name, handoff_root, list_generations, open_negatives, prune, read_static_positives,
    sweep_stale, write_static_positives,
)


def _publish_negatives(run_dir, generation, table):
    parent = handoff_root(run_dir) / "negatives"
    stage = Stage(parent, gen_name(generation))
    entry = dict(stage.write_array("neg.shard0.int32", table, raw=True), shard=0)
    return stage.publish({"kind": "negatives", "generation": generation, "snapshot_epoch": 0, "shards": [entry]})


def test_publish_is_atomic_and_round_trips(tmp_path):
    table = np.arange(12, dtype=np.int32).reshape(4, 3)
    parent = handoff_root(tmp_path) / "negatives"
    stage = Stage(parent, gen_name(1))
    stage.write_array("neg.shard0.int32", table, raw=True)
    assert list_generations(parent) == []  # staged, not visible
    _publish_negatives(tmp_path, 2, table)
    assert list_generations(parent) == [2]
    tables, manifest = open_negatives(tmp_path, 2, [0])
    assert np.array_equal(tables[0], table) and manifest["generation"] == 2
    with pytest.raises(HandoffError, match="immutable"):
        _publish_negatives(tmp_path, 2, table)


def test_truncated_and_corrupted_files_are_rejected(tmp_path):
    final = _publish_negatives(tmp_path, 1, np.ones((50, 4), dtype=np.int32))
    path = final / "neg.shard0.int32"
    data = bytearray(path.read_bytes())
    data[17] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(HandoffError, match="sha256"):
        open_negatives(tmp_path, 1, [0])
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(HandoffError, match="truncated"):
        open_negatives(tmp_path, 1, [0], checksum=False)


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "..", "sub/neg.int32"])
def test_manifest_cannot_point_outside_the_generation(tmp_path, name):
    final = _publish_negatives(tmp_path, 1, np.ones((2, 2), dtype=np.int32))
    manifest = json.loads((final / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (final / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HandoffError, match="plain name|outside"):
        open_negatives(tmp_path, 1, [0])


def test_missing_manifest_means_unpublished(tmp_path):
    with pytest.raises(HandoffError, match="not published"):
        open_negatives(tmp_path, 7, [0])


def test_prune_keeps_newest_and_protected(tmp_path):
    for g in range(1, 6):
        _publish_negatives(tmp_path, g, np.zeros((1, 1), dtype=np.int32))
    prune(handoff_root(tmp_path) / "negatives", keep=2, protect={1})
    assert list_generations(handoff_root(tmp_path) / "negatives") == [1, 4, 5]


def test_stale_staging_dirs_of_dead_writers_are_swept(tmp_path):
    parent = handoff_root(tmp_path) / "negatives"
    parent.mkdir(parents=True)
    dead = parent / "gen-000003.tmp-999999999-abc"
    dead.mkdir()
    mine = Stage(parent, gen_name(4))
    sweep_stale(parent)
    assert not dead.exists() and mine.path.exists()


def test_static_positives_published_once(tmp_path):
    write_static_positives(tmp_path, np.array([0, 2, 3]), np.array([5, 9, 1]))
    write_static_positives(tmp_path, np.array([0, 1, 1]), np.array([0]))  # second call: no change
    indptr, indices = read_static_positives(tmp_path)
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [5, 9, 1]
