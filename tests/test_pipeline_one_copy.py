"""One copy fewer with a store that keeps values in memory (``keeps_values``): a put is
gathered into memory of its own that the store keeps, and a get is answered by lending the
stored value, verified and scattered where it lies — with every promise kept."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.backends import BlockStatus, GetBatch, StorageBackend
from tests.helpers import fill_random

LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
TOKENS = np.arange(16 * 12)


def _cache(seed: int) -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=32)
    fill_random(cache, seed=seed)
    return cache


def _rows(cache: kvpipe.KVCache, blocks: Any) -> list[bytes]:
    return [bytes(r[b]) for b in blocks for r in cache.byte_rows]


async def test_values_are_kept_not_copied_and_never_alias_staging() -> None:
    store = kvpipe.MemoryStore()
    src, dst = _cache(1), _cache(2)
    cfg = kvpipe.PipelineConfig(slice_block_num=4)
    async with kvpipe.open_pipeline(src, store, config=cfg) as pipe:
        staging = pipe._runtime._pool.buffer  # type: ignore[union-attr]
        assert (await pipe.write(TOKENS, np.arange(12))).complete
        values = [store._data[k] for k in store.keys()]
        assert len(values) == 12
        assert not any(np.shares_memory(v, staging) for v in values)
        # kept where they were gathered (views of the slice's own memory), not copied
        assert not any(v.flags.owndata for v in values)
        del staging
        # a second write of other data through the same staging leaves the first intact
        other = np.arange(10_000, 10_000 + 16 * 12)
        assert (await pipe.write(other, np.arange(12, 24))).complete
    async with kvpipe.open_pipeline(dst, store, config=cfg) as pipe:
        r = await pipe.read(TOKENS, np.arange(12))
        assert r.complete
        assert _rows(dst, range(12)) == _rows(src, range(12))


class _Spy(StorageBackend):
    """Passes calls to a MemoryStore and records what each get lent."""

    name = "spy"
    keeps_values = True

    def __init__(self) -> None:
        self.inner = kvpipe.MemoryStore()
        self.lent: list[int] = []

    async def put_blocks(self, batch: Any) -> Any:
        return await self.inner.put_blocks(batch)

    async def get_blocks(self, batch: GetBatch) -> Any:
        statuses = await self.inner.get_blocks(batch)
        self.lent.append(len(batch.lent()))
        return statuses

    async def exists(self, batch: Any) -> Any:
        return await self.inner.exists(batch)

    async def delete(self, keys: Any) -> None:
        await self.inner.delete(keys)

    async def put_residency(self, entries: Any) -> None:
        await self.inner.put_residency(entries)

    async def get_residency(self, keys: Any) -> Any:
        return await self.inner.get_residency(keys)


async def test_reads_take_lent_values_and_still_verify_them() -> None:
    store = _Spy()
    src, dst = _cache(3), _cache(4)
    cfg = kvpipe.PipelineConfig(slice_block_num=4)
    async with kvpipe.open_pipeline(src, store, config=cfg) as pipe:
        assert (await pipe.write(TOKENS, np.arange(12))).complete
    # tamper with block 6's stored value (a new read-only array, as a put would make)
    keys = list(store.inner._data)
    bad = store.inner._data[keys[6]].copy()
    bad[100] ^= 0xFF
    bad.flags.writeable = False
    store.inner._data[keys[6]] = bad
    async with kvpipe.open_pipeline(dst, store, config=cfg) as pipe:
        r = await pipe.read(TOKENS, np.arange(12))
    assert store.lent and all(n > 0 for n in store.lent), "the store lent nothing"
    assert r.loaded == 6 and r.stop_reason == "failed_block" and 6 in r.failed_blocks
    assert _rows(dst, range(6)) == _rows(src, range(6))
    # (blocks past `loaded` may hold anything: a later slice may have been scattered first)


async def test_a_store_that_does_not_keep_values_gets_copies() -> None:
    inner = kvpipe.MemoryStore()

    class Plain(_Spy):
        keeps_values = False

    store = Plain()
    store.inner = inner
    src, dst = _cache(5), _cache(6)
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(TOKENS, np.arange(12))).complete
    async with kvpipe.open_pipeline(dst, store) as pipe:
        assert (await pipe.read(TOKENS, np.arange(12))).complete
    assert store.lent and not any(store.lent)
    assert _rows(dst, range(12)) == _rows(src, range(12))
    assert BlockStatus.OK  # the enum is what the statuses are made of


async def test_small_puts_are_copied_from_staging_into_values_of_their_own() -> None:
    tiny = kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=8, block_size=1)
    src, dst = kvpipe.create_kv_cache(tiny, 8), kvpipe.create_kv_cache(tiny, 8)
    fill_random(src, seed=7)
    store = kvpipe.MemoryStore()
    cfg = kvpipe.PipelineConfig(slice_block_num=2)
    async with kvpipe.open_pipeline(src, store, config=cfg) as pipe:
        staging = pipe._runtime._pool.buffer  # type: ignore[union-attr]
        assert (await pipe.write(np.arange(8), np.arange(8))).complete
        values = [store._data[k] for k in store.keys()]
        assert len(values) == 8
        assert all(v.flags.owndata for v in values)  # copies, one per value
        assert not any(np.shares_memory(v, staging) for v in values)
        del staging
    assert store.statistics()["recycle_allocated"] == 0  # no memory leased for them
    async with kvpipe.open_pipeline(dst, store, config=cfg) as pipe:
        assert (await pipe.read(np.arange(8), np.arange(8))).complete
    assert [bytes(r) for r in dst.byte_rows] == [bytes(r) for r in src.byte_rows]


class _NoMemoryToKeep(kvpipe.MemoryStore):
    """A store that keeps values, but has no memory to offer for them just now (or fails
    to: a store's own error)."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error

    def value_memory(self, slot_nbytes: int, count: int) -> Any:
        raise self.error("no memory for values")


@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
async def test_no_memory_for_values_to_keep_gathers_into_staging_for_the_store_to_copy(
    error: type[Exception],
) -> None:
    """Out of memory for values the store would keep, a write goes through staging (the
    store copies it), not into a writer crash (three of which close the pipeline). So does
    a value_memory that fails otherwise: a store's error, never the writer's crash (a
    RuntimeError crashed it, and the fourth write closed the pipeline)."""
    store = _NoMemoryToKeep(error)
    src, dst = _cache(1), _cache(2)
    cfg = kvpipe.PipelineConfig(slice_block_num=4)
    async with kvpipe.open_pipeline(src, store, config=cfg) as pipe:
        for first in range(0, 4 * 12, 12):  # more writes than the restarts allowed
            tokens, ids = np.arange(16 * 12) + first * 1000, np.arange(12)
            assert (await pipe.write(tokens, ids)).complete
        assert pipe.statistics().restarts == {}
    async with kvpipe.open_pipeline(dst, store, config=cfg) as pipe:
        assert (await pipe.read(TOKENS, np.arange(12))).complete
        assert _rows(dst, range(12)) == _rows(src, range(12))
