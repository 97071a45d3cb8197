"""Hubs among a run's hard negatives, and what the trained model does with frequent labels.

    python tools/hard_negative_hubs.py RUN_DIR [RUN_DIR ...] --out tools/results/hard_negative_hubs_1e6.json

For each run with an asynchronous miner (RUN_DIR/handoff), on its newest generation:
  * concentration: how many distinct labels fill the k_h hard slots of all training queries, and the share
    of the slots taken by the 10 / 100 / 1,000 most used labels; the training frequency and row norm of the
    most used ones;
  * where the exact top-k lies: the share of `--queries` training queries' exact top-k (positives excluded)
    inside the M longest rows of the snapshot, for several M (what `miner.ann.exact_head` relies on).
For every run (with a checkpoint), on `--test` test points: the share of top-5 slots the model gives to the 100
most frequent training labels against their true share, and the share of the points' true frequent labels
it ranks in its top 5: a model that over- or under-ranks the head shows here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def negatives_report(run_dir: Path, queries: int, heads: list[int]) -> dict | None:
    from xc.ann.exact import exact_topk

    negatives = sorted((run_dir / "handoff" / "negatives").glob("gen-*"))
    snapshots = sorted((run_dir / "handoff" / "snapshots").glob("gen-*"))
    if not negatives or not snapshots:
        return None
    manifest = json.loads((negatives[-1] / "manifest.json").read_text())
    shard = manifest["shards"][0]
    neg = np.fromfile(negatives[-1] / shard["file"], dtype=np.int32).reshape(shard["shape"])
    rows = np.load(snapshots[-1] / "W.shard0.npy", mmap_mode="r")
    counts = np.bincount(neg[neg >= 0].ravel(), minlength=rows.shape[0])
    ranked = np.argsort(-counts)
    total = counts.sum()
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    ptr = np.load(run_dir / "handoff" / "static" / "positives.indptr.npy")
    idx = np.load(run_dir / "handoff" / "static" / "positives.indices.npy", mmap_mode="r")
    label_freq = np.bincount(np.asarray(idx), minlength=rows.shape[0]) / (len(ptr) - 1)
    out = {"generation": manifest["generation"], "hard_slots": int(total), "distinct_labels": int((counts > 0).sum()),
           "share_of_slots": {str(t): round(float(counts[ranked[:t]].sum() / total), 4) for t in (10, 100, 1000)},
           "most_used": [{"label": int(i), "slots": int(counts[i]), "row_norm": round(float(norms[i]), 2),
                          "share_of_training_points": round(float(label_freq[i]), 4)}
                         for i in ranked[:10]],
           "row_norm_median": round(float(np.median(norms)), 2)}
    # Where the exact top-k of sampled training queries lies, by norm rank.
    q_all = np.load(snapshots[-1] / "Q.npy", mmap_mode="r")
    sample = np.sort(np.random.default_rng(0).choice(q_all.shape[0], min(queries, q_all.shape[0]), replace=False))
    sample_ptr = np.concatenate([[0], np.cumsum(ptr[sample + 1] - ptr[sample])])
    sample_idx = np.concatenate([np.asarray(idx[ptr[i]:ptr[i + 1]]) for i in sample])
    queries_t = torch.from_numpy(np.ascontiguousarray(q_all[sample]))
    _, top = exact_topk(queries_t, torch.from_numpy(np.ascontiguousarray(rows)), manifest["k_per_shard"],
                        sample_ptr, sample_idx)
    top = top.numpy()
    by_norm = np.empty(len(norms), np.int64)
    by_norm[np.argsort(-norms, kind="stable")] = np.arange(len(norms))
    out["exact_topk_inside_longest_rows"] = {str(m): round(float((by_norm[top] < m).mean()), 4) for m in heads}
    return out


def predictions_report(run_dir: Path, points: int) -> dict:
    import xc
    from xc.inference import encode_rows

    model = xc.load(run_dir)
    c = model.components
    rows = np.arange(min(points, model.dataset.test.num_points))
    q = encode_rows(c.encoder, c.test_inputs, rows, 512, model.ctx)
    top = torch.topk(q @ c.shard.weight[:model.num_labels].float().T, 5, dim=1).indices.numpy()
    freq = np.bincount(np.asarray(model.dataset.train.labels.indices), minlength=model.num_labels)
    head = np.zeros(model.num_labels, bool)
    head[np.argsort(-freq)[:100]] = True
    ptr, idx = model.dataset.test.labels.indptr, model.dataset.test.labels.indices
    truth = [set(np.asarray(idx[ptr[i]:ptr[i + 1]]).tolist()) for i in rows]
    true_head = [{t for t in labels if head[t]} for labels in truth]
    found = [len(set(top[i]) & true_head[i]) / len(true_head[i]) for i in range(len(rows)) if true_head[i]]
    return {"checkpoint": str(model.checkpoint), "test_points": len(rows),
            "P@3": round(float(np.mean([len(set(top[i, :3]) & truth[i]) / 3 for i in range(len(rows))])) * 100, 2),
            "top5_slots_on_100_most_frequent": round(float(head[top].mean()), 4),
            "true_share_per_5_slots": round(float(np.mean([len(t) for t in true_head]) / 5), 4),
            "true_frequent_labels_in_top5": round(float(np.mean(found)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--heads", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "tools" / "results" / "hard_negative_hubs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    for run_dir in args.run_dirs:
        entry = {"negatives": negatives_report(run_dir, args.queries, args.heads),
                 "predictions": predictions_report(run_dir, args.test)}
        print(run_dir, json.dumps(entry), flush=True)
        report[str(run_dir)] = entry
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
