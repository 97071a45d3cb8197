"""tools/bench/bench_exact_rows.py: both ways of an exact ranking over many rows timed, their answers compared."""

from __future__ import annotations

import json

from tools.bench.bench_exact_rows import main


def test_the_benchmark_times_both_ways_and_checks_they_agree(tmp_path):
    out = tmp_path / "rows.json"
    record = main(["--rows", "400000", "--dim", "16", "--queries", "300", "--one-block-queries", "20",
                   "--out", str(out)])
    assert record["same_answer"] is True
    assert record["row_blocks"]["queries"] == 300 and record["one_block"]["queries"] == 20
    assert record["speedup"] > 0 and json.loads(out.read_text().splitlines()[-1]) == record


def test_bfloat16_rows_time_the_ranking_against_the_block_upcast_one(tmp_path):
    out = tmp_path / "bf16.json"
    record = main(["--rows", "200000", "--dim", "64", "--queries", "300", "--bf16-rows", "--out", str(out)])
    assert record["dtype"] == "bfloat16" and record["queries"] == 300
    assert record["equal_labels"] > 0.99  # the same rows ranked: at most a last-bit tie apart
    assert record["speedup"] > 0 and json.loads(out.read_text().splitlines()[-1]) == record
