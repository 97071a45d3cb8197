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


def _synthetic(cache_dir):
    return cache.load_dataset("synthetic", None, str(cache_dir), cache.normalize_params(SMALL))


def _overwrite_same_size(path, byte_value=None, nan=False):
    import numpy as np

    size = os.path.getsize(path)
    if nan:  # keep the .npy header, NaN bytes after it
        arr = np.load(path, mmap_mode="r")
        header = size - arr.nbytes
        blob = np.full(arr.nbytes // 4 + 1, np.nan, np.float32).tobytes()[: arr.nbytes]
        with open(path, "r+b") as f:
            f.seek(header)
            f.write(blob)
    else:
        with open(path, "r+b") as f:
            f.write(bytes([byte_value]) * size)
    assert os.path.getsize(path) == size


@pytest.mark.parametrize("damage", ["nan", "zeroed"])
def test_a_damaged_cached_array_is_detected_at_open_and_rebuilt(tmp_path, damage):
    """A cached values file overwritten at the same size (NaN bytes, or all zeros) used to be memmapped as it was."""
    import numpy as np

    first = _synthetic(tmp_path / "cache")
    directory = first.meta["cache_dir"]
    good = np.array(first.train.features.values)
    del first
    values = os.path.join(directory, "train.features.values.npy")
    _overwrite_same_size(values, 0, nan=(damage == "nan"))
    with pytest.raises(cache.CacheDamagedError, match="train.features.values.npy"):
        cache.open_dataset(directory)
    again = _synthetic(tmp_path / "cache")
    assert again.meta["cache_dir"] == directory
    np.testing.assert_array_equal(np.array(again.train.features.values), good)


def test_a_damaged_cache_is_said_once_and_the_warning_says_it_is_being_converted_again(tmp_path, caplog):
    """The warning was logged twice (the cache is looked at again under the conversion lock) and told the user to
    delete the directory that was already being rebuilt."""
    import logging

    first = _synthetic(tmp_path / "cache")
    directory = first.meta["cache_dir"]
    del first
    values = os.path.join(directory, "train.features.values.npy")
    _overwrite_same_size(values, 0)
    with caplog.at_level(logging.WARNING, logger="xc.data.cache"):
        _synthetic(tmp_path / "cache")
    said = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(said) == 1, said
    assert values in said[0] and f"converting the dataset again from its source into {directory}" in said[0]
    assert "delete" not in said[0] and "\n" not in said[0]


def test_a_damaged_generated_dataset_fails_in_one_line_naming_the_file(tmp_path):
    """Opened by path (no source to rebuild from): one line naming the file and what to delete."""
    cache.generate_synthetic(str(tmp_path / "gen"), **SMALL)
    _overwrite_same_size(str(tmp_path / "gen" / "test.labels.indices.npy"), 0)
    with pytest.raises(XCError) as info:
        cache.load_dataset("synthetic", str(tmp_path / "gen"), str(tmp_path / "cache"))
    message = str(info.value)
    assert "test.labels.indices.npy" in message and f"delete {tmp_path / 'gen'}" in message and "\n" not in message


def test_a_previous_version_cache_is_rebuilt_and_a_generated_one_still_opens(tmp_path):
    import json

    first = _synthetic(tmp_path / "cache")
    directory = first.meta["cache_dir"]
    del first
    meta_path = os.path.join(directory, "meta.json")
    meta = json.load(open(meta_path))
    meta.pop("checksums")
    meta["format_version"] = 2
    json.dump(meta, open(meta_path, "w"))
    assert cache.open_dataset(directory).num_labels == SMALL["num_labels"]  # by path: accepted, unverified
    _synthetic(tmp_path / "cache")  # through the cache: stale, rebuilt with checksums
    rebuilt = json.load(open(meta_path))
    assert rebuilt["format_version"] == cache.FORMAT_VERSION and rebuilt["checksums"]


def test_xc_data_verify_reports_the_damaged_file_with_exit_2(tmp_path, capsys):
    from xc.data.cli import main

    ds = _synthetic(tmp_path / "cache")
    directory = ds.meta["cache_dir"]
    del ds
    assert main(["verify", str(tmp_path / "cache")]) == 0
    assert f"ok: {directory}" in capsys.readouterr().out
    # a change the sampled hash at open would miss on a large file: one byte; the full hash sees it
    path = os.path.join(directory, "train.labels.indices.npy")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 1]))
    assert main(["verify", directory]) == 2
    err = capsys.readouterr().err
    assert f"damaged: {path}: contents differ from the blake2b" in err and f"delete {directory}" in err
