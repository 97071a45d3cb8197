"""A pool worker's shard task (xc/miner/task.py): the negatives file's digest is taken as its bytes are written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash

from xc import handoff
from xc.handoff import gen_name, handoff_root, open_negatives
from tests.unit.miner.test_miner_storage_errors import _run_with_a_snapshot, _service


def test_the_negatives_digest_is_taken_as_written_and_verifies(tmp_path, monkeypatch):
    _run_with_a_snapshot(tmp_path)
    service = _service(tmp_path, monkeypatch)
    read_back = handoff.hash_file  # the snapshot's files are verified by reading them; the negatives' not hashed so

    def hash_file(path, *args, **kwargs):
        if Path(path).name.startswith("neg."):
            pytest.fail(f"{path} was read back to hash it")
        return read_back(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(handoff, "hash_file", hash_file)
        service.mine(1)
    final = handoff_root(tmp_path) / "negatives" / gen_name(1)
    entry = json.loads((final / "manifest.json").read_text())["shards"][0]
    assert entry["xxh3_128"] == xxhash.xxh3_128((final / entry["file"]).read_bytes()).hexdigest()
    tables, _ = open_negatives(tmp_path, 1, [0])  # verified by the digest
    assert tables[0].shape == (12, 3) and np.all(tables[0] < 20)
