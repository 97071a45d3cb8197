"""The xc-data command: convert, inspect, generate, and clean error reporting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xc.data import open_dataset
from xc.data.cli import frequency_histogram, main

REPO = Path(__file__).resolve().parents[3]
TRAIN = "3 4 3\n0,2 0:1 3:2\n1 1:1\n 2:1\n"
TEST = "1 4 3\n2 0:1\n"


def xc_dir(d: Path, train: str = TRAIN) -> str:
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.txt").write_text(train)
    (d / "test.txt").write_text(TEST)
    return str(d)


def test_convert_writes_cache_and_prints_counts(tmp_path, capsys):
    src = xc_dir(tmp_path / "src")
    assert main(["convert", "--kind", "xc_sparse", "--path", src, "--cache", str(tmp_path / "c")]) == 0
    cap = capsys.readouterr()
    assert "converted into" in cap.err and "train: points 3  label nnz 3" in cap.out
    (entry,) = [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    assert open_dataset(str(entry)).train.features.nnz == 4


def test_inspect_without_cache_leaves_nothing_and_shows_histogram(tmp_path, capsys):
    src = xc_dir(tmp_path / "src")
    assert main(["inspect", "--kind", "xc_sparse", "--path", src]) == 0
    out = capsys.readouterr().out
    assert "labels: 3   features: 4" in out
    assert "avg labels/point 1.00" in out and "avg points/label 1.00" in out
    assert "points without labels 1" in out
    hist = out.split("log2 bins):\n")[1].splitlines()
    assert [h.split("|")[1].split()[0] for h in hist] == ["0", "3"]  # all 3 labels occur once
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_inspect_json(tmp_path, capsys):
    src = xc_dir(tmp_path / "src")
    assert main(["inspect", "--kind", "xc_sparse", "--path", src, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["num_labels"] == 3 and st["train"]["label_nnz"] == 3 and st["train"]["feature_nnz"] == 4
    assert st["test"]["points"] == 1 and st["train"]["points_without_labels"] == 1


def test_frequency_histogram_bins():
    lines = frequency_histogram(np.array([0, 0, 1, 2, 3, 4, 9, 1000]))
    counts = {ln.split("|")[0].strip(): int(ln.split("|")[1].split()[0]) for ln in lines}
    assert counts == {"0": 2, "1": 1, "2-3": 2, "4-7": 1, "8-15": 1, "16-31": 0, "32-63": 0, "64-127": 0,
                      "128-255": 0, "256-511": 0, "512-1023": 1}


def test_generate_then_inspect(tmp_path, capsys):
    out_dir = str(tmp_path / "g")
    assert main(["generate", "--out", out_dir, "--num-train", "500", "--num-test", "200",
                 "--num-labels", "300", "--num-features", "1000", "--label-noise", "0.2", "--seed", "7"]) == 0
    cap = capsys.readouterr()
    assert "generated" in cap.err and "oracle_p1:" in cap.out
    ds = open_dataset(out_dir)
    assert (ds.train.num_points, ds.test.num_points, ds.num_labels) == (500, 200, 300)
    assert ds.meta["generator"]["seed"] == 7 and ds.meta["generator"]["label_noise"] == 0.2
    assert main(["inspect", "--kind", "synthetic", "--path", out_dir]) == 0
    assert "train: points 500" in capsys.readouterr().out


@pytest.mark.parametrize("argv_tail,needle", [
    (["inspect", "--kind", "xc_sparse"], "train.txt:3: label id:"),
    (["generate", "--num-labels", "0"], "synthetic.num_labels"),
])
def test_errors_exit_2_without_traceback(tmp_path, capsys, argv_tail, needle):
    src = xc_dir(tmp_path / "src", train="2 4 3\n0 1:1\n7 2:1\n")
    argv = argv_tail + (["--path", src] if argv_tail[0] == "inspect" else ["--out", str(tmp_path / "g")])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err


def test_module_entry_point_reports_errors_cleanly(tmp_path):
    src = xc_dir(tmp_path / "src", train="2 4 3\n0 1:1\n")
    cmd = [sys.executable, "-m", "xc.data.cli", "inspect", "--kind", "xc_sparse", "--path", src]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    expected = f"error: {src}/train.txt:1: row count: header declares 2 rows but the file has only 1"
    assert proc.stderr.strip() == expected


def test_verify_on_the_cache_root_walks_every_dataset_below_it(tmp_path, capsys):
    """xc-train keeps each dataset two levels under the cache root (`.cache/xc-data/<data.name>/<key>/`); verify on
    the root looked one level down only, found no meta.json and exited 2 on a good cache."""
    root = tmp_path / "xc-data"
    for name in ("one", "two"):
        assert main(["convert", "--kind", "xc_sparse", "--path", xc_dir(tmp_path / f"src-{name}"),
                     "--cache", str(root / name)]) == 0
    (root / "one" / ".tmp-half-written").mkdir()  # a conversion in progress is not a dataset
    capsys.readouterr()
    assert main(["verify", str(root)]) == 0
    cap = capsys.readouterr()
    oks = [line for line in cap.out.splitlines() if line.startswith("ok: ")]
    assert len(oks) == 2 and all(str(root / n) in line for n, line in zip(("one", "two"), oks))
    assert "2 of 2 dataset(s) intact" in cap.err
    # one damaged file: that dataset is named, the other still reported intact, exit 2
    (damaged,) = [p for p in (root / "two").iterdir() if not p.name.startswith(".")]
    (damaged / "train.labels.indices.npy").write_bytes(b"x")
    assert main(["verify", str(root)]) == 2
    cap = capsys.readouterr()
    assert f"delete {damaged}" in cap.err and "1 of 2 dataset(s) intact" in cap.err and cap.out.count("ok: ") == 1
    assert main(["verify", str(tmp_path / "src-one")]) == 2  # no dataset anywhere below: one line, exit 2
    assert "holds no dataset directory" in capsys.readouterr().err
