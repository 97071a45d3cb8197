"""Whose run a named checkpoint is (xc/run/identity.py `checkpoint_of_another_run`): the run's kNN fusion, ranker and
label prior are applied only to the run's own checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xc.errors import CheckpointError
from xc.run.identity import checkpoint_of_another_run


def _identity(labels: int = 800, content: str = "abc", embed: int = 64) -> dict:
    return {"version": 1, "data": {"num_labels": labels, "num_features": 20, "content": content},
            "config": {"model.embed_dim": embed}}


def _run(root: Path, name: str, identity: dict) -> Path:
    run = root / name
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run / "identity.json").write_text(json.dumps(identity))
    return run


def _meta(identity: dict) -> dict:
    return {"layout": {"num_labels": identity["data"]["num_labels"]}, "identity": identity}


def test_the_runs_own_checkpoint_and_its_ensemble_members_are_its_own(tmp_path):
    run = _run(tmp_path, "A", _identity())
    assert checkpoint_of_another_run(run, run / "checkpoints" / "step-00000010", _meta(_identity())) is None
    member = run / "members" / "m0" / "checkpoints" / "step-00000010"
    member.mkdir(parents=True)
    assert checkpoint_of_another_run(run, member, _meta(_identity())) is None
    loose = tmp_path / "backup" / "step-00000010"  # a copy kept outside any run: judged by its identity
    loose.mkdir(parents=True)
    assert checkpoint_of_another_run(run, loose, _meta(_identity())) is None


def test_a_checkpoint_of_another_run_directory_or_identity_is_anothers(tmp_path):
    run = _run(tmp_path, "A", _identity())
    other = _run(tmp_path, "B", _identity())  # the same data and model, trained separately
    why = checkpoint_of_another_run(run, other / "checkpoints" / "step-00000010", _meta(_identity()))
    assert why == f"it lies in another run directory, {other.resolve()}"
    loose = tmp_path / "backup" / "step-00000010"
    loose.mkdir(parents=True)
    why = checkpoint_of_another_run(run, loose, _meta(_identity(embed=32)))
    assert why == "model.embed_dim was 64, this run sets 32"
    why = checkpoint_of_another_run(run, loose, _meta(_identity(content="xyz")))
    assert "other content" in why


def test_another_number_of_labels_is_refused_naming_both(tmp_path):
    run = _run(tmp_path, "A", _identity())
    other = _run(tmp_path, "C", _identity(labels=700))
    with pytest.raises(CheckpointError) as info:
        checkpoint_of_another_run(run, other / "checkpoints" / "step-00000010", _meta(_identity(labels=700)))
    assert "has 700 labels and the run in" in str(info.value) and "has 800" in str(info.value)
    assert f"its own run directory ({other.resolve()})" in str(info.value)
