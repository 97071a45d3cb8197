"""Sampling time per query against the number of labels L, for every model-aware sampler.

    .venv/bin/python tools/bench/bench_sampler.py                   # L = 1e4, 1e5, 1e6; d = 64; 64 negatives/query
    .venv/bin/python tools/bench/bench_sampler.py --labels 10000 100000 --samplers midx_rq lsh_embedding

One label shard of L rows (a Gaussian mixture, so quantisers and hashes see structure), a batch of
query embeddings, and `Sampler.sample` timed alone: the per-query cost the sampler adds to a step.
Index builds (`update`: K-means, hashing) are timed separately; they run at epoch boundaries (LSH:
every lsh_rebuild_every steps) and are O(L) by nature. Configurations are timed round-robin in one
process so that background load hits them alike; compare the ratios, not the absolute times.
Writes a JSON of figures and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from xc.config import SamplerConfig
from xc.sampling import SampleBatch, StepKey, build_sampler, draw_positives
from xc.shards import ShardLayout

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout


def make_rows(num_labels: int, dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(256, dim, generator=gen)
    rows = torch.empty(num_labels, dim)
    for start in range(0, num_labels, 1 << 18):
        n = min(1 << 18, num_labels - start)
        rows[start:start + n] = centers[torch.randint(256, (n,), generator=gen)] + 0.5 * torch.randn(n, dim, generator=gen)
    return rows


def make_case(name: str, num_labels: int, args) -> dict:
    layout = ShardLayout.build(num_labels, 1, 1)
    rows = make_rows(num_labels, args.dim)
    counts = np.random.default_rng(0).zipf(1.3, num_labels).astype(np.int64)
    cfg = SamplerConfig(name=name, k_hard=0, k_random=args.negatives, midx_codewords=args.codewords,
                        lsh_bits=args.lsh_bits, lsh_tables=args.lsh_tables, lsh_rebuild_every=0)
    sampler = build_sampler(cfg, layout, seed=0, label_counts=counts)
    start = time.perf_counter()
    sampler.update(0, None, {0: rows}, 0)
    build = time.perf_counter() - start
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(args.batch_size, args.dim, generator=gen)
    indptr = np.arange(0, 2 * args.batch_size + 1, 2)
    indices = np.random.default_rng(2).integers(0, num_labels, 2 * args.batch_size)
    positives = draw_positives(indptr, indices, 2, layout.padded_labels, gen)
    probe = rows[torch.from_numpy(indices[::2])]
    batch = SampleBatch(torch.arange(args.batch_size), positives, z, probe)
    return {"sampler": sampler, "batch": batch, "build_s": build, "times": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--samplers", nargs="+",
                        default=["uniform", "popularity", "midx_pq", "midx_rq", "lsh_embedding", "lsh_label"])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--negatives", type=int, default=64)
    parser.add_argument("--codewords", type=int, default=32)
    parser.add_argument("--lsh-bits", type=int, default=8)
    parser.add_argument("--lsh-tables", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="tools/results/bench_sampler.json")
    args = parser.parse_args()
    if os.environ.get("XC_THREADS"):
        torch.set_num_threads(int(os.environ["XC_THREADS"]))

    cases = {}
    for num_labels in args.labels:
        for name in args.samplers:
            cases[(name, num_labels)] = make_case(name, num_labels, args)
            print(f"built {name} L={num_labels:,} in {cases[(name, num_labels)]['build_s']:.2f}s", flush=True)
    for round_idx in range(args.warmup + args.rounds):
        for (name, num_labels), case in cases.items():
            start = time.perf_counter()
            case["sampler"].sample(StepKey(0, 0, round_idx), 0, case["batch"])
            if round_idx >= args.warmup:
                case["times"].append(time.perf_counter() - start)
    results = []
    for (name, num_labels), case in cases.items():
        t = np.array(case["times"])
        results.append({"sampler": name, "num_labels": num_labels, "build_s": case["build_s"],
                        "median_batch_s": float(np.median(t)),
                        "us_per_query": float(np.median(t)) / args.batch_size * 1e6})
    smallest, largest = min(args.labels), max(args.labels)
    flat = {}
    for name in args.samplers:
        per = {r["num_labels"]: r["us_per_query"] for r in results if r["sampler"] == name}
        flat[name] = {"ratio_largest_over_smallest": per[largest] / per[smallest],
                      "max_ratio_over_smallest": max(v / per[smallest] for v in per.values())}
    for r in results:
        print(f"{r['sampler']:14s} L={r['num_labels']:>9,}  {r['us_per_query']:8.2f} us/query  build {r['build_s']:7.2f}s")
    print(json.dumps(flat, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "machine": {"cpu": platform.processor() or platform.machine(),
                                                                   "threads": torch.get_num_threads()},
                               "results": results, "flatness": flat}, indent=1))
    plot(results, out.with_suffix(".png"))


def plot(results: list[dict], path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in sorted({r["sampler"] for r in results}):
        rows = [r for r in results if r["sampler"] == name]
        ax.plot([r["num_labels"] for r in rows], [r["us_per_query"] for r in rows], "o-", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("labels in the shard (L)")
    ax.set_ylabel("sampling time per query (us, median)")
    ax.set_title("negative sampling cost vs L (d=64, 64 negatives/query)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
