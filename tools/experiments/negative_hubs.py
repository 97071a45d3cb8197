"""How concentrated a run's mined hard negatives are: hubs (a few popular labels drawn for every query) or the
query's own confusable neighbours.

    python tools/experiments/negative_hubs.py RUN_DIR [--generation G] [--out tools/results/negative_hubs.json]

Reads the run's config.json (its data cache and validation split), generation G's negatives table under
RUN_DIR/handoff/negatives/ (G: the newest by default) and the training labels of the cache. Reports, over the
`k_keep` negatives each query trains with (the first columns of the table: the miner's best), how many distinct
labels fill the table, the share of its slots taken by its 100 and 1,000 most used labels, the training points of
the median negative against the median label, and, for synthetic data with label families
(`data.synthetic.family_size`), the share of negatives in the family of one of the query's positives.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from xc.config import build_config  # noqa: E402
from xc.data.inputs import validation_split  # noqa: E402
from xc.handoff import handoff_root, list_generations, read_manifest  # noqa: E402


def cache_dir(cfg) -> Path:
    """The data cache directory the run trained from (one per data name and content hash)."""
    found = sorted((Path(cfg.data.cache_dir) / cfg.data.name).glob("*/meta.json"))
    if not found:
        raise SystemExit(f"no data cache for {cfg.data.name} under {cfg.data.cache_dir}")
    return found[-1].parent


def hub_report(run_dir: Path, generation: int | None = None) -> dict:
    cfg = build_config(json.loads((run_dir / "config.json").read_text()))
    root = handoff_root(run_dir) / "negatives"
    if not generation and not list_generations(root):
        raise SystemExit(f"{root}: no negatives generation (a finished run drops them unless trained with "
                         "train.prune_when_done=false)")
    generation = generation or max(list_generations(root))
    gen_dir = root / f"gen-{generation:06d}"
    manifest = read_manifest(gen_dir)
    if manifest.get("query_rows") is not None:
        raise SystemExit(f"{gen_dir}: mined a window of the queries; this report reads whole tables only")
    data = cache_dir(cfg)
    indptr = np.load(data / "train.labels.indptr.npy")
    labels = np.load(data / "train.labels.indices.npy")
    num_points = len(indptr) - 1
    num_labels = int(json.loads((data / "meta.json").read_text())["num_labels"])
    freq = np.bincount(labels, minlength=num_labels)
    train_ids = validation_split(cfg.data, num_points, cfg.seed)[0] if cfg.data.valid_fraction else \
        np.arange(num_points)
    keep, k = int(manifest["k_keep"]), int(manifest["k_per_shard"])
    tables = []
    for path in sorted(gen_dir.glob("neg.shard*.int32")):
        table = np.memmap(path, dtype=np.int32, mode="r").reshape(-1, k)
        tables.append(np.asarray(table[:, :keep]))  # ids are global label ids, -1 where a row has fewer
    negatives = np.concatenate(tables, axis=1)
    if negatives.shape[0] != len(train_ids):
        raise SystemExit(f"{gen_dir}: {negatives.shape[0]} rows, the run has {len(train_ids)} training rows")
    used = negatives[negatives >= 0]
    counts = np.sort(np.bincount(used, minlength=num_labels))[::-1]
    report = {"run_dir": str(run_dir), "generation": generation, "queries": int(negatives.shape[0]),
              "negatives_per_query": int(negatives.shape[1]), "slots": int(used.size),
              "distinct_labels": int((counts > 0).sum()), "num_labels": num_labels,
              "share_top100": round(float(counts[:100].sum() / used.size), 4),
              "share_top1000": round(float(counts[:1000].sum() / used.size), 4),
              "median_train_points_of_a_negative": float(np.median(freq[used])),
              "median_train_points_of_a_label": float(np.median(freq))}
    family = cfg.data.synthetic.family_size if cfg.data.kind == "synthetic" else 1
    if family > 1:
        rows = np.random.default_rng(0).choice(len(train_ids), min(20_000, len(train_ids)), replace=False)
        same = total = 0
        for r in rows:
            point = train_ids[r]
            families = labels[indptr[point]:indptr[point + 1]] // family
            ids = negatives[r][negatives[r] >= 0]
            same += int(np.isin(ids // family, families).sum())
            total += ids.size
        report["share_in_a_positive_family"] = round(same / max(total, 1), 4)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--generation", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report = hub_report(args.run_dir, args.generation)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
