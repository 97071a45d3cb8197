"""The trainer <-> miner contract: atomic publish, verification, confinement, pruning."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from xc.handoff import (
    HandoffError, Stage, drop_generations, gen_name, handoff_root, list_generations, open_negatives, prune,
    read_static_positives, request_stop, sweep_stale, write_static_positives,
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
    with pytest.raises(HandoffError, match="xxh3_128 does not match"):
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


def test_a_finished_runs_generations_go_and_its_positives_and_control_stay(tmp_path, monkeypatch):
    """drop_generations removes every snapshot and negatives generation (a finished run's), leaves the static
    positives and control/ (an external miner reads `trainer-done` there), and a death between a generation's
    rename and its removal leaves a stage that `sweep_stale` clears, never a published generation missing files."""
    for g in (1, 2, 3):
        _publish_negatives(tmp_path, g, np.zeros((2, 1), dtype=np.int32))
        Stage(handoff_root(tmp_path) / "snapshots", gen_name(g)).publish({"kind": "snapshot", "generation": g,
                                                                           "shards": []})
    write_static_positives(tmp_path, np.array([0, 1]), np.array([4]))
    request_stop(tmp_path, "done")
    in_flight = Stage(handoff_root(tmp_path) / "negatives", gen_name(4))  # a stage is not a generation: left alone
    assert drop_generations(tmp_path) == 6
    for part in ("snapshots", "negatives"):
        assert list_generations(handoff_root(tmp_path) / part) == []
    assert read_static_positives(tmp_path)[1].tolist() == [4] and (handoff_root(tmp_path) / "control").is_dir()
    assert in_flight.path.exists()

    _publish_negatives(tmp_path, 5, np.zeros((2, 1), dtype=np.int32))
    monkeypatch.setattr("xc.handoff.shutil.rmtree", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
    monkeypatch.setattr(os, "getpid", lambda: 999999999)  # a process that dies here: its pid is then dead
    with pytest.raises(SystemExit):
        drop_generations(tmp_path)  # dies after the rename, before the removal
    monkeypatch.undo()
    negatives = handoff_root(tmp_path) / "negatives"
    assert list_generations(negatives) == []  # renamed out of sight: nothing published is left half-removed
    left = [p for p in negatives.iterdir() if p.name.startswith("gen-000005.tmp-999999999@")]
    assert len(left) == 1
    sweep_stale(negatives)  # the next attempt's start-up sweep
    assert not left[0].exists()


def test_static_positives_published_once(tmp_path):
    write_static_positives(tmp_path, np.array([0, 2, 3]), np.array([5, 9, 1]))
    write_static_positives(tmp_path, np.array([0, 1, 1]), np.array([0]))  # second call: no change
    indptr, indices = read_static_positives(tmp_path)
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [5, 9, 1]


# ---------------------------------------------------------------- the trainer's side: nothing bad is consumed

def _sides(run_dir, miner=None, sampler=None, ctx=None):
    """A Refresher's two sides (xc/refresh/schedule.py), built with just what choosing a generation and handing the
    pool's cores back read: 2 label shards of 100 labels, 4 training rows, k=2. `.negatives`, `.snapshots`, their
    shared `.state`, the hand-off `.root`, and `.events`: what they logged."""
    from types import SimpleNamespace

    from xc.config import MinerConfig, SamplerConfig, XCConfig
    from xc.refresh.negatives import Negatives
    from xc.refresh.snapshots import RefreshState, Snapshots
    from xc.shards import ShardLayout

    cfg = XCConfig(run_dir=str(run_dir), miner=miner or MinerConfig(late_policy="reuse"),
                   sampler=sampler or SamplerConfig(start_epoch=1))
    events = []
    common = dict(cfg=cfg, ctx=ctx, logger=SimpleNamespace(event=lambda kind, **f: events.append(dict(f, event=kind))),
                  components=SimpleNamespace(layout=ShardLayout.build(100, 2, 16), train=SimpleNamespace(num_rows=4)),
                  root=handoff_root(run_dir), k=2, mine_k=2)  # mine_k=k: no re-ranking
    state = RefreshState(boundary={})
    snapshots = Snapshots(**common, state=state)
    negatives = Negatives(**common, enabled=True, state=state, snapshots=snapshots)
    return SimpleNamespace(negatives=negatives, snapshots=snapshots, state=state, root=common["root"], events=events)


def _publish_two_shards(run_dir, generation, tables, edit=None):
    stage = Stage(handoff_root(run_dir) / "negatives", gen_name(generation))
    entries = [dict(stage.write_array(f"neg.shard{s}.int32", t, raw=True), shard=s) for s, t in enumerate(tables)]
    manifest = {"kind": "negatives", "generation": generation, "snapshot_epoch": 0, "shards": entries}
    if edit:
        edit(manifest)
    return stage.publish(manifest)


GOOD = [np.array([[1, 2], [3, -1], [0, 5], [7, 8]], np.int32), np.array([[64, 65], [66, 99], [-1, -1], [70, 71]], np.int32)]


def _truncate(final):
    path = final / "neg.shard1.int32"
    path.write_bytes(path.read_bytes()[:-4])


def _flip(final):
    path = final / "neg.shard0.int32"
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tables,edit,damage,reason", [
    (GOOD, None, _truncate, "truncated"),
    (GOOD, None, _flip, "xxh3_128 does not match"),
    (GOOD, lambda m: m["shards"][1].update(file="../../../neg.int32"), None, "not a plain name"),
    (GOOD, lambda m: m["shards"].pop(), None, "no negatives for shard 1"),
    ([GOOD[0], GOOD[0]], None, None, "outside the shard's range"),  # mined for another label layout
    ([GOOD[0], np.zeros((4, 3), np.int32) + 64], None, None, "this run needs (4, 2)"),
    (None, None, None, "miner failed generation 2"),
])
def test_bad_generation_is_not_consumed_and_previous_is_kept(tmp_path, caplog, tables, edit, damage, reason):
    from xc.sampling import HardNegativeSet

    r = _sides(tmp_path)
    if tables is None:  # the miner gave up (a full disk, a worker dying too often)
        (r.root / "control").mkdir(parents=True)
        (r.root / "control" / "failed-gen-000002.json").write_text('{"reason": "No space left on device"}')
    else:
        final = _publish_two_shards(tmp_path, 2, tables, edit)
        if damage:
            damage(final)
    current = HardNegativeSet({0: GOOD[0], 1: GOOD[1]}, 1, 0, 0)
    with caplog.at_level("WARNING", logger="xc.refresh"):
        generation, _, note = r.negatives._decide(2, current)
    assert generation is None and reason in note
    assert "generation 2" in caplog.text and "keeping generation 1" in caplog.text and reason in caplog.text
    assert r.events[-1]["event"] == "negatives_late" and r.events[-1]["kept"] == 1


def test_good_generation_is_taken(tmp_path):
    r = _sides(tmp_path)
    _publish_two_shards(tmp_path, 2, GOOD)
    assert r.negatives._decide(2, None)[0] == 2


def test_staging_of_another_host_is_swept_only_by_the_sole_writer(tmp_path):
    """A pid on another host cannot be checked from here: its staging stays, unless the caller is the only
    writer of the directory (the miner-lease holder for negatives/), for whom any other staging is dead."""
    parent = handoff_root(tmp_path) / "negatives"
    parent.mkdir(parents=True)
    foreign = parent / f"gen-000003.tmp-{os.getpid()}@some.other.host-abc"
    foreign.mkdir()
    mine = Stage(parent, gen_name(4))
    assert "@" in mine.path.name
    sweep_stale(parent)
    assert foreign.exists() and mine.path.exists()
    sweep_stale(parent, sole_writer=True)
    assert not foreign.exists() and mine.path.exists()


def test_trainer_takes_the_pools_cores_back_once_the_newest_generation_is_mined(tmp_path, monkeypatch):
    """A local pool's cores return to the trainer when its generation is published (or failed), checked every
    RECLAIM_CHECK_STEPS steps, not only at the epoch boundary that switches to the negatives."""
    import os
    from types import SimpleNamespace

    import torch

    from xc.config import MinerConfig
    from xc.distributed.host_threads import host_threads
    from xc.refresh.snapshots import RECLAIM_CHECK_STEPS

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.delenv("XC_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        r = _sides(tmp_path, miner=MinerConfig(late_policy="reuse", mode="pool", workers=1, threads_per_worker=1),
                   ctx=SimpleNamespace(is_main=True, active=False, world_size=1, rank=0, device=torch.device("cpu")))
        snapshots = r.snapshots
        r.state.published = 2
        snapshots.follow_miner(mining=True)  # what publishing snapshot 2 does, with the flag finish_snapshot sets
        snapshots._pool_mining = True
        assert torch.get_num_threads() == 3
        for step in range(100, 100 + 2 * RECLAIM_CHECK_STEPS):
            snapshots.poll(step)  # nothing mined yet: the pool keeps its core
        assert torch.get_num_threads() == 3 and not [e for e in r.events if e["event"] == "pool_idle"]
        _publish_two_shards(tmp_path, 2, GOOD)
        for step in range(100 + 2 * RECLAIM_CHECK_STEPS, 100 + 3 * RECLAIM_CHECK_STEPS):
            snapshots.poll(step)
        assert torch.get_num_threads() == 4 and not snapshots._pool_mining
        idle = [e for e in r.events if e["event"] == "pool_idle"]
        assert idle == [{"event": "pool_idle", "generation": 2, "global_step": 100 + 2 * RECLAIM_CHECK_STEPS}]

        # a failed generation frees the pool as well; with XC_THREADS the count is fixed and nothing is watched
        r.state.published = 3
        snapshots.follow_miner(mining=True)
        snapshots._pool_mining = True
        (r.root / "control").mkdir(parents=True, exist_ok=True)
        (r.root / "control" / "failed-gen-000003.json").write_text("{}")
        snapshots.poll(10 * RECLAIM_CHECK_STEPS)
        assert torch.get_num_threads() == 4 and not snapshots._pool_mining
        monkeypatch.setenv("XC_THREADS", "2")  # a fixed count: finish_snapshot sets no flag, nothing is watched
        assert host_threads(snapshots.cfg, True) == host_threads(snapshots.cfg, False)
    finally:
        torch.set_num_threads(before)


def _publish_snapshot(run_dir, generation, snapshot_id):
    stage = Stage(handoff_root(run_dir) / "snapshots", gen_name(generation))
    return stage.publish({"kind": "snapshot", "snapshot_id": snapshot_id, "generation": generation, "shards": []})


def test_negatives_of_another_snapshot_are_rejected_and_the_right_ones_taken(tmp_path, caplog):
    """Negatives carry the id of the snapshot they were mined from; the trainer takes a generation only when that is
    its own snapshot of the generation (a generation copied from another run is rejected with a line)."""
    from xc.sampling import HardNegativeSet

    r = _sides(tmp_path)
    _publish_snapshot(tmp_path, 2, "a" * 32)
    _publish_two_shards(tmp_path, 2, GOOD, edit=lambda m: m.update(snapshot_id="b" * 32))
    current = HardNegativeSet({0: GOOD[0], 1: GOOD[1]}, 1, 0, 0)
    with caplog.at_level("WARNING", logger="xc.refresh"):
        generation, _, note = r.negatives._decide(2, current)
    assert generation is None and "mined from snapshot " + "b" * 32 in note and "copied from another run" in note
    _publish_snapshot(tmp_path, 3, "c" * 32)
    _publish_two_shards(tmp_path, 3, GOOD, edit=lambda m: m.update(snapshot_id="c" * 32))
    assert r.negatives._decide(3, current)[0] == 3


# --------------------------------------------------------------------------- digests taken as the bytes are written


def _stage_files(tmp_path):
    stage = Stage(handoff_root(tmp_path) / "snapshots", gen_name(1))
    rows = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    bits = np.arange(3 * 5, dtype=np.uint16).reshape(3, 5)
    entries = {"npy": stage.write_array("W.shard0.npy", rows), "raw": stage.write_array("neg.int32", rows, raw=True),
               "blocks": stage.write_blocks("W.shard1.npy", (3, 5), "bfloat16", [bits[:2], bits[2:]])}
    return stage, rows, entries


def test_the_digest_written_is_the_files_xxh3_read_back(tmp_path, monkeypatch):
    import xxhash

    from xc import handoff

    monkeypatch.setattr(handoff, "WRITE_CHUNK", 1000)  # many chunks per file, one cut inside a row
    stage, rows, entries = _stage_files(tmp_path)
    for entry in entries.values():
        data = (stage.path / entry["file"]).read_bytes()
        assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest() and entry["bytes"] == len(data)
        assert "sha256" not in entry
    np.save(tmp_path / "ref.npy", rows)  # the .npy written is np.save's, byte for byte
    assert (stage.path / "W.shard0.npy").read_bytes() == (tmp_path / "ref.npy").read_bytes()
    assert (stage.path / "neg.int32").read_bytes() == rows.tobytes()
    final = stage.publish({"kind": "snapshot", "shards": [dict(entries["npy"], shard=0)]})
    assert json.loads((final / "manifest.json").read_text())["format_version"] == 2


def test_a_format_1_manifest_with_sha256_digests_still_verifies(tmp_path):
    """Generations published before the xxh3_128 digests record sha256 ones (format_version 1): a reader verifies
    them by sha256, and refuses a corrupted file of one as it does any other."""
    import hashlib

    table = np.arange(40, dtype=np.int32).reshape(10, 4)
    final = _publish_negatives(tmp_path, 1, table)
    manifest = json.loads((final / "manifest.json").read_text())
    entry = manifest["shards"][0]
    del entry["xxh3_128"]
    entry["sha256"] = hashlib.sha256((final / entry["file"]).read_bytes()).hexdigest()
    manifest["format_version"] = 1
    (final / "manifest.json").write_text(json.dumps(manifest))
    tables, _ = open_negatives(tmp_path, 1, [0])
    assert np.array_equal(tables[0], table)
    _flip_byte(final / "neg.shard0.int32")
    with pytest.raises(HandoffError, match="sha256 does not match the manifest"):
        open_negatives(tmp_path, 1, [0])


def test_an_entry_without_a_digest_or_an_unknown_format_is_refused(tmp_path):
    final = _publish_negatives(tmp_path, 1, np.ones((3, 2), dtype=np.int32))
    manifest = json.loads((final / "manifest.json").read_text())
    del manifest["shards"][0]["xxh3_128"]
    (final / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HandoffError, match="records no digest"):
        open_negatives(tmp_path, 1, [0])
    manifest["format_version"] = 3
    (final / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HandoffError, match=r"format_version 3 is not one this xc reads \(1 or 2\)"):
        open_negatives(tmp_path, 1, [0])


def _flip_byte(path, at=5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
