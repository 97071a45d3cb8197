"""`xc-predict`: top-k labels of new inputs from a trained run, as JSON lines.

    echo "python library for fast json parsing" | xc-predict runs/debian_deps-astra --input - --k 5
    xc-predict runs/bibtex-astra --input queries.txt --out preds.jsonl      # XC feature lines id:value ...
    xc-predict runs/big --input X.npz --ann diskann --save-index            # ANN serving, index kept in the run

One output line per input row: {"ids": [...], "scores": [...], "names": [...]} (names where the data has
label names); with --min-score P, only the labels whose calibrated probability is at least P, and their
"probs". Inputs stream in blocks of --block-rows, with a progress bar on stderr; the queries per
second go to stderr at the end. `--input -` reads stdin; the output defaults to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from xc.ann.base import NEIGHBOURS, NEIGHBOURS_SAVE_REFUSED, SERVE_BACKENDS
from xc.cli.entry import command_main
from xc.errors import XCError
from xc.fsutil import storage_error


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xc-predict", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("run_dir", help="run directory holding checkpoints/")
    parser.add_argument("--input", required=True, help="raw text lines, XC feature lines, or an .npz; '-' = stdin")
    parser.add_argument("--format", default="auto", choices=["auto", "text", "sparse", "npz"],
                        help="input format (auto: .npz by name, XC feature lines by their look, else text)")
    parser.add_argument("--k", type=int, default=10, help="labels per input row (default 10)")
    parser.add_argument("--out", help="JSON lines output file (default: stdout)")
    parser.add_argument("--checkpoint", help="a specific checkpoint directory (default: newest valid)")
    parser.add_argument("--batch-size", type=int, help="rows per encoder batch (default: the run's eval.batch_size)")
    parser.add_argument("--block-rows", type=int, default=8192, help="input rows read and searched at a time")
    parser.add_argument("--ann", choices=SERVE_BACKENDS,
                        help="serve top-k from ANN indexes over the label rows, or from the input's nearest training "
                             "points (neighbours)")
    parser.add_argument("--save-index", action="store_true",
                        help="with --ann: save the built indexes to RUN_DIR/serving/<backend>/ for later runs")
    parser.add_argument("--no-fusion", action="store_true",
                        help="the plain model's scores, without the kNN fusion training chose (RUN_DIR/fusion.json)")
    parser.add_argument("--min-score", type=float, metavar="P",
                        help="only the labels whose calibrated probability is at least P (of the --k best; the map "
                             "training fitted on validation, RUN_DIR/calibration.json); adds \"probs\" to each line")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    return parser


def _check(args) -> None:
    if args.k < 1:
        raise XCError(f"--k must be >= 1, got {args.k}")
    if args.batch_size is not None and args.batch_size < 1:
        raise XCError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.block_rows < 1:
        raise XCError(f"--block-rows must be >= 1, got {args.block_rows}")
    if args.min_score is not None and not 0.0 <= args.min_score <= 1.0:
        raise XCError(f"--min-score is a probability in [0, 1], got {args.min_score}")
    if args.min_score is not None and (args.ann or args.no_fusion):
        raise XCError("--min-score needs the scores the calibration was fitted on: drop --ann / --no-fusion")
    if args.save_index and not args.ann:
        raise XCError("--save-index needs --ann BACKEND (the exact search has no index to save)")
    if args.save_index and args.ann == NEIGHBOURS:
        raise XCError(NEIGHBOURS_SAVE_REFUSED)
    if args.out:  # before the model loads: its folder is made (or refused) now, not after the work
        out = Path(args.out)
        if out.is_dir():
            raise XCError(f"--out {out} is a directory; name a file for the JSON lines")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise XCError(f"--out {out}: cannot create its folder {out.parent} ({exc.strerror})") from None


@contextmanager
def _stdout_to_stderr(active: bool):
    """Point file descriptor 1 at stderr for the block (native libraries write to it directly)."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _out_error(exc: OSError, out: str, rows: int = 0) -> BaseException:
    """A storage failure (disk full, read-only, permission, quota) writing --out: one XCError line naming the file
    and the fix; any other OSError as it is (a closed pipe: command_main's BrokenPipeError)."""
    error = storage_error(exc, f"could not write --out {out}" + (f" after {rows} rows" if rows else ""),
                          "free some space, fix the folder's permissions, or pass another --out FILE")
    return error if error is not exc else exc


def run(args) -> dict:
    """Predict every input row, write JSON lines; returns {"rows", "seconds", "qps", "ann_reused"}."""
    from tqdm import tqdm

    from xc.serve.load import load  # lazy: the serving stack (+0.55 s) stays off --help and argument errors
    from xc.data.queries import read_queries  # lazy: loads the data package (scipy, +0.27 s), as above

    model = load(args.run_dir, args.checkpoint, device=args.device, batch_size=args.batch_size)
    log = logging.getLogger("xc.cli.predict")
    with _stdout_to_stderr(not args.out):  # diskannpy's build prints to fd 1, which may carry the JSON lines
        searcher = model.use_ann(args.ann, save_index=args.save_index) if args.ann else None
    fusion = not args.no_fusion
    if args.k > model.num_labels:  # said once, not left to look like a short answer
        log.info("--k %d is more than the run's %d labels: every row gets all %d", args.k, model.num_labels,
                 model.num_labels)
        args.k = model.num_labels
    if model.fusion is not None and fusion and args.ann:
        log.info("kNN fusion is not applied with --ann: the ANN indexes serve the plain model")
    fmt, blocks = read_queries(args.input, args.format, args.block_rows, model.num_features)
    log.info("%s: %s, reads %s; input %s as %s", model.run_dir, model.checkpoint.name, model.input_kind,
             args.input, fmt)
    rows, start = 0, time.perf_counter()
    # --out is written as a hidden sibling and renamed when every row is in: a failure (disk full, file size limit,
    # a bad input row, Ctrl-C) leaves no partial file, and an earlier file of that name as it was
    part = Path(args.out).with_name(f".{Path(args.out).name}.part-{os.getpid()}") if args.out else None
    try:
        sink = open(part, "w", encoding="utf-8") if part else nullcontext(sys.stdout)
    except OSError as exc:
        raise _out_error(exc, args.out) from None
    try:
        with sink as out, tqdm(desc="predict", unit="row", file=sys.stderr, disable=None, mininterval=1.0) as bar:
            for block in blocks:
                preds = model.predict(block, k=args.k, fusion=fusion, threshold=args.min_score)
                try:
                    out.write("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in preds.records()))
                    out.flush()
                except OSError as exc:
                    raise _out_error(exc, args.out or "stdout", rows) from None
                rows += len(block)
                bar.update(len(block))
            if part:
                try:
                    os.fsync(out.fileno())
                except OSError as exc:
                    raise _out_error(exc, args.out, rows) from None
        if part:
            try:
                os.replace(part, args.out)
            except OSError as exc:
                raise _out_error(exc, args.out, rows) from None
    except BaseException:
        if part:
            part.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - start
    stats = {"rows": rows, "seconds": round(seconds, 3), "qps": round(rows / seconds, 1) if seconds > 0 else 0.0,
             "ann_reused": bool(searcher is not None and getattr(searcher, "reused", False))}
    print(f"predicted {rows} rows in {seconds:.2f}s: {stats['qps']:.1f} queries/s "
          f"({args.ann or 'exact'} search{', kNN fusion' if fusion and model.fusion and not args.ann else ''})",
          file=sys.stderr)
    return stats


def main(argv: list[str] | None = None) -> int:
    return command_main(_parser(), _check, run, argv)


if __name__ == "__main__":
    sys.exit(main())
