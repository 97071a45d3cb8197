"""`xc-eval`: evaluate (and optionally save predictions of) a checkpoint on the test split.

    xc-eval runs/bibtex-astra                       # newest valid checkpoint, all test points
    xc-eval runs/bibtex-astra --topk 100 --predictions preds.npz --out metrics.json
    xc-eval runs/bibtex-astra --ann diskann --save-index   # keep the indexes in RUN_DIR/serving/diskann/
    torchrun --nproc-per-node 2 -m xc.cli.evaluate runs/big   # exact sharded inference over 2 ranks

The checkpoint's own config is used (data, model, label layout); any world size that divides the
run's number of label shards can evaluate it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from xc.run.readers import reading
from xc.run.resume import load_serving_weights
from xc.run.runlog import setup_stdout_logging
from xc.ann.base import NEIGHBOURS, NEIGHBOURS_SAVE_REFUSED, SERVE_BACKENDS
from xc.config import build_config
from xc.cli.entry import check_eval_args
from xc.distributed import init_distributed, shutdown
from xc.errors import XCError
from xc.eval.inference import encode_rows, predict
from xc.eval.metrics import evaluate, inverse_propensities, true_labels
from xc.fsutil import storage_error, storage_failure
from xc.serve.ann import AnnSearcher, SavedIndexes


def evaluate_checkpoint(run_dir: str, checkpoint: str | None = None, topk: int | None = None,
                        max_points: int | None = None, predictions: str | None = None,
                        ann: str | None = None, fusion: bool = True, save_index: bool = False) -> dict[str, float]:
    """Metrics of a checkpoint on the test split (rank 0; {} elsewhere).

    With `ann` (a backend name) predictions come from ANN indexes over the classifier shards; the
    result then also holds the exact-inference metrics under "exact/..." and "ann_recall@k".
    Saved indexes under RUN_DIR/serving/<backend>/ are reused when they match the checkpoint (xc/serve/ann.py);
    `save_index` writes freshly built ones there (one process). Otherwise, where training chose a kNN fusion
    (RUN_DIR/fusion.json) and `fusion` holds, the fused model is evaluated with that choice, as training
    reported it (the plain model under "model/..."); `predictions` then holds the fused top-k. Exact inference
    of the run's final checkpoint adds the label prior training chose (RUN_DIR/prior.json), as training did.
    """
    from xc.serve.load import refuse_unfinished_ensemble  # lazy: scipy (+0.3 s), kept off xc-eval --help

    if checkpoint is None:
        refuse_unfinished_ensemble(run_dir)
    if checkpoint is None and (Path(run_dir) / "ensemble.json").exists():  # an ensemble: its members, averaged
        from xc.serve.ensemble import evaluate_ensemble  # lazy: scipy, as above

        return evaluate_ensemble(run_dir, topk, max_points, predictions, ann, fusion, save_index)
    with reading(run_dir, checkpoint) as held:  # a trainer still running there prunes: the files are held
        return _evaluate_found(run_dir, held.path, held.meta, held.files, checkpoint, topk, max_points, predictions,
                               ann, fusion, save_index)


def _evaluate_found(run_dir: str, path: Path, meta: dict, files: Path, checkpoint: str | None, topk: int | None,
                    max_points: int | None, predictions: str | None, ann: str | None, fusion: bool,
                    save_index: bool) -> dict[str, float]:
    """evaluate_checkpoint on the checkpoint directory `path` (its validated meta.json `meta`), read from `files`,
    the directory its files are held in (xc/run/readers.py)."""
    from xc.train.components import build_components  # lazy: scipy (+0.3 s), kept off xc-eval --help
    from xc.datasets import load_configured_dataset  # lazy: scipy, as above
    if meta.get("mode") == "dual":  # through xc.load, which checks a named checkpoint's run itself
        return _evaluate_dual(run_dir, path, topk, max_points, predictions, ann, fusion, save_index)
    raw = meta["config"]
    raw["parallel"]["num_label_shards"] = meta["num_label_shards"]
    raw["logger"]["wandb"] = "disabled"
    if topk:
        raw["eval"]["topk"] = max(topk, max(raw["eval"]["ks"]))
    if max_points is not None:
        raw["eval"]["max_points"] = max_points
    cfg = build_config(raw)
    ctx = init_distributed(cfg.parallel.backend, cfg.train.device)
    setup_stdout_logging(ctx.rank)
    if cfg.train.amp == "fp16" and ctx.device.type != "cuda":  # a model trained with fp16 autocast on a GPU,
        from dataclasses import replace  # evaluated here: the encoder runs in fp32 (fp16 autocast needs CUDA)

        cfg = replace(cfg, train=replace(cfg.train, amp="none"))
    try:
        from xc.serve.model import foreign_checkpoint_note  # lazy: scipy (+0.3 s), kept off xc-eval --help

        # named, or copied into the run's checkpoints/: the run's fusion, ranker and prior fit its own model only
        foreign = foreign_checkpoint_note(Path(run_dir), path, meta)
        if foreign:
            fusion = False
        dataset = load_configured_dataset(cfg)
        c = build_components(cfg, ctx, dataset, optimizers=False)
        # its messages, never torch's advice to unpickle; mapped: the optimiser state is never read
        load_serving_weights(files, meta, c.encoder, c.shard)
        if not (ann or checkpoint or foreign):  # scored as training's final evaluation did; ANN serving: plain
            from xc.fitting.label_prior import install_for_run  # lazy: scipy (+0.3 s), kept off xc-eval --help

            install_for_run(c.shard, run_dir, dataset.train.labels, c.train.train_ids, dataset.num_labels)
        n = dataset.test.num_points if not cfg.eval.max_points else min(cfg.eval.max_points, dataset.test.num_points)
        rows = np.arange(n, dtype=np.int64)
        scores, ids = predict(c.encoder, c.shard, c.test_inputs, rows, cfg.eval.topk, cfg.eval.batch_size, ctx)
        extra: dict[str, float] = {}
        if ann:
            from dataclasses import replace

            if save_index and ctx.world_size > 1:
                raise XCError("--save-index builds every shard's index in one process; run xc-eval without torchrun")
            if ann == NEIGHBOURS:  # the labels of the query's nearest training points (xc/serve/neighbours.py)
                from xc.serve.neighbours import neighbour_searcher  # lazy: scipy (+0.3 s), kept off xc-eval --help

                points = np.arange(dataset.train.num_points, dtype=np.int64)
                searcher = neighbour_searcher(cfg.miner.ann, c.shard, dataset.train.labels, lambda: encode_rows(
                    c.encoder, c.train.split_inputs, points, cfg.eval.batch_size, ctx))
            else:
                store = SavedIndexes(run_dir, ann, {"checkpoint": path.name, "global_step": int(meta["global_step"])})
                searcher = AnnSearcher(c.shard, c.layout, c.my_shards, replace(cfg.miner.ann, backend=ann),
                                       store=store, save=save_index)
            exact_ids = ids
            scores, ids = predict(c.encoder, c.shard, c.test_inputs, rows, cfg.eval.topk, cfg.eval.batch_size, ctx,
                                  searcher=searcher)
            hits = [len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(ids, exact_ids)]
            extra = {f"ann_recall@{cfg.eval.topk}": 100.0 * float(np.mean(hits)) / cfg.eval.topk,
                     "ann_build_seconds": searcher.build_seconds, "ann_search_seconds": searcher.search_seconds}
            if searcher.tuning is not None:  # the breadth serving chose on its probe (xc/ann/breadth.py)
                extra.update(ann_breadth=float(searcher.tuning.chosen), ann_tuning_seconds=searcher.tuning.seconds,
                             ann_probe_seconds_per_query=searcher.tuning.query_seconds[searcher.tuning.chosen],
                             exact_probe_seconds_per_query=searcher.tuning.exact_query_seconds)
        from xc.fitting.fusion import FusionChoice  # lazy: scipy (+0.3 s), kept off xc-eval --help

        choice = FusionChoice.read(run_dir)
        if fusion and not ann and choice is not None and cfg.model.mode == "classifier":
            from xc.fitting.memory import FusionEvaluator  # lazy: scipy (+0.3 s), kept off xc-eval --help
            from xc.fitting.model_memory import ModelMemory  # lazy: with the evaluator above

            memory = FusionEvaluator([ModelMemory.of(cfg, c, dataset, ctx)], dataset)
            memory.use_saved_ranker(run_dir, choice)
            metrics = memory.test_metrics(choice, rows)
            if ctx.is_main and predictions:  # the fused top-k (scores are fused probabilities)
                fused_scores, fused_ids = memory.test_predictions
                _save_predictions(predictions, metrics, ids=fused_ids, scores=fused_scores, fused=True)
            return metrics
        metrics: dict[str, float] = {}
        if ctx.is_main:
            indptr, truth = true_labels(dataset.test.labels, first=n)
            metrics = evaluate(ids, indptr, truth, c.inv_propensity, ks=tuple(cfg.eval.ks))
            if ann:
                exact = evaluate(exact_ids, indptr, truth, c.inv_propensity, ks=tuple(cfg.eval.ks))
                metrics.update({f"exact/{k}": v for k, v in exact.items()}, **extra)
            if predictions:
                _save_predictions(predictions, metrics, ids=ids, scores=scores)
        return metrics
    finally:
        shutdown()


class PredictionsNotWritten(XCError):
    """--predictions could not be written (a storage failure): carries the metrics, which main prints first."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics


def _save_predictions(path: str, metrics: dict[str, float], **arrays) -> None:
    """np.savez to `path` (".npz" appended as numpy does) through a temporary file and a rename; a storage failure is
    a PredictionsNotWritten naming the file and the fix, with nothing half-written left."""
    target = path if path.endswith(".npz") else path + ".npz"
    tmp = f"{target}.part-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp, target)
    except OSError as exc:
        error = storage_error(exc, f"could not write --predictions {target}",
                              "free some space, fix the folder's permissions, or pass another --predictions FILE")
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if error is exc:
            raise
        raise PredictionsNotWritten(str(error), metrics) from None


def _evaluate_dual(run_dir: str, path: Path, topk: int | None, max_points: int | None, predictions: str | None,
                   ann: str | None, fusion: bool, save_index: bool) -> dict[str, float]:
    """A dual-mode checkpoint on its test split, in one process, through `xc.load` (the label table is every
    label text re-encoded, + free vectors); the fused model where training chose a fusion, as it reported."""
    if int(os.environ.get("RANK", "0")) != 0:  # one process holds every label shard; other ranks idle
        return {}
    from xc.data import read_texts  # lazy: scipy (+0.3 s), kept off xc-eval --help
    from xc.serve.model import TrainedModel  # lazy: scipy, as above

    model = TrainedModel(run_dir, path)
    cfg, test = model.cfg, model.dataset.test
    k = max(topk or cfg.eval.topk, max(cfg.eval.ks))
    n = test.num_points if not max_points else min(max_points, test.num_points)
    if ann:
        model.use_ann(ann, save_index=save_index)
    pred = model.predict(read_texts(test.texts_path)[:n], k=k, fusion=fusion)
    indptr, indices = true_labels(test.labels, first=n)
    inv = inverse_propensities(model.dataset.train, cfg.eval.propensity_a, cfg.eval.propensity_b)
    metrics = evaluate(pred.ids, indptr, indices, inv, ks=tuple(cfg.eval.ks))
    if predictions:
        _save_predictions(predictions, metrics, ids=pred.ids, scores=pred.scores, fused=pred.fused)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xc-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory holding checkpoints/")
    parser.add_argument("--checkpoint", help="a specific checkpoint directory (default: newest valid)")
    parser.add_argument("--topk", type=int, help="labels to predict per point (default: the run's eval.topk)")
    parser.add_argument("--max-points", type=int, help="evaluate the first N test points only")
    parser.add_argument("--predictions", help="write top-k ids and scores to this .npz")
    parser.add_argument("--out", help="write the metrics to this JSON file (default: RUN_DIR/eval.json)")
    parser.add_argument("--ann", choices=SERVE_BACKENDS,
                        help="serve with ANN indexes over the classifier shards, or from the query's nearest training "
                             "points (neighbours); reports exact metrics and recall too")
    parser.add_argument("--save-index", action="store_true",
                        help="with --ann: save the built indexes to RUN_DIR/serving/<backend>/ for later runs to reuse")
    parser.add_argument("--no-fusion", action="store_true",
                        help="evaluate the plain model, without the kNN fusion training chose (RUN_DIR/fusion.json)")
    args = parser.parse_args(argv)
    try:
        check_eval_args(args)
        if args.save_index and not args.ann:
            raise XCError("--save-index needs --ann BACKEND (the exact search has no index to save)")
        if args.save_index and args.ann == NEIGHBOURS:
            raise XCError(NEIGHBOURS_SAVE_REFUSED)
        metrics = evaluate_checkpoint(args.run_dir, args.checkpoint, args.topk, args.max_points, args.predictions,
                                      args.ann, not args.no_fusion, args.save_index)
    except PredictionsNotWritten as exc:  # the metrics were computed: printed and written all the same
        metrics, failed = exc.metrics, exc
    except XCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    else:
        failed = None
    if metrics:
        print("  ".join(f"{k}={v:.2f}" for k, v in metrics.items()))  # first: a failed write below loses nothing
        out = args.out or os.path.join(args.run_dir, "eval.json")
        try:
            Path(out).write_text(json.dumps(metrics, indent=1))
        except OSError as exc:
            print(f"error: could not write {out}: {storage_failure(exc) or exc.strerror}; the metrics are above: "
                  "free some space, fix the folder's permissions, or pass another --out FILE", file=sys.stderr)
            return 2
    if failed is not None:
        print(f"error: {failed}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
