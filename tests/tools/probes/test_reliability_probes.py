"""tools/probes/reliability_probes.py and its package tools/probes/reliability/: the classifier the 75 probes
share (tracebacks found, torchrun's own left out; LOSS from file hashes before and after; SILENT only with exit 0),
on fabricated outputs, the registry (names, rounds, order), and the helpers the fourth round's probes build their
faults with (a resealed export, a file size limit, the records data); no probe is run."""

from __future__ import annotations

import sys

import pytest

from tools.probes.reliability.common import (CLEAN, FAILED, LOSS, SILENT, TRACEBACK, classify, error_line,
                                             file_hashes, find_tracebacks, hash_changes, run)
from tools.probes.reliability.fixtures import (NEWLINE_LABEL, RECORDS_LABELS, UNSEEN_LABEL, records_names,
                                               write_records)
from tools.probes.reliability.round4_exports import reseal
from tools.probes.reliability.round4_storage import NO_BYTECODE, fsize_limit
from tools.probes.reliability_probes import PROBES, main


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


def test_tracebacks_are_found_with_their_last_line_and_the_launchers_are_left_out():
    assert find_tracebacks(XC_TRACEBACK) == ["IndexError: index 12 out of bounds for axis 0 with size 12"]
    assert find_tracebacks(CHAINED) == ["OSError: [Errno 28] No space left on device",
                                           "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 123"]
    assert find_tracebacks(HYDRA) == ["Error executing job with overrides: ['run_dir=/ro/run']"]
    assert find_tracebacks(TORCHRUN_SUMMARY) == []  # torchrun's own summary: the launcher's output
    assert find_tracebacks(TORCHRUN_SUMMARY + XC_TRACEBACK) == [
        "IndexError: index 12 out of bounds for axis 0 with size 12"]
    # a one-line message that mentions a traceback is not one
    assert find_tracebacks("error: could not write the lock /r/.lock: read-only file system\n"
                              "warning: no traceback here; see docs/reliability.md\n") == []


def test_a_traceback_is_classified_traceback_and_a_one_line_error_clean_or_failed():
    outcome, detail = classify(1, "some output\n" + XC_TRACEBACK)
    assert outcome == TRACEBACK and "IndexError" in detail and detail.startswith("1 traceback")
    assert classify(2, HYDRA)[0] == TRACEBACK
    assert classify(2, "error: config run_dir: / is the filesystem's root", clean="refused") == (CLEAN, "refused")
    assert classify(2, "error: x", failed="readers gave up 3 of 10") == (FAILED, "readers gave up 3 of 10")
    # a traceback outranks FAILED: it is what the user saw
    assert classify(1, XC_TRACEBACK, failed="no metrics")[0] == TRACEBACK


def test_a_wrong_answer_is_silent_only_with_exit_0_and_no_word():
    assert classify(0, "P@1=94.00", wrong="another run's fusion applied") == (SILENT, "another run's fusion applied")
    outcome, detail = classify(2, "error: holds no xc run", wrong="wrote .lock before refusing")
    assert outcome == FAILED and "exit 2" in detail and "holds no xc run" in detail
    assert classify(0, XC_TRACEBACK, wrong="x")[0] == TRACEBACK  # it did say something: a traceback


def test_loss_is_a_users_file_changed_or_removed_by_hash(tmp_path):
    folder = tmp_path / "mine"
    (folder / "archive").mkdir(parents=True)
    (folder / "config.json").write_text('{"mine": 1}\n')
    (folder / "metrics.json").write_text('{"acc": 0.9}\n')
    (folder / "archive" / "notes.txt").write_text("keep\n")
    before = file_hashes(folder)
    assert set(before) == {"config.json", "metrics.json", "archive/notes.txt"}

    (folder / ".lock").write_text("pid 1\n")  # something added: not a loss by itself
    after = file_hashes(folder)
    assert hash_changes(before, after) == ([], [], [".lock"])
    assert classify(2, "error: refused", before=before, after=after, clean="ok")[0] == CLEAN

    (folder / "config.json").write_text('{"name": "synthetic-astra"}\n')  # same path, other bytes
    (folder / "archive" / "notes.txt").unlink()
    after = file_hashes(folder)
    outcome, detail = classify(0, "final P@1=90.00", before=before, after=after, wrong="exit 0")
    assert outcome == LOSS
    assert "config.json overwritten" in detail and "archive/notes.txt removed" in detail
    # LOSS outranks a traceback and a silent write
    assert classify(1, XC_TRACEBACK, before=before, after=after)[0] == LOSS

    same = tmp_path / "same"
    same.mkdir()
    (same / "metrics.json").write_text('{"acc": 0.9}\n')
    assert file_hashes(same)["metrics.json"] == before["metrics.json"]  # by content, not by path or time


def test_error_line_is_the_first_error_else_the_last_line():
    assert error_line("INFO a\nerror: config run_dir: x\nmore\n") == "error: config run_dir: x"
    assert error_line("INFO a\n\nlast words\n\n") == "last words"
    assert error_line("") == "(no output)"


def test_the_75_probes_of_the_three_rounds_are_listed(capsys):
    names = [p.name for p in PROBES]
    assert len(names) == len(set(names)) == 75
    assert [sum(p.round == r for p in PROBES) for r in (2, 3, 4)] == [18, 18, 39]
    assert {p.kind for p in PROBES} <= {LOSS, SILENT, TRACEBACK}
    assert all(p.name.startswith(f"r{p.round}_") for p in PROBES)
    assert main(["--list"]) == 0 and len(capsys.readouterr().out.splitlines()) == 75
    assert main(["--only", "no_such_probe"]) == 2  # refused before anything runs
    # every finding of the fourth round has its probe
    for word in ("label_name_with_newline", "csv_unclosed_quote", "csv_stray_quote", "jsonl_not_utf8", "csv_not_utf8",
                 "fit_y_plus_minus_one", "fit_y_fractional", "fit_label_names_too_many", "fit_label_names_too_few",
                 "fit_label_names_duplicate", "fit_label_names_tab", "fit_label_names_newline", "fit_x_not_texts",
                 "manifest_names_parent_file", "manifest_names_absolute_path", "models_name_another_export",
                 "symlink_out", "json_edited", "safetensors_header_edited", "pickle_for_safetensors",
                 "keeps_users_file", "reexport_read_only_export", "export_live_run", "after_use_prior_false",
                 "threshold_other_checkpoint", "threshold_not_a_number", "data_verify_cache_root", "efbig_xc_train",
                 "efbig_xc_export", "efbig_predict_out", "efbig_eval_predictions", "export_full_disk",
                 "export_unwritable_parent", "ann_save_index_read_only_export", "export_ctrl_c",
                 "cache_rebuild_warning_once", "predict_blank_lines_only", "test_labels_never_in_training",
                 "records_run_source_moved"):
        assert f"r4_{word}" in names or any(n.startswith("r4_") and n.endswith(word) for n in names), word


def test_a_resealed_export_passes_the_manifest_check_so_the_probes_reach_the_loaders_own_checks(tmp_path):
    from xc.errors import CheckpointError
    from xc.serve.export_files import FORMAT, VERSION, read_manifest, seal

    folder = tmp_path / "exp"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "model" / "model.safetensors").write_bytes(b"weights")
    (folder / "prior.json").write_text('{"beta": 0.5}')
    seal(folder, {"format": FORMAT, "version": VERSION, "kind": "model", "source": "/runs/a", "models": ["model"],
                  "num_labels": 3, "num_features": 4, "text_features": False, "memory_points": 0})
    (folder / "prior.json").write_text('{"beta": "high"}')  # edited by hand
    with pytest.raises(CheckpointError, match="missing or damaged"):
        read_manifest(folder)
    reseal(folder)
    assert read_manifest(folder)["files"]["prior.json"]["bytes"] == len('{"beta": "high"}')


def test_the_file_size_limit_makes_a_childs_write_efbig(tmp_path):
    code = ("import errno, sys\ntry:\n    open(sys.argv[1], 'wb').write(bytes(100_000))\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])")
    p = run([sys.executable, "-c", code, tmp_path / "big.bin"], tmp_path, env=NO_BYTECODE,
               preexec=fsize_limit(10_000))
    assert p.rc == 0 and p.out.strip() == "EFBIG", p.text


def test_the_records_data_holds_a_name_with_a_line_break_and_a_label_only_test_has(tmp_path):
    import json

    names = records_names()
    assert len(names) == RECORDS_LABELS + 1 == len(set(names)) and names[NEWLINE_LABEL] == "two\nlines"
    src = write_records(tmp_path / "src")
    train = [json.loads(r) for r in (src / "train.jsonl").read_text().splitlines()]
    test = [json.loads(r) for r in (src / "test.jsonl").read_text().splitlines()]
    assert {n for r in train for n in r["labels"]} == set(names[:-1])
    assert sum(r["labels"] == [UNSEEN_LABEL] for r in test) == 3
    assert (src / "train.jsonl").read_text().count("\n") == len(train)  # the break is escaped in the JSON
