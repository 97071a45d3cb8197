"""What the reliability probes run on: the small synthetic run's overrides and commands, a run's checkpoints,
weights and metrics, hand-written XC-repository and JSON-lines data, and Ctx: a temporary root, the shared data
cache, and the runs and export that probes only read (trained once; a probe that writes takes a copy)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from tools.probes.reliability.common import PY, SHOWN_ROOT, error_line, run, xc


# the small synthetic run every probe trains (one model, not the small-data ensemble, unless said)
SMALL = ["data.synthetic.num_train=600", "data.synthetic.num_test=150", "data.synthetic.num_labels=200",
         "data.synthetic.num_features=500", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
         "logger.progress=false"]


def train_cmd(run_dir: Path, cache: Path, *over: str, launcher: str = "xc-train", small: bool = True) -> list[str]:
    head = [xc("xc-train")] if launcher == "xc-train" else [PY, "-m", "xc.cli.train"]
    return [*head, *(SMALL if small else []), *over, f"run_dir={run_dir}", f"data.cache_dir={cache}"]


def torchrun_cmd(nproc: int, run_dir: Path, cache: Path, *over: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "xc.cli.train",
            *SMALL, *over, f"run_dir={run_dir}", f"data.cache_dir={cache}"]


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step-*") if re.fullmatch(r"step-\d+", p.name))


def final_state(run_dir: Path, world: int) -> dict:
    import torch

    states = [torch.load(checkpoints(run_dir)[-1] / f"rank{r}.pt", weights_only=True) for r in range(world)]
    out = {f"encoder.{k}": v for k, v in states[0]["encoder"].items()}
    out["classifier"] = torch.cat([s["classifier"]["weight"] for s in states])
    return out


def metrics(run_dir: Path) -> dict:
    m = json.loads((run_dir / "metrics.json").read_text())
    return {k: v for k, v in m.items() if not any(w in k for w in ("time", "seconds", "wall", "_s"))}


def write_xc_sparse(directory: Path, n_train=200, n_test=50, features=50, labels=20, seed=0,
                    empty_last_test=False) -> Path:
    """A small XC-repository dataset (train.txt, test.txt) whose labels follow their features."""
    import numpy as np

    gen = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in {"train": n_train, "test": n_test}.items():
        lines = [f"{n} {features} {labels}"]
        for i in range(n):
            label = int(gen.integers(0, labels))
            feats = sorted({label * 7 % features, *gen.integers(0, features, 4).tolist()})
            xs = " ".join(f"{f}:1.0" for f in feats)
            last = split == "test" and i == n - 1 and empty_last_test
            lines.append(f"{label}" if last else f"{label} {xs}")
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


# a small records run (JSON lines, tf-idf of the texts): xc-train data=jsonl data.path=DIR
RECORDS_RUN = ["data=jsonl", "data.name=probe-records", "train.epochs=2", "train.ensemble=1", "logger.wandb=disabled",
               "logger.progress=false"]
RECORDS_LABELS = 50
NEWLINE_LABEL = 7  # tag7 is named "two\nlines"
UNSEEN_LABEL = "never-trained"  # only in test.jsonl


def records_names() -> list[str]:
    """The records run's label names by id: first appearance in train.jsonl, then in test.jsonl."""
    names = [f"tag{j}" for j in range(RECORDS_LABELS)]
    names[NEWLINE_LABEL] = "two\nlines"
    return names + [UNSEEN_LABEL]


def records_text(j: int, i: int) -> str:
    return f"item {i} about topic{j} word{j}a word{j}b"


def write_records(directory: Path) -> Path:
    """train.jsonl (8 records a label, each text naming its label's words) and test.jsonl (2 a label, and 3 of a
    label no training record has)."""
    names = records_names()
    directory.mkdir(parents=True, exist_ok=True)
    rows = {"train": [(j, i) for i in range(8) for j in range(RECORDS_LABELS)],
            "test": [(j, 100 + i) for i in range(2) for j in range(RECORDS_LABELS)]}
    for split, pairs in rows.items():
        lines = [json.dumps({"text": records_text(j, i), "labels": [names[j]]}) for j, i in pairs]
        if split == "test":
            lines += [json.dumps({"text": f"unseen {i} word{i}a", "labels": [UNSEEN_LABEL]}) for i in range(3)]
        (directory / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory


# ---------------------------------------------------------------------------------------------- context

class Ctx:
    """A temporary root, the shared data cache, and the runs that probes only read (trained once)."""

    def __init__(self, root: Path):
        self.root = root
        SHOWN_ROOT[:] = [str(root)]
        self.cache = root / "cache"
        self._runs: dict[str, Path] = {}
        self._launcher_runs: dict[str, Path] = {}

    def tmp(self, name: str) -> Path:
        d = self.root / "probes" / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def shared(self, which: str = "A") -> Path:
        """Run A (seed 0) and run B (seed 1): finished small runs on the same data; read, never written (readers
        get --out into their own folder). A probe that writes takes a copy."""
        if which not in self._runs:
            run_dir = self.root / "shared" / which
            if (run_dir / "metrics.json").exists():  # a kept folder (--keep) of an earlier invocation
                self._runs[which] = run_dir
                return run_dir
            seed = {"A": 0, "B": 1}[which]
            p = run(train_cmd(run_dir, self.cache, f"seed={seed}"), self.root, timeout=600)
            if p.rc != 0 or not (run_dir / "metrics.json").exists():
                raise RuntimeError(f"shared run {which} did not train (exit {p.rc}): {error_line(p.text)}")
            self._runs[which] = run_dir
        return self._runs[which]

    def copy_of(self, which: str, dest: Path) -> Path:
        shutil.copytree(self.shared(which), dest, symlinks=True)
        return dest

    def export(self, which: str = "A") -> Path:
        """`xc-export` of run WHICH, written once; read, never written (a probe that edits it takes a copy)."""
        dest = self.root / "shared" / f"export-{which}"
        if not (dest / "export.json").exists():
            p = run([xc("xc-export"), self.shared(which), dest], self.root, timeout=300)
            if p.rc != 0:
                raise RuntimeError(f"xc-export of run {which} failed (exit {p.rc}): {error_line(p.text)}")
        return dest

    def records_run(self) -> tuple[Path, Path, str]:
        """(run directory, source folder, xc-train's output) of a small JSON-lines run (write_records: a label
        name with a line break, a test label no training record has), trained once."""
        base = self.root / "shared" / "records"
        run_dir, src, said = base / "run", base / "src", base / "xc-train.out"
        if not (run_dir / "metrics.json").exists():
            write_records(src)
            p = run([xc("xc-train"), *RECORDS_RUN, f"data.path={src}", f"data.cache_dir={self.cache}",
                     f"run_dir={run_dir}"], self.root, timeout=600)
            said.write_text(p.text)
            if p.rc != 0:
                raise RuntimeError(f"the records run did not train (exit {p.rc}): {error_line(p.text)}")
        return run_dir, src, said.read_text()

    def launcher_run(self, key: str) -> Path:
        """The launcher probes' runs with the defaults (the small-data ensemble): xc-train or python -m, in a
        directory (run and cache) of its own."""
        if key not in self._launcher_runs:
            launcher, n = key.split(":")
            base = self.root / "launchers" / f"{'console' if launcher == 'xc-train' else 'module'}{n}"
            run_dir, cache = base / "run", base / "cache"
            over = [o for o in SMALL if not o.startswith("train.ensemble")]
            cmd = [*([xc("xc-train")] if launcher == "xc-train" else [PY, "-m", "xc.cli.train"]), *over,
                   f"run_dir={run_dir}", f"data.cache_dir={cache}"]
            base.mkdir(parents=True, exist_ok=True)
            p = run(cmd, base, timeout=600)
            if p.rc != 0:
                raise RuntimeError(f"{launcher} run {n} failed (exit {p.rc}): {error_line(p.text)}")
            self._launcher_runs[key] = run_dir
        return self._launcher_runs[key]
