"""The swapper alone: gathers into sealed staging slots, scatters verified blocks."""

from __future__ import annotations

import numpy as np
import pytest

import kvpipe
from kvpipe._keys import key_digest
from kvpipe._plan import plan_slices
from kvpipe.actors import SliceJob, Swapper
from tests.actors.harness import BLOCK, harness
from tests.helpers import check_block

TOKENS = np.arange(6 * BLOCK)


async def test_gather_packs_every_layer_and_role_and_seals_each_block() -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=6) as h:
        ids = np.array([9, 3, 4, 5, 40, 0])
        state = h.write_state(TOKENS, ids)
        spec = state.slices[0]
        lease = await h.ctx.pool.acquire(spec.count)
        await Swapper(h.ctx, h.inboxes["swapper"]).handle(SliceJob(state, spec, lease))
        (job,) = h.sent("writer")
        assert state.keys is not None
        for i, block in enumerate(ids):
            value = job.lease.view(i)
            expected = np.concatenate([rows[block] for rows in h.ctx.cache.byte_rows])
            assert np.array_equal(value[: h.ctx.payload_nbytes], expected)
            assert check_block(value, h.ctx.payload_nbytes, key_digest(state.keys[i]), True) is None
        job.lease.release()


@pytest.mark.parametrize("stop", [None, 2])
async def test_scatter_writes_only_the_valid_leading_blocks(stop: int | None) -> None:
    """4 of 6 blocks valid; with ``stop``, loading stopped at block 2 meanwhile (another
    slice's failure): nothing past it reaches the cache either."""
    loaded = 4 if stop is None else stop
    async with harness(kvpipe.MemoryStore(), slice_blocks=6) as h:
        state = h.read_state(TOKENS, np.array([50, 51, 52, 53, 54, 55]))
        state.plan(plan_slices(0, 6, 6, BLOCK, len(TOKENS)))
        if stop is not None:
            state.stop_at(stop, "failed_block", [stop])
        lease = await h.ctx.pool.acquire(6)
        for i in range(6):
            lease.view(i)[: h.ctx.payload_nbytes] = i + 1
        before = [rows.copy() for rows in h.ctx.cache.byte_rows]
        await Swapper(h.ctx, h.inboxes["swapper"]).handle(
            SliceJob(state, state.slices[0], lease, valid=4)
        )
        for rows, old in zip(h.ctx.cache.byte_rows, before, strict=True):
            for i in range(loaded):
                assert (rows[50 + i] == i + 1).all()
            assert np.array_equal(rows[50 + loaded : 56], old[50 + loaded : 56])
        assert state.done and state.result is not None and state.result.loaded == loaded
        assert h.ctx.pool.in_use == 0


async def test_a_finished_read_is_never_scattered() -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=6) as h:
        state = h.read_state(TOKENS, np.arange(50, 56))
        from kvpipe._plan import plan_slices

        state.plan(plan_slices(0, 6, 6, BLOCK, len(TOKENS)))
        state.end("cancelled", "test")
        lease = await h.ctx.pool.acquire(6)
        before = [rows.copy() for rows in h.ctx.cache.byte_rows]
        await Swapper(h.ctx, h.inboxes["swapper"]).handle(
            SliceJob(state, state.slices[0], lease, valid=6)
        )
        assert all(np.array_equal(a, b) for a, b in zip(before, h.ctx.cache.byte_rows, strict=True))
        assert h.ctx.pool.in_use == 0


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        import trio.testing

        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    async def test_a_slice_that_reaches_it_after_the_read_s_deadline_is_not_scattered(
        self,
    ) -> None:
        """The job waited in the swapper's inbox past the read's deadline (its workers were
        busy) before the deadline guard ended the read: it is not scattered, and the read
        stops there as ``total_timeout``."""
        import anyio

        async with harness(kvpipe.MemoryStore(), slice_blocks=6) as h:
            state = h.read_state(TOKENS, np.arange(50, 56), timeout=5)
            state.plan(plan_slices(0, 6, 6, BLOCK, len(TOKENS)))
            lease = await h.ctx.pool.acquire(6)
            for i in range(6):
                lease.view(i)[: h.ctx.payload_nbytes] = i + 1
            before = [rows.copy() for rows in h.ctx.cache.byte_rows]
            await anyio.sleep(6)
            await Swapper(h.ctx, h.inboxes["swapper"]).handle(
                SliceJob(state, state.slices[0], lease, valid=6)
            )
            assert all(
                np.array_equal(a, b) for a, b in zip(before, h.ctx.cache.byte_rows, strict=True)
            )
            assert state.result is not None
            assert (state.result.loaded, state.result.stop_reason) == (0, "total_timeout")
            assert h.ctx.metrics.slices == {}  # the reader counts a slice, once, as fetched
            assert h.ctx.pool.in_use == 0

    async def test_a_fetched_slice_whose_scatter_starts_too_late_is_counted_once(
        self,
    ) -> None:
        """A device cache's slice fetched in time (the reader counts it, ``read_complete``)
        whose scatter reaches the swapper after the read's deadline: the read stops there as
        ``total_timeout``, and the slice stays counted once, as its fetch ended, as the
        observers saw it — not a second time as ``read_total_timeout``."""
        import anyio

        from kvpipe.actors import Reader, Writer

        async with harness(kvpipe.MemoryStore(), slice_blocks=6) as h:
            h.ctx.engine.name = "cuda"  # a device cache: the swapper scatters
            seen: list[tuple[str, str]] = []
            assert h.ctx.observers is not None
            h.ctx.observers.add(lambda kind, _s, outcome: seen.append((kind, outcome)))
            write = h.write_state(TOKENS, np.arange(6))
            swapper = Swapper(h.ctx, h.inboxes["swapper"])
            await swapper.handle(SliceJob(write, write.slices[0], await h.ctx.pool.acquire(6)))
            for job in h.sent("writer"):
                await Writer(h.ctx, h.inboxes["writer"]).handle(job)
            assert write.result is not None and write.result.complete
            state = h.read_state(TOKENS, np.arange(50, 56), timeout=5)
            state.plan(plan_slices(0, 6, 6, BLOCK, len(TOKENS)))
            job = SliceJob(state, state.slices[0], await h.ctx.pool.acquire(6))
            await Reader(h.ctx, h.inboxes["reader"]).handle(job)
            (job,) = h.sent("swapper")
            await anyio.sleep(6)  # its job waited in the swapper's inbox past the deadline
            await swapper.handle(job)
            assert state.result is not None
            assert (state.result.loaded, state.result.stop_reason) == (0, "total_timeout")
            assert h.ctx.metrics.slices == {"complete": 1, "read_complete": 1}
            assert seen == [("write_slice", "complete"), ("read_slice", "complete")]
            assert h.ctx.pool.in_use == 0
