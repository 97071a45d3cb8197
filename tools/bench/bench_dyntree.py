"""Component figures of the dynamic tree index with Nystrom drift correction ("Improving Dual-Encoder Training through Dynamic Indexes for Negative Mining" §8.2).

    XC_THREADS=1 PYTHONPATH=$PWD .venv/bin/python tools/bench/bench_dyntree.py                 # 2e4 and 1e5 targets
    XC_THREADS=1 PYTHONPATH=$PWD .venv/bin/python tools/bench/bench_dyntree.py --sizes 20000 --quick

Synthetic targets (xc.sampling.drift_synth: clustered, rank-r dominant spectrum, d = 384 like MiniLM)
drift by a random residual ReLU MLP. Reports, per size:
  (a) TV(β-softmax, law of the MH output) vs deepest level m, frontier F and chain length (one tree);
  (b) cosine(cache view, exact) and top-64 overlap after drift, vs s' and vs w (refreshes over a fixed
      drift horizon, errors compounding), against the stale cache;
  (c) tree update: rebuild_below(r) for several r vs a full rebuild, after one refresh interval's drift;
  (d) approximate re-encode (s' encoder calls + fit + d'×d' apply) vs full re-encode (n calls), with the
      encoder cost per label measured on all-MiniLM-L6-v2 over debian-deps label texts (1 thread);
  (e) mining seconds per query (forest of T trees, B queries); (f) memory % vs a brute-force cache.
Writes tools/results/bench_dyntree.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from xc.sampling.drift_synth import DriftingTargets
from xc.sampling.dyntree import DynamicTreeConfig, DynamicTreeSource
from xc.sampling.nystrom import NystromCache, cosine_rows, topk_overlap
from xc.sampling.sgtree import SGTree
from xc.sampling.tree_mh import find_clustering, log_q, mh_chains

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* (tools.plots) of this checkout


def minilm_seconds_per_label(num: int = 256) -> float | None:
    """Seconds per label to encode debian-deps label texts with all-MiniLM-L6-v2 (eval, no grad)."""
    path = REPO.parent / "shared" / "data" / "debian-deps" / "lbl.raw.txt"
    try:
        from transformers import AutoTokenizer

        from xc.models.text_encoder import TransformerEncoder
        enc = TransformerEncoder(None).eval()
        tok = AutoTokenizer.from_pretrained(enc.path, local_files_only=True)
        texts = path.read_text().splitlines()[:num]
    except Exception as e:  # the figure is optional: say why it is missing
        print(f"MiniLM timing skipped: {e}")
        return None
    with torch.no_grad():
        batch = tok(texts[:32], padding=True, truncation=True, max_length=32, return_tensors="pt")
        enc(dict(batch))  # warm-up
        t0 = time.perf_counter()
        for a in range(0, len(texts), 64):
            enc(dict(tok(texts[a:a + 64], padding=True, truncation=True, max_length=32, return_tensors="pt")))
    return (time.perf_counter() - t0) / len(texts)


def tv_section(data: DriftingTargets, nys: NystromCache, quick: bool) -> dict:
    n_tree = min(4000, nys.num_rows)
    tree = SGTree(nys.features[:n_tree])
    tree.build()
    beta, chains = 25.0, 2000 if quick else 6000  # β where 6000 chains resolve TV (floor ~0.03)
    rng = np.random.default_rng(0)
    queries = nys.project(data.queries(3, noise=0.05, drifted=False))

    def tv(m, f, k, length, b=beta, gammas=None):
        out = []
        for q in queries:
            q = q[None]
            p = np.exp(b * (tree.pts @ q[0]).astype(np.float64))
            p /= p.sum()
            prop = find_clustering(tree, q, m, f, k, b)
            states, _ = mh_chains(prop, tree, q, b, chains, length, rng)
            emp = np.bincount(states[0, :, -1], minlength=tree.n) / chains
            out.append(0.5 * np.abs(emp - p).sum())
            if gammas is not None:  # γ = max P/Q, what bounds MH mixing: TV <= exp(-(s-1)/γ)
                qd = np.exp(log_q(prop, np.zeros(tree.n, dtype=np.int64), tree.start[np.arange(tree.n)]))
                gammas.append(float((p / qd).max()))
        return float(np.mean(out))
    g25, g10 = [], []
    tv(-9, 100, 32, 0, gammas=g25)
    tv(-9, 100, 32, 0, b=10.0, gammas=g10)
    res = {"targets_in_tree": n_tree, "beta": beta, "chains": chains,
           "vs_depth": {m: tv(m, 100, 64, 2) for m in (2, -3, -6, -9, -12, -15)},
           "vs_frontier": {f: tv(-12, f, 64, 2) for f in (2, 5, 10, 25, 100)},
           "vs_chain_len": {s: tv(-9, 100, 32, s) for s in (0, 1, 2, 4, 8, 16)},
           # a coarse proposal (small γ = max P/Q is what lets MH steps help, TV <= exp(-(s-1)/γ))
           "vs_chain_len_coarse": {s: tv(-3, 25, 16, s) for s in (0, 1, 2, 4, 8, 16)},
           # at β = 10 the same proposal has γ ~ 1e2 instead of ~ 1e6, and chain length pays
           "vs_chain_len_beta10": {s: tv(-9, 100, 32, s, b=10.0) for s in (0, 1, 2, 4, 8, 16, 32)},
           "gamma_beta25_m-9": float(np.median(g25)), "gamma_beta10_m-9": float(np.median(g10))}
    noise = []  # the floor: TV of `chains` exact softmax draws against the softmax itself
    for q in queries:
        p = np.exp(beta * (tree.pts @ q).astype(np.float64))
        p /= p.sum()
        noise.append(0.5 * np.abs(np.bincount(rng.choice(tree.n, chains, p=p), minlength=tree.n) / chains - p).sum())
    res["sampling_noise_floor"] = float(np.mean(noise))
    res["uniform_sampler"] = float(np.mean([0.5 * np.abs(
        np.bincount(rng.integers(0, tree.n, chains), minlength=tree.n) / chains
        - (lambda p: p / p.sum())(np.exp(beta * (tree.pts @ q).astype(np.float64)))).sum() for q in queries]))
    return res


def regression_section(data: DriftingTargets, d_low: int, quick: bool) -> dict:
    n = data.fresh0.shape[0]
    q = data.queries(100)
    exact = q @ data.fresh1.T
    ids = np.arange(n)
    res = {"vs_s": {}, "vs_w": {}}
    for s in ((512, 4096) if quick else (256, 1024, 4096, 8192)):
        nys = NystromCache(n, d_low, seed=0)
        nys.full_refresh(data.encoder(False))
        stale = nys.reconstruct(ids)
        _, sampled, _ = nys.approximate_reencode(data.encoder(True), s)
        held = np.setdiff1d(ids, sampled)
        res["vs_s"][s] = {"cos_regressed": float(cosine_rows(nys.reconstruct(held), data.fresh1[held]).mean()),
                          "cos_stale": float(cosine_rows(stale, data.fresh1).mean()),
                          "top64_regressed": topk_overlap(nys.project(q) @ nys.features.T, exact, 64),
                          "top64_stale": topk_overlap(q @ stale.T, exact, 64),
                          "top64_stale_brute_full_dim": topk_overlap(q @ data.fresh0.T, exact, 64)}
    horizon, s = 100, 1024  # the drift horizon is 100 "steps"; a refresh every w of them, errors compound
    for w in ((100, 25) if quick else (100, 50, 25, 10)):
        nys = NystromCache(n, d_low, seed=0)
        nys.full_refresh(data.encoder(False))
        for t in range(w, horizon + 1, w):
            nys.approximate_reencode(data.encoder_at(t / horizon), s)
        res["vs_w"][w] = {"refreshes": horizon // w, "encodings": horizon // w * s,
                          "cos": float(cosine_rows(nys.reconstruct(ids), data.fresh1).mean()),
                          "top64": topk_overlap(nys.project(q) @ nys.features.T, exact, 64)}
    return res


def source_section(data: DriftingTargets, cfg: DynamicTreeConfig, sec_per_label: float | None) -> dict:
    n = data.fresh0.shape[0]
    src = DynamicTreeSource(n, cfg, emb_dim=data.fresh0.shape[1])
    t0 = time.perf_counter()
    src.refresh(0, data.encoder(False))
    init_s = time.perf_counter() - t0
    # one refresh interval's drift (a fifth of the horizon), then the approximate re-encode alone
    t0 = time.perf_counter()
    src.nys.approximate_reencode(data.encoder_at(0.2), cfg.regression_samples)
    approx_s = time.perf_counter() - t0
    trees = {}
    for r in (0, -3, -6, -9):
        snap = [(t.parent.copy(), t.level.copy(), [list(c) for c in t.children], t.root) for t in src.trees]
        t0 = time.perf_counter()
        info = [t.rebuild_below(r) for t in src.trees]
        trees[r] = {"seconds": time.perf_counter() - t0, "covering": all(t.check_covering() for t in src.trees),
                    "reinserted": sum(i["reinserted"] for i in info),
                    "escalations": sum(i["escalations"] for i in info)}
        for t, (p, lv, ch, root) in zip(src.trees, snap):  # restore, so every r starts from the same tree
            t.parent[:], t.level[:], t.children, t.root = p, lv, ch, root
            t.finalize()
    t0 = time.perf_counter()
    for t in src.trees:
        t.rebuild()
    full_tree_s = time.perf_counter() - t0
    q = torch.from_numpy(data.queries(256, drifted=False))
    gen = torch.Generator().manual_seed(0)
    src.mine(q[:16], 64, gen)  # warm-up
    t0 = time.perf_counter()
    neg, _ = src.mine(q, 64, gen)
    mine_s = (time.perf_counter() - t0) / len(q)
    def ov(a, b):
        return float(np.mean([len(np.intersect1d(x, y)) / 64 for x, y in zip(a, b)]))
    exact = np.argsort(-(q.numpy() @ data.at(0.2).T), 1)[:, :64]
    cache_top = np.argsort(-(src.nys.project(q) @ src.nys.features.T), 1)[:, :64]
    stale_top = np.argsort(-(q.numpy() @ data.fresh0.T), 1)[:, :64]
    overlap = ov(neg.numpy(), exact)
    diag = {"cache_brute_top64_overlap_with_exact": ov(cache_top, exact),
            "mined_top64_overlap_with_cache_brute": ov(neg.numpy(), cache_top),
            "stale_full_dim_brute_top64_overlap_with_exact": ov(stale_top, exact)}
    sweep = {}  # recall of the cache's own top-64 and cost, vs tree size and frontier
    for per_tree in (25000, 5000):
        for frontier in (100, 400):
            c = DynamicTreeConfig(**{**cfg.__dict__, "num_trees": 0, "targets_per_tree": per_tree,
                                     "frontier": frontier})
            s2 = DynamicTreeSource(n, c, emb_dim=data.fresh0.shape[1])
            s2.nys = src.nys  # same cache; only the forest differs
            s2.trees = [SGTree(src.nys.features[a:b], c.base) for a, b in zip(s2.bounds[:-1], s2.bounds[1:])]
            for t in s2.trees:
                t.build()
            t0 = time.perf_counter()
            got, _ = s2.mine(q[:128], 64, gen)
            sweep[f"{len(s2.trees)} trees of {n // len(s2.trees)}, F={frontier}"] = {
                "recall_of_cache_top64": ov(got.numpy(), cache_top[:128]),
                "seconds_per_query": (time.perf_counter() - t0) / 128}
    out = {"mining_sweep": sweep, "init_full_encode_and_build_s": init_s, "approx_reencode_compute_s": approx_s,
           "tree_rebuild_below": trees, "tree_full_rebuild_s": full_tree_s,
           "mine_seconds_per_query": mine_s, "mined_top64_overlap_with_exact": overlap, **diag,
           "memory_bytes": src.memory_bytes(), "memory": src.memory_fraction()}
    if sec_per_label is not None:
        out["minilm_seconds_per_label"] = sec_per_label
        out["approx_reencode_total_s_est"] = approx_s + cfg.regression_samples * sec_per_label
        out["full_reencode_total_s_est"] = n * sec_per_label
    return out


def plot(results: dict, path: Path) -> None:
    from tools.plots import pyplot  # matplotlib is the `plots` extra: one line where it is missing

    plt = pyplot(__file__)
    fig, ax = plt.subplots(2, 3, figsize=(15, 8.5))
    for label, r in results["sizes"].items():
        tv = r["tv"]
        ax[0, 0].plot(list(map(int, tv["vs_depth"])), list(tv["vs_depth"].values()), "o-", label=f"n={label}: vs m")
        ax[0, 0].plot(list(map(int, tv["vs_chain_len"])), list(tv["vs_chain_len"].values()), "s--",
                      label=f"n={label}: vs chain length (m=-9)")
        ax[0, 0].plot(list(map(int, tv["vs_chain_len_coarse"])), list(tv["vs_chain_len_coarse"].values()), "^:",
                      label=f"n={label}: vs chain length (m=-3, F=25)")
        ax[0, 0].plot(list(map(int, tv["vs_chain_len_beta10"])), list(tv["vs_chain_len_beta10"].values()), "v-.",
                      label=f"n={label}: vs chain length (m=-9, β=10)")
        ax[0, 0].axhline(tv["sampling_noise_floor"], color="grey", lw=0.8)
        ax[0, 1].semilogx(list(map(int, tv["vs_frontier"])), list(tv["vs_frontier"].values()), "o-", label=f"n={label}")
        vs = r["regression"]["vs_s"]
        ax[0, 2].semilogx(list(map(int, vs)), [v["cos_regressed"] for v in vs.values()], "o-",
                          label=f"n={label} regressed")
        ax[0, 2].axhline(next(iter(vs.values()))["cos_stale"], ls="--", color="C3", label=f"n={label} stale")
        vw = r["regression"]["vs_w"]
        ax[1, 0].plot(list(map(int, vw)), [v["top64"] for v in vw.values()], "o-", label=f"n={label} regressed")
        ax[1, 0].axhline(next(iter(vs.values()))["top64_stale_brute_full_dim"], ls="--", color="C3",
                         label=f"n={label} stale brute force")
        tr = r["source"]["tree_rebuild_below"]
        ax[1, 1].bar([f"{label}\nr={k}" for k in tr], [v["seconds"] for v in tr.values()], color="C0")
        ax[1, 1].bar([f"{label}\nfull"], [r["source"]["tree_full_rebuild_s"]], color="C3")
        src = r["source"]
        if "full_reencode_total_s_est" in src:
            ax[1, 2].bar([f"{label}\napprox", f"{label}\nfull"],
                         [src["approx_reencode_total_s_est"], src["full_reencode_total_s_est"]], color=["C0", "C3"])
    ax[0, 0].set(xlabel="deepest level m (F=100) / chain length (m=-9)", ylabel="TV to β-softmax",
                 title="(a) MH output vs softmax")
    ax[0, 1].set(xlabel="frontier F (m=-12, chain 2)", ylabel="TV", title="(a) vs frontier")
    ax[0, 2].set(xlabel="s' (encoded targets)", ylabel="mean cosine to exact", title="(b) regression re-encode")
    ax[1, 0].set(xlabel="w (refresh interval, horizon 100, s'=1024)", ylabel="top-64 overlap with exact",
                 title="(b) vs w, errors compounding")
    ax[1, 1].set(ylabel="seconds (forest)", title="(c) rebuild_below(r) vs full rebuild")
    ax[1, 2].set(ylabel="seconds (MiniLM cost/label, 1 thread)", title="(d) approximate vs full re-encode")
    for a in ax.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--rank", type=int, default=48, help="dominant directions of the synthetic embeddings")
    parser.add_argument("--landmarks", type=int, default=64)
    parser.add_argument("--trees", type=int, default=0, help="0 = one tree per 5000 targets")
    parser.add_argument("--strength", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="tools/results/bench_dyntree.json")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("XC_THREADS", "1")))
    sec_per_label = minilm_seconds_per_label()
    results = {"args": vars(args), "sizes": {}}
    for n in args.sizes:
        print(f"== {n} targets")
        data = DriftingTargets(n, args.dim, clusters=max(50, n // 400), strength=args.strength, seed=0, rank=args.rank)
        cfg = DynamicTreeConfig(num_landmarks=args.landmarks, num_trees=args.trees,
                                regression_samples=min(8192, n // 4), rebuild_level=-6)
        nys = NystromCache(n, args.landmarks, seed=0)
        nys.full_refresh(data.encoder(False))
        r = {"tv": tv_section(data, nys, args.quick)}
        print(" tv", json.dumps(r["tv"])[:300])
        r["regression"] = regression_section(data, args.landmarks, args.quick)
        print(" regression", json.dumps(r["regression"])[:400])
        r["source"] = source_section(data, cfg, sec_per_label)
        print(" source", json.dumps(r["source"])[:600])
        results["sizes"][str(n)] = r
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        plot(results, out.with_suffix(".png"))
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
