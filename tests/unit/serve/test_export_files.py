"""Reading an export (xc/serve/export_files.py, xc/serve/export.py load_export): a manifest that names files
outside the folder, links, edited files whose checksums were recomputed, and a pickle in place of safetensors are
each refused in one line naming the file and the field. The export here is built by hand (a 6-label bag-of-words
model, no training); exports of trained runs: tests/integration/test_export.py."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from xc.config import XCConfig, to_dict
from xc.defaults import resolve
from xc.errors import CheckpointError
from xc.models import build_encoder
from xc.serve.export import load_export
from xc.serve.export_files import FORMAT, MANIFEST, SELF_CHECKSUM, VERSION, seal

L, F = 6, 12


def tiny_export(folder: Path, extra_files: dict | None = None) -> Path:
    """A complete export of an untrained 6-label, 12-feature bag-of-words model (layout of xc/serve/export.py)."""
    raw = to_dict(XCConfig())
    raw["model"].update(embed_dim=8, hidden_dims=[], dropout=0.0)
    (folder / "model").mkdir(parents=True)
    from xc.config import build_config

    cfg = resolve(build_config(raw), 50, L, F, "cpu", 1, 3.0)
    encoder = build_encoder(cfg.model, F)
    tensors = {f"encoder.{k}": v.clone() for k, v in encoder.state_dict().items()}
    tensors["classifier.weight"] = torch.randn(L, encoder.out_dim)
    tensors["classifier.log_counts"] = torch.zeros(L)
    save_file(tensors, str(folder / "model" / "model.safetensors"))
    (folder / "model" / "config.json").write_text(json.dumps({
        "config": raw, "num_label_shards": 1, "checkpoint": "step-00000005", "global_step": 5, "prior_beta": None,
        "resolve": {"num_points": 50, "features_per_row": 3.0}}))
    (folder / "prior.json").write_text(json.dumps({"beta": 0.0}))
    (folder / "label_names.json").write_text(json.dumps([f"l{i}" for i in range(L)]))
    for name, text in (extra_files or {}).items():
        (folder / name).write_text(text)
    seal(folder, {"format": FORMAT, "version": VERSION, "kind": "model", "source": "/runs/tiny", "models": ["model"],
                  "num_labels": L, "num_features": F, "text_features": False, "memory_points": 0})
    return folder


def _reseal(folder: Path, edit=None) -> None:
    """Recompute every checksum after `edit(manifest)`: what someone editing the files by hand would do."""
    manifest = json.loads((folder / MANIFEST).read_text())
    if edit is not None:
        edit(manifest)
    fields = {k: v for k, v in manifest.items() if k not in ("files", SELF_CHECKSUM)}
    names = manifest["files"]
    (folder / MANIFEST).unlink()
    sealed = seal(folder, fields)
    if set(names) != set(sealed["files"]):  # keep the edited list of names, with the sealed checksums
        manifest = dict(sealed, files={n: sealed["files"].get(n, {"bytes": 0, "sha256": ""}) for n in names})
        from xc.serve.export_files import _canonical
        import hashlib

        manifest[SELF_CHECKSUM] = hashlib.sha256(_canonical(manifest)).hexdigest()
        (folder / MANIFEST).write_text(json.dumps(manifest))


def _refused(folder: Path, *words: str) -> str:
    with pytest.raises(CheckpointError) as info:
        load_export(folder)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def test_a_hand_built_export_loads_and_predicts(tmp_path):
    model = load_export(tiny_export(tmp_path / "exp"))
    preds = model.predict(np.eye(F, dtype=np.float32)[:3], k=2)
    assert preds.ids.shape == (3, 2) and preds.names[0][0].startswith("l")


def test_the_manifest_and_every_file_carry_a_sha256(tmp_path):
    folder = tiny_export(tmp_path / "exp")
    manifest = json.loads((folder / MANIFEST).read_text())
    assert len(manifest[SELF_CHECKSUM]) == 64
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    manifest["num_labels"] = 7  # edited without its checksum
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _refused(folder, str(folder / MANIFEST), SELF_CHECKSUM)


@pytest.mark.parametrize("name", ["../outside.txt", "/etc/hostname", "model/../../outside.txt", "", "a//b"])
def test_a_file_name_reaching_outside_the_folder_is_refused(tmp_path, name):
    (tmp_path / "outside.txt").write_text("another folder's file")
    folder = tiny_export(tmp_path / "exp")
    _reseal(folder, lambda m: m["files"].update({name: {"bytes": 21, "sha256": "0" * 64}}))
    _refused(folder, str(folder / MANIFEST), "files", "not a plain file name")


def test_models_naming_another_runs_folder_is_refused(tmp_path):
    folder = tiny_export(tmp_path / "exp")
    _reseal(folder, lambda m: m.update(models=["../../another-run/model"]))
    _refused(folder, "models", "not the model folders")


def test_a_symlink_inside_the_folder_is_refused(tmp_path):
    other = tiny_export(tmp_path / "other")
    folder = tiny_export(tmp_path / "exp")
    target = folder / "label_names.json"
    target.unlink()
    target.symlink_to(other / "label_names.json")
    _reseal(folder)
    _refused(folder, "label_names.json is a symbolic link")
    target.unlink()
    target.write_text((other / "label_names.json").read_text())
    (folder / "model").rename(folder / "model-real")
    (folder / "model").symlink_to(other / "model")
    _refused(folder, "model/config.json is a symbolic link", str(folder / "model"))


def test_edited_json_with_checksums_recomputed_is_one_line(tmp_path):
    folder = tiny_export(tmp_path / "exp")
    info = json.loads((folder / "model" / "config.json").read_text())
    info["global_step"] = "five"
    (folder / "model" / "config.json").write_text(json.dumps(info))
    _reseal(folder)
    _refused(folder, str(folder / "model" / "config.json"), "global_step", "int expected")
    del info["config"]["parallel"]
    info["global_step"] = 5
    (folder / "model" / "config.json").write_text(json.dumps(info))
    _reseal(folder)
    _refused(folder, "config.json", "config")
    folder2 = tiny_export(tmp_path / "exp2")
    (folder2 / "label_names.json").write_text(json.dumps({"0": "a"}))
    _reseal(folder2)
    _refused(folder2, "label_names.json", "a list of 6 label names")
    _reseal(folder2, lambda m: m.update(num_labels="6"))
    _refused(folder2, "num_labels", "int expected")


def test_edited_safetensors_with_checksums_recomputed_is_one_line(tmp_path):
    folder = tiny_export(tmp_path / "exp")
    path = folder / "model" / "model.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    tensors["classifier.weight"] = tensors["classifier.weight"][:4]  # 4 labels where the manifest says 6
    save_file(tensors, str(path))
    _reseal(folder)
    _refused(folder, str(path), "classifier.weight", "shape (4,")
    tensors["classifier.weight"] = torch.zeros(L, 8)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("encoder.")}
    save_file(tensors, str(path))
    _reseal(folder)
    _refused(folder, str(path), "encoder")
    data = bytearray(path.read_bytes())
    data[0:8] = (len(data) * 4).to_bytes(8, "little")  # a header length past the file's end
    path.write_bytes(bytes(data))
    _reseal(folder)
    _refused(folder, str(path), "not a safetensors file")


def test_a_pickle_in_place_of_safetensors_is_one_line_and_never_unpickled(tmp_path, monkeypatch):
    folder = tiny_export(tmp_path / "exp")
    path = folder / "model" / "model.safetensors"
    path.write_bytes(pickle.dumps({"classifier.weight": np.zeros((L, 8))}))
    _reseal(folder)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    assert _refused(folder, str(path)) == f"{path}: not a safetensors file; export the run again"


def test_a_file_the_manifest_does_not_list_is_never_read(tmp_path):
    folder = tiny_export(tmp_path / "exp")
    (folder / "fusion.json").write_text("{not json")  # dropped in afterwards: not the export's
    assert load_export(folder).fusion is None
