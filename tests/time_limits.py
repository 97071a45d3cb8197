"""Per-test time limits (pytest-timeout): every test gets pyproject.toml's `timeout`, and one marked `slow` (a whole
run through the CLI, torchrun with 2 ranks) SLOW_FACTOR times that, so that a hung test fails with its limit named
instead of holding a worker until CI's own limit ends the whole run. tests/conftest.py applies it; a pytest run
elsewhere loads it with `-p tests.time_limits`.
"""

from __future__ import annotations

import os

import pytest

SLOW_FACTOR = 6


def limit_slow_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each slow test without a timeout marker of its own SLOW_FACTOR times the configured limit. A limit set
    on the command line (`--timeout=0` to debug) or in PYTEST_TIMEOUT is the user's choice for every test: kept."""
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return
    base = float(config.getini("timeout") or 0)
    if base <= 0:
        return
    for item in items:
        if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(base * SLOW_FACTOR))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    limit_slow_tests(config, items)
