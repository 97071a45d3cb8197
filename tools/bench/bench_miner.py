"""Trainer stall at epoch boundaries with the asynchronous miner pool (ASTRA Sec. 3.2).

    .venv/bin/python tools/bench/bench_miner.py                       # 2 gloo ranks + pool, DiskANN
    .venv/bin/python tools/bench/bench_miner.py --backend exact --labels 20000 --nproc 1
    .venv/bin/python tools/bench/bench_miner.py --miner ray --nproc 1 --labels 1000000   # miner=ray, a local instance

Runs `torchrun -m xc.cli.train miner=pool` (or `--miner ray`) on a synthetic dataset and reads the run's
log.jsonl: for every
epoch that switched to freshly mined negatives, the seconds the trainer waited for them (stall) against
the epoch's training seconds. Writes JSON and a PNG (bars per epoch: train vs stall).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--labels", type=int, default=100_000)
    parser.add_argument("--train", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--backend", default="diskann")
    parser.add_argument("--miner", default="pool", choices=["pool", "ray"])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--out", default="tools/results/bench_miner.json")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides")
    args = parser.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="xc-bench-miner-"))
    shards = max(2, args.nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           f"--master-port={free_port()}", "-m", "xc.cli.train", f"run_dir={run_dir}", "train.resume=never",
           "logger.wandb=disabled", "logger.progress=false", f"miner={args.miner}", f"miner.ann.backend={args.backend}",
           f"miner.workers={args.workers}", f"data.synthetic.num_labels={args.labels}",
           f"data.synthetic.num_train={args.train}", "data.synthetic.num_test=1000", f"model.embed_dim={args.dim}",
           f"train.epochs={args.epochs}", f"parallel.num_label_shards={shards}", "sampler.start_epoch=1",
           "eval.every_epochs=0", "train.log_every=1000", *args.overrides]
    env = dict(os.environ, XC_THREADS=os.environ.get("XC_THREADS", "1"), PYTHONUNBUFFERED="1")
    started = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    epochs = {e["epoch"]: e for e in events if e["event"] == "epoch"}
    switches = {e["epoch"]: e for e in events if e["event"] == "negatives"}
    rows = []
    for epoch, e in sorted(epochs.items()):
        sw = switches.get(epoch)
        rows.append({"epoch": epoch, "train_seconds": e["train_seconds"], "boundary_seconds": e["boundary_seconds"],
                     "stall_seconds": sw["stall_seconds"] if sw else 0.0,
                     "generation": sw["generation"] if sw else None,
                     "mine_seconds": sw.get("mine_seconds") if sw else None,
                     "recall": sw.get("recall") if sw else None,
                     "shards": sw.get("shards") if sw else None})
    # The first switch waits for a snapshot of the untrained model mined from a cold start of the worker
    # pool (process spawn + imports); steady state is every later switch.
    steady = [r for r in rows if r["generation"] is not None and r["generation"] > 1]
    worst = max((r["stall_seconds"] / r["train_seconds"] for r in steady), default=0.0)
    total_stall = sum(r["stall_seconds"] for r in steady)
    total_train = sum(r["train_seconds"] for r in steady)
    report = {"command": " ".join(cmd[1:]), "wall_seconds": time.time() - started, "epochs": rows,
              "steady_state": {"stall_over_epoch_max": worst,
                               "stall_over_epoch_total": total_stall / total_train if total_train else None},
              "settings": vars(args)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["steady_state"], indent=1))
    for r in rows:
        print(f"epoch {r['epoch']}: train {r['train_seconds']:.1f}s  stall {r['stall_seconds']:.2f}s  "
              f"gen {r['generation']}  recall {r['recall']}")
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r["epoch"] for r in rows]
    ax.bar(xs, [r["train_seconds"] for r in rows], label="training")
    ax.bar(xs, [r["stall_seconds"] for r in rows], bottom=[r["train_seconds"] for r in rows],
           label="stall waiting for negatives")
    ax.set_xlabel("epoch")
    ax.set_ylabel("seconds")
    ax.set_title(f"{args.nproc} ranks + miner pool ({args.backend}), L={args.labels:,}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
