"""The slicer alone (a device cache's requests): leases staging per slice, in order; stops for
ended requests."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe._plan import plan_slices
from kvpipe.actors import SliceJob, Slicer, Swapper
from kvpipe.actors._channels import open_channels
from tests.actors.harness import BLOCK, harness

TOKENS = np.arange(10 * BLOCK)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


async def test_a_device_cache_s_write_slices_go_to_the_swapper() -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=4) as h:
        h.ctx.engine.name = "cuda"  # as the CUDA engine's: copies are not the writer's
        state = h.write_state(TOKENS, np.arange(10))
        await Slicer(h.ctx, h.inboxes["slicer"]).handle(state)
        assert h.sent("writer") == []
        jobs = h.sent("swapper")
        assert [j.spec.first_block for j in jobs] == [0, 4, 8]
        for j in jobs:
            j.lease.release()


async def test_waiting_for_staging_is_bounded_by_the_deadline() -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=4, pool_slots=4) as h:
        h.ctx.engine.name = "cuda"  # a device cache's slices are leased here
        hog = await h.ctx.pool.acquire(4)
        state = h.write_state(TOKENS, np.arange(10), timeout=7)
        start = anyio.current_time()
        await Slicer(h.ctx, h.inboxes["slicer"]).handle(state)
        assert anyio.current_time() - start == pytest.approx(7.0)
        assert state.result is not None and state.result.stop_reason == "total_timeout"
        assert h.sent("swapper") == []
        hog.release()
        assert h.ctx.pool.in_use == 0


@pytest.mark.parametrize("engine", ["host", "cuda"])
async def test_an_ended_write_gets_no_more_slices(engine: str) -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=4) as h:
        h.ctx.engine.name = engine
        state = h.write_state(TOKENS, np.arange(10))
        state.end("cancelled", "test")
        await Slicer(h.ctx, h.inboxes["slicer"]).handle(state)
        assert h.sent("writer") == [] and h.sent("swapper") == []
        assert h.ctx.pool.in_use == 0


async def test_read_slices_past_the_stop_are_resolved_without_fetching() -> None:
    async with harness(kvpipe.MemoryStore(), slice_blocks=4) as h:
        h.ctx.engine.name = "cuda"  # a device cache's slices are leased here
        state = h.read_state(TOKENS, np.arange(10))
        state.plan(plan_slices(0, 10, 4, BLOCK, len(TOKENS)))
        state.stop_at(5, "failed_block", [5])
        await Slicer(h.ctx, h.inboxes["slicer"]).handle(state)
        jobs = h.sent("reader")
        assert [j.spec.index for j in jobs] == [0, 1]
        assert state.machine.pending == {0, 1}
        for j in jobs:
            j.lease.release()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_job_the_inbox_moves_in_as_the_slicer_s_wait_is_cancelled_is_dropped() -> None:
    """The slicer waits on the swapper's full inbox; the write ends (its caller cancelled)
    and, in that step, a swapper worker takes the queued job, which moves the waiting one
    in. The slicer keeps (and lets go of) its job; the swapper drops it when it comes:
    staging released once, and the swapper does not crash on a twice-released lease."""
    async with harness(kvpipe.MemoryStore(), slice_blocks=4) as h:
        h.ctx.engine.name = "cuda"  # a device cache's slices are leased here
        outboxes, inboxes = open_channels(1)
        h.ctx.outboxes = outboxes
        other = h.write_state(TOKENS, np.arange(10))
        queued = SliceJob(other, other.slices[0], await h.ctx.pool.acquire(4))
        outboxes.swapper.send_nowait(queued)  # the swapper's inbox is full
        state = h.write_state(TOKENS[: 4 * BLOCK], np.arange(4))
        async with anyio.create_task_group() as tg:
            tg.start_soon(Slicer(h.ctx, inboxes.slicer).handle, state)
            while outboxes.swapper.statistics().tasks_waiting_send == 0:
                await anyio.lowlevel.checkpoint()
            state.end("cancelled", "caller cancelled")
            # A swapper worker takes the queued job in the same step (no checkpoint).
            assert inboxes.swapper.receive_nowait() is queued
            queued.taken = True
        queued.release()
        outboxes.close()
        # The swapper's loop receives the slicer's job from its inbox.
        await Swapper(h.ctx, inboxes.swapper, 1).run()
        assert h.ctx.pool.in_use == 0
        for inbox in inboxes.by_name().values():
            inbox.close()
