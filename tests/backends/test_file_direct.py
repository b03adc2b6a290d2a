"""FileStore with direct I/O: which writes go past the page cache, the padded (version 2)
files they make, reading both versions, refusals and fallbacks, and tampered padded files."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import _direct, _fileio, _native, _sysio
from kvpipe.backends.file._format import HEADER_NBYTES, PAGE, file_nbytes, unpack_header
from kvpipe.backends.file._fs import DirectIORefused, Root
from kvpipe.backends.file._inspect import inspect_store
from kvpipe.testing.batches import Batches

from .fault_shim import run_with_faults
from .test_file_hostile import block_file

pytestmark = pytest.mark.usefixtures("file_io")


class _RefusingNative:
    """The C extension, but on a file system that refuses direct reads."""

    def __init__(self) -> None:
        self.direct_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(_fileio, name)

    def read_files(self, fd: int, paths: Any, views: Any, direct: bool) -> list[int]:
        if direct:
            self.direct_calls += 1
            return [-errno.EINVAL] * len(paths)
        return _fileio.read_files(fd, paths, views, direct)

    def write_files(self, fd: int, dirs: Any, *args: Any) -> list[int]:
        if args[4]:  # direct (after temps, names, chunks, durability)
            self.direct_calls += 1
            return [-errno.EINVAL] * len(dirs)
        return _fileio.write_files(fd, dirs, *args)


#: A value of a few pages and a partial one: direct writes pad it.
LARGE = value_nbytes(3 * (64 << 10) + 13)


@asynccontextmanager
async def batches(value: int = LARGE, slots: int = 16) -> AsyncIterator[Batches]:
    pool = StagingPool(value, slots)
    async with ThreadRunner() as runner:
        yield Batches(pool, runner)
    assert pool.in_use == 0, "staging left leased"


def values(n: int, size: int = LARGE, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def version_of(path: Path) -> int:
    with open(path, "rb") as f:
        magic, version = struct.unpack("<4sH", f.read(6))
    assert magic == b"KVPF"
    return int(version)


async def round_trip(store: kvpipe.FileStore, b: Batches, n: int = 4, seed: int = 0) -> Any:
    keys, _ = b.keys(n, seed=seed)
    vals = values(n, b.pool.slot_nbytes, seed)
    assert await b.put(store, keys, vals) == [BlockStatus.OK] * n
    statuses, got = await b.get(store, keys)
    assert statuses == [BlockStatus.OK] * n
    assert got == vals
    return keys


def test_staging_slots_of_64_kib_and_more_start_on_a_page() -> None:
    for value, aligned in ((LARGE, True), (64 << 10, True), (4096 + 61, False)):
        pool = StagingPool(value, 5)
        addresses = [pool.slot(i).ctypes.data for i in range(5)]
        assert all(a % PAGE == 0 for a in addresses) is aligned
        assert all(_direct.is_aligned(pool.slot(i).data) for i in range(5)) is aligned


async def test_aligned_values_are_written_directly_as_padded_files(tmp_path: Path) -> None:
    async with kvpipe.FileStore(tmp_path, durability="data") as store, batches() as b:
        keys = await round_trip(store, b)
        assert store.statistics()["direct_writes"] == 4
    for key in keys:
        path = block_file(tmp_path, key)
        assert version_of(path) == 2
        assert path.stat().st_size == file_nbytes(LARGE, padded=True) > HEADER_NBYTES + LARGE
        raw = path.read_bytes()
        header = unpack_header(raw[:HEADER_NBYTES])
        assert header.padded and header.payload_nbytes == LARGE
        assert raw[HEADER_NBYTES + LARGE :] == bytes(len(raw) - HEADER_NBYTES - LARGE)  # zeros


@pytest.mark.parametrize(
    ("durability", "direct_io", "expected"),
    [("none", None, False), ("data", False, False), ("none", True, True), ("full", None, True)],
)
async def test_when_direct_io_is_used(
    tmp_path: Path, durability: Any, direct_io: bool | None, expected: bool
) -> None:
    async with (
        kvpipe.FileStore(tmp_path, durability=durability, direct_io=direct_io) as store,
        batches() as b,
    ):
        keys = await round_trip(store, b)
        assert store.statistics().get("direct_writes", 0) == (4 if expected else 0)
    assert version_of(block_file(tmp_path, keys[0])) == (2 if expected else 1)
    assert block_file(tmp_path, keys[0]).stat().st_size == file_nbytes(LARGE, padded=expected)


def _cached(path: Path) -> bool | None:
    """Whether the page cache holds all of ``path`` (``None``: the kernel cannot say)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _sysio.cached_pages(fd) is None:
            return None
        return _sysio.all_cached(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("durability", ["data", "full"])
@pytest.mark.parametrize("cached_writes", [False, True])
async def test_cached_writes_go_through_the_page_cache_and_stay_there(
    tmp_path: Path, durability: Any, cached_writes: bool
) -> None:
    """cached_writes: large values are written through the page cache (still synced per
    durability), unpadded, and are still in it afterwards; direct writes leave nothing there."""
    store = kvpipe.FileStore(tmp_path, durability=durability, cached_writes=cached_writes)
    async with store, batches() as b:
        keys, _ = b.keys(4, seed=3)
        vals = values(4, b.pool.slot_nbytes, 3)
        assert await b.put(store, keys, vals) == [BlockStatus.OK] * 4
        assert store.statistics().get("direct_writes", 0) == (0 if cached_writes else 4)
        cached = [_cached(block_file(tmp_path, k)) for k in keys]
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] * 4 and got == vals
    assert version_of(block_file(tmp_path, keys[0])) == (1 if cached_writes else 2)
    size = file_nbytes(LARGE, padded=not cached_writes)
    assert block_file(tmp_path, keys[0]).stat().st_size == size
    if cached[0] is not None:  # the kernel tells (cachestat, Linux >= 6.5)
        assert cached == [cached_writes] * 4


def test_cached_writes_and_direct_io_true_are_refused(tmp_path: Path) -> None:
    with pytest.raises(kvpipe.ConfigError, match="cached_writes"):
        kvpipe.FileStore(tmp_path, cached_writes=True, direct_io=True)


async def test_small_values_go_through_the_page_cache(tmp_path: Path) -> None:
    small = value_nbytes(4096 + 13)
    async with kvpipe.FileStore(tmp_path) as store:
        async with batches(small) as b:
            keys = await round_trip(store, b)
            assert version_of(block_file(tmp_path, keys[0])) == 1
        assert store.statistics().get("direct_writes", 0) == 0


async def test_both_versions_read_back_from_one_store(tmp_path: Path) -> None:
    async with batches() as b:
        async with kvpipe.FileStore(tmp_path, direct_io=False) as store:
            old = await round_trip(store, b, seed=1)
        async with kvpipe.FileStore(tmp_path) as store:
            new = await round_trip(store, b, seed=2)
            statuses, got = await b.get(store, [*old, *new])
            assert statuses == [BlockStatus.OK] * 8
            assert got == [*values(4, LARGE, 1), *values(4, LARGE, 2)]
    assert {version_of(block_file(tmp_path, k)) for k in old} == {1}
    assert {version_of(block_file(tmp_path, k)) for k in new} == {2}
    report = inspect_store(str(tmp_path), verify=True)
    assert report.blocks == 8 and not report.corrupt


async def test_direct_io_required_but_refused_fails_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvpipe.backends.file.store.probe_direct", lambda fd, scratch: False)
    with pytest.raises(kvpipe.BackendError, match="direct I/O"):
        await kvpipe.FileStore(tmp_path, direct_io=True).open()
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:  # auto: falls back
        keys = await round_trip(store, b)
    assert version_of(block_file(tmp_path, keys[0])) == 1


async def test_a_refused_direct_write_falls_back_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, file_io: str
) -> None:
    calls: list[bool] = []
    real = Root.write_atomic

    def refuse_direct(self: Root, *args: Any, **kwargs: Any) -> bool:
        direct = bool(args[5] if len(args) > 5 else kwargs.get("direct", False))
        calls.append(direct)
        if direct:
            raise DirectIORefused(errno.EINVAL, "direct I/O refused: Invalid argument")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Root, "write_atomic", refuse_direct)
    native = _RefusingNative()
    if file_io == "native":
        monkeypatch.setattr(_native, "fileio", native)
    caplog.set_level(logging.WARNING, "kvpipe.file_store")
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        keys = await round_trip(store, b, seed=3)
        refused = (calls.count(True), native.direct_calls)
        await round_trip(store, b, seed=4)
        assert (calls.count(True), native.direct_calls) == refused  # not tried again
        assert store.statistics().get("direct_writes", 0) == 0
        assert "io_errors" not in store.statistics()
    assert version_of(block_file(tmp_path, keys[0])) == 1
    assert sum(refused) >= 1
    assert sum("direct I/O refused" in r.getMessage() for r in caplog.records) == 1


def _tamper(path: Path, how: str) -> None:
    size = path.stat().st_size
    if how == "padding dropped":
        os.truncate(path, HEADER_NBYTES + LARGE)
    elif how == "page added":
        with open(path, "ab") as f:
            f.write(bytes(PAGE))
    elif how == "one byte short":
        os.truncate(path, size - 1)
    elif how == "payload byte flipped":
        with open(path, "r+b") as f:
            f.seek(HEADER_NBYTES + 100)
            byte = f.read(1)
            f.seek(HEADER_NBYTES + 100)
            f.write(bytes([byte[0] ^ 1]))
    elif how == "last padding byte set":
        with open(path, "r+b") as f:
            f.seek(size - 1)
            f.write(b"\x01")
    elif how == "header only":
        os.truncate(path, HEADER_NBYTES)


@pytest.mark.parametrize(
    "how",
    ["padding dropped", "page added", "one byte short", "payload byte flipped", "header only"],
)
async def test_tampered_padded_files_are_corrupt(tmp_path: Path, how: str) -> None:
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        keys = await round_trip(store, b, n=2, seed=6)
        _tamper(block_file(tmp_path, keys[1]), how)
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK, BlockStatus.CORRUPT]
        assert got[0] == values(2, LARGE, 6)[0]
        assert not block_file(tmp_path, keys[1]).exists()  # quarantined
        assert store.statistics()["corrupt"] == 1


async def test_padding_is_not_part_of_the_checksum(tmp_path: Path) -> None:
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        keys = await round_trip(store, b, n=1, seed=7)
        _tamper(block_file(tmp_path, keys[0]), "last padding byte set")
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] and got == values(1, LARGE, 7)


async def test_pipeline_writes_large_blocks_directly(tmp_path: Path) -> None:
    layout = kvpipe.CacheLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=64, dtype="bfloat16"
    )
    assert layout.block_nbytes >= 64 << 10
    src = kvpipe.create_kv_cache(layout, 8)
    dst = kvpipe.create_kv_cache(layout, 8)
    rng = np.random.default_rng(8)
    for rows in src.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    tokens = np.arange(8 * 64 - 10)
    async with kvpipe.FileStore(tmp_path) as store:
        async with kvpipe.open_pipeline(src, store, namespace="d") as pipe:
            w = await pipe.write(tokens, np.arange(8), include_partial=True)
            assert w.written == 8
        async with kvpipe.open_pipeline(dst, store, namespace="d") as pipe:
            r = await pipe.read(tokens, np.arange(8), include_partial=True, require_all=True)
            assert r.loaded == 8
        assert store.statistics()["direct_writes"] == 8
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a, b)


async def test_a_refused_direct_read_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    real = Root.read_into
    calls: list[bool] = []

    def refuse_direct(self: Root, parts: Any, name: str, views: Any, direct: bool = False) -> Any:
        calls.append(direct)
        if direct:
            raise DirectIORefused(errno.EINVAL, "direct I/O refused: Invalid argument")
        return real(self, parts, name, views, direct)

    native = _RefusingNative()
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        keys, _ = b.keys(4, seed=9)
        vals = values(4, LARGE, 9)
        assert await b.put(store, keys, vals) == [BlockStatus.OK] * 4
        monkeypatch.setattr(Root, "read_into", refuse_direct)
        if file_io == "native":
            monkeypatch.setattr(_native, "fileio", native)
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] * 4 and got == vals
        refused = (calls.count(True), native.direct_calls)
        statuses, got = await b.get(store, keys)  # direct I/O is off for good now
        assert statuses == [BlockStatus.OK] * 4 and got == vals
        assert (calls.count(True), native.direct_calls) == refused
    assert calls.count(True) >= 1 and calls[-1] is False
    if file_io == "native":
        assert native.direct_calls >= 1  # refused there first, then by os calls


async def test_a_fifo_at_a_large_blocks_name_is_quarantined_not_a_refusal(tmp_path: Path) -> None:
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        keys = await round_trip(store, b, n=2, seed=10)
        path = block_file(tmp_path, keys[1])
        path.unlink()
        os.mkfifo(path, 0o600)
        statuses, _ = await b.get(store, keys)
        assert statuses == [BlockStatus.OK, BlockStatus.CORRUPT]
        assert not path.exists()
        await round_trip(store, b, n=2, seed=11)
        assert store.statistics()["direct_writes"] == 4  # direct I/O still on


async def test_the_store_reads_and_probes_natively_where_it_can(
    tmp_path: Path, file_io: str
) -> None:
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        assert store._native is (file_io == "native")
        keys = await round_trip(store, b, n=4, seed=12)
        block_file(tmp_path, keys[2]).unlink()
        # the probe stops at the first missing file: the last one is there but not counted
        assert list(await store.exists(b.key_batch(keys))) == [True, True, False, False]


def _cut_short_once(real: Any) -> Any:
    """An ``os.writev`` whose first direct write stops after a page and 100 bytes (through
    the page cache), as a write cut short by a full disk can; after which a direct write at
    an offset off a 512-byte boundary fails with ``EINVAL``, as on a device that needs its
    blocks aligned."""
    cut: list[int] = []

    def writev(fd: int, views: Any) -> int:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if not flags & os.O_DIRECT:
            return int(real(fd, views))
        if not cut:
            cut.append(fd)
            part = memoryview(b"".join(bytes(v) for v in views)[: PAGE + 100])
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            try:
                return int(real(fd, [part]))
            finally:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        if os.lseek(fd, 0, os.SEEK_CUR) % 512:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return int(real(fd, views))

    return writev


@pytest.mark.parametrize("file_io", ["os"], indirect=True)  # native: the test below
async def test_a_direct_write_cut_short_does_not_turn_direct_io_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, file_io: str
) -> None:
    """A direct write that stops short at an offset off the device's blocks: the next write
    from there fails with ``EINVAL``, which was taken for the file system refusing direct
    I/O, and turned it off for good. The rest of the file is written through the page cache
    instead, and direct I/O stays on."""
    monkeypatch.setattr(os, "writev", _cut_short_once(os.writev))
    caplog.set_level(logging.WARNING, "kvpipe.file_store")
    async with kvpipe.FileStore(tmp_path, durability="data") as store, batches() as b:
        if not store._direct:
            pytest.skip("this file system takes no direct writes")
        await round_trip(store, b, seed=5)
        await round_trip(store, b, seed=6)
        assert store.statistics()["direct_writes"] == 8
        assert "io_errors" not in store.statistics()
    assert not any("direct I/O refused" in r.getMessage() for r in caplog.records)


_WRITE_CUT_SHORT = """
import json, mmap, os
from kvpipe.backends.file import _fileio
fd = os.open({root!r}, os.O_RDONLY | os.O_DIRECTORY)
buf = mmap.mmap(-1, 3 * 4096)
buf[:] = bytes(range(256)) * 48
print(json.dumps(_fileio.write_files(
    fd, [b"d"], [b".t"], [b"a"], [[memoryview(buf)]], 1, True, bytearray(1)
)))
"""


@pytest.mark.parametrize("file_io", ["native"], indirect=True)
def test_write_files_finishes_a_direct_write_cut_short(tmp_path: Path, file_io: str) -> None:
    """The native writer's direct write cut short off the device's blocks (the fault
    injector's): the rest goes through the page cache, not ``-EINVAL`` (which the store
    reads as direct I/O refused)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not _direct.probe_direct(fd, _direct.Scratch()):
            pytest.skip("this file system takes no direct writes")
    finally:
        os.close(fd)
    (tmp_path / "d").mkdir()
    code = _WRITE_CUT_SHORT.format(root=str(tmp_path))
    assert run_with_faults(tmp_path, code, KVPIPE_FAULT_SHORT_DIRECT="1") == [0]
    assert (tmp_path / "d" / "a").read_bytes() == bytes(range(256)) * 48
    assert os.listdir(tmp_path / "d") == ["a"]
