"""ANN backends for hard-negative mining: build time, search time, memory and recall@k against exact
MIPS, on synthetic classifier-like vectors.

    .venv/bin/python tools/bench/bench_ann.py                                  # L = 1e6, d = 64, 20k queries, k = 16
    .venv/bin/python tools/bench/bench_ann.py --labels 10000 100000 --queries 5000 --out /tmp/ann.json
    .venv/bin/python tools/bench/bench_ann.py --backends diskann --diskann-graph-degree 48 --no-sweep
    .venv/bin/python tools/bench/bench_ann.py --backends diskann torch --threads 16 --queries 100000   # GPU host
    .venv/bin/python tools/bench/bench_ann.py --backends torch --torch-dtype bfloat16 --queries 100000 --out /tmp/bf16.json

Synthetic data (`make_data`, seeded):
  * labels: C = max(1, L / 1000) cluster centres c ~ N(0, I_d); label l takes a uniform centre c_l,
    w_l = c_l + 0.7 * N(0, I_d), rescaled to norm |w_l| ~ LogNormal(0, 0.35) (about 0.5 .. 2):
    clustered directions plus varying norms, like trained extreme-classification classifier rows,
    where norm tracks label frequency and MIPS differs from cosine search.
  * queries: a source label s ~ U[0, L); q = w_s / |w_s| + (0.5 / sqrt(d)) * N(0, I_d), normalised
    to unit norm (the encoder's query embeddings sit near their positives' classifier rows).
Reference: exact top-k of the query sample (blocked matrix products, xc.ann exact backend).

Each backend is built once with `AnnParams` defaults (overridable by flags) and searched with its
default search complexity; `--sweep` (on by default) also searches at a few other complexities to
draw recall against search time. Times are wall seconds on this machine with `--threads` threads
(CPU seconds are recorded too: the machine may be shared, and CPU time is less load-sensitive).
`memory_bytes` is the index's own resident size as the backend reports it; `rss_delta_bytes` is
the process RSS growth over the build (includes allocator slack and transient buffers).
Writes a JSON of all figures and a PNG (recall vs search time per 1000 queries; build seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # xc and tools.plots of this checkout

from xc.ann.base import AnnParams, recall_at_k  # noqa: E402
from xc.ann.registry import build_index  # noqa: E402

SWEEPS = {  # search-complexity values swept per backend (the default is always included)
    "diskann": ("diskann_search_complexity", [16, 32, 48, 64, 96, 128]),
    "faiss_hnsw": ("hnsw_ef_search", [32, 64, 96, 128, 192, 256]),
    "faiss_ivf": ("ivf_nprobe", [8, 16, 32, 64, 128]),
    "faiss_gpu": ("ivf_nprobe", []),
    "exact": ("exact_block_queries", []),
    "torch": ("torch_dtype", []),  # the dtype is fixed at build: run again with --torch-dtype bfloat16
}
PARAM_PREFIX = {"diskann": "diskann_", "faiss_hnsw": "hnsw_", "faiss_ivf": "ivf_", "faiss_gpu": "gpu_", "exact": "exact_",
                "torch": "torch_"}


def make_data(num_labels: int, dim: int, num_queries: int, seed: int = 0, chunk: int = 1 << 18):
    """(W (L, d), Q (N, d)) float32, see the module docstring."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, num_labels // 1000), dim)).astype(np.float32)
    rows = np.empty((num_labels, dim), np.float32)
    for lo in range(0, num_labels, chunk):
        hi = min(num_labels, lo + chunk)
        block = centres[rng.integers(0, len(centres), hi - lo)]
        block += 0.7 * rng.standard_normal((hi - lo, dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        block *= rng.lognormal(0.0, 0.35, (hi - lo, 1)).astype(np.float32)
        rows[lo:hi] = block
    src = rng.integers(0, num_labels, num_queries)
    queries = rows[src] / np.linalg.norm(rows[src], axis=1, keepdims=True)
    queries += (0.5 / np.sqrt(dim)) * rng.standard_normal((num_queries, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return rows, queries.astype(np.float32)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed_search(index, queries, k):
    wall, cpu = time.perf_counter(), cpu_seconds()
    _, ids = index.search(queries, k)
    return ids, time.perf_counter() - wall, cpu_seconds() - cpu


def run_backend(backend: str, params: AnnParams, rows, queries, exact_ids, k: int, sweep: bool) -> dict:
    gc.collect()
    rss0, cpu0 = rss_bytes(), cpu_seconds()
    index = build_index(backend, params)
    index.build(rows)
    build_cpu = cpu_seconds() - cpu0
    rss_delta = rss_bytes() - rss0
    ids, search_s, search_cpu = timed_search(index, queries, k)
    nq = len(queries)
    out = {
        "backend": backend, "labels": int(rows.shape[0]), "dim": int(rows.shape[1]), "queries": nq, "k": k,
        "params": {f: v for f, v in dataclasses.asdict(params).items()
                   if f.startswith(PARAM_PREFIX[backend]) or f == "num_threads"},
        "build_s": round(index.build_seconds, 3), "build_cpu_s": round(build_cpu, 3),
        "search_s": round(search_s, 3), "search_cpu_s": round(search_cpu, 3),
        "search_s_per_1k": round(1000 * search_s / nq, 4),
        f"recall@{k}": round(recall_at_k(ids, exact_ids), 4),
        "memory_bytes": int(index.memory_bytes), "rss_delta_bytes": int(rss_delta),
    }
    if backend == "faiss_gpu":
        out["on_gpu"] = bool(index.on_gpu)
    if backend == "torch":
        out["device"] = index.device
    field, values = SWEEPS[backend]
    curve = []
    if sweep and values:
        for value in sorted(set(values) | {getattr(params, field)}):
            index.params = dataclasses.replace(params, **{field: value})
            ids, s, _ = timed_search(index, queries, k)
            curve.append({field: value, "search_s": round(s, 3), "search_s_per_1k": round(1000 * s / nq, 4),
                          f"recall@{k}": round(recall_at_k(ids, exact_ids), 4)})
            print(f"    {field}={value}: {1000 * s / nq:.3f} s/1k queries, recall@{k} {curve[-1][f'recall@{k}']:.4f}",
                  flush=True)
        index.params = params
    out["sweep"] = curve
    del index
    gc.collect()
    return out


def plot(results: list[dict], k: int, path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = sorted({r["labels"] for r in results})
    for r in results:
        if r["backend"] == "exact":
            continue
        tag = f"{r['backend']} (L={r['labels']:.0e})" if len(sizes) > 1 else r["backend"]
        if r["sweep"]:
            xs = [p["search_s_per_1k"] for p in r["sweep"]]
            ys = [p[f"recall@{k}"] for p in r["sweep"]]
            line, = ax1.plot(xs, ys, "o-", label=tag)
            field = next(f for f in r["sweep"][0] if f not in ("search_s", "search_s_per_1k", f"recall@{k}"))
            for p in r["sweep"]:
                ax1.annotate(str(p[field]), (p["search_s_per_1k"], p[f"recall@{k}"]), fontsize=7,
                             textcoords="offset points", xytext=(3, -9))
            color = line.get_color()
        else:
            color = None
        ax1.plot([r["search_s_per_1k"]], [r[f"recall@{k}"]], "*", ms=14, color=color,
                 label=None if r["sweep"] else tag)
    ax1.axhline(0.9, color="grey", ls=":", lw=1)
    ax1.set_xscale("log")
    ax1.xaxis.set_minor_locator(matplotlib.ticker.LogLocator(base=10, subs=(2.0, 3.0, 5.0)))
    ax1.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax1.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax1.set_xlabel("search seconds per 1000 queries (wall)")
    ax1.set_ylabel(f"recall@{k} vs exact MIPS")
    ax1.set_title("recall vs search time\n(star = default params; point labels = search complexity)", fontsize=10)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    names = [f"{r['backend']}\nL={r['labels']:.0e}" if len(sizes) > 1 else r["backend"] for r in results]
    ax2.bar(range(len(results)), [r["build_s"] for r in results], color="tab:gray")
    for i, r in enumerate(results):
        ax2.text(i, r["build_s"], f"{r['build_s']:.0f} s (cpu {r['build_cpu_s']:.0f} s)\n{r['memory_bytes'] / 2**20:.0f} MiB", ha="center",
                 va="bottom", fontsize=8)
    ax2.set_xticks(range(len(results)))
    ax2.set_xticklabels(names, fontsize=8)
    ax2.set_ylabel("build seconds (wall)")
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set_title("index build time (and index memory)", fontsize=10)
    ax2.set_ylim(0, 1.2 * max(r["build_s"] for r in results) + 1e-9)
    fig.suptitle(f"ANN for hard-negative mining: d={results[0]['dim']}, k={k}, {results[0]['queries']} queries, "
                 f"{results[0]['params'].get('num_threads')} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _gpu_name() -> str | None:
    """The GPU the torch and faiss_gpu figures were taken on (named with every figure), or None without one."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    from xc.ann.faiss_backend import num_gpus

    return "a GPU visible to faiss" if num_gpus() else None


def main(argv=None) -> None:
    defaults = AnnParams()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=20_000)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["diskann", "faiss_hnsw"],
                    choices=["diskann", "faiss_hnsw", "faiss_ivf", "faiss_gpu", "exact", "torch"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    for f in dataclasses.fields(AnnParams):
        if f.name not in ("backend", "num_threads"):
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                            default=getattr(defaults, f.name))
    ap.add_argument("--out", default="tools/results/bench_ann.json")
    ap.add_argument("--exact-cache", default="",
                    help="directory to keep the exact reference top-k in (reused by later runs with the same data)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    params = AnnParams(num_threads=args.threads,
                       **{f.name: getattr(args, f.name) for f in dataclasses.fields(AnnParams)
                          if f.name not in ("backend", "num_threads")}).validate()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "tool": "tools/bench/bench_ann.py", "argv": sys.argv[1:],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "affinity": len(os.sched_getaffinity(0)), "loadavg_start": os.getloadavg(),
                    "gpu": _gpu_name()},
        "generator": "clustered Gaussian classifier rows (L/1000 centres, sigma 0.7, log-normal(0, 0.35) norms); "
                     "unit queries = normalised source row + N(0, 0.25/d) noise; see make_data",
        "k": args.k, "queries": args.queries, "dim": args.dim, "threads": args.threads,
        "exact": [], "results": [],
    }
    for num_labels in args.labels:
        t = time.perf_counter()
        rows, queries = make_data(num_labels, args.dim, args.queries, args.seed)
        print(f"L={num_labels}: data {time.perf_counter() - t:.1f}s", flush=True)
        cache = (Path(args.exact_cache) / f"exact-L{num_labels}-d{args.dim}-N{args.queries}-k{args.k}-s{args.seed}.npz"
                 if args.exact_cache else None)
        if cache is not None and cache.exists():
            saved = np.load(cache)
            exact_ids, exact_s, exact_cpu = saved["ids"], float(saved["seconds"]), float(saved["cpu_seconds"])
            print(f"  exact top-{args.k}: from {cache}", flush=True)
        else:
            t, c = time.perf_counter(), cpu_seconds()
            exact = build_index("exact", params)
            exact.build(rows)
            _, exact_ids = exact.search(queries, args.k)
            exact_s, exact_cpu = time.perf_counter() - t, cpu_seconds() - c
            del exact
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                np.savez(cache, ids=exact_ids, seconds=exact_s, cpu_seconds=exact_cpu)
        report["exact"].append({"labels": num_labels, "search_s": round(exact_s, 3),
                                "search_cpu_s": round(exact_cpu, 3),
                                "search_s_per_1k": round(1000 * exact_s / args.queries, 4)})
        print(f"  exact top-{args.k}: {exact_s:.1f}s ({1000 * exact_s / args.queries:.3f} s/1k queries)", flush=True)
        for backend in args.backends:
            print(f"  {backend} ...", flush=True)
            r = run_backend(backend, params, rows, queries, exact_ids, args.k, args.sweep)
            report["results"].append(r)
            print(f"  {backend}: build {r['build_s']:.1f}s (cpu {r['build_cpu_s']:.0f}s), search {r['search_s']:.2f}s "
                  f"({r['search_s_per_1k']:.3f} s/1k), recall@{args.k} {r[f'recall@{args.k}']:.4f}, "
                  f"memory {r['memory_bytes'] / 2**20:.0f} MiB (rss +{r['rss_delta_bytes'] / 2**20:.0f} MiB)",
                  flush=True)
            out_path.write_text(json.dumps(report, indent=2))  # partial results survive an interrupted run
        del rows, queries, exact_ids
        gc.collect()
    report["machine"]["loadavg_end"] = os.getloadavg()
    out_path.write_text(json.dumps(report, indent=2))
    plot(report["results"], args.k, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
