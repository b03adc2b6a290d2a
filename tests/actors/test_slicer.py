"""The slicer alone (a device cache's requests): leases staging per slice, in order; stops for
ended requests."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe._plan import plan_slices
from kvpipe.actors import Slicer
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
