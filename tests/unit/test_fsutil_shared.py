"""The file helpers that several layers share (xc/fsutil.py): the convert-once lock of the dataset cache, the token
cache and the synthetic LF generator, and the sampled file digest of the dataset cache's checksums and of a run's data
fingerprint. The digests are stored (meta.json, identity.json, checkpoints), so each caller's must not change: the
expected values below were computed by each caller's own code before they shared the helper."""

from __future__ import annotations

import ast
import fcntl
import hashlib
from pathlib import Path

import numpy as np
import pytest

from xc.data.cache import _sampled_hash
from xc.fsutil import exclusive_lock, sampled_digest
from xc.run.identity import _sample_digest

ROOT = Path(__file__).resolve().parents[2]
# size: (dataset cache's sampled blake2b, run identity's sampled sha256) of np.random.default_rng(size).bytes(size)
DIGESTS = {
    0: ("1240a4684403b160e6597a653a88f56c", "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"),
    100: ("dbef8543ff6974fd37a4858140623bf7", "56a008cb174a481dff03541ab4bc81b43a23255c75db29e08ecd9adf20a6f9d0"),
    1 << 20: ("4785f9ff2c6e086e6dfaeec005a6fddc", "d524704bbe2ff3733eaabee3cc16c204a734c2b8b6186285f6f34a35c687a9a1"),
    3 << 19: ("92a8850fb7fd45c6ecd160c63a93ee57", "541eed763cf08a99e512d49239ae98e39644e207ba2a431d9d57be52a0d61d2b"),
    (2 << 20) + (8 << 16): ("1976820c2cee5ec1e2b64dad0d96716b",
                            "4205af3d3179d8ba0e926247bb8b5223ef6aec7be17ee7268911e1cb51b4216f"),
    (2 << 20) + (8 << 16) + 1: ("bfcfc3e8eb20aa8cfab9806e89fe85ba",
                                "2f4ededff2d60f6899af9596be74242759678fc256e7d22682ab7ae3139e1cd8"),
    5 << 20: ("331b98b3d6d7010c0d17a6849ba5aca5", "48bd4fe933e60173151f30e7664e7fe2b281e08c52714e346b6abba6ae1cef04"),
}


@pytest.mark.parametrize("size", sorted(DIGESTS))
def test_each_callers_sampled_digest_is_the_one_it_stored_before(tmp_path, size):
    """Whole small files, the edges and 8 blocks of large ones (cache); head, middle and tail MiB (identity)."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(size).bytes(size))
    assert (_sampled_hash(str(path), size), _sample_digest(path)) == DIGESTS[size]


def test_sampled_digest_reads_the_spans_in_order_and_stops_at_the_end(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    spans = [(5, 10), (0, 3), (10_000, 500), (20_000, 7)]  # the last two run past the end of the file / start after it
    want = hashlib.sha256(b"head" + data[5:15] + data[0:3] + data[10_000:]).hexdigest()
    assert sampled_digest(path, hashlib.sha256(b"head"), spans, chunk=4) == want


def test_exclusive_lock_excludes_another_holder_until_the_block_ends(tmp_path):
    lock = tmp_path / "x.lock"

    def try_lock() -> bool:
        with open(lock, "a+b") as other:  # another open file: flock excludes it as it would another process
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other.fileno(), fcntl.LOCK_UN)
            return True

    with exclusive_lock(lock):
        assert lock.exists() and not try_lock()
    assert try_lock() and lock.exists()  # released, and the file stays (deleting it would race with a waiter)
    with pytest.raises(RuntimeError), exclusive_lock(lock):
        raise RuntimeError("a failed build")
    assert try_lock()  # released on an exception too


@pytest.mark.parametrize("module", ["xc/data/cache.py", "xc/data/tokens.py", "xc/data/synthetic_lf.py"])
def test_the_convert_once_builders_lock_through_the_one_helper(module):
    tree = ast.parse((ROOT / module).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert "fcntl" not in imported and "exclusive_lock" in imported


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_an_atomic_write_that_fails_leaves_the_file_as_it_was_and_no_temporary(tmp_path, failure):
    from xc.fsutil import write_atomic, write_json_atomic

    path = tmp_path / "report.json"
    write_json_atomic(path, {"kept": 1})
    before = path.read_bytes()

    def half_then_fail(handle):
        handle.write(b'{"half"')
        raise failure

    with pytest.raises(type(failure)):
        write_atomic(path, half_then_fail)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_json_atomic(path, {"kept": 2})
    assert path.read_text() == '{\n "kept": 2\n}'
