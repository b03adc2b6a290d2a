"""Reads of a host cache over the file store: each value checked and placed in the store's
thread (kvpipe's FetchSink). A value that fails kvpipe's own check is never loaded, is
fetched again and deleted; a read that ended writes nothing more into the cache."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import xxhash

import kvpipe
from kvpipe import _blockformat
from kvpipe.actors import _rowsink
from kvpipe.backends.file import FileStore
from kvpipe.backends.file._format import HEADER_NBYTES, file_nbytes, pack_header, unpack_header
from kvpipe.benchmarks._file_baselines import warm_cached
from tests.backends.test_file_hostile import (
    LAYOUT,
    NBLOCKS,
    SENTINEL,
    TOKENS,
    _pipeline_keys,
    _source_cache,
    block_file,
)
from tests.helpers import host_threads_busy, needs_native_digests

pytestmark = pytest.mark.usefixtures("file_io")


@pytest.fixture(params=["data", "none"])
def durability(request: pytest.FixtureRequest) -> str:
    """Files written past the page cache (``data``: read with ``O_DIRECT`` unless warmed)
    and through it (``none``)."""
    return str(request.param)


@pytest.fixture(params=["cold", "cached"])
def warm(request: pytest.FixtureRequest) -> bool:
    """Read the files from wherever they are, or after reading them through the page cache
    (the store then reads them from it, at the cache rows' offset)."""
    return bool(request.param == "cached")


def _reseal(path: Path, key: str, other: Path) -> None:
    """Make ``path`` a sound block file of ``key`` that holds ``other``'s value: the file
    store's checks pass, kvpipe's trailer check (the value's key) fails."""
    raw = path.read_bytes()
    header = unpack_header(raw[:HEADER_NBYTES])
    body = other.read_bytes()[HEADER_NBYTES : HEADER_NBYTES + header.payload_nbytes]
    head = pack_header(
        key,
        header.payload_nbytes,
        xxhash.xxh3_64_intdigest(body),
        header.created,
        header.fingerprint,
        header.padded,
    )
    data = head + body
    path.write_bytes(data + bytes(file_nbytes(header.payload_nbytes, header.padded) - len(data)))


def _blank_cache() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, 32)
    for rows in cache.byte_rows:
        rows[:] = SENTINEL
    return cache


async def test_a_value_of_another_key_is_not_loaded_and_is_deleted(
    tmp_path: Path, durability: str, warm: bool
) -> None:
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=3)
    ids = np.arange(NBLOCKS)
    k = 4
    async with FileStore(root, durability=durability) as store:  # type: ignore[arg-type]
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, ids)).complete
        keys = _pipeline_keys("e2e")
        _reseal(block_file(root, keys[k]), keys[k], block_file(root, keys[k + 1]))
        if warm:
            warm_cached(str(root / "blocks"))
        dst = _blank_cache()
        dst_ids = np.arange(31, 31 - NBLOCKS, -1)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            r = await pipe.read(TOKENS, dst_ids)
            assert r.loaded == k and r.stop_reason == "failed_block" and k in r.failed_blocks
            for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
                assert np.array_equal(a[ids[:k]], c[dst_ids[:k]])
                assert np.all(c[dst_ids[k]] == SENTINEL)  # the failed block: untouched
        # closed: the reader's deletion of the corrupt block has run
        counters = pipe.statistics().counters
        assert counters["blocks_refetched"] >= 1
        assert counters["corrupt_blocks_deleted"] == 1
        assert not block_file(root, keys[k]).exists()
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            assert await pipe.lookup(TOKENS) == k


class _Held:
    """Holds a store thread at the first call of a sink method until :meth:`go`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.entered = threading.Event()
        self._go = threading.Event()
        self._first = True
        self._lock = threading.Lock()
        original = getattr(_rowsink.RowSink, name)

        def held(sink: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                first, self._first = self._first, False
            if first:
                self.entered.set()
                assert self._go.wait(30), "never let go"
            return original(sink, *args, **kwargs)

        monkeypatch.setattr(_rowsink.RowSink, name, held)

    def go(self) -> None:
        self._go.set()


async def _cancelled_read(
    tmp_path: Path, held: _Held, after_cancel: Any
) -> tuple[kvpipe.KVCache, np.ndarray]:
    """Write 8 blocks, then read them with a store thread held in the sink; cancel the
    read once it is held; ``after_cancel(returned)`` runs while it still is."""
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=8)
    dst = _blank_cache()
    dst_ids = np.arange(31, 31 - NBLOCKS, -1)
    async with FileStore(root, durability="none", threads=1) as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, np.arange(NBLOCKS))).complete
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            returned = anyio.Event()
            with anyio.fail_after(30):  # a guard against a hang, not a timing
                await _cancel_while_held(pipe, dst_ids, held, after_cancel, returned)
    # the store is closed: its threads have all returned
    return dst, dst_ids


async def _cancel_while_held(
    pipe: kvpipe.Pipeline, dst_ids: np.ndarray, held: _Held, after_cancel: Any, returned: Any
) -> None:
    async with anyio.create_task_group() as tg:

        async def read() -> None:
            try:
                await pipe.read(TOKENS, dst_ids)
            finally:
                returned.set()

        scope = anyio.CancelScope()

        async def cancellable() -> None:
            with scope:
                await read()

        tg.start_soon(cancellable)
        try:
            assert await anyio.to_thread.run_sync(held.entered.wait, 30)
            scope.cancel()
            await after_cancel(returned)
        finally:
            held.go()
        await returned.wait()


# Only the native reads hand values to the sink: with os calls, kvpipe places them itself.
@pytest.mark.parametrize("file_io", ["native"], indirect=True)
async def test_a_read_cancelled_before_a_value_is_placed_writes_nothing_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """A store thread that hands a value over after the read ended: nothing goes into the
    cache (the read's claim on it ended with the call)."""
    held = _Held(monkeypatch, "fetched")

    async def after_cancel(returned: anyio.Event) -> None:
        await returned.wait()  # the call returns without waiting for the held thread

    dst, dst_ids = await _cancelled_read(tmp_path, held, after_cancel)
    for rows in dst.byte_rows:
        assert np.all(rows[dst_ids] == SENTINEL)


# Only the native reads hand values to the sink: with os calls, kvpipe places them itself.
@pytest.mark.parametrize("file_io", ["native"], indirect=True)
async def test_a_read_cancelled_while_a_value_is_placed_waits_for_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """A store thread inside a copy into the cache when the read is cancelled: the call
    returns only after that copy is out, and no other copy starts."""
    held = _Held(monkeypatch, "_exit")  # held just after its first copy, before leaving

    async def after_cancel(returned: anyio.Event) -> None:
        await anyio.wait_all_tasks_blocked()
        assert not returned.is_set()  # still waiting for the copy in the store's thread

    dst, dst_ids = await _cancelled_read(tmp_path, held, after_cancel)
    placed = [
        i
        for i in range(NBLOCKS)
        if not all(np.all(rows[dst_ids[i]] == SENTINEL) for rows in dst.byte_rows)
    ]
    assert placed == [0]  # the copy under way, and none after it


async def test_a_slice_partly_in_the_page_cache_loads_whole(tmp_path: Path) -> None:
    """Blocks the page cache holds are handed to the sink; the others are read from the
    device and placed by kvpipe afterwards: every block loads, byte for byte."""
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=8)
    ids = np.arange(NBLOCKS)
    async with FileStore(root, durability="data") as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, ids)).complete
        keys = _pipeline_keys("e2e")
        for key in keys[::2]:  # every other block file read through the page cache
            block_file(root, key).read_bytes()
        dst = _blank_cache()
        dst_ids = np.arange(31, 31 - NBLOCKS, -1)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            r = await pipe.read(TOKENS, dst_ids)
            assert r.complete and r.loaded == NBLOCKS
        for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
            assert np.array_equal(a[ids], c[dst_ids])


@pytest.mark.parametrize("file_io", ["native"], indirect=True)
@pytest.mark.parametrize("placing", ["native", "python", "refused"])
async def test_cached_values_land_in_every_row_whichever_way_they_are_checked_and_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str, placing: str
) -> None:
    """The sink checks and copies a value in one native call, or through python-xxhash and
    numpy where the extension is not there or refuses the rows: the cache gets the same
    bytes either way."""
    real, calls = _rowsink.place_if_sound, []

    def counted(*args: Any) -> Any:
        calls.append(args[6])
        if placing == "refused":
            raise ValueError("rows it does not take")
        return real(*args)

    if placing == "python":
        monkeypatch.setattr(_blockformat, "native", None)
    else:
        needs_native_digests()
    monkeypatch.setattr(_rowsink, "place_if_sound", counted)
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=8)
    ids = np.arange(NBLOCKS)
    async with FileStore(root, durability="none") as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, ids)).complete
        warm_cached(str(root / "blocks"))
        dst = _blank_cache()
        dst_ids = np.arange(31, 31 - NBLOCKS, -1)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            r = await pipe.read(TOKENS, dst_ids)
            assert r.complete and r.loaded == NBLOCKS
        assert store.statistics().get("blocks_read") == NBLOCKS
    for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[ids], c[dst_ids])
    # Native: every value in one call each; refused: asked once per slice, then the slow way.
    assert len(calls) == {"native": NBLOCKS, "python": 0, "refused": -(-NBLOCKS // 8)}[placing]
    untouched = np.setdiff1d(np.arange(32), dst_ids)
    assert all(np.all(c[untouched] == SENTINEL) for c in dst.byte_rows)


# Only the native reads hand values to the sink: with os calls, kvpipe places them itself.
@pytest.mark.parametrize("file_io", ["native"], indirect=True)
async def test_a_cancelled_read_waits_for_its_copy_without_the_hosts_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """Waiting for a store thread's copy into the cache to end takes none of the event loop
    library's shared worker threads: a server that has them all busy (blocking endpoints,
    say) does not hold up a cancelled read."""
    held = _Held(monkeypatch, "_exit")  # held just after its first copy, before leaving
    config = kvpipe.PipelineConfig(slice_block_num=8)
    dst = _blank_cache()
    dst_ids = np.arange(31, 31 - NBLOCKS, -1)
    async with FileStore(tmp_path / "store", durability="none", threads=1) as store:
        src = _source_cache()
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            assert (await pipe.write(TOKENS, np.arange(NBLOCKS))).complete
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            returned = anyio.Event()
            read_scope = anyio.CancelScope()

            async def read() -> None:
                with read_scope:
                    await pipe.read(TOKENS, dst_ids)
                returned.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                try:
                    assert await anyio.to_thread.run_sync(held.entered.wait, 30)
                    async with host_threads_busy():
                        read_scope.cancel()
                        await anyio.wait_all_tasks_blocked()
                        held.go()
                        with anyio.fail_after(5):  # a guard against a hang, not a timing
                            await returned.wait()
                finally:
                    held.go()
