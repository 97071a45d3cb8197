"""Checkpoint faults (truncated, missing, bit-flipped, stray files), safe loading, and the resume planner
that moves a checkpoint onto another world size (docs/reliability.md, items 2, 3 and 7)."""

from __future__ import annotations

import json
import zlib
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from xc.run import checkpoint as ckpt
from xc.run import resume
from xc.errors import CheckpointError
from xc.shards import ShardLayout

REPO = Path(__file__).resolve().parents[3]


def _write(run_dir, step, layout: ShardLayout, world_size: int, hard_k: int | None = None, num_rows: int = 6):
    """A checkpoint as the trainer writes it: row l of the classifier holds l (real labels) or 0 (padding);
    hard tables hold, per query row q, the shard's first real labels shifted by q."""
    digests = {}
    for rank in range(world_size):
        lo, hi = layout.rank_range(rank, world_size)
        weight = torch.zeros(hi - lo, 3)
        real = torch.arange(lo, min(hi, layout.num_labels), dtype=torch.float32)
        weight[:len(real)] = real.unsqueeze(1)
        state = {"encoder": {"w": torch.ones(2)}, "epoch": 1, "micro": 2, "global_step": step, "rng_cpu": torch.get_rng_state(),
                 "classifier": {"lo": lo, "hi": hi, "num_labels": layout.num_labels, "weight": weight},
                 "hard": None if hard_k is None else {"generation": 1, "made_at_epoch": 1, "made_at_step": 0}}
        tables = None
        if hard_k is not None:
            tables = {}
            for s in layout.shards_of_rank(rank, world_size):
                s_lo, _ = layout.shard_range(s)
                n = layout.real_count(s)
                tables[s] = np.array([[s_lo + (q + j) % n for j in range(hard_k)] for q in range(num_rows)], np.int32)
        digests.update(ckpt.write_rank_files(run_dir, step, rank, state, tables))
    meta = {"num_label_shards": layout.num_shards, "layout": vars(layout), "config": {}}
    return ckpt.publish(run_dir, step, world_size, meta, keep=5, crc32=digests)


LAYOUT2 = ShardLayout.build(100, 2, 16)  # 2 shards of 64 rows: [0, 64) and [64, 128), labels < 100


# ------------------------------------------------------------------ damaged checkpoints (item 3)

@pytest.mark.parametrize("damage,needle", [
    (lambda p: (p / "rank1.pt").unlink(), r"rank1\.pt: missing"),
    (lambda p: (p / "rank0.pt").write_bytes((p / "rank0.pt").read_bytes()[:100]), r"rank0\.pt: truncated"),
    (lambda p: (p / "rank1.hard.npz").write_bytes((p / "rank1.hard.npz").read_bytes()[:-7]), r"rank1\.hard\.npz: truncated"),
    (lambda p: _flip(p / "rank1.pt", 200), r"rank1\.pt: CRC-32 does not match"),
    (lambda p: (p / "meta.json").write_text("{\"files\": "), r"meta\.json: unreadable"),
    (lambda p: (p / "meta.json").unlink(), r"meta\.json: unreadable"),
    (lambda p: _edit_meta(p, lambda m: m["files"].pop("rank1.pt")), r"rank1\.pt: missing from meta\.json"),
    (lambda p: _edit_meta(p, lambda m: m["files"].update({"../../escape.pt": 1})), r"not a checkpoint file name"),
])
def test_damaged_newest_checkpoint_falls_back_to_previous_naming_the_file(tmp_path, caplog, damage, needle):
    _write(tmp_path, 5, LAYOUT2, 2, hard_k=3)
    newest = _write(tmp_path, 10, LAYOUT2, 2, hard_k=3)
    damage(newest)
    with pytest.raises(CheckpointError, match=needle):
        ckpt.validate(newest)
    with caplog.at_level(logging.WARNING, logger="xc.run.checkpoint"):
        path, meta = ckpt.latest_valid(tmp_path)
    assert path.name == "step-00000005" and meta["global_step"] == 5
    assert re.search(needle, caplog.text) and "step-00000010" in caplog.text and "previous" in caplog.text


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def _edit_meta(path: Path, edit) -> None:
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def test_all_checkpoints_damaged_means_none(tmp_path):
    only = _write(tmp_path, 5, LAYOUT2, 2)
    (only / "rank0.pt").unlink()
    assert ckpt.latest_valid(tmp_path) is None


def test_crashed_attempt_leaves_nothing_that_can_be_published(tmp_path):
    # A 2-rank attempt died while writing step 7 (with hard negatives); the 1-rank job that follows
    # writes step 7 again without them. Neither rank1.* nor the stale rank0.hard.npz may be published.
    stale = {"x": torch.zeros(1)}
    ckpt.write_rank_files(tmp_path, 7, 0, stale, {0: np.zeros((2, 2), np.int32)})
    ckpt.write_rank_files(tmp_path, 7, 1, stale, {1: np.zeros((2, 2), np.int32)})
    assert ckpt.list_checkpoints(tmp_path) == []  # half-written: invisible
    digests = ckpt.write_rank_files(tmp_path, 7, 0, {"x": torch.ones(1)}, None)
    path = ckpt.publish(tmp_path, 7, 1, {}, keep=2, crc32=digests)
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rank0.pt", "rank1.hard.npz", "rank1.pt"]
    assert set(json.loads((path / "meta.json").read_text())["files"]) == {"rank0.pt"}
    assert ckpt.load_rank(path, 0)[1] is None
    # and at start-up the trainer sweeps what a crash left
    ckpt.write_rank_files(tmp_path, 9, 0, stale, None)
    assert ckpt.sweep_partial(tmp_path) == ["step-00000009.tmp"]
    assert not (ckpt.checkpoint_root(tmp_path) / "step-00000009.tmp").exists()


def test_writes_are_atomic_and_last_k_kept(tmp_path):
    for step in range(1, 6):
        digests = ckpt.write_rank_files(tmp_path, step, 0, {"s": step}, None)
        assert ckpt.list_checkpoints(tmp_path)[-1:] != [ckpt.checkpoint_root(tmp_path) / f"step-{step:08d}"]
        ckpt.publish(tmp_path, step, 1, {}, keep=3, crc32=digests)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004", "step-00000005"]
    assert not list(ckpt.checkpoint_root(tmp_path).glob("*.tmp")) and not list(tmp_path.rglob("*.part"))


# ------------------------------------------------------------------ safe loading (item 7)

class _Payload:
    marker: Path | None = None

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_loading_runs_no_pickle(tmp_path):
    _Payload.marker = tmp_path / "pwned"
    path = tmp_path / "ck"
    path.mkdir()
    torch.save({"encoder": {}, "x": _Payload()}, path / "rank0.pt")
    with pytest.raises(CheckpointError, match="rank0.pt: cannot load"):
        ckpt.load_rank(path, 0)
    np.savez(path / "rank0.hard.npz", shard0=np.array([_Payload()], dtype=object))
    with pytest.raises(CheckpointError, match="rank0.hard.npz: cannot load"):
        ckpt.load_hard_tables(path, 0)
    assert not _Payload.marker.exists()


def test_library_never_unpickles_run_directory_files():
    """Static guard: every torch.load passes weights_only=True, no np.load allows pickle, no pickle.load."""
    offenders = []
    for file in sorted((REPO / "xc").rglob("*.py")):
        text = file.read_text()
        for match in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in match.group(1):
                offenders.append(f"{file}: {match.group(0)}")
        for bad in ("allow_pickle=True", "weights_only=False", "pickle.load", "pickle.loads(", "yaml.load("):
            if bad in text:
                offenders.append(f"{file}: {bad}")
    assert offenders == []


# ------------------------------------------------------------------ resume on another world size (item 2)

def _source(path: Path) -> resume.ResumeSource:
    meta = ckpt.validate(path)
    return resume.ResumeSource(path, meta, resume._layout_of(path, meta))


def test_plan_adopts_shards_that_divide_the_new_world_size_and_resplits_otherwise(tmp_path):
    src = _source(_write(tmp_path, 3, LAYOUT2, 2))
    assert resume.plan_layout(src, 0, 2, 100, 16) == (2, resume.SAME)
    assert resume.plan_layout(src, 2, 2, 100, 16) == (2, resume.SAME)
    assert resume.plan_layout(src, 0, 1, 100, 16) == (2, resume.ADOPT)
    assert resume.plan_layout(src, 0, 4, 100, 16) == (4, resume.RESPLIT)
    assert resume.plan_layout(src, 0, 3, 100, 16) == (3, resume.RESPLIT)
    assert resume.plan_layout(src, 0, 1, 100, 8) == (2, resume.RESPLIT)  # same count, other padding
    with pytest.raises(CheckpointError, match=r"2 label shards.*parallel\.num_label_shards=4.*=2, or 0"):
        resume.plan_layout(src, 4, 4, 100, 16)
    with pytest.raises(CheckpointError, match="trained on 100 labels, but this run's data has 90"):
        resume.plan_layout(src, 0, 2, 90, 16)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_restore_moves_rows_and_hard_negatives_by_label_id(tmp_path, world_size):
    src = _source(_write(tmp_path, 3, LAYOUT2, 2, hard_k=4))
    shards, mode = resume.plan_layout(src, 0, world_size, 100, 16)
    layout = ShardLayout.build(100, shards, 16)
    k_new = 8 // shards  # k_hard = 8 over the new shard count
    got_rows, got_tables = [], {}
    for rank in range(world_size):
        state, tables = resume.restore_rank(src, layout, rank, world_size, k_new if mode == resume.RESPLIT else 4)
        c = state["classifier"]
        assert (c["lo"], c["hi"]) == layout.rank_range(rank, world_size)
        assert state["global_step"] == 3 and torch.equal(state["encoder"]["w"], torch.ones(2))
        got_rows.append(c["weight"])
        got_tables.update(tables)
    weight = torch.cat(got_rows)
    assert weight.shape == (layout.padded_labels, 3)
    assert torch.equal(weight[:100, 0], torch.arange(100, dtype=torch.float32))  # row l is label l
    assert not weight[100:].any()  # padding stays zero
    assert sorted(got_tables) == list(range(shards))
    old = {**ckpt.load_hard_tables(src.path, 0), **ckpt.load_hard_tables(src.path, 1)}
    for s, table in got_tables.items():
        lo, _ = layout.shard_range(s)
        real = layout.real_count(s)
        assert ((table == -1) | ((table >= lo) & (table < lo + real))).all()  # only the shard's own labels
        if mode != resume.RESPLIT:
            assert np.array_equal(table, old[s])  # untouched when the layout is kept
        else:  # every old id that falls in the new shard is kept, in its order, up to k_new
            both = np.concatenate([old[t] for t in old], axis=1)
            for q in range(table.shape[0]):
                want = [int(i) for i in both[q] if lo <= i < lo + real][:k_new]
                assert table[q].tolist() == want + [-1] * (k_new - len(want))


def test_recut_table_keeps_order_and_pads():
    table = np.array([[5, 70, 6, 71], [70, 71, 72, 73]], np.int32)
    assert resume.recut_table(table, 0, 64, 3).tolist() == [[5, 6, -1], [-1, -1, -1]]
    assert resume.recut_table(table, 64, 128, 3).tolist() == [[70, 71, -1], [70, 71, 72]]


def test_restore_refuses_missing_hard_tables(tmp_path):
    path = _write(tmp_path, 3, LAYOUT2, 2, hard_k=2)
    (path / "rank1.hard.npz").unlink()
    meta = json.loads((path / "meta.json").read_text())
    src = resume.ResumeSource(path, meta, LAYOUT2)  # bypasses validate(), which would refuse it first
    with pytest.raises(CheckpointError, match="lacks shard 1"):
        resume.restore_rank(src, LAYOUT2, 0, 1, 2)


def test_impossible_resplit_names_shards_and_the_setting(tmp_path, monkeypatch):
    """2 shards onto 3 ranks need 3 shards, and k_hard=16 cannot split over 3: a CheckpointError saying so."""
    from types import SimpleNamespace

    from xc.train import trainer as trainer_mod
    from xc.train.modes.classifier import mode as classifier_mode
    from xc.train.plan import resolve_run
    from xc.config import XCConfig
    from xc.distributed import DistContext
    from xc.errors import ConfigError

    src = _source(_write(tmp_path, 3, LAYOUT2, 2))
    monkeypatch.setattr(resume, "find_checkpoint", lambda cfg, ctx: src)
    from xc.train import plan as plan_mod  # the ranks' agreement on the rows' precision: no process group here

    monkeypatch.setattr(plan_mod, "broadcast_object", lambda obj, ctx, src=0: obj)

    def build(cfg, ctx, dataset):
        assert cfg.parallel.num_label_shards == 3  # the plan asked for a re-split into 3
        raise ConfigError("sampler.k_hard", "16 per query does not split evenly over 3 label shards")

    monkeypatch.setattr(classifier_mode, "build_components", build)
    ctx = DistContext(rank=0, world_size=3)
    dataset = SimpleNamespace(num_labels=100, num_features=0, train=SimpleNamespace(num_points=1000, labels=SimpleNamespace(nnz=3000)))
    plan = resolve_run(XCConfig(run_dir=str(tmp_path)), ctx, dataset)
    with pytest.raises(CheckpointError) as e:
        trainer_mod.Trainer(plan, ctx, dataset)
    msg = str(e.value)
    assert "2 label shards, which do not split over 3 ranks" in msg and "re-splitting them into 3 is impossible" in msg
    assert "sampler.k_hard: 16 per query does not split evenly over 3" in msg and "divides 2" in msg


def test_a_reader_whose_checkpoint_the_trainer_prunes_reads_the_newest_instead(tmp_path, caplog, monkeypatch):
    """xc-eval, xc-predict and xc.load read through `xc.run.readers.reading`: a checkpoint pruned before its files
    were held (a running trainer publishing a newer one) is chosen again, said in the log; a named checkpoint is
    never swapped. Once held, pruning no longer takes the files away (tests/unit/run/test_checkpoint_readers.py)."""
    import os
    import shutil

    from xc.run import readers

    layout = ShardLayout.build(100, 1, 16)
    _write(tmp_path, 4, layout, 1)
    _write(tmp_path, 8, layout, 1)
    real_link, pruned = os.link, []

    def link(source, target):  # the trainer publishes step 12 and prunes step 8 while step 8 is being linked
        if not pruned and "step-00000008" in str(source):
            pruned.append(source)
            _write(tmp_path, 12, layout, 1)
            shutil.rmtree(ckpt.step_dir(tmp_path, 8))
        return real_link(source, target)

    monkeypatch.setattr(readers.os, "link", link)
    with caplog.at_level(logging.WARNING, logger="xc.run.checkpoint"):
        with readers.reading(tmp_path) as held:
            assert held.path.name == "step-00000012"
            assert ckpt.load_state_file(held.files / "rank0.pt")["global_step"] == 12
    assert "step-00000008 removed by the trainer" in caplog.text and "read step-00000012 instead" in caplog.text
    named = ckpt.step_dir(tmp_path, 12)

    def prune_named(source, target):  # step 12, named, is pruned while it is being linked
        shutil.rmtree(named, ignore_errors=True)
        return real_link(source, target)

    monkeypatch.setattr(readers.os, "link", prune_named)
    with pytest.raises(CheckpointError, match="was removed while it was being opened"):
        with readers.reading(tmp_path, named):
            pytest.fail("a checkpoint pruned while it was being linked was opened")


def test_resume_skips_a_checkpoint_that_validates_but_does_not_load(tmp_path, caplog):
    """A rank file replaced by a foreign pickle with its checksum recomputed passes validation; resume loads every
    rank state before choosing, so it falls back to the previous checkpoint, naming the file and the reason."""
    import hashlib
    import pickle

    layout = ShardLayout.build(100, 1, 16)
    _write(tmp_path, 4, layout, 1)
    newest = _write(tmp_path, 8, layout, 1)
    evil = pickle.dumps({"x": slice(1, 2)})
    (newest / "rank0.pt").write_bytes(evil)
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["rank0.pt"], meta["crc32"]["rank0.pt"] = len(evil), f"{zlib.crc32(evil):08x}"
    (newest / "meta.json").write_text(json.dumps(meta))
    assert ckpt.latest_valid(tmp_path)[0] == newest  # the checksum alone cannot tell
    with caplog.at_level(logging.WARNING, logger="xc.run.checkpoint"):
        path, _ = ckpt.latest_loadable(tmp_path)
    assert path.name == "step-00000004"
    assert "skipping damaged checkpoint step-00000008" in caplog.text and "rank0.pt: cannot load" in caplog.text


@pytest.mark.parametrize("when", ["republish", "prune"])
def test_a_death_while_removing_a_published_checkpoint_leaves_it_whole_or_gone(tmp_path, monkeypatch, when):
    """The same step published twice (a timed checkpoint, then the epoch's), or an old one pruned, with the process
    killed half-way through deleting the old directory (simulated: the deletion removes meta.json, then dies). The
    kill-anywhere soak (tools/probes/soak.py) found published directories without their meta.json this way; now the old
    directory is renamed out of discovery's sight first, and every listed checkpoint still validates."""
    import shutil

    _write(tmp_path, 5, LAYOUT2, 2)
    if when == "prune":
        for step in (6, 7, 8, 9):
            _write(tmp_path, step, LAYOUT2, 2)  # keep=5: the next publish prunes step 5

    def dies_half_way(path, *args, **kwargs):
        (Path(path) / "meta.json").unlink()
        raise SystemExit("killed while deleting")

    monkeypatch.setattr(shutil, "rmtree", dies_half_way)
    with pytest.raises(SystemExit):
        _write(tmp_path, 5 if when == "republish" else 10, LAYOUT2, 2)
    monkeypatch.undo()
    listed = ckpt.list_checkpoints(tmp_path)
    assert listed and all(ckpt.validate(p) for p in listed)
    assert ckpt.sweep_partial(tmp_path)  # what the death left is swept at the next start
    assert ckpt.latest_valid(tmp_path)[1]["global_step"] == (5 if when == "republish" else 10)


def test_a_death_between_setting_a_checkpoint_aside_and_publishing_its_replacement_puts_it_back(tmp_path,
                                                                                               monkeypatch):
    """Killed after the old step-5 was renamed aside and before the new step-5 was renamed into place: the next
    start-up sweep publishes the old one again (it validates) instead of losing the run's only checkpoint."""
    import os

    _write(tmp_path, 5, LAYOUT2, 2)
    real = os.replace
    calls = []

    def dies_publishing(src, dst):
        if Path(dst).name == "step-00000005" and ".old-" in str(calls):  # the old one is aside already
            raise SystemExit("killed between the renames")
        calls.append(Path(dst).name)
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", dies_publishing)
    with pytest.raises(SystemExit):
        _write(tmp_path, 5, LAYOUT2, 2)
    monkeypatch.undo()
    assert ckpt.list_checkpoints(tmp_path) == []
    ckpt.sweep_partial(tmp_path)  # the unpublished new stage is removed, the old checkpoint put back
    path, meta = ckpt.latest_valid(tmp_path)
    assert path.name == "step-00000005" and meta["global_step"] == 5
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000005"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_kept_epochs_weights_load_through_mapped_files(tmp_path, monkeypatch, world_size):
    """`load_model_weights` (the epoch a run keeps) copies the encoder and this rank's rows out of the checkpoint's
    files mapped, not read whole: the optimiser state beside them (at 10^7 labels as large as the rows) is never
    read into memory."""
    from xc.models import ClassifierShard

    src = _write(tmp_path, 3, LAYOUT2, 2, hard_k=4)
    layout = ShardLayout.build(100, 2, 16)
    mapped, real = [], ckpt.load_state_file
    monkeypatch.setattr(ckpt, "load_state_file", lambda file, mmap=False: mapped.append(mmap) or real(file, mmap))
    for rank in range(world_size):
        lo, hi = layout.rank_range(rank, world_size)
        encoder = torch.nn.Module()
        encoder.w = torch.nn.Parameter(torch.zeros(2))
        shard = ClassifierShard(lo, hi, 100, 3, 0.1, 0, torch.device("cpu"))
        tables = resume.load_model_weights(src, encoder, shard, layout, rank, world_size, 4)
        assert torch.equal(encoder.w.detach(), torch.ones(2))
        want = torch.arange(lo, hi, dtype=torch.float32).where(torch.arange(lo, hi) < 100, torch.tensor(0.0))
        assert torch.equal(shard.weight[:, 0], want) and sorted(tables) == list(layout.shards_of_rank(rank, world_size))
    assert mapped and all(mapped)


def _rss_file_bytes() -> int:
    """This process's resident file-backed pages (Linux /proc/self/status RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_copy_mapped_equals_a_plain_copy_and_reads_again_after_it(tmp_path, monkeypatch, dst_dtype):
    """Block by block (blocks that end mid-page, a last short block), with the dtype cast copy_ does; the source
    still reads its values after its pages were let go (they come back from the file)."""
    monkeypatch.setattr(ckpt, "COPY_BLOCK_BYTES", 3000)  # 2.9 rows of 1,024 bytes a block: ends mid-page
    values = torch.randn(1001, 256)
    torch.save({"w": values}, tmp_path / "s.pt")
    src = ckpt.load_state_file(tmp_path / "s.pt", mmap=True)["w"]
    dst = torch.zeros(1001, 256, dtype=dst_dtype)
    ckpt.copy_mapped(dst, src)
    assert torch.equal(dst, values.to(dst_dtype))
    assert torch.equal(src, values)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_copy_mapped_holds_at_most_a_block_of_the_mapped_file_resident(tmp_path, monkeypatch):
    """A plain copy out of a mapped checkpoint leaves every page it read resident (counted in the process's memory
    until the mapping goes); copy_mapped hands each block back. 64 MiB source, 1 MiB blocks."""
    monkeypatch.setattr(ckpt, "COPY_BLOCK_BYTES", 1 << 20)
    torch.save({"w": torch.randn(1 << 14, 1024)}, tmp_path / "s.pt")
    size = 64 << 20
    grown = {}
    for name, copy in (("plain", torch.Tensor.copy_), ("mapped", ckpt.copy_mapped)):
        src = ckpt.load_state_file(tmp_path / "s.pt", mmap=True)["w"]
        dst = torch.zeros_like(src)
        before = _rss_file_bytes()
        copy(dst, src)
        grown[name] = _rss_file_bytes() - before
        del src
    assert grown["plain"] > size // 2, grown  # the measurement sees the pages a plain copy keeps
    assert grown["mapped"] < 4 << 20, grown


def test_loading_a_shard_casts_through_the_given_copy(tmp_path):
    """ClassifierShard.load_state_dict with copy_mapped: the stored masters (float32) into bfloat16 rows and their
    float32 masters, as with the plain copy."""
    from xc.models import ClassifierShard

    rows = torch.randn(40, 8)
    state = {"lo": 0, "hi": 40, "num_labels": 40, "weight": rows.bfloat16(), "master": rows,
             "row_sq": torch.rand(40, 1)}
    torch.save(state, tmp_path / "s.pt")
    mapped = ckpt.load_state_file(tmp_path / "s.pt", mmap=True)
    plain, released = (ClassifierShard(0, 40, 40, 8, 0.1, 0, torch.device("cpu"), dtype=torch.bfloat16,
                                       master_fp32=True) for _ in range(2))
    for shard in (plain, released):
        shard.row_sq = torch.zeros(40, 1)  # as the row-wise Adagrad optimiser gives it (xc/train/optim.py)
    plain.load_state_dict(state)
    released.load_state_dict(mapped, copy=ckpt.copy_mapped)
    for a, b in ((plain.weight, released.weight), (plain.master, released.master), (plain.row_sq, released.row_sq)):
        assert torch.equal(a, b)
    assert torch.equal(released.master, rows)


def test_classifier_rows_load_into_a_given_tensor_with_its_padding_zeroed(tmp_path):
    """load_classifier_rows(out=...) (a live shard's rows, another dtype): the rows of every rank file by label id,
    the padding rows past num_labels zeroed whatever `out` held, the same values as the new tensor it returns
    without `out`."""
    src = _write(tmp_path, 3, LAYOUT2, 2, hard_k=4)
    meta = ckpt.validate(src)
    fresh = ckpt.load_classifier_rows(src, meta, 40, 112, num_labels=100)
    out = torch.full((72, fresh.shape[1]), 7.0, dtype=torch.float64)
    assert ckpt.load_classifier_rows(src, meta, 40, 112, num_labels=100, out=out) is out
    assert torch.equal(out, fresh.double()) and not out[60:].any()


def test_copy_mapped_leaves_a_tensor_that_is_not_mapped_from_a_file_whole(monkeypatch):
    """An anonymous source (a re-split resume's stitched rows) is copied plainly: letting its pages go would zero it,
    and a shard with masters reads it twice."""
    monkeypatch.setattr(ckpt, "COPY_BLOCK_BYTES", 4096)
    src = torch.randn(512, 64)
    kept = src.clone()
    dst = torch.zeros_like(src)
    ckpt.copy_mapped(dst, src)
    assert torch.equal(src, kept) and torch.equal(dst, kept)
