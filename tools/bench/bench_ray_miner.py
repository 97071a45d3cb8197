"""miner=ray: refresh wall time with 1 and with 2 Ray nodes, against the process pool, on one snapshot.

    .venv/bin/python tools/bench/bench_ray_miner.py                         # L = 1e6, d = 64, 20k queries, 4 shards
    .venv/bin/python tools/bench/bench_ray_miner.py --labels 100000 --backend exact --out /tmp/ray.json

Publishes one synthetic snapshot (classifier-like rows of tools/bench/bench_ann.py, queries near them, 3 positives
per query) into a scratch run directory, then mines it (a) with the process pool of 1 and of N worker
processes (`miner=pool`) and (b) with `miner=ray` on a local Ray cluster (`ray.cluster_utils.Cluster`) of
1 and of N nodes, each node with `--cpus-per-node` CPUs and each task asking for `--threads` of them.
Each figure is the wall time of `MinerService.mine` (read the snapshot, build every shard's index, search
every query, write and publish the negatives), so it includes what Ray adds: shipping rows and queries
through the object store and the task overheads. The Ray tables are checked equal to the pool's for the
exact backend, and DiskANN recall (against exact, on `miner.recall_sample` queries per shard) is recorded.
Before any of that, `footprint`: a local Ray instance of `--nodes` CPUs as `miner=ray` starts one (start-up
seconds, first tasks, and the resident memory of Ray's processes once its workers are up; docs/miner.md quotes it).
Writes JSON (and the machine it ran on); the trainer's stall with miner=ray is `tools/bench/bench_miner.py --miner ray`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # xc and tools.* of this checkout

from xc.config import AnnConfig, MinerConfig  # noqa: E402
from xc.errors import XCError, require_extra  # noqa: E402
from xc.handoff import Stage, gen_name, handoff_root, open_negatives, write_static_positives  # noqa: E402
from xc.miner.service import MinerService  # noqa: E402


def publish_snapshot(run_dir: Path, labels: int, dim: int, queries: int, shards: int, k: int, seed: int) -> None:
    from tools.bench.bench_ann import make_data

    rows, q = make_data(labels, dim, queries, seed)
    rng = np.random.default_rng(seed + 1)
    positives = rng.integers(0, labels, (queries, 3)).astype(np.int64).ravel()
    write_static_positives(run_dir, np.arange(0, 3 * queries + 1, 3, dtype=np.int64), positives)
    stage = Stage(handoff_root(run_dir) / "snapshots", gen_name(1))
    bounds = np.linspace(0, labels, shards + 1).astype(int)
    entries = [dict(stage.write_array(f"W.shard{s}.npy", rows[lo:hi]), shard=s, lo=int(lo), num_real=int(hi - lo))
               for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
    stage.publish({"kind": "snapshot", "generation": 1, "epoch": 0, "global_step": 0, "num_rows": queries, "dim": dim,
                   "k_per_shard": k, "shards": entries, "queries": stage.write_array("Q.npy", q)})


def fresh_copy(source: Path, name: str) -> Path:
    """A run directory holding the snapshot only (no negatives yet)."""
    target = source.parent / name
    shutil.rmtree(target, ignore_errors=True)
    (target / "handoff").mkdir(parents=True)
    for part in ("static", "snapshots"):
        shutil.copytree(handoff_root(source) / part, handoff_root(target) / part)
    return target


def timed_mine(service: MinerService) -> float:
    began = time.perf_counter()
    if service.mine(1) is None:
        sys.exit(f"mining failed: {sorted((service.control).glob('failed-*'))}")
    return time.perf_counter() - began


def stats(run_dir: Path) -> dict:
    manifest = json.loads((handoff_root(run_dir) / "negatives" / gen_name(1) / "manifest.json").read_text())
    recalls = [s["recall"] for s in manifest["stats"] if s.get("recall") is not None]
    return {"build_seconds": round(sum(s["build_seconds"] for s in manifest["stats"]), 2),
            "search_seconds": round(sum(s["search_seconds"] for s in manifest["stats"]), 2),
            "recall_min": round(min(recalls), 4) if recalls else None,
            "hosts": sorted({h for s in manifest["stats"] for h in s.get("hosts", [])})}


def ray_processes_rss_mb() -> float:
    """Resident memory of this machine's Ray processes (GCS, raylet, agents, workers), in MB."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "rss=,args="], capture_output=True, text=True).stdout
    names = ("gcs_server", "raylet", "ray::", "site-packages/ray/")
    return sum(int(line.split(None, 1)[0]) for line in out.splitlines()
               if any(n in line for n in names) and "bench_ray_miner" not in line) / 1024


def footprint(cpus: int, store_mb: int) -> dict:
    """Start-up time and idle memory of a local Ray instance, as `miner=ray` with no address starts one."""
    import ray

    began = time.perf_counter()
    ray.init(address="local", num_cpus=cpus, object_store_memory=store_mb * 2**20, include_dashboard=False,
             log_to_driver=False)
    started = time.perf_counter() - began

    @ray.remote
    def noop() -> int:
        return 1

    began = time.perf_counter()
    ray.get([noop.remote() for _ in range(cpus)])
    first = time.perf_counter() - began
    time.sleep(2)  # let the agents settle
    out = {"cpus": cpus, "start_seconds": round(started, 2), "first_tasks_seconds": round(first, 2),
           "processes_rss_mb": round(ray_processes_rss_mb()), "object_store_mb": store_mb}
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--backend", default="diskann")
    ap.add_argument("--nodes", type=int, default=2, help="the larger cluster (and pool) size")
    ap.add_argument("--cpus-per-node", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPUs per task (miner.threads_per_worker)")
    ap.add_argument("--query-blocks", type=int, default=1, help="miner.ray_query_blocks")
    ap.add_argument("--store-mb", type=int, default=1024, help="object store per node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="tools/results/bench_ray_miner.json")
    args = ap.parse_args()
    try:
        require_extra("ray", "Ray", "ray", "tools/bench/bench_ray_miner.py")
    except XCError as e:
        raise SystemExit(f"error: {e}")

    import ray
    from ray.cluster_utils import Cluster

    from xc.miner.ray_pool import RayMinerService

    idle = footprint(args.nodes * args.cpus_per_node, 512)
    print(f"local Ray instance: {idle}", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="xc-bench-ray-"))
    base = scratch / "snapshot"
    began = time.perf_counter()
    publish_snapshot(base, args.labels, args.dim, args.queries, args.shards, args.k, args.seed)
    print(f"snapshot: {args.labels} labels x {args.dim} in {args.shards} shards, {args.queries} queries "
          f"({time.perf_counter() - began:.1f}s)", flush=True)
    cfg = MinerConfig(threads_per_worker=args.threads, ann=AnnConfig(backend=args.backend),
                      ray_query_blocks=args.query_blocks)
    results = []
    reference = None
    for workers in sorted({1, args.nodes}):
        run_dir = fresh_copy(base, f"pool{workers}")
        service = MinerService(run_dir, replace(cfg, workers=workers))
        seconds = timed_mine(service)
        service._reset_pool()
        results.append({"miner": "pool", "workers": workers, "seconds": round(seconds, 2), **stats(run_dir)})
        print(results[-1], flush=True)
        reference = reference or run_dir
    for nodes in sorted({1, args.nodes}):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus_per_node,
                                                                "object_store_memory": args.store_mb * 2**20})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=args.cpus_per_node, object_store_memory=args.store_mb * 2**20)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        cluster.wait_for_nodes()
        run_dir = fresh_copy(base, f"ray{nodes}")
        service = RayMinerService(run_dir, replace(cfg, mode="ray", ray_address=cluster.address))
        seconds = timed_mine(service)
        row = {"miner": "ray", "nodes": nodes, "cpus": nodes * args.cpus_per_node, "seconds": round(seconds, 2),
               **stats(run_dir)}
        if args.backend == "exact":
            want, _ = open_negatives(reference, 1, range(args.shards))
            got, _ = open_negatives(run_dir, 1, range(args.shards))
            row["equal_to_pool"] = all(np.array_equal(want[s], got[s]) for s in range(args.shards))
        results.append(row)
        print(results[-1], flush=True)
        ray.shutdown()
        cluster.shutdown()
    by = {(r["miner"], r.get("workers", r.get("nodes"))): r["seconds"] for r in results}
    out = {"command": " ".join(["python tools/bench/bench_ray_miner.py", *sys.argv[1:]]),
           "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
           "labels": args.labels, "dim": args.dim, "queries": args.queries, "shards": args.shards, "k": args.k,
           "backend": args.backend, "cpus_per_node": args.cpus_per_node, "threads_per_task": args.threads,
           "query_blocks": args.query_blocks, "ray": ray.__version__, "local_instance": idle, "results": results,
           "speedup_ray_2_nodes": round(by[("ray", 1)] / by[("ray", args.nodes)], 2) if args.nodes > 1 else None,
           "ray_over_pool_1": round(by[("ray", 1)] / by[("pool", 1)], 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
