"""Peer extreme-classification libraries (PECOS XR-Linear, Omikuji Parabel / Bonsai, napkinXC PLT) on
exactly the split, features and metrics xc uses, so their figures sit beside xc's and the kNN's.

    .venv/bin/python tools/experiments/bench_peers.py                                   # all data, all peers, 1 thread
    .venv/bin/python tools/experiments/bench_peers.py --data bibtex --peers pecos napkinxc --runs 3
    .venv/bin/python tools/experiments/bench_peers.py --threads 8 --out /tmp/peers.json  # also writes /tmp/peers.md
    .venv/bin/python tools/experiments/bench_peers.py --carve-out    # hold out xc's validation carve-out, as xc trains
    .venv/bin/python tools/experiments/bench_peers.py --data arff:/data/medical xc_sparse:/data/Eurlex   # your own data
    .venv/bin/python tools/experiments/bench_peers.py --data synthetic --override data.synthetic.num_labels=100000 ...

Data as `xc-baseline knn` sees it (`xc/cli/baseline.py`): the data preset's config (data=<name>), the
dataset's features weighted by `xc.fitting.knn.input_weights` and rows L2-normalised (`input_vectors`); peers
train on all training points, as a user gives a library all of their training data and as the kNN's test run
searches them (--carve-out: only on the training ids left after xc's validation carve-out, the points xc's
model trains on; --all-train, the old spelling of the default, is accepted and changes nothing), predict the
top 5 of every test point, and are scored by `xc.eval.metrics.evaluate` with the training split's inverse
propensities.
Each (data, peer, run) runs in a fresh spawned process: a crash stays contained, its peak RSS is its own
(data plus model, no torch), and thread limits hold. Train seconds include the peer's own label
clustering and, for Omikuji, parsing its training file (writing that file is not counted).
Peers: omikuji 0.5.2, napkinxc 0.7.2 and libpecos 1.2.8. libpecos declares numpy<2 and scipy<1.14, which
xc's numpy>=2 excludes: install it with `pip install --no-deps libpecos==1.2.8` (run_pecos shims the rest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATASETS = ("bibtex", "delicious", "debian_deps")
PRESETS = (*DATASETS, "synthetic")  # synthetic: sized by --override data.synthetic.* as tools/experiments/scale_quality.py does
PEERS = {"pecos": "pecos", "omikuji_parabel": "omikuji", "omikuji_bonsai": "omikuji", "napkinxc": "napkinxc"}
METRICS = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")
TIMES = ("train_s", "predict_s", "peak_rss_mb")


def prepare(name: str, carve_out: bool = True, overrides: tuple[str, ...] = ()) -> dict:
    """The preset `name`'s training rows (with `carve_out` those left after xc's validation carve-out, else all
    of them) and test rows, mirroring `knn_baseline`: tf-idf weights from all training points, L2-normalised
    float32 CSR. `main` passes `carve_out` explicitly (False unless --carve-out); the default keeps other
    tools' memory (tools/bench/bench_input_search.py) the training points xc's model trains on."""
    from xc.cli.baseline import _compose
    from xc.data.inputs import validation_split
    from xc.datasets import load_configured_dataset
    from xc.cli.entry import register_resolvers
    from xc.fitting.knn import input_vectors, input_weights, labels_csr
    from xc.eval.metrics import inverse_propensities

    register_resolvers()
    if ":" in name:  # a user's own data, KIND:PATH, read as `xc-train data.kind=KIND data.path=PATH` reads it
        kind, path = name.split(":", 1)
        cfg = _compose([f"data.kind={kind}", f"data.path={os.path.abspath(path)}", *overrides])
    else:
        cfg = _compose([f"data={name}", *overrides])  # the data group alone: experiment=debian_deps is the MiniLM preset
    dataset = load_configured_dataset(cfg)
    train, test = dataset.train, dataset.test
    weights = input_weights(train.features, bool(dataset.meta.get("text_features")))
    if carve_out:
        train_ids, _ = validation_split(cfg.data, train.num_points, cfg.seed)
    else:
        train_ids = np.arange(train.num_points, dtype=np.int64)
    n = test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, test.num_points)
    rows = np.arange(n, dtype=np.int64)
    truth = labels_csr(test.labels, rows)
    # PECOS refuses query rows with unsorted feature ids; sorting is free for the others.
    return {"x_train": input_vectors(train.features, weights, train_ids).sorted_indices(),
            "y_train": labels_csr(train.labels, train_ids).astype(np.float32),
            "x_test": input_vectors(test.features, weights, rows).sorted_indices(),
            "truth_indptr": truth.indptr.astype(np.int64), "truth_indices": truth.indices.astype(np.int64),
            "inv": inverse_propensities(train, cfg.eval.propensity_a, cfg.eval.propensity_b),
            "ks": tuple(cfg.eval.ks), "num_labels": int(dataset.num_labels),
            "label": cfg.data.name if overrides else data_label(name)}


def _pad(rows: list[list[int]], k: int) -> np.ndarray:
    """(n, k) int64 label ids, best first, -1 where a peer returned fewer than k labels."""
    out = np.full((len(rows), k), -1, np.int64)
    for i, r in enumerate(rows):
        out[i, :min(k, len(r))] = r[:k]
    return out


def run_pecos(data: dict, k: int, threads: int, workdir: str):
    """XR-Linear with the README's recipe and defaults: PIFA label embeddings, hierarchical k-means."""
    import scipy.sparse
    from scipy.sparse import _sputils

    # libpecos 1.2.8 pins numpy<2 and scipy<1.14, which xc's numpy>=2 rules out. Two shims, in this child
    # process only: the helpers newer SciPy moved out of `scipy.sparse.sputils`, and NumPy 2's spelling of
    # "copy only if needed" (copy=None; copy=False now raises) in PECOS's sparse-matrix constructor.
    for helper in ("get_index_dtype", "upcast"):
        setattr(scipy.sparse.sputils, helper, getattr(_sputils, helper))
    from pecos.utils import smat_util

    original = smat_util.cs_matrix
    smat_util.cs_matrix = lambda arg1, mat_type, shape=None, dtype=None, copy=False, check_contents=False: \
        original(arg1, mat_type, shape, dtype, copy or None, check_contents)
    from pecos.xmc import Indexer, LabelEmbeddingFactory
    from pecos.xmc.xlinear.model import XLinearModel

    x, y = data["x_train"], data["y_train"]
    t0 = time.perf_counter()
    chain = Indexer.gen(LabelEmbeddingFactory.create(y, x, method="pifa", threads=threads), threads=threads)
    model = XLinearModel.train(x, y, C=chain, threads=threads)
    t1 = time.perf_counter()
    scores = model.predict(data["x_test"], only_topk=k, threads=threads).tocsr()
    rows = []
    for i in range(scores.shape[0]):  # PECOS returns the top-k as an unsorted sparse row
        a, b = scores.indptr[i], scores.indptr[i + 1]
        order = np.argsort(-scores.data[a:b], kind="stable")
        rows.append(scores.indices[a:b][order].tolist())
    return t1 - t0, time.perf_counter() - t1, _pad(rows, k)


def write_xc_file(path: str, x, y) -> None:
    """x, y in the XC-repository text format Omikuji trains from. A row with labels and no features is
    written without a trailing space (Omikuji rejects "l1,l2 "); a row with no labels starts with a space."""
    with open(path, "w") as f:
        f.write(f"{x.shape[0]} {x.shape[1]} {y.shape[1]}\n")
        for i in range(x.shape[0]):
            labels = ",".join(map(str, y.indices[y.indptr[i]:y.indptr[i + 1]]))
            a, b = x.indptr[i], x.indptr[i + 1]
            feats = " ".join(f"{j}:{v:.6g}" for j, v in zip(x.indices[a:b], x.data[a:b]))
            f.write((f"{labels} {feats}" if feats else labels) + "\n")


def run_omikuji(data: dict, k: int, threads: int, workdir: str, bonsai: bool):
    """Omikuji with its README's settings: Parabel = the defaults (3 trees, balanced 2-means, depth 20);
    Bonsai = unbalanced k-means, cluster.k 100, max depth 3."""
    import omikuji

    path = os.path.join(workdir, "train.txt")
    write_xc_file(path, data["x_train"], data["y_train"])
    hp = omikuji.Model.default_hyper_param()
    if bonsai:
        hp.cluster_balanced, hp.cluster_k, hp.max_depth = False, 100, 3
    t0 = time.perf_counter()
    model = omikuji.Model.train_on_data(path, hp, n_threads=threads)
    t1 = time.perf_counter()
    x = data["x_test"]
    rows = []
    for i in range(x.shape[0]):
        a, b = x.indptr[i], x.indptr[i + 1]
        pairs = list(zip(x.indices[a:b].tolist(), x.data[a:b].tolist()))
        rows.append([lab for lab, _ in model.predict(pairs, top_k=k)])  # a row without features gets its bias
    return t1 - t0, time.perf_counter() - t1, _pad(rows, k)


def run_napkinxc(data: dict, k: int, threads: int, workdir: str):
    """napkinXC's PLT with its defaults (hierarchical k-means tree, arity 2, 100 labels a leaf)."""
    from napkinxc.models import PLT

    y = data["y_train"]
    labels = [y.indices[y.indptr[i]:y.indptr[i + 1]].tolist() for i in range(y.shape[0])]
    model = PLT(os.path.join(workdir, "plt"), threads=threads)
    t0 = time.perf_counter()
    model.fit(data["x_train"], labels)
    t1 = time.perf_counter()
    rows = model.predict(data["x_test"], top_k=k)
    return t1 - t0, time.perf_counter() - t1, _pad([list(r) for r in rows], k)


def run_job(peer: str, data: dict, k: int, threads: int) -> dict:
    """One peer's training and prediction: seconds, top-k ids and the process's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="xc-peer-") as workdir:
        if peer == "pecos":
            train_s, predict_s, ids = run_pecos(data, k, threads, workdir)
        elif peer.startswith("omikuji"):
            train_s, predict_s, ids = run_omikuji(data, k, threads, workdir, bonsai=peer == "omikuji_bonsai")
        else:
            train_s, predict_s, ids = run_napkinxc(data, k, threads, workdir)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
    hwm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    return {"train_s": train_s, "predict_s": predict_s, "peak_rss_mb": hwm_kib / 1024, "ids": ids}


def die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent `parent` exits (Linux prctl PR_SET_PDEATHSIG), and
    exit now where it already has. A peer killed with its benchmark would otherwise train on, for an hour at
    10^6 labels, on the cores the next measurement needs (a SIGTERM to the benchmark reaches only the parent).
    Elsewhere (no prctl) the peer outlives a killed benchmark, as before."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took hold
        os._exit(1)


def _child(conn, log_path: str, parent: int, *job) -> None:
    """Spawned-process entry: the peer's own progress bars and logs go to `log_path` (Omikuji prints
    thousands of lines), the result or the error back through `conn`; it dies with `parent`."""
    die_with_parent(parent)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            conn.send(("ok", run_job(*job)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def spawn_job(ctx, peer: str, data: dict, k: int, threads: int) -> dict:
    """run_job in a fresh spawned process (not forked: the parent holds torch and xc's state, which
    belongs neither in a peer's RSS nor under a forked OpenMP runtime). A peer that dies outright (a Rust
    panic, a segfault) raises RuntimeError with the tail of its output instead of hanging a pool."""
    receive, send = ctx.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile(prefix="xc-peer-", suffix=".log", delete=False) as log:
        log_path = log.name
    try:
        proc = ctx.Process(target=_child, args=(send, log_path, os.getpid(), peer, data, k, threads))
        proc.start()
        send.close()
        try:
            status, out = receive.recv()
        except EOFError:
            status, out = "error", "process died"
        proc.join()
        if status != "ok":
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{out} (exit code {proc.exitcode})" + ("; last output: " + " | ".join(tail)
                                                                        if tail else ""))
        return out
    finally:
        os.unlink(log_path)


def save_rankings(path: Path, ids: np.ndarray, data: dict, peer: str) -> None:
    """A peer's test top-k `ids` (n, k) with the test labels they are judged against (CSR indptr / indices), written
    whole or not at all: paired_compare.py pairs them with an xc run's over the same test points."""
    from xc.fsutil import write_atomic

    write_atomic(path, lambda f: np.savez(f, ids=ids, truth_indptr=data["truth_indptr"],
                                          truth_indices=data["truth_indices"], peer=np.array(peer),
                                          data=np.array(data["label"])))


def machine(threads: int) -> dict:
    """What the timings ran on."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": model, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "threads": threads, "python": platform.python_version(), "platform": platform.platform()}


def versions() -> dict:
    """Installed versions of the peers' packages."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("libpecos", "omikuji", "napkinxc", "numpy", "scipy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def markdown(report: dict) -> str:
    """The mean of each (data, peer) as one markdown table."""
    head = ["data", "peer", *METRICS, "train s", "predict s", "peak RSS MB", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["results"]:
        m = r["mean"]
        lines.append("| " + " | ".join([r["data"], r["peer"], *(f"{m[x]:.2f}" for x in METRICS),
                                        f"{m['train_s']:.1f}", f"{m['predict_s']:.1f}",
                                        f"{m['peak_rss_mb']:.0f}", str(len(r["runs"]))]) + " |")
    lines += [f"\n{f['data']} {f['peer']} failed: {f['error']}" for f in report["failures"]]
    mach = report["machine"]
    return (f"Peers on xc's features, trained on {report['trained_on']} ({mach['cpu']}, {mach['cores']} "
            f"cores, {mach['threads']} thread(s)); `{report['command']}`\n\n" + "\n".join(lines) + "\n")


def _data_arg(value: str) -> str:
    if value in PRESETS:
        return value
    kind, _, path = value.partition(":")
    if not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected one of {', '.join(PRESETS)} or KIND:PATH")
    if not Path(path).exists():
        raise argparse.ArgumentTypeError(f"{path}: no such file or folder")
    return value


def data_label(name: str) -> str:
    """The table's name for a preset or for KIND:PATH (the data's folder or file name)."""
    return Path(name.split(":", 1)[1].rstrip("/")).name if ":" in name else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", nargs="+", default=list(DATASETS), type=_data_arg,
                        help=f"shipped presets ({', '.join(PRESETS)}) or your own data as KIND:PATH "
                             "(e.g. xc_sparse:/data/Eurlex, arff:/data/medical, lf_raw:/data/texts)")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="hydra overrides for every --data (e.g. data.synthetic.num_labels=100000 data.name=s100k)")
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS))
    parser.add_argument("--threads", type=int, default=1, help="threads per peer (default 1)")
    parser.add_argument("--runs", type=int, default=1, help="repeats per (data, peer); the mean is reported")
    parser.add_argument("--carve-out", action="store_true",
                        help="train only on the training points left after xc's validation carve-out "
                             "(data.valid_fraction), the points xc's model trains on; default: all of them")
    parser.add_argument("--all-train", action="store_true",
                        help="the default (all training points), accepted for old command lines; "
                             "cannot be combined with --carve-out")
    parser.add_argument("--out", default="tools/results/peers.json", help="JSON here, markdown at the same stem")
    parser.add_argument("--save-rankings", type=Path, metavar="DIR",
                        help="keep each peer's test top-k (its first run's) as DIR/DATA-PEER.npz, with the test "
                             "labels, for tools/experiments/paired_compare.py RUN DIR/DATA-PEER.npz")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.runs < 1:
        parser.error("--threads and --runs must be >= 1")
    if args.all_train and args.carve_out:
        parser.error("--all-train (the default: all training points) contradicts --carve-out")
    if args.save_rankings is not None:  # said now, not after the first peer has trained for half an hour
        try:
            args.save_rankings.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"--save-rankings {args.save_rankings}: cannot be a folder here ({exc.strerror})")
    peers = []
    for peer in args.peers:
        if importlib.util.find_spec(PEERS[peer]) is None:
            print(f"skip {peer}: {PEERS[peer]} is not installed (.venv/bin/pip install -e .[peers]; for pecos also "
                  "--no-deps libpecos==1.2.8)", file=sys.stderr)
        else:
            peers.append(peer)
    # The children inherit these, so OpenMP/BLAS pools inside the peers honour --threads too.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    from xc.eval.metrics import evaluate

    ctx = mp.get_context("spawn")
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable), *sys.argv])
    trained_on = ("training ids (validation carve-out held out)" if args.carve_out
                  else "all training points")
    report = {"command": command, "machine": machine(args.threads), "versions": versions(),
              "trained_on": trained_on, "results": [], "failures": []}
    start = time.perf_counter()
    for name in args.data:
        data = prepare(name, args.carve_out, tuple(args.override))
        label = data["label"]
        k = max(data["ks"])
        for peer in peers:
            runs, failure = [], None
            kept = args.save_rankings / f"{label}-{peer}.npz" if args.save_rankings else None
            if kept is not None and kept.exists():  # never over a file already there
                report["failures"].append({"data": label, "peer": peer, "error": f"{kept} exists"})
                print(f"{label} {peer}: {kept} exists: move it away to keep this run's rankings", file=sys.stderr)
                continue
            for run in range(args.runs):
                try:
                    out = spawn_job(ctx, peer, data, k, args.threads)
                except RuntimeError as exc:  # one peer failing should not lose the others' figures
                    failure = str(exc)
                    print(f"{label} {peer} run {run + 1} failed: {failure}", file=sys.stderr, flush=True)
                    break
                ids = out.pop("ids")
                if kept is not None and run == 0:
                    save_rankings(kept, ids, data, peer)
                metrics = evaluate(ids, data["truth_indptr"], data["truth_indices"], data["inv"], ks=data["ks"])
                runs.append({**{m: round(metrics[m], 2) for m in METRICS},
                             **{t: round(out[t], 2) for t in TIMES}})
                print(f"{label} {peer} run {run + 1}: " + "  ".join(f"{key}={v}" for key, v in runs[-1].items()),
                      flush=True)
            if failure:
                report["failures"].append({"data": label, "peer": peer, "error": failure})
                continue
            mean = {key: round(statistics.fmean(r[key] for r in runs), 2) for key in (*METRICS, *TIMES)}
            report["results"].append({"data": label, "peer": peer, "mean": mean, "runs": runs,
                                      "train_points": data["x_train"].shape[0],
                                      "test_points": data["x_test"].shape[0], "labels": data["num_labels"]})
    report["wall_s"] = round(time.perf_counter() - start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
