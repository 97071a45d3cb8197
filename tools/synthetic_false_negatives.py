"""Share of a run's mined hard negatives that are missing true labels, on the synthetic family.

    python tools/synthetic_false_negatives.py RUN_DIR [--generation G] [--rows 3000]

The synthetic generator (xc/data/synthetic.py) drops each generating label of a point with probability
`label_noise`, but the dropped label's signature features stay in the point's text. A label with at least 3
of its 8 signature features in a point is almost surely one of the point's generating labels (a random label:
never, on the 10^6 family; an observed positive: 99.9%), so among the mined ids of a training row those are
false negatives: labels the data dropped, which hard negatives would push down. Prints the share for the
row's positives (the check's sanity), its mined hard negatives and uniform labels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--generation", type=int, default=None, help="default: the newest mined")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--min-signature", type=int, default=3)
    args = ap.parse_args()

    from xc.config import build_config
    from xc.data.inputs import validation_split
    from xc.data.synthetic import label_signatures, normalize_params
    from xc.handoff import handoff_root, list_generations, open_negatives

    cfg = build_config(json.loads((args.run_dir / "config.json").read_text()))
    params = normalize_params({k: v for k, v in vars(cfg.data.synthetic).items() if v is not None})
    data = next((Path(cfg.data.cache_dir) / cfg.data.name).glob("*/meta.json")).parent  # the generated set
    indptr, indices = (np.load(data / f"train.features.{p}.npy", mmap_mode="r") for p in ("indptr", "indices"))
    lab_ptr, lab_ids = (np.load(data / f"train.labels.{p}.npy", mmap_mode="r") for p in ("indptr", "indices"))
    generation = args.generation or list_generations(handoff_root(args.run_dir) / "negatives")[-1]
    tables, _ = open_negatives(args.run_dir, generation, [0])
    mined = tables[0]
    train_ids, _ = validation_split(cfg.data, len(indptr) - 1, cfg.seed)  # table row i = dataset row train_ids[i]
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(mined), min(args.rows, len(mined)), replace=False))

    def share(label_lists) -> float:
        hits = total = 0
        for row, labels in zip(train_ids[rows], label_lists):
            labels = np.asarray([x for x in labels if x >= 0], dtype=np.int64)
            if not len(labels):
                continue
            present = set(indices[indptr[row]:indptr[row + 1]].tolist())
            sigs = label_signatures(labels, params["seed"], params["signature_size"], params["num_features"])
            counts = np.array([len(present & set(s.tolist())) for s in sigs])
            hits, total = hits + int((counts >= args.min_signature).sum()), total + len(counts)
        return hits / max(total, 1)

    out = {"run_dir": str(args.run_dir), "generation": generation, "rows": len(rows),
           "positives": share([lab_ids[lab_ptr[r]:lab_ptr[r + 1]] for r in train_ids[rows]]),
           "mined_hard_negatives": share([mined[i] for i in rows]),
           "uniform_labels": share([rng.integers(0, params["num_labels"], mined.shape[1]) for _ in rows])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
