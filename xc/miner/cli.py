"""`xc-miner`: the offline hard-negative miner, run beside or away from the trainer.

    xc-miner --run-dir runs/big                      # settings from the run's config.json
    xc-miner --run-dir /shared/runs/big --workers 16 --threads 2 --backend diskann
    xc-miner --run-dir /shared/runs/big --ray-address auto     # a Ray driver: tasks on the cluster's nodes

It watches RUN_DIR/handoff/snapshots, mines each new snapshot (one task per label shard), publishes
RUN_DIR/handoff/negatives/gen-*, and exits when RUN_DIR/handoff/control/stop appears or on Ctrl-C (either
abandons a generation in flight at once, publishing nothing for it), or once the trainer has finished and
nothing is pending. Train with `miner=external` to consume them.
One miner serves a run: a second `xc-miner` (or the miner of a `miner=pool` or `miner=ray` trainer) holding
RUN_DIR/handoff/control/miner.lease makes this one stop at once, naming the holder (xc/miner/lease.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from xc.ann.base import BACKENDS
from xc.config import MinerConfig, build_config
from xc.errors import XCError, require_extra
from xc.handoff import handoff_root
from xc.miner.lease import MinerLease
from xc.miner.service import MinerService


def _wait_for_run(run_dir: Path, seconds: float) -> None:
    """Return once `run_dir` is a run directory (a trainer wrote its config.json or hand-off files); a
    miner started beside its trainer may come first, so wait up to `seconds`, then stop with one line
    (a mistyped path must not wait forever, nor `--once` report success having found nothing)."""
    deadline = time.monotonic() + seconds
    said = False
    while not ((run_dir / "config.json").is_file() or handoff_root(run_dir).is_dir()):
        if time.monotonic() >= deadline:
            what = "does not exist" if not run_dir.exists() else "holds no config.json or handoff/ of a trainer"
            raise XCError(f"--run-dir {run_dir} {what}"
                          + (f" (waited {seconds:.0f}s)" if seconds else "") + "; start xc-train with "
                          f"miner=external run_dir={run_dir}, or check the path")
        if not said:
            logging.getLogger("xc.miner").info("waiting up to %.0fs for %s to become a run directory", seconds, run_dir)
            said = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xc-miner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--threads", type=int, help="threads per worker")
    parser.add_argument("--backend", choices=list(BACKENDS))
    parser.add_argument("--ray", action="store_true",
                        help="mine with Ray tasks (xc/miner/ray_pool.py) on a local Ray instance, or the cluster "
                             "of --ray-address")
    parser.add_argument("--ray-address", help="the Ray cluster to drive (auto, or HOST:PORT); implies --ray")
    parser.add_argument("--ray-query-blocks", type=int, help="search tasks per shard (default: the run's config)")
    parser.add_argument("--once", action="store_true", help="mine what is pending now, then exit")
    parser.add_argument("--wait-for-run", type=float, default=600.0, metavar="SECONDS",
                        help="how long to wait for RUN_DIR to become a run directory (default 600; --once: 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [miner] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        if args.wait_for_run < 0:
            raise XCError(f"--wait-for-run must be >= 0, got {args.wait_for_run}")
        if args.ray or args.ray_address:
            require_extra("ray", "Ray", "ray", "xc-miner --ray")
        _wait_for_run(Path(args.run_dir), 0.0 if args.once else args.wait_for_run)
        cfg_path = Path(args.run_dir) / "config.json"
        cfg = build_config(json.loads(cfg_path.read_text())).miner if cfg_path.exists() else MinerConfig()
        if args.workers:
            cfg = replace(cfg, workers=args.workers)
        if args.threads:
            cfg = replace(cfg, threads_per_worker=args.threads)
        if args.backend:
            cfg = replace(cfg, ann=replace(cfg.ann, backend=args.backend))
        if args.ray_address:
            cfg = replace(cfg, ray_address=args.ray_address)
        if args.ray_query_blocks:
            cfg = replace(cfg, ray_query_blocks=args.ray_query_blocks)
        with MinerLease(args.run_dir, "xc-miner") as lease:  # a second miner on this run stops here
            if args.ray or args.ray_address:
                from xc.miner.ray_pool import RayMinerService  # lazy: the optional Ray backend, only with --ray

                service = RayMinerService(args.run_dir, cfg, lease)
            else:
                service = MinerService(args.run_dir, cfg, lease)
            if args.once:
                for generation in service.pending():
                    service.mine(generation)
            else:
                service.serve()
    except KeyboardInterrupt:
        return 130
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
