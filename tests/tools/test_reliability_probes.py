"""tools/reliability_probes.py: the classifier its 36 probes share (tracebacks found, torchrun's own left out;
LOSS from file hashes before and after; SILENT only with exit 0), on fabricated outputs; no probe is run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rp():
    spec = importlib.util.spec_from_file_location("reliability_probes", REPO / "tools" / "reliability_probes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reliability_probes"] = module
    spec.loader.exec_module(module)
    return module


XC_TRACEBACK = """\
12:00:01 [rank0] INFO xc.train.trainer: training synthetic-astra
Traceback (most recent call last):
  File "/work/main/xc/fitting/knn.py", line 88, in query_blocks
    sums = np.add.reduceat(values, starts)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
IndexError: index 12 out of bounds for axis 0 with size 12
"""

CHAINED = """\
Traceback (most recent call last):
  File "x.py", line 3, in write
    f.write(b)
OSError: [Errno 28] No space left on device

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "torch/serialization.py", line 672, in save
RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 123
"""

HYDRA = """\
Error executing job with overrides: ['run_dir=/ro/run']
Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""

TORCHRUN_SUMMARY = """\
error: rank 0: rank 1 (pid 4242) has exited mid-run, so this rank stops too
Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/torch/distributed/run.py", line 905, in main
    run(args)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
xc.cli.train FAILED
Traceback (most recent call last):
  File "/usr/lib/python3/site-packages/torch/distributed/elastic/agent/server/api.py", line 1, in _invoke_run
torch.distributed.elastic.multiprocessing.api.SignalException: Process 10592 got signal: 15
"""


def test_tracebacks_are_found_with_their_last_line_and_the_launchers_are_left_out(rp):
    assert rp.find_tracebacks(XC_TRACEBACK) == ["IndexError: index 12 out of bounds for axis 0 with size 12"]
    assert rp.find_tracebacks(CHAINED) == ["OSError: [Errno 28] No space left on device",
                                           "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 123"]
    assert rp.find_tracebacks(HYDRA) == ["Error executing job with overrides: ['run_dir=/ro/run']"]
    assert rp.find_tracebacks(TORCHRUN_SUMMARY) == []  # torchrun's own summary: the launcher's output
    assert rp.find_tracebacks(TORCHRUN_SUMMARY + XC_TRACEBACK) == [
        "IndexError: index 12 out of bounds for axis 0 with size 12"]
    # a one-line message that mentions a traceback is not one
    assert rp.find_tracebacks("error: could not write the lock /r/.lock: read-only file system\n"
                              "warning: no traceback here; see docs/reliability.md\n") == []


def test_a_traceback_is_classified_traceback_and_a_one_line_error_clean_or_failed(rp):
    outcome, detail = rp.classify(1, "some output\n" + XC_TRACEBACK)
    assert outcome == rp.TRACEBACK and "IndexError" in detail and detail.startswith("1 traceback")
    assert rp.classify(2, HYDRA)[0] == rp.TRACEBACK
    assert rp.classify(2, "error: config run_dir: / is the filesystem's root", clean="refused") == (rp.CLEAN, "refused")
    assert rp.classify(2, "error: x", failed="readers gave up 3 of 10") == (rp.FAILED, "readers gave up 3 of 10")
    # a traceback outranks FAILED: it is what the user saw
    assert rp.classify(1, XC_TRACEBACK, failed="no metrics")[0] == rp.TRACEBACK


def test_a_wrong_answer_is_silent_only_with_exit_0_and_no_word(rp):
    assert rp.classify(0, "P@1=94.00", wrong="another run's fusion applied") == (rp.SILENT, "another run's fusion applied")
    outcome, detail = rp.classify(2, "error: holds no xc run", wrong="wrote .lock before refusing")
    assert outcome == rp.FAILED and "exit 2" in detail and "holds no xc run" in detail
    assert rp.classify(0, XC_TRACEBACK, wrong="x")[0] == rp.TRACEBACK  # it did say something: a traceback


def test_loss_is_a_users_file_changed_or_removed_by_hash(rp, tmp_path):
    folder = tmp_path / "mine"
    (folder / "archive").mkdir(parents=True)
    (folder / "config.json").write_text('{"mine": 1}\n')
    (folder / "metrics.json").write_text('{"acc": 0.9}\n')
    (folder / "archive" / "notes.txt").write_text("keep\n")
    before = rp.file_hashes(folder)
    assert set(before) == {"config.json", "metrics.json", "archive/notes.txt"}

    (folder / ".lock").write_text("pid 1\n")  # something added: not a loss by itself
    after = rp.file_hashes(folder)
    assert rp.hash_changes(before, after) == ([], [], [".lock"])
    assert rp.classify(2, "error: refused", before=before, after=after, clean="ok")[0] == rp.CLEAN

    (folder / "config.json").write_text('{"name": "synthetic-astra"}\n')  # same path, other bytes
    (folder / "archive" / "notes.txt").unlink()
    after = rp.file_hashes(folder)
    outcome, detail = rp.classify(0, "final P@1=90.00", before=before, after=after, wrong="exit 0")
    assert outcome == rp.LOSS
    assert "config.json overwritten" in detail and "archive/notes.txt removed" in detail
    # LOSS outranks a traceback and a silent write
    assert rp.classify(1, XC_TRACEBACK, before=before, after=after)[0] == rp.LOSS

    same = tmp_path / "same"
    same.mkdir()
    (same / "metrics.json").write_text('{"acc": 0.9}\n')
    assert rp.file_hashes(same)["metrics.json"] == before["metrics.json"]  # by content, not by path or time


def test_error_line_is_the_first_error_else_the_last_line(rp):
    assert rp.error_line("INFO a\nerror: config run_dir: x\nmore\n") == "error: config run_dir: x"
    assert rp.error_line("INFO a\n\nlast words\n\n") == "last words"
    assert rp.error_line("") == "(no output)"


def test_the_36_probes_of_the_two_rounds_are_listed(rp, capsys):
    names = [p.name for p in rp.PROBES]
    assert len(names) == len(set(names)) == 36
    assert sum(p.round == 2 for p in rp.PROBES) == sum(p.round == 3 for p in rp.PROBES) == 18
    assert {p.kind for p in rp.PROBES} <= {rp.LOSS, rp.SILENT, rp.TRACEBACK}
    assert all(p.name.startswith(f"r{p.round}_") for p in rp.PROBES)
    assert rp.main(["--list"]) == 0 and len(capsys.readouterr().out.splitlines()) == 36
    assert rp.main(["--only", "no_such_probe"]) == 2  # refused before anything runs
