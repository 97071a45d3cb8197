"""Keeping the best epoch on validation (xc/eval/epoch_select.py): the one-standard-error choice, its state through a
checkpoint, the best checkpoint kept past pruning, and which checkpoint a finished run's model is."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
import torch

from xc.run import checkpoint as ckpt
from xc.distributed import DistContext
from xc.eval.epoch_select import EpochSelector
from xc.eval.metrics import paired_gain


class _Logger:
    def __init__(self):
        self.events = []

    def event(self, name, **fields):
        self.events.append((name, fields))


def _selector(per_epoch: list[np.ndarray], enabled: bool = True) -> EpochSelector:
    """A selector that has seen one epoch per array (each the validation rows' per-point figures)."""
    feed = iter(per_epoch)
    sel = EpochSelector(enabled, lambda: next(feed), DistContext(), _Logger())
    for epoch in range(1, len(per_epoch) + 1):
        sel.after_epoch(epoch, 10 * epoch)
    return sel


def test_paired_gain_is_the_mean_difference_and_its_standard_error():
    better, base = np.array([1.0, 0.0, 1.0, 1.0]), np.array([0.0, 0.0, 1.0, 0.0])
    gain, se = paired_gain(better, base)
    diff = better - base
    assert gain == pytest.approx(100 * 0.5)
    assert se == pytest.approx(100 * diff.std(ddof=1) / 2)


def test_an_earlier_epoch_is_kept_only_when_it_beats_the_last_by_more_than_one_se():
    rng = np.random.default_rng(0)
    last = rng.random(400)
    clear = np.clip(last + 0.05 + 0.01 * rng.standard_normal(400), 0, None)  # +5 points, SE ~0.05
    choice = _selector([last * 0.5, clear, last]).choose()
    assert choice["kept"]["epoch"] == 2 and choice["best"]["epoch"] == 2 and choice["last"]["epoch"] == 3
    assert choice["gain"] > choice["gain_se"] > 0
    assert [row["epoch"] for row in choice["epochs"]] == [1, 2, 3]
    noisy = last.copy()
    noisy[:20] += 0.02  # a hair better in mean, well inside one SE of the paired difference
    noisy[20:38] -= 0.02
    choice = _selector([noisy, last]).choose()
    assert choice["best"]["epoch"] == 1 and choice["kept"]["epoch"] == 2
    assert 0 < choice["gain"] <= choice["gain_se"]


def test_the_last_epoch_is_kept_when_it_is_the_best_and_ties_keep_the_earlier():
    points = np.linspace(0, 1, 50)
    choice = _selector([points * 0.5, points]).choose()
    assert choice["kept"]["epoch"] == 2 and choice["gain"] == 0.0
    choice = _selector([points, points]).choose()
    assert choice["best"]["epoch"] == 1 and choice["kept"]["epoch"] == 2  # equal: no gain, the last stays


def test_epochs_since_the_best_count_what_patience_stops_on():
    """eval.select_epoch_patience stops a run once this reaches it: 0 while the newest epoch is the best (a tie keeps
    the earlier one best), the epochs after the best otherwise, and 0 when nothing is selected."""
    up, down = np.linspace(0, 1, 50), np.linspace(0, 0.5, 50)
    assert _selector([down, up]).epochs_since_best() == 0
    assert _selector([down, up, down, up, down]).epochs_since_best() == 3  # epoch 4 ties epoch 2: 2 stays the best
    assert _selector([up, down, down, up * 1.01]).epochs_since_best() == 0
    assert _selector([up, down], enabled=False).epochs_since_best() == 0
    assert EpochSelector(True, lambda: up, DistContext(), _Logger()).epochs_since_best() == 0


def test_off_or_without_validation_nothing_is_chosen():
    assert _selector([np.ones(4)], enabled=False).choose() is None
    sel = EpochSelector(False, lambda: np.zeros(0), DistContext(), _Logger())  # no validation rows: not enabled
    sel.after_epoch(1, 10)
    assert sel.choose() is None and sel.protected_step() is None


def test_the_selector_state_survives_a_checkpoint():
    rng = np.random.default_rng(1)
    sel = _selector([rng.random(30), rng.random(30), rng.random(30)])
    buffer = io.BytesIO()
    torch.save({"selector": sel.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)["selector"]  # as the trainer's checkpoints are read
    again = _selector([np.zeros(30)], enabled=True)
    again.load_state_dict(state)
    assert again.choose() == sel.choose() and again.protected_step() == sel.protected_step()


def _publish(run_dir, step, keep=2, protect=None):
    digests = ckpt.write_rank_files(run_dir, step, 0, {"global_step": step, "w": torch.full((2,), float(step))}, None)
    return ckpt.publish(run_dir, step, 1, {"config": {}}, keep=keep, crc32=digests, protect=protect)


def test_pruning_keeps_the_protected_best_checkpoint(tmp_path):
    for step in (10, 20, 30, 40):
        _publish(tmp_path, step, keep=2, protect=10)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000010", "step-00000030", "step-00000040"]
    _publish(tmp_path, 50, keep=2, protect=40)  # a newer best: the old one may go
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000040", "step-00000050"]


def _select(run_dir, kept: int, last: int):
    selection = {"kept": {"global_step": kept}, "last": {"global_step": last}}
    (run_dir / ckpt.SELECTION_FILE).write_text(json.dumps(selection))


def test_final_checkpoint_is_the_kept_epoch_unless_the_selection_is_stale_or_damaged(tmp_path, caplog):
    for step in (10, 20, 30):
        _publish(tmp_path, step, keep=5)
    assert ckpt.final_checkpoint(tmp_path)[0].name == "step-00000030"  # no selection: the newest
    _select(tmp_path, kept=10, last=30)
    path, meta = ckpt.final_checkpoint(tmp_path)
    assert path.name == "step-00000010" and meta["global_step"] == 10
    _select(tmp_path, kept=10, last=20)  # made before the run trained on to step 30
    assert ckpt.final_checkpoint(tmp_path)[0].name == "step-00000030"
    _select(tmp_path, kept=10, last=30)
    rank0 = ckpt.step_dir(tmp_path, 10) / "rank0.pt"
    rank0.write_bytes(rank0.read_bytes()[:50])
    with caplog.at_level(logging.WARNING, logger="xc.run.checkpoint"):
        assert ckpt.final_checkpoint(tmp_path)[0].name == "step-00000030"
    assert "kept epoch's checkpoint step-00000010 is unusable" in caplog.text
    (tmp_path / ckpt.SELECTION_FILE).write_text("{")
    assert ckpt.final_checkpoint(tmp_path)[0].name == "step-00000030"


@pytest.mark.parametrize("served_gain", [+0.10, -0.05, 0.0])
def test_an_earlier_epoch_that_leads_plainly_is_judged_again_as_served(tmp_path, monkeypatch, served_gain):
    """The 10^6 case: the best plain epoch leads the last beyond one SE, but each model is served under the
    prior validation chooses for it. The served figures decide (one-SE rule again); the weights end as the kept
    epoch's, and the kept model's prior choice is handed on."""
    from xc.fitting.label_prior import PriorChoice

    rng = np.random.default_rng(2)
    last = rng.random(400) * 0.5
    best = np.clip(last + 0.05 + 0.01 * rng.standard_normal(400), 0, None)  # plainly ahead, SE ~0.05 points
    sel = _selector([best, last])
    assert sel.choose()["kept"]["epoch"] == 1  # the plain rule alone keeps epoch 1
    for step in (10, 20):
        _publish(tmp_path, step, keep=5)
    loaded = ["step-00000020"]  # the weights the model holds: the last epoch's at the end of training
    served = {"step-00000020": (last + 0.2, PriorChoice(0.75, 400, None, None, [])),  # the last gains more
              "step-00000010": (last + 0.2 + served_gain + 0.001 * rng.standard_normal(400),
                                PriorChoice(-0.5, 400, None, None, []))}
    choice = sel.finish(tmp_path, lambda path: loaded.append(path.name), lambda: served[loaded[-1]])
    keep_best = served_gain > 0.01
    assert choice["kept"]["epoch"] == (1 if keep_best else 2)
    assert loaded[-1] == ("step-00000010" if keep_best else "step-00000020")
    assert sel.kept_prior.beta == (-0.5 if keep_best else 0.75)
    assert choice["served"]["last_beta"] == 0.75 and choice["served"]["best_beta"] == -0.5
    assert json.loads((tmp_path / ckpt.SELECTION_FILE).read_text())["kept"]["epoch"] == choice["kept"]["epoch"]
    # without a calibration (the prior off) the plain choice stands, and no prior is handed on
    sel = _selector([best, last])
    loaded[:] = ["step-00000020"]
    assert sel.finish(tmp_path, lambda path: loaded.append(path.name))["kept"]["epoch"] == 1
    assert loaded[-1] == "step-00000010" and sel.kept_prior is None


def test_the_gain_over_the_best_epoch_before_is_paired_and_in_points():
    """What train.epochs_by_validation reads (xc/train/schedule.py): the newest epoch's mean gain over the best epoch
    before it (not merely the one before) and its standard error, in points of mean P@k."""
    from types import SimpleNamespace

    from xc.eval.epoch_select import EpochSelector

    figures = iter([np.array([0.5, 0.5, 0.0, 1.0]), np.array([0.75, 0.5, 0.25, 1.0]), np.array([0.5, 0.5, 0.0, 1.0]),
                    np.array([0.75, 0.75, 0.25, 1.0])])
    logged = []
    selector = EpochSelector(True, lambda: next(figures), SimpleNamespace(is_main=True),
                             SimpleNamespace(event=lambda *a, **k: logged.append(a)))
    selector.after_epoch(1, 10)
    assert selector.gain_over_best is None  # nothing before epoch 1
    selector.after_epoch(2, 20)
    gain, se = selector.gain_over_best
    # differences 0.25, 0, 0.25, 0: mean 0.125 = 12.5 points; sample SD 0.1443, SE 0.0722 = 7.22 points
    assert gain == pytest.approx(12.5) and se == pytest.approx(100 * np.std([0.25, 0, 0.25, 0], ddof=1) / 2)
    selector.after_epoch(3, 30)  # back to epoch 1's figures: -12.5 against epoch 2, the best
    assert selector.gain_over_best[0] == pytest.approx(-12.5)
    selector.after_epoch(4, 40)  # against epoch 2 (the best), not epoch 3: differences 0, 0.25, 0, 0
    gain, se = selector.gain_over_best
    assert gain == pytest.approx(6.25) and se == pytest.approx(100 * np.std([0, 0.25, 0, 0], ddof=1) / 2)


def test_a_finished_run_keeps_the_checkpoint_it_serves_and_its_newest(tmp_path, monkeypatch):
    """prune_finished: the kept epoch's checkpoint (what serving loads) and the newest (what a rerun resumes from and
    dates the selection) stay, every other goes; with no selection, or a stale one, only the newest stays. Each kept
    file's checksum is read once (at 10^7 labels a checkpoint is 9.6 GB)."""
    for step in (10, 20, 30, 40):
        _publish(tmp_path, step, keep=5)
    _select(tmp_path, kept=20, last=40)
    read, crc32_file = [], ckpt.crc32_file
    monkeypatch.setattr(ckpt, "crc32_file", lambda path: read.append(path) or crc32_file(path))
    removed = ckpt.prune_finished(tmp_path)
    assert len(read) == len(set(read)) == 2
    assert [p.name for p in removed] == ["step-00000010", "step-00000030"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000020", "step-00000040"]
    assert ckpt.final_checkpoint(tmp_path)[0].name == "step-00000020"  # still what the run serves
    assert not [p for p in ckpt.checkpoint_root(tmp_path).iterdir() if p.name.endswith(".tmp")]
    _select(tmp_path, kept=20, last=30)  # stale: made before step 40
    assert [p.name for p in ckpt.prune_finished(tmp_path)] == ["step-00000020"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000040"]
    assert ckpt.prune_finished(tmp_path) == []
    assert ckpt.prune_finished(tmp_path / "none") == []  # no checkpoint at all: nothing to do
