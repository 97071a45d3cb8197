"""The reliability probes of the second, third and fourth rounds, re-run as a whole, as a user would.

    XC_THREADS=1 .venv/bin/python tools/probes/reliability_probes.py [--only NAME ...] [--out JSON] [--keep DIR]

75 probes: the 18 of the second round (docs/reliability.md; 11 that were clean then, 7 that were not), the
18 of the third, and the 39 of the fourth (records data, `xc.fit`, exports, thresholds, storage errors, rough
edges). Each one runs the real commands (`xc-train`, `xc-eval`, `xc-predict`, `xc-export`,
`xc-data`, `xc-miner`, `torchrun`, `python -m xc.cli.train`, a `python -c` calling `xc.load` or `xc.fit`) as
subprocesses in a temporary folder on small synthetic (or hand-written XC-repository, JSON-lines, CSV) data, and
classifies what happened (a Python call's XCError, printed by the probe's script, is its one-line message):

    CLEAN      the promised behaviour: a refusal in one line, the right answer, the same figures
    LOSS       a user's file overwritten or removed (file hashes before and after), or code run from a file
    SILENT     a wrong answer or a wrong write with exit 0 and no word about it
    TRACEBACK  a Python traceback (or hydra's "Error executing job") where a one-line message belongs
               (torchrun's own ChildFailedError / SignalException, the launcher's output, is not counted)
    FAILED     none of those, but the promised behaviour did not happen (a one-line error where an answer
               was due, readers of a live run that gave up): unclean too
    SKIPPED    the probe cannot run here (says why); ERROR: the probe itself broke (a bug of this tool)

Read-only folders, a full disk and `run_dir=/` are made real with a private mount namespace
(`unshare -m`: a read-only bind mount, a small tmpfs, `/` remounted read-only), because root (which the test
machines run as) ignores `chmod -w`; without `unshare`, a non-root user gets `chmod -w` and root gets SKIPPED.
A file size limit is a real `ulimit -f` (RLIMIT_FSIZE in the child, SIGXFSZ ignored, no bytecode written).

Probes that only read share what they read, trained once: runs A and B (small synthetic, seeds 0 and 1), an
export of A, and a small JSON-lines run; a probe that writes takes a copy.

The probes live in the package tools/probes/reliability/ beside this script: common.py (the outcomes, the
classifier, running a command, the @probe registry), fixtures.py (Ctx, the shared runs and the data) and one module
per round, the fourth in three (records data and `xc.fit`; exports and thresholds; storage errors and rough
edges). This script imports them in order and runs, reports and records the probes.

Prints a table and the counts (paths under the probes' temporary folder read TMP/...); exit code 1 if any
probe is not CLEAN (SKIPPED included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # xc and tools.* of this checkout

from tools.probes.reliability import load_probes  # noqa: E402
from tools.probes.reliability.common import CLEAN, ERROR, IS_ROOT, OUTCOMES, UNSHARE, shown  # noqa: E402
from tools.probes.reliability.fixtures import Ctx  # noqa: E402

PROBES = load_probes()  # the 75, in the order they run: tools/probes/reliability/


# ---------------------------------------------------------------------------------------------- main

def run_probes(names: list[str] | None, root: Path) -> list[dict]:
    ctx = Ctx(root)
    chosen = [p for p in PROBES if not names or p.name in names]
    results = []
    for pr in chosen:
        t0 = time.monotonic()
        try:
            outcome, detail = pr.fn(ctx)
        except Exception as e:  # the probe itself broke: say so, do not hide it
            outcome, detail = ERROR, f"{type(e).__name__}: {str(e)[:200]}"
        secs = time.monotonic() - t0
        results.append({"probe": pr.name, "round": pr.round, "kind_if_fails": pr.kind, "what": pr.what,
                        "outcome": outcome, "detail": shown(" ".join(str(detail).split())), "seconds": round(secs, 1)})
        print(f"  {pr.name:<38} {outcome:<9} {secs:6.1f}s  {results[-1]['detail'][:150]}", flush=True)
    return results


def counts(results: list[dict]) -> dict[str, int]:
    return {o: sum(r["outcome"] == o for r in results) for o in OUTCOMES}


def table(results: list[dict]) -> str:
    rows = ["| probe | round | kind if it fails | outcome | detail |", "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['probe']} | {r['round']} | {r['kind_if_fails']} | {r['outcome']} | "
                    f"{r['detail'].replace('|', '/')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME", help="run this probe (repeatable)")
    ap.add_argument("--out", type=Path, help="write the results to this JSON file")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one, removed)")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for p in PROBES:
            print(f"{p.name:<38} round {p.round}  {p.kind:<9}  {p.what}")
        return 0
    unknown = [n for n in args.only or [] if n not in {p.name for p in PROBES}]
    if unknown:
        print(f"error: --only {', '.join(unknown)}: no such probe (see --list)", file=sys.stderr)
        return 2
    os.environ.setdefault("XC_THREADS", "1")
    t0 = time.monotonic()
    print(f"{len(args.only or PROBES)} probe(s); read-only folders by "
          f"{'a read-only bind mount (unshare -m)' if UNSHARE else 'chmod -w' if not IS_ROOT else 'nothing (root)'}"
          f"; running as {'root' if IS_ROOT else 'uid ' + str(os.geteuid())}", flush=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run_probes(args.only, args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="xc-probes-") as tmp:
            results = run_probes(args.only, Path(tmp))
    wall = time.monotonic() - t0
    c = counts(results)
    print()
    print(table(results))
    print()
    print("counts: " + ", ".join(f"{k} {v}" for k, v in c.items()) + f"; wall time {wall:.0f}s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "XC_THREADS=1 .venv/bin/python tools/probes/reliability_probes.py" + "".join(
                f" --only {n}" for n in args.only or []), "wall_seconds": round(wall, 1),
            "read_only_by": "unshare -m read-only bind mount" if UNSHARE else ("chmod -w" if not IS_ROOT else "none"),
            "user": "root" if IS_ROOT else os.geteuid(), "counts": c, "probes": results}, indent=1) + "\n")
    return 0 if c[CLEAN] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
