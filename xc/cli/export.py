"""`xc-export`: a trained run written as files that load without unpickling anything (safetensors and JSON).

    xc-export runs/bibtex-astra exports/bibtex                  # the run's model, fusion, prior, ranker, kNN memory
    xc-predict exports/bibtex --input queries.txt --k 5         # served like the run itself
    python -c "import xc; print(xc.load('exports/bibtex'))"

DIR must be new, empty, or an earlier export holding nothing but its own files (which is then replaced; a file
of yours inside it stops the export). The export is written into a hidden sibling of DIR, loaded back and checked
to predict what the run predicts on the first --verify-rows test rows (ids and scores equal, with fusion), and only
then renamed to DIR: a crash, a failed check, a full disk or Ctrl-C leaves DIR as it was and no hidden sibling.
A run still training (its lock held) is refused: its fusion, prior and calibration come when training ends
(--allow-running exports its newest checkpoint as it is, with a warning). The layout of DIR: xc/serve/export.py
and docs/serving.md, "Exporting a model".
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from xc.cli.entry import command_main
from xc.errors import XCError

log = logging.getLogger("xc.cli.export")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xc-export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("run_dir", help="run directory holding checkpoints/ (one model or an ensemble)")
    parser.add_argument("dest", help="folder to write the export into: new, empty, or an earlier export")
    parser.add_argument("--checkpoint", help="a specific checkpoint directory (default: the run's model, as xc.load "
                                             "chooses it)")
    parser.add_argument("--verify-rows", type=int, default=256,
                        help="test rows the export must predict exactly as the run does before it is published "
                             "(default 256; 0 skips the check)")
    parser.add_argument("--allow-running", action="store_true",
                        help="export a run that is still training (its newest checkpoint, without the fusion, label "
                             "prior and calibration training ends with)")
    return parser


def _check(args) -> None:
    """Refusals that need no model: said before the run is loaded, not after."""
    from xc.serve.export import check_destination, is_export, refuse_running  # lazy: serving stack (+0.4 s)

    run = Path(args.run_dir)
    if not run.is_dir():
        raise XCError(f"{run} is not a directory; name a run directory (it holds checkpoints/)")
    if is_export(run):
        raise XCError(f"{run} is already an export: copy the folder instead")
    if args.verify_rows < 0:
        raise XCError(f"--verify-rows must be >= 0, got {args.verify_rows}")
    dest = Path(args.dest)
    if dest.resolve() == run.resolve():
        raise XCError(f"{dest} is the run directory itself; name a new or empty folder for the export")
    check_destination(dest)
    if not args.allow_running:  # said before the run is loaded (export_model warns where it is allowed)
        refuse_running(run)


def check_rows(model, n: int) -> list:
    """Up to n of the run's test rows in every form the export must serve alike: feature rows (SparseMatrix), and
    the same points' raw texts where the run's data is raw text featurised by its tf-idf vocabulary."""
    from xc.serve.ensemble import split_test_inputs  # lazy: serving stack (scipy, +0.4 s), kept off --help

    test = model.dataset.test
    n = min(n, test.num_points)
    if n == 0:
        return []
    inputs = [split_test_inputs(model, n)]
    if test.texts_path and model.dataset.meta.get("text_features"):
        from xc.data import read_texts  # lazy: scipy (+0.3 s), kept off --help

        inputs.append(read_texts(test.texts_path)[:n])
    return inputs


def verifier(model, inputs: list, k: int):
    """check(folder): the export in `folder`, loaded as `xc.load` loads it, predicts `inputs` exactly as `model` does
    (ids and scores equal, with fusion and without); raises XCError naming the first row that differs."""
    import numpy as np

    from xc.serve.export import load_export  # lazy: serving stack (scipy, +0.4 s), kept off --help

    expected = [(model.predict(x, k=k), model.predict(x, k=k, fusion=False)) for x in inputs]

    def check(folder: Path) -> None:
        exported = load_export(folder)
        for x, (fused, plain) in zip(inputs, expected):
            kind = "raw texts" if isinstance(x, list) else "feature rows"
            for want, got in ((fused, exported.predict(x, k=k)), (plain, exported.predict(x, k=k, fusion=False))):
                same = (want.ids == got.ids).all(1) & (want.scores == got.scores).all(1)
                if not same.all():
                    row = int(np.argmin(same))
                    raise XCError(f"the export does not reproduce {model.run_dir} on test row {row} ({kind}, "
                                  f"{'fused' if want.fused else 'plain'}: ids {got.ids[row].tolist()} against "
                                  f"{want.ids[row].tolist()}); nothing was published")
    return check


def describe(model, manifest: dict) -> str:
    """One line of what the export serves: model or ensemble, checkpoint(s), labels, prior, fusion."""
    fusion = model.fusion.as_dict() if model.fusion is not None else None
    prior = getattr(model, "prior_beta", None)
    if prior is None and manifest["kind"] == "ensemble":
        prior = model.members[0].prior_beta
    what = model.checkpoint.name if manifest["kind"] == "model" else f"{len(manifest['models'])} members"
    parts = [f"{manifest['kind']} ({what})", f"{manifest['num_labels']} labels"]
    parts.append(f"label prior beta {prior:g}" if prior else "no label prior")
    if fusion:
        ranker = f", lexical ranker gamma {fusion['gamma']:g}" if fusion.get("gamma") else ""
        parts.append(f"kNN fusion lambda {fusion['lambda']:g}, k {fusion['k']}, {fusion['space']} space{ranker} over "
                     f"{manifest['memory_points']} training points")
    else:
        parts.append("no kNN fusion")
    if manifest["text_features"]:
        parts.append(f"raw text through its tf-idf vocabulary ({manifest['num_features']} terms)")
    return "; ".join(parts)


def run(args) -> dict:
    """Load the run, export it (checked before it is published); returns the manifest."""
    from xc.serve.load import load  # lazy: serving stack (scipy, +0.4 s), kept off --help
    from xc.serve.export import export_model  # lazy: as above

    start = time.perf_counter()
    model = load(args.run_dir, args.checkpoint)
    inputs = check_rows(model, args.verify_rows) if args.verify_rows else []
    check = verifier(model, inputs, k=min(model.num_labels, max(model.cfg.eval.topk, 10))) if inputs else None
    manifest = export_model(model, args.dest, check=check, allow_running=args.allow_running)
    size = sum(f["bytes"] for f in manifest["files"].values())
    print(f"exported {args.run_dir} to {args.dest}: {describe(model, manifest)}", file=sys.stderr)
    rows = min(args.verify_rows, model.dataset.test.num_points)
    checked = (f"the first {rows} test rows predict exactly as the run does"
               + (" (feature rows and raw texts)" if len(inputs) > 1 else "") if inputs else "not checked")
    print(f"{len(manifest['files']) + 1} files, {size / 2**20:.1f} MiB, in {time.perf_counter() - start:.1f}s; "
          f"{checked}; serve it with xc-predict {args.dest} or xc.load({str(args.dest)!r})", file=sys.stderr)
    return manifest


def main(argv: list[str] | None = None) -> int:
    try:
        return command_main(_parser(), _check, run, argv)
    except KeyboardInterrupt as exc:  # publish removed its hidden sibling on the way out
        done = ("after the export was published (DIR holds the new export)" if getattr(exc, "published", False)
                else "before anything was published (an earlier export in DIR is as it was; nothing else was left)")
        print(f"xc-export interrupted {done}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
