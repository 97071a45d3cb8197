"""The dataset cache (xc/data/cache.py) on storage that cannot be written: one line naming the cache and the fix."""

from __future__ import annotations

import builtins
import errno
import os

import pytest

from xc.data import cache
from xc.errors import XCError

SMALL = dict(num_train=200, num_test=50, num_labels=30, num_features=100)
FAILURES = {"EROFS": "read-only file system", "EACCES": "permission denied", "ENOSPC": "no space left on the device",
            "EDQUOT": "disk quota exceeded"}


@pytest.mark.parametrize("errno_name", sorted(FAILURES))
def test_a_new_dataset_in_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, errno_name):
    """A read-only cache (tests run as root, who ignores permissions: the cache's lock file fails to open instead)
    used to end in hydra's "Error executing job" and an OSError traceback from xc/data/cache.py."""
    real_open = builtins.open
    code = getattr(errno, errno_name)

    def failing(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing)
    with pytest.raises(XCError) as info:
        cache.load_dataset("synthetic", None, str(tmp_path / "cache"), cache.normalize_params(SMALL))
    message = str(info.value)
    assert message.startswith(f"could not write the dataset cache {tmp_path / 'cache'} (converting ")
    assert FAILURES[errno_name] in message and "data.cache_dir=" in message and "\n" not in message


def test_a_source_file_that_cannot_be_read_keeps_its_own_error(tmp_path, monkeypatch):
    """Only failures inside the cache are the cache's: an unreadable source outside it keeps its own OSError."""
    source = tmp_path / "data"
    source.mkdir()
    (source / "train.txt").write_text("2 3 2\n0 1:1\n1 2:1\n")
    (source / "test.txt").write_text("1 3 2\n0 1:1\n")
    real_open = builtins.open

    def failing(path, *args, **kwargs):
        if str(path).startswith(str(source)):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing)
    with pytest.raises(OSError) as info:
        cache.load_dataset("xc_sparse", str(source), str(tmp_path / "cache"))
    assert not isinstance(info.value, XCError) and str(source) in str(info.value.filename)
