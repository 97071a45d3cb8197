"""tools/bench/bench_knn_topk.py: the kNN's top-k timed against a vectorised one, whose rankings are compared with
xc's."""

from __future__ import annotations

import json

from tools.bench.bench_knn_topk import main


def test_the_benchmark_times_each_way_and_compares_its_rankings(tmp_path):
    out = tmp_path / "topk.json"
    figures = main(["--points", "300", "--queries", "100", "--features", "2000", "--words", "20", "--k", "5",
                    "--repeats", "1", "--methods", "xc,lexsort", "--out", str(out)])
    rows = {(r["method"], r["threads"]): r for r in figures["results"]}
    assert set(rows) == {(m, t) for m in ("xc (per-query loop)", "numpy lexsort per block") for t in (1, 2)}
    assert all(r["identical"] and r["rows_differing"] == 0 and r["s_per_1k_queries"] > 0 for r in rows.values())
    assert json.loads(out.read_text()) == figures
