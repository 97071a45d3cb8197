"""Checks that stop a run with one line before any work (docs/reliability.md, section 8): numeric config
keys, override keys, settings against the data, absolute paths, presets' names, xc-eval's and xc-data's
arguments, xc-miner's run directory, the miner's supervision, the run lock and the run identity."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.conftest import REPO
from xc.config import MinerConfig, build_config
from xc.config_checks import check_against_data
from xc.cli.entry import absolute_paths, check_overrides
from xc.errors import ConfigError, XCError


# ------------------------------------------------------------------ item 10: every numeric key


@pytest.mark.parametrize("raw,key", [
    ({"eval": {"ks": []}}, "eval.ks"),
    ({"eval": {"ks": [0]}}, "eval.ks[0]"),
    ({"model": {"embed_dim": 0}}, "model.embed_dim"),
    ({"model": {"hidden_dims": [32, 0]}}, "model.hidden_dims[1]"),
    ({"model": {"bottleneck_dim": 0}}, "model.bottleneck_dim"),
    ({"train": {"lr_classifier": -1}}, "train.lr_classifier"),
    ({"train": {"lr_encoder": 0}}, "train.lr_encoder"),
    ({"train": {"lr_lexical": 0}}, "train.lr_lexical"),
    ({"model": {"lexical_features": -1}}, "model.lexical_features"),
    ({"train": {"min_lr_ratio": 2}}, "train.min_lr_ratio"),
    ({"train": {"checkpoint_every_minutes": -1}}, "train.checkpoint_every_minutes"),
    ({"train": {"max_steps": -2}}, "train.max_steps"),
    ({"eval": {"max_points": -5}}, "eval.max_points"),
    ({"parallel": {"timeout_s": 0}}, "parallel.timeout_s"),
    ({"miner": {"mode": "pool", "workers": 0}}, "miner.workers"),
    ({"miner": {"max_restarts": -1}}, "miner.max_restarts"),
    ({"miner": {"first_snapshot_at": 1.0}}, "miner.first_snapshot_at"),
    ({"miner": {"mode": "pool", "ann": {"backend": "auto"}}}, "miner.ann.backend"),  # auto: the sync miner's only
    ({"miner": {"mode": "pool", "ann": {"backend": "exact"}, "rerank_candidates": 8}}, "miner.rerank_candidates"),
    ({"miner": {"mode": "sync", "rerank_candidates": 64}}, "miner.rerank_candidates"),  # its rows are current
    ({"miner": {"mode": "pool", "ann": {"backend": "exact"}, "rerank_candidates": 64},
      "sampler": {"hard_source": "label_text"}}, "miner.rerank_candidates"),
    ({"sampler": {"random_proposal": "zipf"}}, "sampler.random_proposal"),
    ({"sampler": {"name": "uniform", "random_proposal": "popularity"}}, "sampler.random_proposal"),  # no mixture
    ({"train": {"time_budget": -1}}, "train.time_budget"),
    ({"train": {"time_budget": float("nan")}}, "train.time_budget"),
    ({"train": {"time_budget": float("inf")}}, "train.time_budget"),
    ({"model": {"lexical_init": "centroids"}}, "model.lexical_init"),
    ({"model": {"lexical_init": 1}}, "model.lexical_init"),
    ({"model": {"lexical_init_scale": 0}}, "model.lexical_init_scale"),
    ({"model": {"lexical_init_scale": -3.0}}, "model.lexical_init_scale"),
    ({"model": {"lexical_init_scale": float("nan")}}, "model.lexical_init_scale"),
    ({"model": {"lexical_init_scale": float("inf")}}, "model.lexical_init_scale"),
    ({"train": {"plateau_epochs": 0}}, "train.plateau_epochs"),
    ({"train": {"plateau_epochs": -2}}, "train.plateau_epochs"),
    ({"train": {"plateau_epochs": 1.5}}, "train.plateau_epochs"),
    ({"train": {"plateau_epochs": "two"}}, "train.plateau_epochs"),
    ({"train": {"epochs_by_validation": "yes"}}, "train.epochs_by_validation"),
    ({"train": {"epochs_by_validation": True}, "eval": {"select_epoch": False}}, "train.epochs_by_validation"),
    ({"train": {"epochs_by_validation": True}, "data": {"valid_fraction": 0.0}}, "train.epochs_by_validation"),
    ({"train": {"epochs_by_validation": True}, "model": {"mode": "dual"}, "sampler": {"name": "lf_stale"}},
     "train.epochs_by_validation"),
])
def test_bad_numbers_are_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    assert info.value.key == key, str(info.value)


def test_defaults_and_presets_pass_the_checks():
    assert build_config({}).train.batch_size is None  # nulls survive the checks, to be derived from the data
    assert build_config({"miner": {"mode": "sync", "workers": 0}}).miner.workers == 0  # only the pool reads workers
    pool = build_config({"miner": {"mode": "pool", "ann": {"backend": "exact"}, "rerank_candidates": 64}})
    assert (pool.miner.mode, pool.miner.ann.backend, pool.miner.rerank_candidates) == ("pool", "exact", 64)
    assert build_config({"miner": {"mode": "sync", "rerank_candidates": 0}}).miner.rerank_candidates == 0  # 0 = off


def test_negatives_beyond_the_labels_are_refused_in_the_dual_mode_only():
    """The classifier mode takes the exact loss where the negatives cover the labels (xc/defaults/); the dual
    mode, which has no exact loss, refuses before training."""
    classifier = build_config({"sampler": {"k_hard": 40, "k_random": 64}})
    check_against_data(classifier, SimpleNamespace(num_labels=100))
    dual = build_config({"model": {"mode": "dual"}, "sampler": {"name": "lf_stale", "k_hard": 40, "k_random": 64}})
    with pytest.raises(ConfigError) as info:
        check_against_data(dual, SimpleNamespace(num_labels=100))
    assert info.value.key == "sampler.k_random" and "104 negatives per query exceed the data's 100 labels" in str(
        info.value)
    check_against_data(dual, SimpleNamespace(num_labels=104))


# ------------------------------------------------------------------ item 11: misspelled override keys


@pytest.mark.parametrize("argv,key,hint", [
    (["train.epoch=2"], "train.epoch", "did you mean 'train.epochs'?"),
    (["sampler.k_hrd=3"], "sampler.k_hrd", "did you mean 'sampler.k_hard'?"),
    (["miner.ann.backnd=exact"], "miner.ann.backnd", "did you mean 'miner.ann.backend'?"),
    (["trian.epochs=2"], "trian", "did you mean 'train'?"),
])
def test_unknown_override_keys_get_a_did_you_mean(argv, key, hint):
    with pytest.raises(ConfigError) as info:
        check_overrides(argv)
    assert info.value.key == key and hint in str(info.value)


def test_valid_overrides_groups_and_hydra_flags_pass():
    assert check_overrides(["train.epochs=2", "data=bibtex", "experiment=bibtex", "sampler=full", "+foo=1",
                            "~train.amp", "hydra.verbose=true", "--cfg", "job", "model.hidden_dims=[64]",
                            "sampler.tree.frontier=3", "data.synthetic.seed=2", "run_dir=/tmp/x"]) is None
    with pytest.raises(ConfigError):  # the same check does refuse: the list above passes on its merits
        check_overrides(["train.epochs=2", "train.epoch=2"])


def test_xc_train_prints_one_line_for_a_misspelled_key():
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", "train.epoch=2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: config train.epoch: unknown key (did you mean 'train.epochs'?)"


# ------------------------------------------------------------------ items 13, 14: names and paths


def test_paths_are_stored_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(build_config({"run_dir": "runs/a", "data": {"kind": "xc_sparse", "path": "../d",
                                                                      "cache_dir": ".cache/x"}}))
    assert cfg.run_dir == str(tmp_path / "runs" / "a")
    assert cfg.data.path == str(tmp_path.parent / "d") and cfg.data.cache_dir == str(tmp_path / ".cache" / "x")


def test_an_experiment_presets_own_name_wins():
    from hydra import compose, initialize_config_dir

    from xc.cli.train import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        assert compose("config", overrides=["experiment=debian_deps_lf"]).name == "debian_deps_lf-corrector"
        assert compose("config", overrides=["experiment=bibtex", "name=mine"]).run_dir == "runs/mine"
        assert compose("config").name == "synthetic-astra"


def test_launch_scripts_keep_the_callers_directory_and_hypothesis_is_ignored():
    for script in (REPO / "launch").glob("*.sh"):
        assert "\ncd " not in script.read_text(), script
    assert ".hypothesis/" in (REPO / ".gitignore").read_text().split()


# ------------------------------------------------------------------ item 10: xc-eval arguments


@pytest.mark.parametrize("extra,needle", [
    (["--topk", "-3"], "error: --topk must be >= 1, got -3"),
    (["--max-points", "-5"], "error: --max-points must be >= 0"),
    (["--predictions", "/missing/dir/p.npz"], "error: --predictions /missing/dir/p.npz: directory /missing/dir does"),
])
def test_xc_eval_arguments_are_checked_first(tmp_path, capsys, extra, needle):
    from xc.cli.evaluate import main

    assert main([str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err.startswith(needle)


def test_xc_eval_on_a_missing_run_directory(tmp_path, capsys):
    from xc.cli.evaluate import main

    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: run directory {tmp_path / 'nope'} does not exist"


# ------------------------------------------------------------------ item 4: xc-data generate --out


def test_generate_never_replaces_a_checkpoint_or_a_foreign_directory(tmp_path, capsys):
    from xc.data.cli import main

    step = tmp_path / "run" / "checkpoints" / "step-00000030"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"global_step": 30, "world_size": 1, "files": {}}))
    (step / "rank0.pt").write_bytes(b"weights")
    tiny = ["--num-labels", "50", "--num-train", "60", "--num-test", "20", "--num-features", "80"]
    assert main(["generate", "--out", str(step), *tiny]) == 2
    assert "is not a generated dataset" in capsys.readouterr().err
    assert (step / "rank0.pt").read_bytes() == b"weights"
    out = tmp_path / "gen"
    assert main(["generate", "--out", str(out), *tiny]) == 0
    assert main(["generate", "--out", str(out), *tiny, "--seed", "3"]) == 0  # an earlier generate: replaced


# ------------------------------------------------------------------ item 8: xc-miner --run-dir


def test_xc_miner_refuses_a_missing_run_directory(tmp_path, capsys):
    from xc.miner.cli import main

    missing = tmp_path / "nope"
    assert main(["--run-dir", str(missing), "--once"]) == 2
    assert f"error: --run-dir {missing} does not exist" in capsys.readouterr().err
    started = time.monotonic()
    assert main(["--run-dir", str(missing), "--wait-for-run", "0.5"]) == 2
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------ item 7: the miner cannot die silently


def _fake_shard_task(task: dict) -> dict:
    return {"entry": {"shard": task["shard"]}, "build_seconds": 0.0, "search_seconds": 0.0, "recall": None}


class _FakeSnapshot:
    manifest = {"k_per_shard": 4, "shards": [{"shard": 0}], "epoch": 0, "global_step": 0}


def test_a_pool_broken_while_idle_is_retried(tmp_path, monkeypatch):
    import xc.miner.service as service_module

    monkeypatch.setattr(service_module, "run_shard_task", _fake_shard_task)
    monkeypatch.setattr(service_module, "open_snapshot", lambda run_dir, generation: _FakeSnapshot())
    service = service_module.MinerService(tmp_path, MinerConfig(workers=1, max_retries=1))
    pool = service._pool()
    assert pool.submit(os.getpid).result(timeout=60) > 0  # the worker is up, and idle now
    for process in list(pool._processes.values()):
        os.kill(process.pid, signal.SIGKILL)  # an OOM kill between two generations
        process.join(10)
    time.sleep(0.5)  # the executor's manager notices and marks the pool broken
    assert service.mine(1) is not None  # was: BrokenProcessPool out of mine(), killing the miner thread
    service._reset_pool()


def test_a_dead_miner_thread_is_restarted_then_stops_the_run(tmp_path, monkeypatch):
    import xc.miner.background as background_module
    import xc.miner.service as service_module

    calls = []

    def dies(self, stop=None, exit_when_done=True):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(service_module.MinerService, "serve", dies)
    miner = background_module.BackgroundMiner(tmp_path, MinerConfig(max_restarts=2))
    for _ in range(2):
        miner._thread.join(10)
        miner.check()  # restarts it
    miner._thread.join(10)
    with pytest.raises(background_module.MinerDiedError, match="died 3 times .*RuntimeError: boom"):
        miner.check()
    assert len(calls) == 3
    miner.close()


# ------------------------------------------------------------------ item 5: the lock, unit level


def test_lock_is_exclusive_and_released(tmp_path):
    from xc.run.lock import RunLock, RunLockedError

    with RunLock(tmp_path):
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        child = subprocess.run([sys.executable, "-c", "from xc.run.lock import RunLock; import sys; "
                                f"RunLock({str(tmp_path)!r}).acquire()"], cwd=REPO, capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
        assert child.returncode != 0 and f"is in use by pid {os.getpid()}" in child.stderr
    assert not (tmp_path / ".lock").exists()
    assert RunLockedError.__mro__[1] is XCError


def test_a_restarted_torchrun_attempt_takes_over_its_own_jobs_lock(tmp_path, monkeypatch):
    from xc.run.lock import RunLock

    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "another-host", "started": 0,
                                                "torchrun_run_id": "job-7", "restart_count": 0}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["restart_count"] == 1
    lock.release()


# ------------------------------------------------------------------ item 2: identity differences


def test_identity_differences_name_both_values():
    from xc.run.identity import differences

    old = {"data": {"num_labels": 500, "content": "a"}, "config": {"model.embed_dim": 64, "data.max_len": 32}}
    new = {"data": {"num_labels": 400, "content": "b"}, "config": {"model.embed_dim": 32, "data.max_len": 32}}
    assert differences(old, new) == ["it was trained on 500 labels, but this run's data has 400",
                                     "model.embed_dim was 64, this run sets 32"]
    assert differences(old, old) == []
    same_counts = dict(new, data={"num_labels": 500, "content": "b"}, config=old["config"])
    assert differences(old, same_counts) == [
        "the data has the same counts but other content (another dataset, generator seed or file)"]



@pytest.mark.parametrize("argv,line", [
    (["train.epochs=1", "data.path=/my", "data/x"], "data.path=/my data/x: quote a value with spaces: "
                                                   "data.path='/my data/x'"),
    (["data.path=/my", "big", "data/x", "--cfg", "job"], "data.path=/my big data/x: quote a value with spaces: "
                                                          "data.path='/my big data/x'"),
    (["data.path=/my(1) data"], "data.path=/my(1) data: quote a value with spaces: data.path='/my(1) data'"),
])
def test_a_value_with_spaces_gets_a_quoting_hint_through_xc_train(argv, line, monkeypatch, capsys):
    """Unquoted, the shell splits the value and hydra failed on the rest with a LexerNoViableAltException."""
    from xc.cli import train

    monkeypatch.setattr(sys, "argv", ["xc-train", *argv])
    monkeypatch.setattr(train, "_hydra_main", lambda: pytest.fail("hydra reached"))
    with pytest.raises(SystemExit) as info:
        train.main()
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"


def test_quoted_values_with_spaces_and_flag_values_pass():
    assert check_overrides(["data.path=/my data/x", "--cfg", "job", "train.epochs=2", "-cn", "config"]) is None


def test_a_miner_halted_while_its_pool_restarts_marks_no_generation_failed(tmp_path, monkeypatch):
    """The trainer's stop (halt) arriving while the miner rebuilds its pool after a worker died: the submit then
    raises "cannot schedule new futures after shutdown". That is the miner's own stop, not a failed generation: a
    failure marker would make the resumed run skip the generation (the kill-anywhere soak, tools/probes/soak.py,
    ended 505 apart from an uninterrupted run this way)."""
    import xc.miner.service as service_module

    monkeypatch.setattr(service_module, "run_shard_task", _fake_shard_task)
    monkeypatch.setattr(service_module, "open_snapshot", lambda run_dir, generation: _FakeSnapshot())
    service = service_module.MinerService(tmp_path, MinerConfig(workers=1, max_retries=1))

    class ShutDownPool:
        def submit(self, *args, **kwargs):
            service._halted.set()  # the halt lands while the pool is being rebuilt
            raise RuntimeError("cannot schedule new futures after shutdown")

    monkeypatch.setattr(service, "_pool", lambda: ShutDownPool())
    assert service.mine(1) is None
    assert not list(tmp_path.rglob("failed-gen-*.json"))


def test_one_signal_delivered_twice_is_one_request_and_a_later_one_leaves_at_once(monkeypatch):
    """A job's SIGTERM reaches a rank directly and again through torchrun within moments: the second copy must not
    exit the rank mid-checkpoint (the soak found half-deleted checkpoints so). A second signal seconds later is a
    user who will not wait: SIGINT then raises KeyboardInterrupt at once."""
    import xc.run.signals as signals_module

    clock = [100.0]
    monkeypatch.setattr(signals_module.time, "monotonic", lambda: clock[0])
    stop = signals_module.StopControl().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same request again, at once: still waiting for the checkpoint
        assert stop.received == signal.SIGINT
        clock[0] += signals_module.SAME_REQUEST_S + 1
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()


def test_in_the_final_phase_the_first_signal_stops_where_it_is():
    """After `leave_at_once` a signal raises StopRequested at once (no step left to finish), one that came before
    raises it on the call; `finish_steps_first` restores the wait for the step (an ensemble's next member)."""
    import xc.run.signals as signals_module

    stop = signals_module.StopControl().install()
    try:
        stop.leave_at_once("in the final evaluation")
        with pytest.raises(signals_module.StopRequested, match="stopped by SIGTERM in the final evaluation") as info:
            os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.exit_code == 143
    finally:
        stop.uninstall()
    stop = signals_module.StopControl().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # during the last step: it waits for the step
        assert stop.received == signal.SIGINT
        with pytest.raises(signals_module.StopRequested, match="stopped by SIGINT in the final") as info:
            stop.leave_at_once("in the final evaluation")
        assert info.value.exit_code == 130
    finally:
        stop.uninstall()
    stop = signals_module.StopControl().install()
    try:
        stop.leave_at_once("in the final evaluation")
        stop.finish_steps_first()
        os.kill(os.getpid(), signal.SIGTERM)  # training again: the flag is set, nothing raised
        assert stop.received == signal.SIGTERM
    finally:
        stop.uninstall()
