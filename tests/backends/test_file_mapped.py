"""Block files the page cache holds whole, read by mapping them: checked and copied into the
cache rows in one pass out of the page cache (``read_mapped``, the sink's ``mapped=True``),
with the file locked against reuse while mapped and a file that shrinks under its mapping
refused (``SIGBUS`` caught), not fatal."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.actors import _rowsink
from kvpipe.backends.file import FileStore, _native, _reads
from kvpipe.backends.file import store as file_store
from kvpipe.backends.file._fs import Root
from kvpipe.backends.file._sysio import cached_pages
from kvpipe.benchmarks._file_baselines import warm_cached
from tests.backends import test_file_sink
from tests.backends.test_file_hostile import (
    LAYOUT,
    NBLOCKS,
    SENTINEL,
    TOKENS,
    _pipeline_keys,
    _source_cache,
    block_file,
)
from tests.helpers import needs_native_digests


@pytest.fixture
def fileio(tmp_path: Path) -> Any:
    """The file store's extension, where the page cache says what it holds (cachestat)."""
    needs_native_digests()
    assert _native.fileio is not None, "the C extension was not built (see setup.py)"
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    fd = os.open(probe, os.O_RDONLY)
    try:
        if cached_pages(fd) is None:
            pytest.skip("no cachestat here: block files are read, not mapped")
    finally:
        os.close(fd)
    return _native.fileio


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Root]:
    (tmp_path / "d").mkdir()
    r = Root(tmp_path)
    try:
        yield r
    finally:
        r.close()


def _cached_file(root: Root, data: bytes) -> str:
    path = os.path.join(root.path, "d", "f")
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_open_cached_locks_a_cached_file_until_its_last_descriptor_closes(
    root: Root, fileio: Any
) -> None:
    path = _cached_file(root, bytes(3 * mmap.PAGESIZE + 5))
    fd, size = fileio.open_cached(root.fd, b"d/f")
    assert fd >= 0 and size == 3 * mmap.PAGESIZE + 5
    mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)  # the mapping keeps its own descriptor, and the lock with it
    other = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        mem.close()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)


def test_open_cached_refuses_what_it_cannot_map_whole(root: Root, fileio: Any) -> None:
    path = _cached_file(root, bytes(16 * mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        evicted = cached_pages(fd) == 0
    finally:
        os.close(fd)
    if evicted:  # a file system whose page cache lets go (tmpfs keeps it)
        assert fileio.open_cached(root.fd, b"d/f") == (fileio.NOT_CACHED, 0)
    os.mkdir(os.path.join(root.path, "d", "g"))
    assert fileio.open_cached(root.fd, b"d/g") == (fileio.NOT_REGULAR, 0)
    assert fileio.open_cached(root.fd, b"d/missing") == (-errno.ENOENT, 0)
    os.symlink(path, os.path.join(root.path, "d", "link"))
    assert fileio.open_cached(root.fd, b"d/link")[0] == -errno.ELOOP


# The guard is process-wide state and a failure kills the process: run it in a child.
_SHRINK = """
import faulthandler, mmap, os, sys, tempfile
import numpy as np
from kvpipe import _blockformat
from kvpipe._blockformat import TRAILER_NBYTES
payload = 64 * 4096
rows = [np.full((4, payload // 2), 7, np.uint8), np.full((4, payload // 2), 7, np.uint8)]
table = np.array([[0, 0, payload // 2], [1, payload // 2, payload // 2]], np.int64)
with tempfile.TemporaryFile() as f:
    f.write(bytes(payload + TRAILER_NBYTES))
    f.flush()
    mem = mmap.mmap(f.fileno(), payload + TRAILER_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    os.ftruncate(f.fileno(), 0)
    with memoryview(mem) as value:
        for _ in range(2):  # the guard still there, with faulthandler installed since
            code = _blockformat.place_if_sound(
                value, payload, 0, bytes(16), True, rows, 1, table, mapped=True
            )
            print(code, int(rows[0][1].max()), int(rows[1][1].max()))
            faulthandler.enable()
    mem.close()
"""


_SENT = """
import mmap, os, signal, tempfile
import numpy as np
from kvpipe import _blockformat
from kvpipe._blockformat import TRAILER_NBYTES
payload = 4096
rows = [np.zeros((2, payload), np.uint8)]
table = np.array([[0, 0, payload]], np.int64)
with tempfile.TemporaryFile() as f:
    f.write(bytes(payload + TRAILER_NBYTES))
    f.flush()
    mem = mmap.mmap(f.fileno(), payload + TRAILER_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    with memoryview(mem) as value:  # installs the guard
        _blockformat.place_if_sound(value, payload, 0, bytes(16), True, rows, 1, table, mapped=True)
    mem.close()
os.kill(os.getpid(), signal.SIGBUS)
print("survived")
"""


def test_a_sigbus_sent_to_the_process_is_not_swallowed_by_the_guard() -> None:
    """The guard takes only a fault in the value it is reading; a ``SIGBUS`` sent to the
    process goes on to the default action (the process ends by it)."""
    needs_native_digests()
    child = subprocess.run(
        [sys.executable, "-c", _SENT], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGBUS, (child.returncode, child.stdout, child.stderr)
    assert "survived" not in child.stdout


# A SIGBUS sent to a process that ignores it, again and again, to a thread that keeps reading
# a mapped value whose file shrank: the signal once landed mid-read and took the guard away
# (on_bus put the handler before back), and the read's fault then ended the process.
_SENT_WHILE_READING = """
import mmap, os, signal, tempfile, threading, time
import numpy as np
from kvpipe import _blockformat
from kvpipe._blockformat import TRAILER_NBYTES
signal.signal(signal.SIGBUS, signal.SIG_IGN)  # a SIGBUS sent here is ignored
payload = 16 << 20  # hashing the half still there takes a while: the signal lands mid-read
rows = [np.zeros((2, payload), np.uint8)]
table = np.array([[0, 0, payload]], np.int64)
codes = []
with tempfile.TemporaryFile() as f:
    f.write(bytes(payload + TRAILER_NBYTES))
    f.flush()
    mem = mmap.mmap(f.fileno(), payload + TRAILER_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ)
    os.ftruncate(f.fileno(), payload // 2)  # its second half faults
    value = memoryview(mem)

    def read():
        for _ in range(100):
            codes.append(
                _blockformat.place_if_sound(
                    value, payload, 0, bytes(16), True, rows, 1, table, mapped=True
                )
            )

    reader = threading.Thread(target=read)
    reader.start()
    while reader.is_alive():
        signal.pthread_kill(reader.ident, signal.SIGBUS)
        time.sleep(0.001)
    reader.join()
    value.release()
    mem.close()
print(sorted(set(codes)), len(codes))
"""


def test_a_sigbus_sent_mid_read_leaves_the_guard_in_place() -> None:
    """A ``SIGBUS`` sent while a thread reads a mapped value goes to the handler there was
    before (here: ignored) without taking the guard away from that read."""
    needs_native_digests()
    child = subprocess.run(
        [sys.executable, "-c", _SENT_WHILE_READING], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stderr)
    assert child.stdout.split() == ["[3]", "100"]  # every read unreadable, none fatal


def test_a_mapped_value_whose_file_shrank_is_unreadable_not_fatal() -> None:
    needs_native_digests()
    child = subprocess.run(
        [sys.executable, "-c", _SHRINK], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    assert "Fatal Python error" not in child.stderr  # caught first, not via faulthandler
    assert child.stdout.split() == ["3", "7", "7"] * 2  # unreadable; the block untouched


async def _write_then_read_warm(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shrink: int | None = None,
    mapped_from: int = 0,
) -> tuple[kvpipe.ReadResult, kvpipe.KVCache, kvpipe.KVCache, list[bool], Path]:
    """Write NBLOCKS blocks (``durability="none"``), have the page cache hold their files,
    then read them back with values of ``mapped_from`` bytes and more mapped (these are
    small), noting how each value was handed to the sink; with ``shrink``, that block's file
    is cut short just before its value is placed."""
    monkeypatch.setattr(file_store, "MAPPED_FROM_NBYTES", mapped_from)
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=3)
    mapped: list[bool] = []
    original = _rowsink.RowSink.fetched
    keys = _pipeline_keys("e2e")

    def spy(sink: Any, index: int, checksum: int, value: Any = None, **kw: Any) -> bool:
        mapped.append(bool(kw.get("mapped")))
        if shrink is not None and kw.get("mapped") and sink._blocks[index] == 31 - shrink:
            os.truncate(block_file(root, keys[shrink]), 100)
        return original(sink, index, checksum, value, **kw)

    monkeypatch.setattr(_rowsink.RowSink, "fetched", spy)
    async with FileStore(root, durability="none", threads=1) as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, np.arange(NBLOCKS))).complete
        warm_cached(str(root / "blocks"))
        dst = test_file_sink._blank_cache()
        dst_ids = np.arange(31, 31 - NBLOCKS, -1)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            result = await pipe.read(TOKENS, dst_ids)
    return result, src, dst, mapped, root


def _assert_all_loaded(src: kvpipe.KVCache, dst: kvpipe.KVCache) -> None:
    """Every block :func:`_write_then_read_warm` wrote is in ``dst``, byte for byte."""
    dst_ids = np.arange(31, 31 - NBLOCKS, -1)
    for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[:NBLOCKS], c[dst_ids])


async def test_a_warm_read_maps_every_block_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    result, src, dst, mapped, _ = await _write_then_read_warm(tmp_path, monkeypatch)
    assert result.complete and result.loaded == NBLOCKS
    assert mapped == [True] * NBLOCKS
    _assert_all_loaded(src, dst)


async def test_a_block_file_cut_short_while_mapped_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    k = 4
    result, src, dst, mapped, root = await _write_then_read_warm(tmp_path, monkeypatch, k)
    assert mapped[k]
    assert result.loaded == k and result.stop_reason == "failed_block"
    dst_ids = np.arange(31, 31 - NBLOCKS, -1)
    for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[:k], c[dst_ids[:k]])
        assert np.all(c[dst_ids[k]] == SENTINEL)  # faulted while hashed: nothing copied
    assert not block_file(root, _pipeline_keys("e2e")[k]).exists()  # quarantined


async def test_small_values_are_read_not_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    default = file_store.MAPPED_FROM_NBYTES
    assert LAYOUT.block_nbytes < default
    result, *_, mapped, _ = await _write_then_read_warm(tmp_path, monkeypatch, None, default)
    assert result.complete and mapped == [False] * NBLOCKS


async def test_a_mapped_value_of_another_key_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    """Its trailer is not one the extension expects, so the sink declines the mapping (only
    the extension's read of it is guarded) and the store hands it over again, read: the
    sink's Python path never reads a mapped value."""
    monkeypatch.setattr(file_store, "MAPPED_FROM_NBYTES", 0)
    in_mapped = threading.local()
    calls: list[tuple[bool, Any]] = []
    fetched, slowly = _rowsink.RowSink.fetched, _rowsink.RowSink._fetched_slowly

    def spy(sink: Any, *args: Any, **kw: Any) -> Any:
        in_mapped.now = bool(kw.get("mapped"))
        try:
            got = fetched(sink, *args, **kw)
        finally:
            in_mapped.now = False
        calls.append((bool(kw.get("mapped")), got))
        return got

    def slow(sink: Any, *args: Any) -> bool:
        assert not getattr(in_mapped, "now", False), "a mapped value read from Python"
        return slowly(sink, *args)

    monkeypatch.setattr(_rowsink.RowSink, "fetched", spy)
    monkeypatch.setattr(_rowsink.RowSink, "_fetched_slowly", slow)
    await test_file_sink.test_a_value_of_another_key_is_not_loaded_and_is_deleted(
        tmp_path, "none", True
    )
    assert (True, None) in calls  # declined, then read
    assert all(got is not None for was_mapped, got in calls if not was_mapped)


async def test_a_file_that_shrank_before_it_was_mapped_is_read_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    """``mmap`` refuses a length past the file's end (``ValueError``): the file is read
    instead, and the read says what it found."""

    class _Refusing:
        MAP_SHARED, PROT_READ = mmap.MAP_SHARED, mmap.PROT_READ

        @staticmethod
        def mmap(*_: Any) -> Any:
            raise ValueError("mmap length is greater than file size")

    monkeypatch.setattr(_reads, "mmap", _Refusing)
    result, src, dst, mapped, _ = await _write_then_read_warm(tmp_path, monkeypatch)
    assert result.complete and mapped == [False] * NBLOCKS
    _assert_all_loaded(src, dst)


async def test_a_value_that_cannot_be_mapped_is_read_from_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fileio: Any
) -> None:
    """Where a file cannot be mapped (here: a kernel that cannot say what is cached), the
    store reads it from the page cache into its buffer and still hands it to the sink."""
    monkeypatch.setattr(fileio, "open_cached", lambda *_: (fileio.NOT_CACHED, 0))
    result, src, dst, mapped, _ = await _write_then_read_warm(tmp_path, monkeypatch)
    assert result.complete and mapped == [False] * NBLOCKS
    _assert_all_loaded(src, dst)
