"""The fourth round's 13 probes of records data and `xc.fit`: a label name with a line break, a CSV with a
quote left open or a stray one, JSON lines and CSV that are not UTF-8; `xc.fit` with Y in {-1, +1} or fractional,
label names too many, too few, repeated, or holding a tab or a line break, X a list of numbers."""

from __future__ import annotations

import json
import re

from tools.probes.reliability.common import PY, SILENT, TRACEBACK, api_refusal, classify, error_line, probe, run, xc
from tools.probes.reliability.fixtures import NEWLINE_LABEL, RECORDS_RUN, Ctx, records_names, records_text


# ---- round 4: records data

@probe("r4_records_label_name_with_newline", 4, SILENT,
       "JSON lines whose label name holds a line break ('two\\nlines'): xc-predict prints every label's own name")
def _r4_records_label_name_with_newline(ctx: Ctx):
    d = ctx.tmp("r4_records_label_name_with_newline")
    run_dir, _, _ = ctx.records_run()
    names = records_names()
    queries = [records_text(j, 900) for j in (3, NEWLINE_LABEL, 20, 41, 49)]
    p = run([xc("xc-predict"), run_dir, "--input", "-", "--k", "3"], d, stdin="\n".join(queries) + "\n")
    if p.rc != 0:
        return classify(p.rc, p.text, failed=f"exit {p.rc}: {error_line(p.text)[:150]}")
    rows = [json.loads(r) for r in p.out.splitlines() if r.startswith("{")]
    misnamed = [(i, n) for row in rows for i, n in zip(row["ids"], row.get("names", [])) if names[i] != n]
    top = [row["ids"][0] for row in rows]
    wrong = None
    if len(rows) != len(queries) or any("names" not in row for row in rows):
        wrong = f"{len(rows)} rows with names for {len(queries)} queries"
    elif misnamed:
        wrong = f"label {misnamed[0][0]} printed as {misnamed[0][1]!r}, its name is {names[misnamed[0][0]]!r}"
    return classify(p.rc, p.text, wrong=wrong,
                    clean=f"{len(rows)} rows, every id printed with its own name (top: "
                          f"{', '.join(repr(names[i]) for i in top[:2])}, ...)")


def _bad_records(ctx: Ctx, name: str, kind: str, body: bytes):
    """xc-train data=KIND on a train file holding BODY: exit 2, one line naming the file and the line."""
    d = ctx.tmp(name)
    src = d / "src"
    src.mkdir()
    (src / f"train.{kind}").write_bytes(body)
    p = run([xc("xc-train"), f"data={kind}", f"data.name={name}", *RECORDS_RUN[2:], f"data.path={src}",
             f"data.cache_dir={d / 'cache'}", f"run_dir={d / 'run'}"], d)
    line = error_line(p.text)
    named = re.search(rf"train\.{kind}:\d+:", line) is not None
    return classify(p.rc, p.text, wrong="the bad file was trained on" if p.rc == 0 else None,
                    failed=None if (p.rc == 2 and named) else f"exit {p.rc}, no file:line: field line: {line[:150]}",
                    clean=line[:180])


def _csv_rows(n: int = 400) -> list[str]:
    return ["text,labels"] + [f"item {i} about topic{i % 20},tag{i % 20}" for i in range(n)]


@probe("r4_csv_unclosed_quote", 4, SILENT, "a CSV whose row 200 opens a quote it never closes")
def _r4_csv_unclosed_quote(ctx: Ctx):
    rows = _csv_rows()
    rows[200] = '"' + rows[200]
    return _bad_records(ctx, "r4_csv_unclosed_quote", "csv", ("\n".join(rows) + "\n").encode())


@probe("r4_csv_stray_quote", 4, SILENT, "a CSV row whose labels field ends in a stray quote (tag21\")")
def _r4_csv_stray_quote(ctx: Ctx):
    rows = _csv_rows()
    rows[22] = 'item 21 about topic1,tag21"'
    return _bad_records(ctx, "r4_csv_stray_quote", "csv", ("\n".join(rows) + "\n").encode())


@probe("r4_jsonl_not_utf8", 4, TRACEBACK, "a JSON-lines text holding bytes that are not UTF-8")
def _r4_jsonl_not_utf8(ctx: Ctx):
    lines = [json.dumps({"text": f"item {i}", "labels": [f"tag{i % 20}"]}).encode() for i in range(200)]
    lines[50] = b'{"text": "caf\xe9 \xff", "labels": ["tag10"]}'
    return _bad_records(ctx, "r4_jsonl_not_utf8", "jsonl", b"\n".join(lines) + b"\n")


@probe("r4_csv_not_utf8", 4, TRACEBACK, "a CSV (Latin-1 saved) whose text holds bytes that are not UTF-8")
def _r4_csv_not_utf8(ctx: Ctx):
    rows = [r.encode() for r in _csv_rows(200)]
    rows[77] = b"\xe9t\xe9 76,tag16"
    return _bad_records(ctx, "r4_csv_not_utf8", "csv", b"\n".join(rows) + b"\n")


FIT_SCRIPT = """
import json, sys
import numpy as np
import xc
from xc.errors import XCError
rng = np.random.default_rng(0)
n, L = 200, 10
truth = np.arange(n) % L
X = rng.random((n, 30)).astype(np.float32)
X[np.arange(n), truth] += 3.0
Y = (truth[:, None] == np.arange(L)[None, :]).astype(np.int64)
label_names = None
{setup}
try:
    m = xc.fit(X, Y, label_names=label_names, run_dir=sys.argv[1], data__cache_dir=sys.argv[2], train__epochs=1,
               train__ensemble=1, logger__wandb="disabled", logger__progress=False)
except XCError as exc:
    print(json.dumps({{"error": str(exc), "type": type(exc).__name__}}))
    sys.exit(2)
out = m.predict(X[:5], k=3)
names = getattr(out, "names", None)
print(json.dumps({{"num_labels": int(m.num_labels), "names": None if names is None else [list(r) for r in names]}}))
"""


def _fit(ctx: Ctx, name: str, setup: str, words: list[str], wrong: str):
    d = ctx.tmp(name)
    p = run([PY, "-c", FIT_SCRIPT.format(setup=setup), d / "run", d / "cache"], d)
    return api_refusal(p, words, wrong)


@probe("r4_fit_y_plus_minus_one", 4, SILENT, "xc.fit(X, Y) with Y in {-1, +1}")
def _r4_fit_y_plus_minus_one(ctx: Ctx):
    return _fit(ctx, "r4_fit_y_plus_minus_one", "Y = 2 * Y - 1", ["Y[", "-1"],
                "trained with every -1 taken as a relevant label")


@probe("r4_fit_y_fractional", 4, SILENT, "xc.fit(X, Y) with fractional Y (0.5)")
def _r4_fit_y_fractional(ctx: Ctx):
    return _fit(ctx, "r4_fit_y_fractional", "Y = Y * 0.5", ["Y[", "0.5"], "trained with Y binarised")


@probe("r4_fit_label_names_too_many", 4, SILENT, "xc.fit(label_names=) with 12 names for 10 label columns")
def _r4_fit_label_names_too_many(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_too_many", "label_names = [f'n{j}' for j in range(12)]",
                ["label_names", "12", "10"], "a model trained with 12 names for 10 labels")


@probe("r4_fit_label_names_too_few", 4, SILENT, "xc.fit(label_names=) with 8 names for 10 label columns")
def _r4_fit_label_names_too_few(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_too_few", "label_names = [f'n{j}' for j in range(8)]",
                ["label_names", "8", "10"], "a model trained with 8 names for 10 labels")


@probe("r4_fit_label_names_duplicate", 4, SILENT, "xc.fit(label_names=) naming two columns alike")
def _r4_fit_label_names_duplicate(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_duplicate",
                "label_names = [f'n{j}' for j in range(10)]; label_names[4] = 'n1'",
                ["label_names[4]", "repeats"], "a model trained with a name given twice")


@probe("r4_fit_label_names_tab", 4, TRACEBACK, "xc.fit(label_names=) with a name holding a tab")
def _r4_fit_label_names_tab(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_tab", "label_names = [f'n{j}' for j in range(10)]; label_names[2] = 'a\\tb'",
                ["label_names[2]", "tab"], "a model trained with a tab in a name")


@probe("r4_fit_label_names_newline", 4, TRACEBACK, "xc.fit(label_names=) with a name holding a line break")
def _r4_fit_label_names_newline(ctx: Ctx):
    return _fit(ctx, "r4_fit_label_names_newline",
                "label_names = [f'n{j}' for j in range(10)]; label_names[3] = 'two\\nlines'",
                ["label_names[3]", "line break"], "a model trained with a line break in a name")


@probe("r4_fit_x_not_texts", 4, TRACEBACK, "xc.fit(X, Y) with X a list of numbers (not texts)")
def _r4_fit_x_not_texts(ctx: Ctx):
    return _fit(ctx, "r4_fit_x_not_texts", "X = [int(t) for t in truth]", ["X[0]", "not a text"],
                "a model trained on a list of numbers")
