"""tools/experiments/bench_peers.py: the peers train on every training point unless --carve-out asks otherwise, and a
peer's process does not outlive the benchmark that spawned it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_peer_dies_with_the_benchmark_that_spawned_it(tmp_path):
    # the benchmark's process spawns a "peer" that would sleep for a minute, prints its pid, and is then killed
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, sys, time
        sys.path.insert(0, {str(REPO / "tools" / "experiments")!r})
        from bench_peers import die_with_parent

        def peer(parent):
            die_with_parent(parent)
            time.sleep(60)

        if __name__ == "__main__":
            proc = mp.get_context("spawn").Process(target=peer, args=(os.getpid(),))
            proc.start()
            time.sleep(3)  # the peer is up and has asked to die with its parent
            print(proc.pid, flush=True)
            time.sleep(60)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive beside its parent
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break  # a zombie: dead, waiting to be reaped by init
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the peer outlived its killed benchmark")
    finally:
        parent.kill()


def _tiny_xc_sparse(root: Path, num_train: int = 60, num_test: int = 20) -> Path:
    """A folder `data.kind=xc_sparse` reads: every point one or two of 6 labels and a few of 12 features."""
    rng = np.random.default_rng(0)
    root.mkdir()
    for split, n in (("train", num_train), ("test", num_test)):
        lines = [f"{n} 12 6"]
        for _ in range(n):
            labels = sorted(rng.choice(6, size=rng.integers(1, 3), replace=False).tolist())
            feats = sorted(rng.choice(12, size=3, replace=False).tolist())
            lines.append(",".join(map(str, labels)) + " " + " ".join(f"{f}:1" for f in feats))
        (root / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return root


def test_the_peers_train_on_every_training_point_unless_asked_for_the_carve_out(tmp_path, monkeypatch):
    from tools.experiments import bench_peers

    data = f"xc_sparse:{_tiny_xc_sparse(tmp_path / 'tiny')}"
    overrides = (f"data.cache_dir={tmp_path / 'cache'}", "data.valid_fraction=0.25")
    whole = bench_peers.prepare(data, carve_out=False, overrides=overrides)
    carved = bench_peers.prepare(data, carve_out=True, overrides=overrides)
    assert whole["x_train"].shape[0] == whole["y_train"].shape[0] == 60
    assert carved["x_train"].shape[0] == carved["y_train"].shape[0] == 45  # 25% held out for xc's validation
    assert whole["x_test"].shape[0] == carved["x_test"].shape[0] == 20

    # The command line: all training points by default, the carve-out on request, --all-train the default's old name.
    seen = []
    monkeypatch.setattr(bench_peers, "prepare", lambda name, carve_out, overrides: seen.append(carve_out) or whole)
    monkeypatch.setattr(bench_peers.importlib.util, "find_spec", lambda module: object())  # installed or not
    monkeypatch.setattr(bench_peers, "spawn_job", lambda ctx, peer, data, k, threads: {
        "train_s": 0.0, "predict_s": 0.0, "peak_rss_mb": 0.0, "ids": np.tile(np.arange(k), (20, 1))})
    for flags, carve_out, trained_on in (([], False, "all training points"),
                                         (["--all-train"], False, "all training points"),
                                         (["--carve-out"], True, "validation carve-out held out")):
        out = tmp_path / f"peers{len(seen)}.json"
        assert bench_peers.main(["--data", data, "--peers", "pecos", "--out", str(out), *flags]) == 0
        assert seen[-1] is carve_out
        report = json.loads(out.read_text())
        assert trained_on in report["trained_on"] and report["results"][0]["train_points"] == 60
    with pytest.raises(SystemExit):
        bench_peers.main(["--data", data, "--all-train", "--carve-out", "--out", str(tmp_path / "x.json")])


def test_a_peers_rankings_are_kept_with_their_test_labels_and_never_over_a_file(tmp_path, monkeypatch):
    """--save-rankings DIR keeps each peer's test top-k (its first run's) with the labels they were judged against,
    as paired_compare.py reads them; a file already there is left as it is and the peer skipped, in one line."""
    from tools.experiments import bench_peers

    truth_indptr, truth_indices = np.array([0, 1, 3]), np.array([2, 0, 1])
    data = {"label": "tiny", "ks": (1, 3, 5), "truth_indptr": truth_indptr, "truth_indices": truth_indices,
            "inv": np.ones(5), "x_train": np.zeros((5, 2)), "x_test": np.zeros((2, 2)), "num_labels": 5}
    runs = iter([np.array([[2, 1, 0, 3, 4], [0, 1, 3, 2, 4]]), np.array([[0, 1, 2, 3, 4], [3, 2, 1, 0, 4]])])
    monkeypatch.setattr(bench_peers, "prepare", lambda name, carve_out, overrides: data)
    monkeypatch.setattr(bench_peers.importlib.util, "find_spec", lambda module: object())
    monkeypatch.setattr(bench_peers, "spawn_job", lambda ctx, peer, data, k, threads: {
        "train_s": 0.0, "predict_s": 0.0, "peak_rss_mb": 0.0, "ids": next(runs)})
    keep = tmp_path / "rankings"
    args = ["--data", "bibtex", "--peers", "pecos", "--runs", "2", "--save-rankings", str(keep)]
    assert bench_peers.main([*args, "--out", str(tmp_path / "a.json")]) == 0
    with np.load(keep / "tiny-pecos.npz") as kept:
        assert kept["ids"].tolist() == [[2, 1, 0, 3, 4], [0, 1, 3, 2, 4]]  # the first run's
        assert kept["truth_indptr"].tolist() == [0, 1, 3] and kept["truth_indices"].tolist() == [2, 0, 1]
        assert str(kept["peer"]) == "pecos" and str(kept["data"]) == "tiny"
    assert [p.name for p in keep.iterdir()] == ["tiny-pecos.npz"]  # no part file left
    before = (keep / "tiny-pecos.npz").read_bytes()
    assert bench_peers.main([*args, "--out", str(tmp_path / "b.json")]) == 0
    assert (keep / "tiny-pecos.npz").read_bytes() == before
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["results"] == [] and "exists" in report["failures"][0]["error"]


def test_a_rankings_folder_that_cannot_be_one_is_refused_before_any_peer_trains(tmp_path, monkeypatch, capsys):
    from tools.experiments import bench_peers

    monkeypatch.setattr(bench_peers, "prepare", lambda *a: pytest.fail("no data is prepared"))
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    for where in (taken, taken / "below"):
        with pytest.raises(SystemExit):
            bench_peers.main(["--data", "bibtex", "--peers", "pecos", "--save-rankings", str(where)])
        assert f"--save-rankings {where}: cannot be a folder here" in capsys.readouterr().err
    assert taken.read_text() == "mine"


def test_rankings_on_a_full_disk_leave_no_file(tmp_path, monkeypatch):
    from tools.experiments import bench_peers

    def full(handle, **arrays):
        handle.write(b"PK")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench_peers.np, "savez", full)
    data = {"label": "tiny", "truth_indptr": np.array([0, 1]), "truth_indices": np.array([0])}
    with pytest.raises(OSError, match="No space left"):
        bench_peers.save_rankings(tmp_path / "tiny-pecos.npz", np.zeros((1, 5), np.int64), data, "pecos")
    assert list(tmp_path.iterdir()) == []
