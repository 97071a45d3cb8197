"""`xc-train data.kind=arff` on ARFF as MULAN ships it: nominal features (birds' multi-valued location,
genbase's {YES,NO} motifs), a string and an identifier attribute, {YES,NO} labels; a date attribute stops
the run with one line naming file, line and attribute."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, run_cli
from tests.format_writers import write_mulan_xml
from tests.integration.test_own_formats import ARGS

pytestmark = pytest.mark.slow  # a subprocess or multi-process run: `pytest -m slow` (.ci/run runs both)

LOCATIONS = ["2", "10", "1", "4", "7", "3", "12"]  # declared out of order, as birds does


def _mulan_like(rng, n, first_id):
    """n rows of (label sets [n x 6] bool, motifs [n x 12] bool, location codes, numeric features [n x 4]):
    label j is relevant when motif j is present or the location is the j-th declared one."""
    motifs = rng.random((n, 12)) < 0.3
    loc = rng.integers(0, len(LOCATIONS), n)
    numbers = np.round(rng.random((n, 4)) * 3, 2)
    labels = motifs[:, :6] | (loc[:, None] == np.arange(6))
    return labels, motifs, loc, numbers, [f"P{first_id + k:04d}" for k in range(n)]


def _write_mulan(path, parts, protein_ids, sparse):
    labels, motifs, loc, numbers, ids = parts
    attrs = [f"@attribute protein {{{','.join(protein_ids)}}}", "@attribute 'note' string",
             f"@attribute location {{{','.join(LOCATIONS)}}}"]
    attrs += [f"@attribute f{k} numeric" for k in range(4)] + [f"@attribute PS{k:05d} {{YES,NO}}" for k in range(12)]
    attrs += [f"@attribute 'bird {j}' {{0,1}}" for j in range(6)]
    lines = ["@relation mulan-like", *attrs, "@data"]
    for r in range(len(ids)):
        values = [ids[r], f"'seen at {r}, dusk'", LOCATIONS[loc[r]], *map(str, numbers[r]),
                  *("YES" if m else "NO" for m in motifs[r]), *("1" if x else "0" for x in labels[r])]
        if sparse:  # Weka's sparse form: values at the first declared one (protein P0000, location 2, YES, 0) left out
            first = {0: "P0000", 2: LOCATIONS[0], **{7 + k: "YES" for k in range(12)}}
            items = [f"{i} {v}" for i, v in enumerate(values) if v != first.get(i, "0")]
            lines.append("{" + ",".join(items) + "}")
        else:
            lines.append(",".join(values))
    path.write_text("\n".join(lines) + "\n")


def test_mulan_style_arff_with_nominal_string_and_identifier_attributes_trains_with_the_defaults(tmp_path):
    rng = np.random.default_rng(0)
    train, test = _mulan_like(rng, 300, 0), _mulan_like(rng, 120, 300)
    protein_ids = train[4] + test[4]  # declared in both files, as MULAN's genbase does: 420 values for 300 rows
    src = tmp_path / "genbirds"
    src.mkdir()
    _write_mulan(src / "genbirds-train.arff", train, protein_ids, sparse=False)
    _write_mulan(src / "genbirds-test.arff", test, protein_ids, sparse=True)
    write_mulan_xml(src / "genbirds.xml", [f"bird {j}" for j in range(6)])
    run_dir = tmp_path / "run"
    proc = run_cli(["data.kind=arff", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
                    f"run_dir={run_dir}", "logger.wandb=disabled", "logger.progress=false"], cwd=REPO)
    out = proc.stdout + proc.stderr
    assert "final P@1=" in proc.stdout, out[-3000:]
    skipped = [line for line in out.splitlines() if "attributes skipped" in line]
    assert len(skipped) == 1 and "string: note" in skipped[0] and "protein (420 values)" in skipped[0], skipped
    meta = json.loads(next((tmp_path / "cache").glob("*/arff-*/meta.json")).read_text())
    assert (meta["num_labels"], meta["num_features"]) == (6, 7 + 4 + 12)  # location one-hot, motifs one column each
    model_p1 = json.loads((run_dir / "metrics.json").read_text())["P@1"]
    popularity_p1 = 100.0 * test[0][:, train[0].sum(0).argmax()].mean()
    assert model_p1 > popularity_p1 + 10, (model_p1, popularity_p1)  # it learned from the nominal features


def _write_binary(path, labels, features, words, sparse):
    """2 labels and 10 binary features, declared {YES,NO} (words) or {0,1}; labels last (MEKA's -C -2)."""
    yes, no = ("YES", "NO") if words else ("1", "0")
    decl = "{YES,NO}" if words else "{0,1}"
    attrs = [f"@attribute g{k} {decl}" for k in range(features.shape[1])]
    attrs += [f"@attribute tag{j} {decl}" for j in range(labels.shape[1])]
    lines = ["@relation 'binary: -C -2'", *attrs, "@data"]
    for row in np.hstack([features, labels]):
        if sparse:  # left out: the first declared value, YES of {YES,NO} and 0 of {0,1}
            lines.append("{" + ",".join(f"{i} {yes if v else no}" for i, v in enumerate(row) if v != words) + "}")
        else:
            lines.append(",".join(yes if v else no for v in row))
    path.write_text("\n".join(lines) + "\n")


def test_yes_no_labels_and_features_train_exactly_like_zero_one(tmp_path):
    rng = np.random.default_rng(5)
    features = rng.random((600, 10)) < 0.4
    labels = np.stack([features[:, 0] | features[:, 1], features[:, 2] & ~features[:, 3]], axis=1)
    labels[rng.random(600) < 0.1] ^= True  # some noise, so that the metrics are not all 100
    metrics = {}
    for name, words, sparse in (("zero_one", False, False), ("yes_no", True, False), ("yes_no_sparse", True, True)):
        src = tmp_path / name
        src.mkdir()
        for split, rows in (("train", slice(0, 450)), ("test", slice(450, 600))):
            _write_binary(src / f"{split}.arff", labels[rows], features[rows], words, sparse)
        run_dir = tmp_path / f"run-{name}"
        proc = run_cli([*ARGS, "data.kind=arff", f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}",
                        f"run_dir={run_dir}"], cwd=REPO)
        assert "final P@1=" in proc.stdout, proc.stdout[-2000:]
        metrics[name] = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["zero_one"]["P@1"] > 50
    assert metrics["yes_no"] == metrics["zero_one"]
    assert metrics["yes_no_sparse"] == metrics["zero_one"]


def test_a_date_attribute_stops_the_run_with_one_line(tmp_path):
    src = tmp_path / "dated"
    src.mkdir()
    header = ("@relation 'dated: -C 1'\n@attribute tag {0,1}\n@attribute x numeric\n"
              "@attribute seen DATE \"yyyy-MM-dd\"\n")
    for split in ("train", "test"):
        (src / f"{split}.arff").write_text(header + "@data\n1,0.5,'2024-01-02'\n")
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", "data.kind=arff", f"data.path={src}",
                           f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}",
                           "logger.wandb=disabled"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {src / 'train.arff'}:4: attribute seen: date attributes are not supported: declare it numeric "
        "(e.g. seconds since 1970) or string (then it is skipped)"], proc.stderr[-2000:]
