"""`xc-train`: the hydra entry point. Converts the config to dataclasses once, then hands over.

    xc-train                                   # synthetic data, ASTRA, one process
    xc-train experiment=bibtex                 # a shipped preset
    torchrun --nproc-per-node 2 -m xc.cli.train sampler.k_hard=32 train.epochs=10
"""

from __future__ import annotations

import os
import time

STARTED = time.monotonic()  # the run's clock starts before the heavy imports: `_report` prints the whole run's time

# Before torch is imported (torch reads it once, at its first allocation): back CPU tensors of 2 MB and more with
# transparent huge pages. A step's large temporaries (a 10^4-row gather of a 1024-wide feature table is 40 MB)
# are otherwise mmap'd fresh by glibc every time, a page fault per 4 KB: the 10^6-label step went from 0.145 s to
# 0.095 s with it (docs/scaling.md). A value the user exported wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from xc.config import XCConfig, build_config, to_dict  # noqa: E402
from xc.config_checks import check_against_data  # noqa: E402
from xc.cli.entry import absolute_paths, check_overrides, register_resolvers  # noqa: E402
from xc.distributed import barrier, init_distributed, on_rank0, shutdown  # noqa: E402
from xc.distributed.host_threads import host_threads  # noqa: E402
from xc.errors import XCError, require_extra  # noqa: E402
from xc.faults import NO_FAULTS, Faults  # noqa: E402
from xc.fsutil import storage_error  # noqa: E402
from xc.run.guard import REQUESTED_CONFIG, check_run_dir_is_ours, guard_run_dir  # noqa: E402
from xc.run.identity import write_identity  # noqa: E402
from xc.run.lock import RunLock  # noqa: E402
from xc.run.runlog import memory_gib  # noqa: E402
from xc.run.runlog import setup_stdout_logging  # noqa: E402
from xc.run.signals import StopControl, StopRequested  # noqa: E402
from xc.train.host_memory import keep_freed_blocks  # noqa: E402

log = logging.getLogger("xc")


def _threads(cfg: XCConfig, device_type: str) -> tuple[int, str]:
    """Threads for this rank at the start: every core the ranks on this host share, as a miner pool is idle until
    the first snapshot (xc/distributed/host_threads.py; the Refresher gives the pool its cores while it mines), at most a
    few on a GPU rank."""
    return host_threads(cfg, mining=False, device_type=device_type)


def run(cfg: XCConfig, stop=None, faults: Faults = NO_FAULTS) -> dict[str, float]:
    """Train and evaluate per `cfg` in this process (one torchrun rank); returns the final metrics.

    Nothing is written into the run directory before rank 0 holds its lock (xc/run/lock.py) and has
    checked this run against the one stored there (xc/run/guard.py); `stop` (xc/run/signals.py) turns
    SIGTERM/SIGINT into a checkpoint at the same step on every rank and a StopRequested; `faults`: the tests'
    fault injection (xc/faults.py), none by default. Small data trains an ensemble (xc/ensemble/members.py):
    each member is such a run in RUN_DIR/members/m{m}/, under its own lock too."""
    import torch

    from xc.datasets import load_configured_dataset, log_unseen_test_labels  # lazy: scipy (+0.2 s), off --help
    from xc.ensemble.members import check_run_layout, resolve_members, train_ensemble  # lazy: +0.4 s, as above

    ctx = init_distributed(cfg.parallel.backend, cfg.train.device, cfg.parallel.timeout_s)
    if cfg.miner.mode == "ray":  # rank 0 drives the Ray miner: a missing extra stops the run before the data loads
        on_rank0(ctx, lambda: require_extra("ray", "Ray", "ray", "miner=ray"))
    setup_stdout_logging(ctx.rank)
    threads, why = _threads(cfg, ctx.device.type)
    torch.set_num_threads(threads)
    keep_freed_blocks()  # xc/train/host_memory.py: a step's large tensors reuse their pages
    if ctx.is_main:
        log.info("host threads per rank: %d (%s; XC_THREADS overrides)", threads, why)
    lock = RunLock(cfg.run_dir)
    try:
        on_rank0(ctx, lambda: check_run_dir_is_ours(cfg.run_dir))  # a user's folder is refused untouched
        on_rank0(ctx, lock.acquire)  # before anything is written into the run directory
        dataset = load_configured_dataset(cfg)
        check_against_data(cfg, dataset)
        if ctx.is_main:
            log_unseen_test_labels(dataset)
        members, why = resolve_members(cfg, dataset.train.num_points)
        on_rank0(ctx, lambda: check_run_layout(cfg, members))
        if members == 1:
            if ctx.is_main and cfg.train.ensemble is None:
                log.info("one model (%s; train.ensemble=N trains an ensemble of N)", why)
            return _train_model(cfg, ctx, dataset, stop, faults)
        if ctx.is_main:
            log.info("training an ensemble of %d models (%s; train.ensemble overrides) in %s", members, why,
                     cfg.run_dir)
            (Path(cfg.run_dir) / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))

        def train_member(member_cfg: XCConfig) -> dict:
            member_lock = RunLock(member_cfg.run_dir)
            try:
                on_rank0(ctx, member_lock.acquire)
                return _train_model(member_cfg, ctx, dataset, stop, faults)
            finally:
                member_lock.release()

        metrics, served = train_ensemble(cfg, ctx, dataset, members, train_member)
        if ctx.is_main:
            metrics.update(_calibrated(cfg, served))
            _report(cfg, metrics)
        barrier(ctx)
        return metrics
    finally:
        lock.release()
        shutdown()


def _report(cfg: XCConfig, metrics: dict[str, float]) -> None:
    """Print the final metrics, then write metrics.json: printed first, a disk that fills (or turned read-only)
    at the end of a long run loses no figures, and stops with one line naming the file."""
    print("final " + "  ".join(f"{k}={v:.2f}" for k, v in metrics.items() if k.split("@")[0] in ("P", "nDCG", "PSP")),
          flush=True)
    print(f"wall time {wall_clock(time.monotonic() - STARTED)} since xc-train started{_peak_memory()}", flush=True)
    path = Path(cfg.run_dir) / "metrics.json"
    try:
        path.write_text(json.dumps(metrics, indent=1))
    except OSError as exc:
        error = storage_error(exc, f"could not write {path}", "the metrics are printed above and the checkpoints "
                              "are kept; free some space (or make the folder writable) and run the same command to "
                              "evaluate again")
        if error is exc:
            raise
        raise error from None


def _peak_memory() -> str:
    """', peak memory 19.4 GiB': the most this process held resident (xc.run.runlog.memory_gib), as the docs quote it."""
    memory = memory_gib()
    return f", peak memory {memory['peak_rss_gib']:.1f} GiB" if memory else ""


def wall_clock(seconds: float) -> str:
    """'5m04s', '42.5s', '1h02m03s': a run's wall time as the docs quote it."""
    if round(seconds, 1) < 60:
        return f"{seconds:.1f}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _calibrated(cfg: XCConfig, served=None) -> dict[str, float]:
    """Rank 0, after the final evaluation: the served scores' map to probabilities, fitted on validation, and the
    test precision/recall at thresholds it gives (xc/serve/calibration.py); {} when eval.calibrate is off. `served`:
    the final fused evaluation's `ServedScores`, fitted on where it holds what serving ranks (else the run is
    loaded and ranked as served)."""
    if not cfg.eval.calibrate:
        return {}
    from xc.cli.calibrate import calibrate_run  # lazy: the serving stack (+0.4 s), off --help and override errors

    return calibrate_run(cfg.run_dir, served)


def _train_model(cfg: XCConfig, ctx, dataset, stop, faults: Faults) -> dict[str, float]:
    """One model in cfg.run_dir (whose lock this process holds): check the run directory against the run
    stored there, train or resume, evaluate, fit the score calibration; metrics.json on rank 0."""
    identity = on_rank0(ctx, lambda: guard_run_dir(cfg, dataset))
    from xc.train.plan import resolve_run  # lazy: the data rules and the checkpoint reader, off --help
    from xc.train.trainer import Trainer  # lazy: the trainer (+0.3 s), off --help and override errors

    # The one resolution of this model's config (xc/train/plan.py), once the run directory is guarded: the rank 0
    # sweep of half-written checkpoints it makes must not touch a directory the guard refuses.
    plan = resolve_run(cfg, ctx, dataset)
    # either mode (model.mode): xc/train/modes/
    trainer = Trainer(plan, ctx, dataset, identity=identity, stop=stop, heartbeat=True, faults=faults)
    heartbeat = trainer.heartbeat
    if ctx.is_main:  # only now: a refused resume (above) leaves the run directory as it was
        # the config the run uses, every rule resolved; beside it the config as given (null: a rule decides)
        (Path(cfg.run_dir) / "config.json").write_text(json.dumps(to_dict(plan.cfg), indent=1))
        (Path(cfg.run_dir) / REQUESTED_CONFIG).write_text(json.dumps(to_dict(cfg), indent=1))
        write_identity(cfg.run_dir, identity)
    try:
        metrics = trainer.fit()
    except StopRequested:
        barrier(ctx)  # every rank stopped after the same step and wrote its part of the checkpoint
        raise
    except RuntimeError as exc:  # gloo/nccl: a peer did not arrive within parallel.timeout_s, or died
        error = _collective_error(exc, cfg, ctx, heartbeat)
        if error is exc:
            raise
        raise error from exc
    finally:
        heartbeat.stop()
    # The calibration may load the run as served (its rows, kNN memory and ranker): the trainer's rows, optimiser
    # state and fusion memory go first. Held beside it, 10^6 rows of 1024 ran a 24 GiB host out of memory there.
    served = trainer.mode.served_scores
    trainer = heartbeat = None
    gc.collect()
    if ctx.is_main:
        metrics.update(_calibrated(cfg, served))
        _report(cfg, metrics)
    # Every rank leaves together: a rank that tears its gloo group down while a peer is still finishing
    # the last collective can abort ("terminate called without an active exception"). Only on success:
    # after a failure the peers may never arrive.
    barrier(ctx)
    return metrics


_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "socket closed", "remote process exited")


def _collective_error(exc: RuntimeError, cfg: XCConfig, ctx, heartbeat) -> Exception:
    """One line for a collective that failed because a peer is late or gone (naming the gone rank when its heartbeat
    says so); any other RuntimeError is returned as it is, to be raised with its traceback."""
    text = str(exc).lower()
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    if "timed out" in text or "timeout" in text:
        return XCError(f"rank {ctx.rank}: a collective waited longer than parallel.timeout_s="
                       f"{cfg.parallel.timeout_s:.0f}s for a peer ({first}); the newest checkpoint resumes the run")
    if ctx.world_size > 1 and any(p in text for p in _PEER_LOST):
        gone = heartbeat.gone_peers(wait_s=3.0)  # a SIGKILLed peer closes its sockets while still exiting
        who = (", ".join(f"rank {r} (pid {pid})" for r, pid in gone) + (" has" if len(gone) == 1 else " have")
               + " exited") if gone else "a peer rank closed its connection"
        return XCError(f"rank {ctx.rank}: {who} mid-run, so this rank stops too (the peer's own output, or torchrun's "
                       f"summary, says why); the newest checkpoint resumes the run, and torchrun --max-restarts=N "
                       f"restarts it by itself")
    return exc


# An absolute path: a relative one is resolved against the *calling module's package* when hydra is
# entered through the `xc-train` console script, and fails there.
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
register_resolvers()  # before hydra composes conf/ (conf/data/synthetic.yaml names the data by its directory)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_main(raw: DictConfig) -> None:
    # Our own errors (bad config, bad data, bad checkpoint) end with one clear line and exit code 2;
    # this must happen inside the task function, where hydra would otherwise print a traceback.
    stop = None
    try:
        cfg = absolute_paths(build_config(OmegaConf.to_container(raw, resolve=True)))
        stop = StopControl(cfg.train.checkpoint_every_minutes).install()
        # the process's entry: the tests switch faults on with XC_FAULT_* variables on the process they launch
        run(cfg, stop, Faults.from_env(os.environ))
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except StopRequested as exc:
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            print(str(exc), file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # a second Ctrl-C: leave at once, without a traceback
        print("interrupted (second signal); no checkpoint written since the last one", file=sys.stderr)
        sys.exit(130)
    finally:
        if stop is not None:
            stop.uninstall()


def main() -> None:
    # Unknown override keys get xc's one line (with a did-you-mean) instead of hydra's advice to append.
    try:
        check_overrides(sys.argv[1:])
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    _hydra_main()
    _leave_multi_rank_job()


def _leave_multi_rank_job() -> None:
    """A rank of a finished multi-rank job leaves without the interpreter's teardown. Every rank has passed the
    final barrier and destroyed its process group by now, and all files are closed; what remains is C++
    static and thread teardown, where a gloo rank was seen to abort ("terminate called without an active
    exception", SIGABRT) after a complete run, which torchrun then reports as a failed job."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
