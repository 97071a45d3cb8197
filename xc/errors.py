"""The library's own error types: every failure a user can cause ends in one of these."""

from __future__ import annotations

import importlib.util


class XCError(Exception):
    """Base class of every error xc raises on purpose."""


class DataFormatError(XCError, ValueError):
    """Malformed input data, located by file, line (1-based, 0 when not line-bound) and field."""

    def __init__(self, path: str, line: int, field: str, problem: str):
        self.path, self.line, self.field, self.problem = str(path), int(line), field, problem
        where = f"{self.path}:{self.line}" if self.line > 0 else self.path
        super().__init__(f"{where}: {field}: {problem}")


class ConfigError(XCError, ValueError):
    """An invalid configuration value, named by its dotted key."""

    def __init__(self, key: str, problem: str):
        self.key, self.problem = key, problem
        super().__init__(f"config {key}: {problem}")


class CheckpointError(XCError):
    """A checkpoint that is missing, truncated, corrupt or incompatible with the run."""


class MissingExtraError(XCError):
    """A feature the user chose needs an optional package (one of xc's pip extras) that is not installed."""

    def __init__(self, feature: str, package: str, extra: str):
        self.feature, self.package, self.extra = feature, package, extra
        super().__init__(f"{feature} needs {package}, which is not installed: pip install -e \".[{extra}]\" "
                         "(in the xc checkout)")


def require_extra(module: str, package: str, extra: str, feature: str) -> None:
    """Raise MissingExtraError unless `module` can be imported. It only finds the module (cheap: ray's import takes
    seconds), so the check can run where a run starts, before any data is loaded."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        found = False
    if not found:
        raise MissingExtraError(feature, package, extra)
