"""Writes sent in place from a host cache (``write_in_place``): same stored bytes as gathered
writes, the right path chosen, registration, and the safety net for abandoned calls.

Runs in virtual time (trio's MockClock): the late completion below costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe.backends import BlockStatus, PutBatch
from kvpipe.testing.faults import FaultPlan, FaultRule, FaultyStore
from tests.helpers import LAYOUTS, fill_random

CONFIG = kvpipe.PipelineConfig(
    slice_block_num=3, slice_timeout=1.0, staging_bytes=1 << 20, write_in_place=True
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def tokens(seed: int, blocks: int, block_size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * block_size - 3)


class RecordingStore(kvpipe.MemoryStore):
    """A memory store that records how values arrive and what is registered."""

    def __init__(self, accepts_parts: bool = True) -> None:
        super().__init__()
        self.accepts_parts = accepts_parts
        self.in_parts: list[bool] = []
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        self.in_parts.append(batch.in_parts)
        if batch.in_parts:
            with pytest.raises(RuntimeError, match="accepts_parts"):
                _ = batch.values
        return await super().put_blocks(batch)

    async def register_staging(self, buffer: memoryview) -> None:
        self.registered.append(len(buffer))

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistered.append(len(buffer))


async def write_all(
    store: kvpipe.MemoryStore, cache: kvpipe.KVCache, toks: np.ndarray, **config: object
) -> kvpipe.WriteResult:
    n = -(-len(toks) // cache.layout.block_size)
    async with kvpipe.open_pipeline(cache, store, config=CONFIG.replace(**config)) as pipe:
        return await pipe.write(toks, list(range(n)), include_partial=True)


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
async def test_in_place_stores_the_same_bytes_as_gathered(layout_name: str) -> None:
    layout = LAYOUTS[layout_name]()
    cache = kvpipe.create_kv_cache(layout, num_blocks=8)
    fill_random(cache, seed=3)
    toks = tokens(1, 7, layout.block_size)
    in_place, gathered = RecordingStore(), RecordingStore()
    w1 = await write_all(in_place, cache, toks)
    w2 = await write_all(gathered, cache, toks, write_in_place=False)
    assert w1.written == w2.written == 7
    assert set(in_place.in_parts) == {True} and set(gathered.in_parts) == {False}
    assert sorted(in_place.keys()) == sorted(gathered.keys())
    for key in in_place.keys():
        assert in_place._data[key].tobytes() == gathered._data[key].tobytes(), key


async def test_in_place_write_reads_back_byte_exact_and_is_counted() -> None:
    layout = LAYOUTS["gqa_fp8"]()
    src = kvpipe.create_kv_cache(layout, num_blocks=8)
    dst = kvpipe.create_kv_cache(layout, num_blocks=8)
    fill_random(src, seed=5)
    toks = tokens(2, 6, layout.block_size)
    store = RecordingStore()
    async with kvpipe.open_pipeline(src, store, config=CONFIG) as pipe:
        w = await pipe.write(toks, [5, 1, 2, 7, 0, 3], include_partial=True)
        stats = pipe.statistics()
    assert w.written == 6
    assert stats.counters["bytes_sent_in_place"] == 6 * layout.block_nbytes
    assert stats.counters.get("bytes_gathered", 0) == 0
    async with kvpipe.open_pipeline(dst, store, config=CONFIG) as pipe:
        r = await pipe.read(toks, [0, 1, 2, 3, 4, 5], include_partial=True, require_all=True)
    assert r.loaded == 6
    for s_rows, d_rows in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(s_rows[[5, 1, 2, 7, 0, 3]], d_rows[:6])


async def test_writes_are_gathered_by_default() -> None:
    assert kvpipe.PipelineConfig().write_in_place is False
    layout = LAYOUTS["mla"]()
    cache = kvpipe.create_kv_cache(layout, num_blocks=8)
    store = RecordingStore()
    async with kvpipe.open_pipeline(cache, store, config=kvpipe.PipelineConfig()) as pipe:
        assert (await pipe.write(tokens(3, 4, layout.block_size), [0, 1, 2, 3])).complete
    assert set(store.in_parts) == {False}


@pytest.mark.parametrize(
    ("accepts", "config", "expect_parts", "why"),
    [
        (True, {}, True, ""),
        # a store that wants contiguous values gets them gathered
        (False, {}, False, "accepts_parts is False"),
        (True, {"write_in_place": False}, False, ""),
        # no checksum: no safety net, gather
        (True, {"verify_checksums": False}, False, "verify_checksums is off"),
    ],
)
async def test_path_choice_and_registration(
    accepts: bool,
    config: dict[str, object],
    expect_parts: bool,
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    layout = LAYOUTS["mla"]()
    cache = kvpipe.create_kv_cache(layout, num_blocks=8)
    fill_random(cache, seed=1)
    store = RecordingStore(accepts_parts=accepts)
    with caplog.at_level("WARNING", logger="kvpipe"):
        async with kvpipe.open_pipeline(cache, store, config=CONFIG.replace(**config)) as pipe:
            assert (await pipe.write(tokens(3, 4, layout.block_size), [0, 1, 2, 3])).complete
            stats = pipe.statistics()
    assert set(store.in_parts) == {expect_parts}
    # The path taken is reported, and a refused write_in_place says why, once, at open.
    assert stats.write_path == ("in place" if expect_parts else "gathered")
    assert why in stats.write_path_note and bool(why) == bool(stats.write_path_note)
    refused = [r for r in caplog.records if "write_in_place=True, but" in r.getMessage()]
    assert len(refused) == (1 if why else 0)
    if why:
        assert why in refused[0].getMessage()
    tensors = [rows.nbytes for rows in cache.byte_rows]
    # Staging always; the cache's tensors too when they are sent in place.
    assert len(store.registered) == 1 + (len(tensors) if expect_parts else 0)
    if expect_parts:
        assert sorted(store.registered[1:]) == sorted(tensors)
    assert sorted(store.unregistered) == sorted(store.registered)


@pytest.mark.parametrize("in_place", [True, False])
async def test_abandoned_put_of_reused_rows_is_never_loaded(in_place: bool) -> None:
    """A put abandoned on its slice timeout completes later, after the caller reused the
    block. In place, the stored value mixes the new rows with the old trailer and a read
    rejects it; gathered, the late put still reads the (held) staging: a sound old value."""
    layout = LAYOUTS["gqa"]()
    cache = kvpipe.create_kv_cache(layout, num_blocks=4)
    fill_random(cache, seed=7)
    original = [rows[:2].copy() for rows in cache.byte_rows]
    toks = tokens(4, 2, layout.block_size)
    inner = kvpipe.MemoryStore()
    plan = FaultPlan(seed=0, rules=(FaultRule(op="put", kind="late", latency=5.0),))
    config = CONFIG.replace(write_in_place=in_place)
    async with FaultyStore(inner, plan) as store:
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            w = await pipe.write(toks, [0, 1], include_partial=True)
            assert w.written == 0 and w.stop_reason == "slice_timeout"
            for rows in cache.byte_rows:  # the server reuses the blocks at once
                rows[0] ^= 0xFF
            await trio.sleep(10)  # the late put lands now
            assert len(inner.keys()) == 2
            assert await pipe.lookup(toks, include_partial=True) == 2
            r = await pipe.read(toks, [2, 3], include_partial=True)
            stats = pipe.statistics()
    if in_place:
        # Block 0 fails its checksum: nothing is loaded, nothing corrupt is trusted.
        assert r.loaded == 0
        assert stats.counters["blocks_failed_verify"] >= 1
    else:
        assert r.loaded == 2
        for rows, orig in zip(cache.byte_rows, original, strict=True):
            assert np.array_equal(rows[2:4], orig)
