"""The writer alone: order, per-slice results, stop at the first incomplete slice — for a
device cache's slices (handed on one by one) and a host cache's whole writes (leased,
gathered and put slice by slice)."""

from __future__ import annotations

import asyncio

import anyio
import numpy as np
import pytest
import trio.testing
import xxhash

import kvpipe
from kvpipe._keys import as_tokens, key_digest
from kvpipe._results import SliceOutcome
from kvpipe.actors import SliceJob, Writer
from kvpipe.actors import writer as writer_module
from kvpipe.actors._base import keeps_own_memory
from kvpipe.backends import BlockStatus, GetBatch
from tests.actors.harness import BLOCK, Harness, harness
from tests.fakes import Act, ScriptedStore
from tests.helpers import check_block

TOKENS = np.arange(12 * BLOCK)


async def _gathered_jobs(h: Harness, state) -> list[SliceJob]:  # type: ignore[no-untyped-def]
    """A device cache's jobs, as the swapper hands them on (not gathered: the stores of the
    tests that use them do not look at the bytes)."""
    return [SliceJob(state, spec, await h.ctx.pool.acquire(spec.count)) for spec in state.slices]


@pytest.fixture
def big_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slice of a host cache's write counts as large: gathered in a task of its own,
    ahead of the puts."""
    monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)


@pytest.fixture(params=["inline", "large"])
def gathers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a host cache's slices are gathered: inline, and (every slice counted as
    large) in tasks of their own ahead of the puts."""
    if request.param == "large":
        monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)


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


@pytest.mark.parametrize("answer", ["short", "none", "count"])
async def test_a_wrong_number_of_statuses_is_a_backend_error(answer: str) -> None:
    """Too few statuses, or no sequence at all (``None``, a count: a third-party store's
    slip), fail the slice as the store's error. ``None`` or a count crashed the writer
    (``TypeError`` from ``list``): the write ended ``actor_crashed``, the actor restarted."""

    class Short(ScriptedStore):
        async def put_blocks(self, batch):  # type: ignore[no-untyped-def]
            got = list(await super().put_blocks(batch))
            return {"short": got[:-1], "none": None, "count": len(got)}[answer]

    store = Short()
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12))
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert state.result is not None
        assert (state.result.written, state.result.stop_reason) == (0, "backend_error")
        assert "statuses" in (state.result.error or "")
        assert len(store.calls_of("put")) == 1 and h.ctx.pool.in_use == 0


@pytest.mark.usefixtures("gathers")
async def test_a_host_cache_s_slices_are_gathered_and_sealed_by_the_writer() -> None:
    store = kvpipe.MemoryStore()
    async with harness(store, slice_blocks=6) as h:
        ids = np.array([9, 3, 4, 5, 40, 0])
        state = h.write_state(TOKENS[: 6 * BLOCK], ids)
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert state.result is not None and state.result.written == 6
        assert state.keys is not None
        lease = await h.ctx.pool.acquire(6)
        got = GetBatch(
            h.ctx.scope,
            "r",
            state.keys,
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
            digest = key_digest(state.keys[i])
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
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert state.result is not None and state.result.written == 12
    assert len(store.given) == 3
    assert store.given == store.hashed  # the whole value's XXH3-64: the store need not hash


async def test_without_checksums_a_put_carries_none() -> None:
    store = _Recording()
    config = kvpipe.PipelineConfig(slice_block_num=4, verify_checksums=False)
    async with harness(store, config=config) as h:
        state = h.write_state(TOKENS, np.arange(12))
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
    assert store.given == [None, None, None]


@pytest.mark.usefixtures("gathers")
async def test_a_host_cache_s_write_stops_at_the_first_incomplete_slice() -> None:
    """Slices gathered ahead of a put that fell short are let go, never put."""
    store = ScriptedStore(puts={1: Act(fail=[1])})
    async with harness(store, slice_blocks=2) as h:
        state = h.write_state(TOKENS, np.arange(12))
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert [c.first_block for c in store.calls_of("put")] == [0, 2]
        assert state.result is not None
        assert (state.result.written, state.result.stop_reason) == (3, "incomplete_slice")
        assert h.ctx.pool.in_use == 0


@pytest.mark.usefixtures("big_slices")
async def test_a_host_cache_s_write_never_waits_for_staging_while_holding_some() -> None:
    """Two slots of staging, two-block slices gathered ahead: each slice's staging comes
    from the put of the one before it, not from a wait that would never end."""
    store = ScriptedStore()
    async with harness(store, slice_blocks=2, pool_slots=2) as h:
        state = h.write_state(TOKENS, np.arange(12))
        with anyio.fail_after(10):
            await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert [c.first_block for c in store.calls_of("put")] == [0, 2, 4, 6, 8, 10]
        assert state.result is not None and state.result.written == 12
        assert h.ctx.pool.in_use == 0


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    async def test_waiting_for_staging_is_bounded_by_the_deadline(self) -> None:
        store = ScriptedStore()
        async with harness(store, slice_blocks=4, pool_slots=4) as h:
            hog = await h.ctx.pool.acquire(4)
            state = h.write_state(TOKENS, np.arange(12), timeout=7)
            start = anyio.current_time()
            await Writer(h.ctx, h.inboxes["writer"]).handle(state)
            assert anyio.current_time() - start == pytest.approx(7.0)
            assert state.result is not None and state.result.stop_reason == "total_timeout"
            assert store.calls_of("put") == []
            hog.release()
            assert h.ctx.pool.in_use == 0

    @pytest.mark.usefixtures("big_slices")
    async def test_a_slow_put_times_out_and_the_slices_gathered_behind_it_are_let_go(
        self,
    ) -> None:
        store = ScriptedStore(puts={0: Act(hang=True)})
        config = kvpipe.PipelineConfig(slice_block_num=2, slice_timeout=3, copy_threads=2)
        async with harness(store, config=config, slice_blocks=2) as h:
            state = h.write_state(TOKENS, np.arange(12))
            start = anyio.current_time()
            await Writer(h.ctx, h.inboxes["writer"]).handle(state)
            assert anyio.current_time() - start == pytest.approx(3.0)
            assert state.result is not None
            assert (state.result.written, state.result.stop_reason) == (0, "slice_timeout")
            assert len(store.calls_of("put")) == 1
            assert h.ctx.pool.in_use == 0

    @pytest.mark.parametrize("first", ["writer", "elsewhere"])
    async def test_a_put_cut_off_at_the_deadline_is_recorded_once_whoever_ends_the_write(
        self, first: str
    ) -> None:
        """Slice 1's put hangs. Whether the writer's own cancel scope reports the deadline
        first, or another task (the slicer waiting for staging, the swapper, a gather ahead;
        here the test, while the put is held in flight) ends the write as ``total_timeout``
        first, the slice sent has one outcome, ``total_timeout`` with nothing counted, one
        slice count and one observation."""
        store = ScriptedStore(puts={1: Act(hang=True)})
        async with harness(store, slice_blocks=4) as h:
            seen: list[tuple[str, str]] = []
            assert h.ctx.observers is not None
            h.ctx.observers.add(lambda kind, _s, outcome: seen.append((kind, outcome)))
            state = h.write_state(TOKENS, np.arange(12), timeout=7)
            jobs = await _gathered_jobs(h, state)
            writer = Writer(h.ctx, h.inboxes["writer"])
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(writer.handle, job)
                await store.wait_calls("put", 2)  # slice 1 is in its store call
                if first == "elsewhere":
                    state.end("total_timeout", "deadline passed waiting for staging")
            state.end("total_timeout", "the deadline guard")  # too late: ignored
            r = state.result
            assert r is not None
            assert (r.written, r.stop_reason) == (4, "total_timeout")
            assert [(o.index, o.outcome, o.written) for o in r.slices] == [
                (0, "complete", 4),
                (1, "total_timeout", 0),
            ]
            assert store.calls_of("put")[1].cancelled and len(store.calls_of("put")) == 2
            assert h.ctx.metrics.slices == {"complete": 1, "total_timeout": 1}
            assert seen == [("write_slice", "complete"), ("write_slice", "total_timeout")]
            assert h.ctx.metrics.counters["blocks_written"] == 4 == len(store.inner.keys())
            assert h.ctx.pool.in_use == 0


def test_only_puts_over_32_kib_are_gathered_into_memory_the_store_keeps() -> None:
    assert not keeps_own_memory(1, 1024)
    assert not keeps_own_memory(32, 1024)
    assert keeps_own_memory(33, 1024)
    assert keeps_own_memory(1, (32 << 10) + 1)


async def test_a_small_last_slice_is_not_gathered_once_the_put_before_it_fell_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slice 0 (large: gathered ahead) stores short; slice 1 (small: gathered inline, after
    the puts ahead) must not be gathered then: the write has ended, and after it ends
    nothing more of it starts (nor reads the caller's cache)."""
    store = ScriptedStore(puts={0: Act(fail=[1])})
    async with harness(store, slice_blocks=2) as h:
        payload = h.ctx.payload_nbytes
        monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", payload)  # 2 blocks: ahead
        state = h.write_state(TOKENS[: 3 * BLOCK], np.arange(3))  # slices of 2 and 1
        await Writer(h.ctx, h.inboxes["writer"]).handle(state)
        assert state.result is not None
        assert (state.result.written, state.result.stop_reason) == (1, "incomplete_slice")
        assert len(store.calls_of("put")) == 1
        assert h.ctx.metrics.counters["bytes_gathered"] == 2 * payload
        assert h.ctx.pool.in_use == 0


async def test_a_slice_whose_turn_comes_as_the_deadline_passes_ends_the_write() -> None:
    """The slice before it is done in the very step the write's deadline passes (asyncio
    then cancels the wait for the turn that has just ended): the slice, not sent, ends the
    write itself, as one whose turn came just before the deadline does."""
    store = ScriptedStore()
    async with harness(store, slice_blocks=4) as h:
        state = h.write_state(TOKENS, np.arange(12), timeout=0.05)
        first, second, third = await _gathered_jobs(h, state)

        def slice_0_done() -> None:
            state.machine.sent(0, state.started)
            spec = first.spec
            state.slice_done(
                SliceOutcome(0, spec.first_block, spec.count, spec.count, 0.0, "complete")
            )

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(Writer(h.ctx, h.inboxes["writer"]).handle, second)
                await anyio.wait_all_tasks_blocked()  # waiting for its turn, till the deadline
                asyncio.get_running_loop().call_at(state.deadline, slice_0_done)
        finally:
            first.release()
            third.release()
        assert store.calls_of("put") == []
        r = state.result
        assert r is not None and (r.written, r.stop_reason) == (4, "total_timeout")
        assert r.error == "deadline passed before the slice was sent"
