"""`xc-train`'s closing line: the run's wall time as the docs quote it."""

from xc.cli.train import wall_clock


def test_wall_clock_reads_as_the_docs_write_it():
    assert wall_clock(42.46) == "42.5s"
    assert wall_clock(59.96) == "1m00s"
    assert wall_clock(60.0) == "1m00s"
    assert wall_clock(303.6) == "5m04s"
    assert wall_clock(3723.0) == "1h02m03s"
