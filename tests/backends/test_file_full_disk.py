"""A file store whose disk fills: it keeps serving reads, refuses writes honestly
(``NO_SPACE``, never an exception out of a write), keeps its catalog and its files in
agreement, and opens again with default options on the full disk.

The disk is a 40 MiB tmpfs mounted by the test (we run as root in CI); where mounting is not
possible the tests are skipped and say why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import FileStore, inspect_store
from kvpipe.backends.file._catalog import Catalog, SizeOf
from tests.backends.test_file_hostile import batches, block_file, make_values, put_chain
from tests.helpers import fill_random, mounted

BS = 16
#: 288 KiB a block: about 140 block files fill the 40 MiB disk.
LAYOUT = kvpipe.CacheLayout.mla(num_layers=16, kv_lora_rank=512, rope_dim=64, block_size=BS)
CONFIG = kvpipe.PipelineConfig(slice_block_num=8, staging_bytes=16 << 20)
PREFIX = 40  #: blocks per written prefix
PREFIXES = 5  #: more than the disk holds
SPARE = 8  #: the cache's blocks from ``SPARE * PREFIX`` on are read into


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A fresh 40 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    with mounted(mnt, "tmpfs", "size=40m,mode=0700"):
        yield mnt


def _tokens(i: int) -> np.ndarray:
    return np.arange(PREFIX * BS) + i * 1_000_000


def _ids(i: int) -> np.ndarray:
    return np.arange(PREFIX) + i * PREFIX


def _hog(path: Path) -> int:
    """Take every byte left on ``path``'s file system with another file; the bytes taken."""
    taken = 0
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 512, 1):
            chunk = b"x" * size
            while True:
                try:
                    taken += f.write(chunk) or 0
                except OSError:
                    break
    assert os.statvfs(path).f_bavail == 0
    return taken


def _agree(root: Path) -> None:
    """The catalog and the block files agree: every file recorded, every record a file, no
    unsettled reservation, no temporary file left behind."""
    report = inspect_store(str(root))
    assert report.corrupt == []
    assert report.untracked == 0
    assert report.temp_files == 0
    assert report.blocks == report.catalog_blocks
    assert report.catalog_pending == 0


def _no_space(w: kvpipe.WriteResult) -> None:
    """Refused, not broken: the store said ``no_space`` for the block the write stopped at."""
    assert w.stop_reason == "incomplete_slice", w
    assert w.error == f"block {w.skipped + w.written}: no_space", w


async def _fill(pipe: kvpipe.Pipeline) -> list[int]:
    """Write prefixes until one stops short; the blocks stored per prefix."""
    written = []
    for i in range(PREFIXES):
        w = await pipe.write(_tokens(i), _ids(i))
        assert w.skipped == 0
        written.append(w.written)
        if not w.complete:
            _no_space(w)
            break
    assert written[-1] < PREFIX, f"the disk never filled: {written}"
    return written


async def _reads_back(pipe: kvpipe.Pipeline, src: kvpipe.KVCache, written: list[int]) -> None:
    for i, n in enumerate(written):
        assert await pipe.lookup(_tokens(i)) == n
        if not n:
            continue
        dst_ids = np.arange(PREFIX) + SPARE * PREFIX
        r = await pipe.read(_tokens(i)[: n * BS], dst_ids[:n])
        assert (r.loaded, r.complete) == (n, True), r
        for rows in src.byte_rows:
            assert np.array_equal(rows[_ids(i)[:n]], rows[dst_ids[:n]])


async def _refuses_writes(pipe: kvpipe.Pipeline, store: FileStore, written: list[int]) -> None:
    """A write of a new prefix stops ``no_space`` (after what room is left, if any: closing
    the store gives back its catalog's log); ``written`` gets its count."""
    assert len(written) < SPARE
    before = store.statistics().get("no_space", 0)
    w = await pipe.write(_tokens(len(written)), _ids(len(written)))
    assert w.written < PREFIX
    _no_space(w)
    assert store.statistics().get("no_space", 0) > before
    written.append(w.written)


def _cache() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, (SPARE + 1) * PREFIX)
    fill_random(cache, seed=7)
    return cache


async def test_a_store_that_fills_its_disk_serves_reads_refuses_writes_and_reopens(
    small_disk: Path, file_io: str
) -> None:
    root = small_disk / "store"
    src = _cache()
    async with FileStore(root) as store, kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        written = await _fill(pipe)
        assert sum(written) > 2 * PREFIX  # most of the disk went to blocks
        await _reads_back(pipe, src, written)
        # A later write, of a new prefix, is refused from its first block.
        await _refuses_writes(pipe, store, written)
        assert written[-1] == 0
    _agree(root)
    # Reopened with default options on the full disk: reads work, writes are refused.
    async with FileStore(root) as store, kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        await _reads_back(pipe, src, written)
        await _refuses_writes(pipe, store, written)
        await _reads_back(pipe, src, written)
    _agree(root)


async def test_a_store_whose_last_bytes_another_file_took_reopens_with_defaults(
    small_disk: Path,
) -> None:
    root = small_disk / "store"
    src = _cache()
    async with FileStore(root) as store, kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        written = await _fill(pipe)
    assert _hog(small_disk / "hog") > 0
    async with FileStore(root) as store, kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        await _reads_back(pipe, src, written)
        await _refuses_writes(pipe, store, written)
        assert written[-1] == 0
        await _reads_back(pipe, src, written)
    _agree(root)
    # Nothing was lost: with room again, the store takes writes again.
    os.unlink(small_disk / "hog")
    async with FileStore(root) as store, kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        await _reads_back(pipe, src, written)
        w = await pipe.write(_tokens(len(written)), _ids(len(written)))
        assert w.written > 0, w
    _agree(root)


def test_store_info_reads_a_catalog_on_a_full_disk(small_disk: Path) -> None:
    root = small_disk / "store"
    root.mkdir()
    Catalog(str(root / "catalog.sqlite3")).close()
    _hog(small_disk / "hog")
    report = inspect_store(str(root))
    assert (report.blocks, report.catalog_blocks, report.catalog_pending) == (0, 0, 0)


async def test_a_put_whose_settling_finds_the_disk_full_unpublishes_its_tail(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """Another file takes the last bytes after a batch's files are written, before the
    catalog records them: the newest files go until the catalog can record the rest."""
    root = small_disk / "store"
    settle = Catalog.settle

    def hog_then_settle(
        catalog: Catalog,
        written: Sequence[str],
        failed: Sequence[str],
        size_of: SizeOf,
        *rest: Any,
    ) -> None:
        if not (small_disk / "hog").exists():
            _hog(small_disk / "hog")
        settle(catalog, written, failed, size_of, *rest)

    async with batches() as b, FileStore(root) as store:
        keys, _ = b.keys(16, seed=3)
        monkeypatch.setattr(Catalog, "settle", hog_then_settle)
        statuses = await put_chain(b, store, keys, make_values(16, 3))
        monkeypatch.undo()
        stored = statuses.count(BlockStatus.OK)
        assert 0 < stored < 16
        assert statuses == [BlockStatus.OK] * stored + [BlockStatus.NO_SPACE] * (16 - stored)
        assert store.statistics()["no_space"] == 16 - stored
        assert [block_file(root, k).exists() for k in keys] == [i < stored for i in range(16)]
    _agree(root)
