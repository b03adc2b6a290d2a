"""The writer alone: order, per-slice results, stop at the first incomplete slice."""

from __future__ import annotations

import anyio
import numpy as np
import xxhash

import kvpipe
from kvpipe._blockformat import check_block
from kvpipe._keys import as_tokens, key_digest
from kvpipe.actors import SliceJob, Writer
from kvpipe.backends import BlockStatus, GetBatch
from tests.actors.harness import BLOCK, Harness, harness
from tests.fakes import Act, ScriptedStore

TOKENS = np.arange(12 * BLOCK)


async def _gathered_jobs(h: Harness, state) -> list[SliceJob]:  # type: ignore[no-untyped-def]
    """The slicer's jobs for a host cache: the writer gathers them itself."""
    return [SliceJob(state, spec, await h.ctx.pool.acquire(spec.count)) for spec in state.slices]


async def test_slices_are_written_in_order_even_when_they_arrive_out_of_order() -> None:
    store = ScriptedStore()
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12))
        jobs = await _gathered_jobs(h, state)
        writer = Writer(h.ctx, h.inboxes["writer"])
        async with anyio.create_task_group() as tg:
            for job in reversed(jobs):
                tg.start_soon(writer.handle, job)
        assert [c.first_block for c in store.calls_of("put")] == [0, 4, 8]
        assert state.done and state.result is not None
        assert (state.result.written, state.result.complete) == (12, True)
        puts = store.calls_of("put")
        assert [c.token_prefix_len for c in puts] == [16, 32, 48]
        assert [c.parent_key for c in puts] == [None, puts[0].keys[-1], puts[1].keys[-1]]
        assert h.ctx.pool.in_use == 0


async def test_first_incomplete_slice_stops_the_request() -> None:
    store = ScriptedStore(puts={1: Act(fail=[0])})
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12))
        jobs = await _gathered_jobs(h, state)
        writer = Writer(h.ctx, h.inboxes["writer"])
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(writer.handle, job)
        assert [c.first_block for c in store.calls_of("put")] == [0, 4]
        assert state.result is not None
        assert (state.result.written, state.result.stop_reason) == (4, "incomplete_slice")
        # blocks 5, 6, 7 were reported stored after the failed block 4: never counted, and
        # left alone (content-chained keys: valid bytes, unreachable until block 4 is stored)
        assert store.deleted == []
        assert h.ctx.metrics.counters["blocks_stored_past_a_failure"] == 3
        assert h.ctx.pool.in_use == 0
        assert h.ctx.metrics.slices == {"complete": 1, "incomplete": 1}


async def test_a_wrong_number_of_statuses_is_a_backend_error() -> None:
    class Short(ScriptedStore):
        async def put_blocks(self, batch):  # type: ignore[no-untyped-def]
            return list(await super().put_blocks(batch))[:-1]

    store = Short()
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12))
        jobs = await _gathered_jobs(h, state)
        writer = Writer(h.ctx, h.inboxes["writer"])
        for job in jobs:
            await writer.handle(job)
        assert state.result is not None
        assert (state.result.written, state.result.stop_reason) == (0, "backend_error")
        assert "statuses" in (state.result.error or "")


async def test_a_host_cache_s_slices_are_gathered_and_sealed_by_the_writer() -> None:
    store = kvpipe.MemoryStore()
    async with harness(store, slice_blocks=6) as h:
        ids = np.array([9, 3, 4, 5, 40, 0])
        state = h.write_state(TOKENS[: 6 * BLOCK], ids)
        (job,) = await _gathered_jobs(h, state)
        await Writer(h.ctx, h.inboxes["writer"]).handle(job)
        assert state.result is not None and state.result.written == 6
        assert state.keys is not None
        lease = await h.ctx.pool.acquire(6)
        got = GetBatch(
            h.ctx.scope,
            "r",
            state.keys.keys,
            0,
            as_tokens(TOKENS[: 6 * BLOCK]),
            None,
            lease=lease,
            value_nbytes=h.ctx.value_nbytes,
            runner=h.ctx.runner,
            limiter=h.ctx.io_limiter,
        )
        assert await store.get_blocks(got) == [BlockStatus.OK] * 6
        for i, block in enumerate(ids):
            value = lease.view(i)
            expected = np.concatenate([rows[block] for rows in h.ctx.cache.byte_rows])
            assert np.array_equal(value[: h.ctx.payload_nbytes], expected)
            digest = key_digest(state.keys.keys[i])
            assert check_block(value, h.ctx.payload_nbytes, digest, True) is None
        lease.release()
        assert h.ctx.pool.in_use == 0


class _Recording(kvpipe.MemoryStore):
    """Copies values (keeps none), recording the checksums each put came with."""

    keeps_values = False

    def __init__(self) -> None:
        super().__init__()
        self.given: list[list[int] | None] = []
        self.hashed: list[list[int]] = []

    async def put_blocks(self, batch):  # type: ignore[no-untyped-def]
        self.given.append(batch.checksums)
        self.hashed.append([xxhash.xxh3_64_intdigest(v) for v in batch.values])
        return await super().put_blocks(batch)


async def test_a_put_carries_each_value_s_checksum_from_the_seal() -> None:
    store = _Recording()
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12))
        for job in await _gathered_jobs(h, state):
            await Writer(h.ctx, h.inboxes["writer"]).handle(job)
        assert state.result is not None and state.result.written == 12
    assert len(store.given) == 3
    assert store.given == store.hashed  # the whole value's XXH3-64: the store need not hash


async def test_without_checksums_a_put_carries_none() -> None:
    store = _Recording()
    config = kvpipe.PipelineConfig(slice_block_num=4, verify_checksums=False)
    async with harness(store, config=config) as h:
        state = h.write_state(TOKENS, np.arange(12))
        for job in await _gathered_jobs(h, state):
            await Writer(h.ctx, h.inboxes["writer"]).handle(job)
    assert store.given == [None, None, None]
