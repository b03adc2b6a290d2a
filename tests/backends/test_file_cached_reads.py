"""Reading a block file from the page cache as far as the cache holds it, and only the rest
with ``O_DIRECT``: through the C extension and through ``os`` calls (:meth:`Root.read_into`)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import _native
from kvpipe.backends.file._direct import Scratch, probe_direct
from kvpipe.backends.file._fs import Root
from kvpipe.backends.file._sysio import cached_pages

from .test_file_direct import LARGE, batches, values
from .test_file_hostile import block_file

PAGE = mmap.PAGESIZE
#: Sixteen pages and a part of one.
DATA = np.random.default_rng(0).integers(0, 256, 16 * PAGE + 100, dtype=np.uint8).tobytes()

Reader = Callable[[Root, list[memoryview], bool], int]


def _native_read(root: Root, views: list[memoryview], direct: bool) -> int:
    if _native.fileio is None:
        pytest.skip("the C extension was not built")
    (got,) = _native.fileio.read_files(root.fd, [b"d/f"], [views], direct)
    assert isinstance(got, int)
    return got


def _os_read(root: Root, views: list[memoryview], direct: bool) -> int:
    got = root.read_into(("d",), "f", views, direct)
    assert got is not None
    return got


@pytest.fixture(params=[_native_read, _os_read], ids=["native", "os"])
def read(request: pytest.FixtureRequest) -> Reader:
    reader: Reader = request.param
    return reader


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Root]:
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(DATA)
    r = Root(tmp_path)
    try:
        if not probe_direct(r.fd, Scratch()):
            pytest.skip("the file system refuses direct I/O")
        yield r
    finally:
        r.close()


def _file(root: Root) -> str:
    return os.path.join(root.path, "d", "f")


def _evict(root: Root) -> None:
    fd = os.open(_file(root), os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached(root):
        pytest.skip("the page cache kept the file")


def _cached(root: Root) -> int:
    """How many of the file's pages the page cache holds (without reading any in)."""
    fd = os.open(_file(root), os.O_RDONLY)
    try:
        pages = cached_pages(fd)
    finally:
        os.close(fd)
    if pages is None:
        pytest.skip("no cachestat here")
    return pages


def _aligned_views(nbytes: int) -> tuple[bytearray | mmap.mmap, list[memoryview]]:
    """Page-aligned memory of ``nbytes`` rounded up to pages, as two views (a split read)."""
    mem = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE + PAGE)
    view = memoryview(mem)
    return mem, [view[: 4 * PAGE], view[4 * PAGE :]]


def test_a_cached_file_is_read_from_the_cache(root: Root, read: Reader) -> None:
    # Views no direct read accepts (not on a page): only a read from the cache can fill them.
    mem = bytearray(len(DATA) + 1)
    view = memoryview(mem)[1:]
    assert _cached(root) == 17
    assert read(root, [view[:5], view[5:]], True) == len(DATA)
    assert bytes(view) == DATA


def test_an_evicted_file_is_read_directly_past_the_cache(root: Root, read: Reader) -> None:
    _evict(root)
    mem, views = _aligned_views(len(DATA))
    assert read(root, views, True) == len(DATA)
    assert bytes(memoryview(mem)[: len(DATA)]) == DATA
    assert _cached(root) == 0  # it did not go through the cache
    # without direct I/O the same read fills the cache (so the check above could fail)
    assert read(root, views, False) == len(DATA)
    assert _cached(root) == 17


@pytest.mark.parametrize("cached_pages", [1, 3, 16, 17])
def test_a_partly_cached_file_is_finished_directly(
    root: Root, read: Reader, cached_pages: int
) -> None:
    _evict(root)
    fd = os.open(_file(root), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: just these pages
        os.preadv(fd, [bytearray(cached_pages * PAGE)], 0)
    finally:
        os.close(fd)
    assert _cached(root) == cached_pages
    mem, views = _aligned_views(len(DATA))
    assert read(root, views, True) == len(DATA)
    assert bytes(memoryview(mem)[: len(DATA)]) == DATA
    assert _cached(root) <= cached_pages  # the rest came past the cache


@pytest.mark.parametrize("cached_pages", [1, 3, 16])
def test_without_cachestat_the_cached_part_then_the_rest_directly(
    root: Root, monkeypatch: pytest.MonkeyPatch, cached_pages: int
) -> None:
    # os calls, where the kernel cannot count cached pages: reading with RWF_NOWAIT finds
    # where the cache ends, and the rest is read directly from the page boundary there.
    _evict(root)
    fd = os.open(_file(root), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.preadv(fd, [bytearray(cached_pages * PAGE)], 0)
    finally:
        os.close(fd)
    monkeypatch.setattr("kvpipe.backends.file._fs.all_cached", lambda fd, size: True)
    preadv, calls = os.preadv, []

    def counting(fd: int, views: Any, offset: int, flags: int = 0) -> int:
        calls.append((offset, flags))
        return preadv(fd, views, offset, flags)

    monkeypatch.setattr(os, "preadv", counting)
    mem, views = _aligned_views(len(DATA))
    assert root.read_into(("d",), "f", views, True) == len(DATA)
    assert bytes(memoryview(mem)[: len(DATA)]) == DATA
    assert calls[0] == (0, os.RWF_NOWAIT)
    direct = [offset for offset, flags in calls if not flags]
    # (a read-ahead the first miss started may have cached more before the rest is read)
    assert not direct or (direct[0] % PAGE == 0 and direct[0] >= cached_pages * PAGE)


@pytest.mark.parametrize("durability", ["none", "data"])
async def test_the_store_reads_what_the_cache_lacks_past_it_in_every_durability(
    tmp_path: Path, file_io: str, durability: Any
) -> None:
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT here")
    async with kvpipe.FileStore(tmp_path, durability=durability) as store, batches() as b:
        keys, _ = b.keys(4, seed=3)
        vals = values(4, LARGE, 3)
        assert await b.put(store, keys, vals) == [BlockStatus.OK] * 4
        paths = [block_file(tmp_path, k) for k in keys]
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] * 4 and got == vals
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                pages = cached_pages(fd)
            finally:
                os.close(fd)
            if pages is None:
                pytest.skip("no cachestat here")
            assert pages == 0  # read past the page cache, not into it
