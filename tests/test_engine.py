"""``run_copy``: host work inline when small, else in a copy thread; never started late."""

from __future__ import annotations

import threading

import anyio
import pytest

from kvpipe._engine import run_copy
from kvpipe._staging import StagingPool
from kvpipe._workers import INLINE_COPY_BYTES, Lane, NotStarted, ThreadRunner


@pytest.mark.parametrize("nbytes", [0, INLINE_COPY_BYTES])
async def test_small_work_not_started_by_its_deadline_never_runs(nbytes: int) -> None:
    """Inline work, as a thread's (tests/test_workers.py), does not start once ``start_by``
    has passed, though its caller is shielded (its checkpoint cancels nothing)."""
    pool = StagingPool(16, 2)
    lease = await pool.acquire(1)
    ran: list[int] = []
    async with ThreadRunner() as runner:
        with anyio.CancelScope(shield=True), pytest.raises(NotStarted):
            await run_copy(
                runner, Lane(1), nbytes, ran.append, 1, hold=lease,
                start_by=anyio.current_time(),
            )  # fmt: skip
        assert ran == []
        start_by = anyio.current_time() + 60
        await run_copy(runner, Lane(1), nbytes, ran.append, 2, hold=lease, start_by=start_by)
        assert ran == [2]
    lease.release()
    assert pool.in_use == 0


async def test_small_work_runs_on_the_event_loop_and_large_in_a_thread() -> None:
    pool = StagingPool(16, 2)
    lease = await pool.acquire(1)
    loop_thread = threading.get_ident()
    async with ThreadRunner() as runner:
        inline = await run_copy(runner, Lane(1), INLINE_COPY_BYTES, threading.get_ident, hold=lease)
        threaded = await run_copy(
            runner, Lane(1), INLINE_COPY_BYTES + 1, threading.get_ident, hold=lease
        )
    assert inline == loop_thread != threaded
    lease.release()
    assert pool.in_use == 0
