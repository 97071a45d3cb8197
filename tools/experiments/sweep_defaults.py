"""How the defaults were chosen: candidate configurations x datasets, judged on the validation split.

    python tools/experiments/sweep_defaults.py --variants base softmax wide --datasets bibtex delicious debian_deps \
        --workers 8 --threads 2 --out tools/results/sweep_defaults.json

Each run is a plain `xc.cli.train` with the variant's overrides, so the held-out validation split
(`data.valid_fraction`) decides: the table ranks variants by their mean validation P@k (fused and
model alone) over the datasets. Test metrics are recorded beside them for the docs, never used to choose.
Results are written after every finished run, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SOFTMAX = ["sampler.loss=softmax"]
WIDE = ["model.embed_dim=1024", "model.dropout=0.5"]
DEEP = ["model.embed_dim=1024", "model.hidden_dims=[512]", "model.dropout=0.3"]
VARIANTS: dict[str, list[str]] = {
    "default": [],  # the shipped defaults, nothing overridden
    "bce": ["sampler.loss=bce"],
    "softmax": SOFTMAX,
    "wide": SOFTMAX + WIDE,
    "wide_bce": WIDE + ["sampler.loss=bce"],
    "deep": SOFTMAX + DEEP,
    "deep_bce": DEEP + ["sampler.loss=bce"],
    "mid": SOFTMAX + ["model.embed_dim=512", "model.hidden_dims=[512]", "model.dropout=0.5"],
    "deep_lr03": SOFTMAX + DEEP + ["train.lr_classifier=0.3"],
    "deep_lr003": SOFTMAX + DEEP + ["train.lr_classifier=0.03"],
    "deep_b128": SOFTMAX + DEEP + ["train.batch_size=128"],
    "deep_enc3e3": SOFTMAX + DEEP + ["train.lr_encoder=0.003"],
    "sgd": SOFTMAX + ["train.optimizer_classifier=sgd"],
    "deep_noaug": SOFTMAX + DEEP + ["data.label_text_augmentation=false"],
    "softmax_noaug": SOFTMAX + ["data.label_text_augmentation=false"],
    "wide_do7": SOFTMAX + ["model.embed_dim=1024", "model.dropout=0.7"],
    "wide_lr03": SOFTMAX + WIDE + ["train.lr_classifier=0.3"],
    "wide_do7_enc3e3": SOFTMAX + ["model.embed_dim=1024", "model.dropout=0.7", "train.lr_encoder=0.003"],
    "deep_do5_lr03": SOFTMAX + ["model.embed_dim=1024", "model.hidden_dims=[512]", "model.dropout=0.5",
                                "train.lr_classifier=0.3"],
    "wide_b128": SOFTMAX + WIDE + ["train.batch_size=128"],
    # round 3 (after the adaptive defaults): feature dropout, a per-label bias
    "indrop2": ["model.input_dropout=0.2"],
    "bias": ["model.label_bias=true"],
    # round 4: one model where the defaults train an ensemble (small data); member 0 of each ensemble is this model
    "single": ["train.ensemble=1"],
    # round 5: ASTRA's random part drawn from the popularity proposal (docs/negatives_that_pay.md)
    "popprop": ["sampler.random_proposal=popularity"],
    "uniprop": ["sampler.random_proposal=uniform"],
}
_DATA = os.environ.get("XC_DATA", str(REPO.parent / "shared" / "data"))
DATASETS = {"bibtex": ["data=bibtex"], "delicious": ["data=delicious"],
            "debian_deps": ["data=debian_deps", "data.label_text_augmentation=false"],
            # Bibtex's tf-idf under a fixed random projection to 128 dense dimensions: a dense-feature set, read
            # as npz like a user's own (python tools/experiments/make_dense_proxy.py --data ../shared/data/bibtex --out DIR)
            "bibtex_dense": ["data.kind=npz", f"data.path={os.environ.get('XC_DENSE_PROXY', '/tmp/bibtex-dense128')}",
                             "data.name=bibtex_dense"]}


def run_one(variant: str, dataset: str, seed: int, out_dir: Path, threads: int, extra: list[str]) -> dict:
    run_dir = out_dir / f"{variant}-{dataset}-s{seed}"
    args = [*DATASETS[dataset], *VARIANTS[variant], *extra, f"seed={seed}", f"run_dir={run_dir}",
            "logger.wandb=disabled", "logger.progress=false", "train.resume=never"]
    env = dict(os.environ, XC_THREADS=str(threads), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xc.cli.train", *args], cwd=REPO, env=env, capture_output=True, text=True)
    row = {"variant": variant, "dataset": dataset, "seed": seed, "args": args, "seconds": round(time.perf_counter() - start, 1),
           "rc": proc.returncode}
    if proc.returncode != 0:
        row["error"] = proc.stderr[-1500:]
        return row
    metrics = json.loads((run_dir / "metrics.json").read_text())
    row["test"] = {k: round(v, 2) for k, v in metrics.items() if isinstance(v, float) and "@" in k
                   and k.split("/")[-1].split("@")[0] in ("P", "PSP")}
    fusion, ensemble = run_dir / "fusion.json", run_dir / "ensemble.json"
    if ensemble.exists():  # an ensemble (small data): its validation P@k beside its members' (xc/ensemble/members.py)
        record = json.loads(ensemble.read_text())
        row["valid"] = {"model": None, "fused": record["valid"], "members": record["valid_members"]}
        row["members"] = record["members"]
    elif fusion.exists():
        record = json.loads(fusion.read_text())
        row["valid"] = {"model": record.get("valid_model"), "fused": record.get("valid_fused")}
        row["choice"] = {k: record[k] for k in ("lambda", "k", "space")}
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per variant: mean validation (fused, model) and test P@1 over the datasets it finished on."""
    table = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        done = [r for r in rows if r["variant"] == variant and r.get("valid")]
        if not done:
            continue
        mean = lambda xs: round(sum(xs) / len(xs), 2)  # noqa: E731
        table.append({"variant": variant, "datasets": [r["dataset"] for r in done],
                      "valid_fused": mean([r["valid"]["fused"] for r in done]),
                      "valid_model": mean([r["valid"]["model"] for r in done if r["valid"]["model"] is not None] or [0.0]),
                      "test_P@1": mean([r["test"]["P@1"] for r in done])})
    return sorted(table, key=lambda t: -t["valid_fused"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="XC_THREADS per run")
    parser.add_argument("--runs-dir", default="/tmp/xc-sweep")
    parser.add_argument("--out", default=str(REPO / "tools" / "results" / "sweep_defaults.json"))
    parser.add_argument("extra", nargs="*", help="overrides added to every run (e.g. train.device=cuda)")
    args = parser.parse_intermixed_args()
    jobs = [(v, d, s) for d in args.datasets for v in args.variants for s in args.seeds
            if not (v.endswith("noaug") and d != "debian_deps")]
    # longest first: the raw-text set, then Delicious, then Bibtex
    order = {"debian_deps": 0, "delicious": 1, "bibtex": 2, "bibtex_dense": 3}
    jobs.sort(key=lambda j: order[j[1]])
    rows: list[dict] = []
    with ThreadPoolExecutor(args.workers) as pool:
        futures = [pool.submit(run_one, v, d, s, Path(args.runs_dir), args.threads, args.extra) for v, d, s in jobs]
        for fut in as_completed(futures):
            row = fut.result()
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("variant", "dataset", "seed", "seconds", "valid", "test", "choice",
                                                      "error")})[:600], flush=True)
            Path(args.out).write_text(json.dumps({"runs": rows, "summary": summarise(rows)}, indent=1))
    print(json.dumps(summarise(rows), indent=1))


if __name__ == "__main__":
    main()
