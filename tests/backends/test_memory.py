"""MemoryStore: the shared conformance suite, plus its capacity bound."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe._keys import Scope, as_tokens
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, GetBatch, PutBatch, StorageBackend
from kvpipe.testing import BackendConformance
from kvpipe.testing.batches import Batches, random_values
from tests.helpers import fill_random

SCOPE = Scope("t", "0123456789abcdef")


class TestMemoryStoreConformance(BackendConformance):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[StorageBackend]:
        async with kvpipe.MemoryStore() as store:
            yield store


async def test_capacity_reports_no_space_for_what_does_not_fit() -> None:
    suite = BackendConformance()
    store = kvpipe.MemoryStore(capacity_bytes=3 * (suite.payload_nbytes + 48))
    async with suite._batches(store) as b:
        keys, _ = b.keys(5)
        values = [bytes([i]) * b.pool.slot_nbytes for i in range(5)]
        statuses = await b.put(store, keys, values)
        assert statuses == [BlockStatus.OK] * 3 + [BlockStatus.NO_SPACE] * 2
        assert store.statistics()["no_space"] == 2
        assert store.nbytes == 3 * b.pool.slot_nbytes


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        kvpipe.MemoryStore(capacity_bytes=0)


def test_recycle_bytes_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        kvpipe.MemoryStore(recycle_bytes=-1)


LAYOUT = kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)


async def test_later_puts_reuse_the_memory_of_deleted_values() -> None:
    store = kvpipe.MemoryStore()
    src = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    fill_random(src, seed=1)
    dst = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(slice_block_num=4)
    first, second = np.arange(16 * 8), np.arange(16 * 8) + 10_000
    async with kvpipe.open_pipeline(src, store, config=config) as w:
        assert (await w.write(first, np.arange(8))).complete
        assert store.statistics()["recycle_allocated"] == 2
        await store.delete(store.keys())
        assert store.statistics()["recycle_held_bytes"] > 0
        assert (await w.write(second, np.arange(8, 16))).complete
    stats = store.statistics()
    assert (stats["recycle_reused"], stats["recycle_allocated"]) == (2, 2)
    async with kvpipe.open_pipeline(dst, store, config=config) as r:
        assert (await r.read(second, np.arange(8))).complete
    for rows, got in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(rows[8:16], got[:8])


async def test_a_lent_value_keeps_its_memory_from_new_puts() -> None:
    store = kvpipe.MemoryStore()
    keys, slot = ["k0", "k1"], 4096
    common = (SCOPE, "r", keys, 0, as_tokens(np.arange(8)))
    async with ThreadRunner() as runner:
        extra = {"value_nbytes": slot, "runner": runner, "limiter": None}
        kept = store.value_memory(slot, 2)
        kept.pool.buffer[:] = 5
        put = PutBatch(*common, lease=kept, may_keep=True, **extra)
        assert list(await store.put_blocks(put)) == [BlockStatus.OK] * 2
        kept.release()
        del kept, put
        staging = StagingPool(slot, 2)
        get = GetBatch(*common, lease=staging.try_acquire(2), may_lend=True, **extra)
        assert list(await store.get_blocks(get)) == [BlockStatus.OK] * 2
        lent = list(get.lent().values())
        del get
        await store.delete(keys)
        new = store.value_memory(slot, 2)  # the memory is still lent: not reused
        new.pool.buffer[:] = 9
        assert store.statistics()["recycle_reused"] == 0
        assert all(bytes(v) == b"\x05" * slot for v in lent)
        del lent, new
        assert store.value_memory(slot, 2) is not None
        assert store.statistics()["recycle_reused"] == 1


async def test_closing_the_store_frees_the_memory_held_for_reuse() -> None:
    store = kvpipe.MemoryStore()
    lease = store.value_memory(4096, 2)
    del lease
    assert store.statistics()["recycle_held_bytes"] == 2 * 4096
    async with store:
        pass
    assert store.statistics()["recycle_held_bytes"] == 0
    store.value_memory(4096, 2)  # let go at once: freed, not held
    assert store.statistics()["recycle_held_bytes"] == 0


async def test_large_copied_puts_reuse_the_memory_of_deleted_values() -> None:
    """Values the store must copy (staging it may not keep: the CUDA path's pinned staging)
    go into its recycled memory when large, as kept ones do, not into fresh memory."""
    store = kvpipe.MemoryStore()
    slot, n = 256 * 1024, 4  # over the inline limit: copied in a worker thread
    staging = StagingPool(slot, n)
    async with ThreadRunner() as runner:
        extra = {"value_nbytes": slot, "runner": runner, "limiter": None}
        for round_, fill in enumerate((3, 7)):
            keys = [f"r{round_}k{i}" for i in range(n)]
            common = (SCOPE, "r", keys, 0, as_tokens(np.arange(8)))
            lease = staging.try_acquire(n)
            assert lease is not None
            staging.buffer[:] = fill
            put = PutBatch(*common, lease=lease, may_keep=False, **extra)
            assert list(await store.put_blocks(put)) == [BlockStatus.OK] * n
            staging.buffer[:] = 0  # staging is reused: the store holds copies
            assert all(bytes(store._data[k]) == bytes([fill]) * slot for k in keys)
            assert all(not np.shares_memory(store._data[k], staging.buffer) for k in keys)
            lease.release()
            del put
            if round_ == 0:
                await store.delete(keys)
    stats = store.statistics()
    assert (stats["recycle_allocated"], stats["recycle_reused"]) == (1, 1)


async def test_a_stored_value_of_another_size_is_corrupt_not_copied_in_part() -> None:
    """A value shorter than the batch's values is refused as the lending path refuses it,
    not copied into the start of the buffer and answered OK over stale bytes."""
    async with kvpipe.MemoryStore() as store, ThreadRunner() as runner:
        short, full = Batches(StagingPool(64, 4), runner), Batches(StagingPool(128, 4), runner)
        keys, _ = short.keys(2)
        assert await short.put(store, keys, random_values(2, 64, 1)) == [BlockStatus.OK] * 2
        statuses, _ = await full.get(store, keys)
        assert statuses == [BlockStatus.CORRUPT] * 2


class _PausingDict(dict[str, object]):
    """The store's dictionary; the first lookup made in ``thread`` stops there, after the
    lookup, until ``go_on`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.paused = threading.Event()
        self.go_on = threading.Event()

    def get(self, key: str, default: object = None) -> object:
        found = super().get(key, default)
        if threading.current_thread() is self.thread and not self.paused.is_set():
            self.paused.set()
            assert self.go_on.wait(30)
        return found


class _WatchedLock:
    """A lock that says when ``thread`` starts to wait for it (``waited``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if threading.current_thread() is self.thread:
            self.waited.set()
        self._lock.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


def _put_in_own_loop(store: kvpipe.MemoryStore, keys: list[str], fill: int) -> list[BlockStatus]:
    """Put a 64-byte value under each key, on an event loop of this thread's own."""

    async def put() -> list[BlockStatus]:
        async with ThreadRunner() as runner:
            lease = StagingPool(64, len(keys)).try_acquire(len(keys))
            assert lease is not None
            lease.pool.buffer[:] = fill
            common = (SCOPE, "r", keys, 0, as_tokens(np.arange(4 * len(keys))))
            batch = PutBatch(*common, lease=lease, value_nbytes=64, runner=runner, limiter=None)
            return list(await store.put_blocks(batch))

    return anyio.run(put)


def test_puts_of_one_key_from_two_threads_count_its_bytes_once() -> None:
    """One store shared by pipelines on two event loops in two threads: a put of a key in
    one thread between the lookup of the key's old value and the update of another put of
    that key (a thread switch there) made the other put count the key's bytes as new, so
    ``nbytes`` counted them twice, and with ``capacity_bytes`` the store refused puts it had
    room for (even once empty). Interleaved deterministically: the first put stops after its
    lookup until the second has stored the key (or waits for the store's lock)."""
    store = kvpipe.MemoryStore(capacity_bytes=128)
    data = _PausingDict()
    store._data = data  # type: ignore[assignment]
    lock = _WatchedLock()
    store._lock = lock  # type: ignore[attr-defined]
    results: dict[str, list[BlockStatus]] = {}
    moved = threading.Event()  # the second put is done, or waits for the first

    def run(name: str, fill: int) -> None:
        results[name] = _put_in_own_loop(store, ["k"], fill)
        moved.set()

    first = threading.Thread(target=run, args=("first", 1))
    second = threading.Thread(target=run, args=("second", 2))
    data.thread, lock.thread = first, second
    first.start()
    assert data.paused.wait(30)
    second.start()
    threading.Thread(target=lambda: lock.waited.wait(30) and moved.set(), daemon=True).start()
    assert moved.wait(30)
    data.go_on.set()
    first.join(30)
    second.join(30)
    assert results == {"first": [BlockStatus.OK], "second": [BlockStatus.OK]}
    assert store.nbytes == 64 == sum(len(v) for v in store._data.values())  # type: ignore[arg-type]
    assert store.statistics()["puts"] == 2
    anyio.run(store.delete, ["k"])
    assert store.nbytes == 0
    assert _put_in_own_loop(store, ["a", "b"], 3) == [BlockStatus.OK] * 2


async def test_a_delete_with_an_invalid_key_removes_none() -> None:
    """The keys before the invalid one were removed, then ValueError raised: a caller
    retrying without it could not tell which were gone."""
    suite = BackendConformance()
    store = kvpipe.MemoryStore()
    async with suite._batches(store) as b:
        keys, _ = b.keys(2)
        values = [bytes([i]) * b.pool.slot_nbytes for i in range(2)]
        assert await b.put(store, keys, values) == [BlockStatus.OK] * 2
        with pytest.raises(ValueError):
            await store.delete([keys[0], "bad\x00key", keys[1]])
        assert await store.exists(b.key_batch(keys)) == [True, True]


async def test_a_residency_write_with_an_invalid_key_records_none() -> None:
    """The entries before the invalid one were recorded, then ValueError raised."""
    suite = BackendConformance()
    store = kvpipe.MemoryStore()
    async with suite._batches(store) as b:
        keys, _ = b.keys(2)
        good = [kvpipe.ResidencyEntry(k, "node-a", kvpipe.Residency.GPU, 1.0) for k in keys]
        bad = kvpipe.ResidencyEntry("bad\x00key", "node-a", kvpipe.Residency.GPU, 1.0)
        with pytest.raises(ValueError):
            await store.put_residency([good[0], bad, good[1]])
        assert await store.get_residency(keys) == [(), ()]


async def test_a_get_with_an_invalid_key_is_refused_as_the_other_calls_are() -> None:
    """``get_blocks`` answered ``MISSING`` for a key that ``exists``, ``delete`` and
    ``get_residency`` (and the file and Mooncake stores' ``get_blocks``) refuse with
    ``RequestError``: a caller's bad key passed for a miss on this store only."""
    suite = BackendConformance()
    store = kvpipe.MemoryStore()
    async with suite._batches(store) as b:
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await b.get(store, ["../x"])
        assert store.statistics()["gets"] == 0
