"""`xc-miner`: the offline hard-negative miner, run beside or away from the trainer.

    xc-miner --run-dir runs/big                      # settings from the run's config.json
    xc-miner --run-dir /shared/runs/big --workers 16 --threads 2 --backend diskann

It watches RUN_DIR/handoff/snapshots, mines each new snapshot (one task per label shard), publishes
RUN_DIR/handoff/negatives/gen-*, and exits when RUN_DIR/handoff/control/stop appears, on Ctrl-C, or
once the trainer has finished and nothing is pending. Train with `miner=external` to consume them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from xc.config import MinerConfig, build_config
from xc.errors import XCError
from xc.miner.service import MinerService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xc-miner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--threads", type=int, help="threads per worker")
    parser.add_argument("--backend", choices=["exact", "diskann", "faiss_hnsw", "faiss_ivf", "faiss_gpu"])
    parser.add_argument("--once", action="store_true", help="mine what is pending now, then exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [miner] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        cfg_path = Path(args.run_dir) / "config.json"
        cfg = build_config(json.loads(cfg_path.read_text())).miner if cfg_path.exists() else MinerConfig()
        if args.workers:
            cfg = replace(cfg, workers=args.workers)
        if args.threads:
            cfg = replace(cfg, threads_per_worker=args.threads)
        if args.backend:
            cfg = replace(cfg, ann=replace(cfg.ann, backend=args.backend))
        service = MinerService(args.run_dir, cfg)
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
