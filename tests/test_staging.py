"""The staging pool (FIFO fairness, cancellation, slot views, lease refcounts) and the
ThreadRunner (results, errors, and holding staging while an abandoned thread still runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from trio.testing import MockClock

from kvpipe._errors import ConfigError
from kvpipe._staging import StagingLease, StagingPool, ThreadRunner


async def _until(pred: Callable[[], bool], limit: int = 10_000) -> None:
    """Yield to other tasks until ``pred()`` holds (no sleeping; bounded)."""
    for _ in range(limit):
        if pred():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never became true")


async def _checkpoints(n: int = 20) -> None:
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


# ---------------------------------------------------------------- pool basics


def test_pool_larger_than_memory_says_how_much() -> None:
    # 1 PiB: numpy's allocation fails on any machine; the error names what was asked.
    with pytest.raises(ConfigError, match="could not allocate 1125899906842624 B") as info:
        StagingPool(1 << 20, 1 << 30)
    assert info.value.field == "staging_bytes" and "available now" in str(info.value)


@pytest.mark.parametrize(("nbytes", "slots"), [(0, 1), (1, 0), (-1, 4)])
def test_pool_rejects_empty(nbytes: int, slots: int) -> None:
    with pytest.raises(ValueError):
        StagingPool(nbytes, slots)


def test_pool_geometry() -> None:
    pool = StagingPool(100, 4)
    assert pool.capacity == 4
    assert pool.slot_nbytes == 100
    assert pool.stride >= 100
    assert pool.stride % 64 == 0
    assert pool.buffer.shape == (4, pool.stride)
    assert pool.in_use == 0
    assert pool.waiters == 0
    assert pool.leases == 0


@pytest.mark.parametrize("count", [0, -1, 5])
async def test_acquire_rejects_bad_count(count: int) -> None:
    pool = StagingPool(10, 4)
    with pytest.raises(ValueError):
        await pool.acquire(count)
    assert pool.in_use == 0


async def test_slot_views_are_right_size_and_distinct() -> None:
    pool = StagingPool(100, 4)
    a = await pool.acquire(3)
    b = await pool.acquire(1)
    assert len(set(a.slots) | set(b.slots)) == 4
    assert list(a.slots) == sorted(a.slots)
    assert a.pool is pool
    views = [a.view(i) for i in range(3)] + [b.view(0)]
    for i, v in enumerate(views):
        assert v.shape == (100,)
        assert v.dtype == np.uint8
        assert v.flags.writeable
        v[:] = i + 1
    for i, v in enumerate(views):
        assert (v == i + 1).all()
        for j, w in enumerate(views):
            if i != j:
                assert not np.shares_memory(v, w)
    for i, slot in enumerate(a.slots):
        assert (pool.buffer[slot, :100] == i + 1).all()
    mvs = a.memoryviews()
    assert len(mvs) == 3
    assert all(m.nbytes == 100 and not m.readonly for m in mvs)
    mvs[1][0] = 0xAB
    assert a.view(1)[0] == 0xAB
    assert len(a.memoryviews(2)) == 2
    a.release()
    b.release()
    assert pool.in_use == 0


async def test_lease_refcount() -> None:
    pool = StagingPool(16, 4)
    lease = await pool.acquire(3)
    assert pool.in_use == 3
    assert pool.leases == 1
    assert not lease.released
    lease.retain()
    lease.retain()
    lease.release()
    lease.release()
    assert pool.in_use == 3
    assert not lease.released
    lease.release()
    assert lease.released
    assert pool.in_use == 0
    assert pool.leases == 0
    with pytest.raises(RuntimeError):
        lease.release()
    with pytest.raises(RuntimeError):
        lease.retain()
    assert pool.in_use == 0


async def test_released_slots_are_reused() -> None:
    pool = StagingPool(16, 2)
    for _ in range(5):
        lease = await pool.acquire(2)
        assert sorted(lease.slots) == [0, 1]
        lease.release()
    assert pool.in_use == 0


# ---------------------------------------------------------------- fairness and cancellation


async def test_fifo_big_waiter_not_overtaken_by_small() -> None:
    pool = StagingPool(16, 4)
    first = await pool.acquire(3)  # one slot left
    order: list[str] = []
    got: dict[str, StagingLease] = {}

    async def want(n: int, tag: str) -> None:
        got[tag] = await pool.acquire(n)
        order.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 4, "big")
        await _until(lambda: pool.waiters == 1)
        tg.start_soon(want, 1, "small")
        await _until(lambda: pool.waiters == 2)
        await _checkpoints()
        # a slot is free, but the small request queued behind the big one
        assert order == []
        assert pool.in_use == 3
        first.release()
        await _until(lambda: order == ["big"])
        assert pool.in_use == 4
        assert pool.waiters == 1
        got["big"].release()
        await _until(lambda: order == ["big", "small"])
        assert pool.in_use == 1
        got["small"].release()
    assert pool.in_use == 0
    assert pool.leases == 0
    assert pool.waiters == 0


async def test_new_acquire_queues_behind_existing_waiter() -> None:
    pool = StagingPool(16, 2)
    hold = await pool.acquire(1)
    order: list[str] = []
    leases: list[StagingLease] = []

    async def want(n: int, tag: str) -> None:
        leases.append(await pool.acquire(n))
        order.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 2, "two")
        await _until(lambda: pool.waiters == 1)
        tg.start_soon(want, 1, "one")  # one slot is free, but "two" is first
        await _checkpoints()
        assert order == []
        hold.release()
        await _until(lambda: order == ["two"])
        leases[0].release()
        await _until(lambda: order == ["two", "one"])
        leases[1].release()
    assert pool.in_use == 0


async def test_cancelled_waiter_takes_nothing() -> None:
    pool = StagingPool(16, 2)
    hold = await pool.acquire(2)
    order: list[str] = []
    other: list[StagingLease] = []
    scope = anyio.CancelScope()

    async def cancelled() -> None:
        with scope:
            await pool.acquire(1)
            order.append("cancelled-got-it")

    async def waiter() -> None:
        other.append(await pool.acquire(1))
        order.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled)
        await _until(lambda: pool.waiters == 1)
        tg.start_soon(waiter)
        await _until(lambda: pool.waiters == 2)
        scope.cancel()
        await _until(lambda: pool.waiters == 1)
        assert pool.in_use == 2
        hold.release()
        await _until(lambda: order == ["other"])
        assert pool.in_use == 1
        other[0].release()
    assert scope.cancelled_caught
    assert order == ["other"]
    assert pool.in_use == 0
    assert pool.leases == 0


async def test_cancelled_head_waiter_lets_the_next_proceed() -> None:
    pool = StagingPool(16, 4)
    hold = await pool.acquire(2)
    big_scope = anyio.CancelScope()
    small: list[StagingLease] = []

    async def big() -> None:
        with big_scope:
            await pool.acquire(4)

    async def little() -> None:
        small.append(await pool.acquire(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await _until(lambda: pool.waiters == 1)
        tg.start_soon(little)
        await _until(lambda: pool.waiters == 2)
        await _checkpoints()
        assert small == []  # blocked behind big even though 2 slots are free
        big_scope.cancel()
        await _until(lambda: len(small) == 1)
        assert pool.in_use == 3
        assert pool.waiters == 0
    small[0].release()
    hold.release()
    assert pool.in_use == 0


async def test_cancelled_before_wait_takes_nothing() -> None:
    pool = StagingPool(16, 2)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pool.acquire(1)
    assert scope.cancelled_caught
    with anyio.move_on_after(0) as scope2:
        await pool.acquire(2)
    assert scope2.cancelled_caught
    assert pool.in_use == 0
    assert pool.leases == 0
    lease = await pool.acquire(2)
    lease.release()


async def test_served_then_cancelled_is_consistent() -> None:
    pool = StagingPool(16, 1)
    hold = await pool.acquire(1)
    scope = anyio.CancelScope()
    got: list[StagingLease] = []

    async def waiter() -> None:
        with scope:
            got.append(await pool.acquire(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await _until(lambda: pool.waiters == 1)
        hold.release()  # hands the slot to the waiter...
        scope.cancel()  # ...which is cancelled before it resumes
    if got:
        assert pool.in_use == 1
        got[0].release()
    assert pool.in_use == 0
    assert pool.leases == 0
    again = await pool.acquire(1)
    again.release()


# ---------------------------------------------------------------- ThreadRunner


async def test_runner_returns_values_and_forwards_args() -> None:
    async with ThreadRunner() as runner:
        assert await runner.run(lambda a, b: a * b, 6, 7) == 42
        assert await runner.run(threading.get_ident) != threading.get_ident()
        limiter = anyio.CapacityLimiter(1)
        assert await runner.run(sorted, [3, 1, 2], limiter=limiter) == [1, 2, 3]
        assert runner.running == 0


async def test_runner_propagates_exceptions() -> None:
    pool = StagingPool(16, 2)
    lease = await pool.acquire(2)

    def boom() -> None:
        raise KeyError("boom")

    async with ThreadRunner() as runner:
        with pytest.raises(KeyError, match="boom"):
            await runner.run(boom, hold=lease)
        assert runner.running == 0
    # the runner's reference is gone; the caller's is still there
    assert not lease.released
    assert pool.in_use == 2
    lease.release()
    assert pool.in_use == 0


async def test_runner_not_running() -> None:
    runner = ThreadRunner()
    with pytest.raises(RuntimeError):
        await runner.run(int)
    async with runner:
        pass
    with pytest.raises(RuntimeError):
        await runner.run(int)


async def test_runner_holds_lease_while_thread_runs() -> None:
    pool = StagingPool(16, 2)
    lease = await pool.acquire(2)
    gate = threading.Event()
    started = threading.Event()

    def work() -> str:
        started.set()
        gate.wait(30)
        return "done"

    async with ThreadRunner() as runner, anyio.create_task_group() as tg:
        results: list[str] = []

        async def caller() -> None:
            results.append(await runner.run(work, hold=lease))
            lease.release()

        tg.start_soon(caller)
        await anyio.to_thread.run_sync(started.wait)
        assert runner.running == 1
        gate.set()
    assert results == ["done"]
    assert lease.released
    assert pool.in_use == 0


async def test_cancelled_caller_from_other_task_keeps_lease_until_thread_ends() -> None:
    pool = StagingPool(16, 2)
    lease = await pool.acquire(2)
    gate = threading.Event()
    started = threading.Event()
    finished = threading.Event()

    def work() -> str:
        started.set()
        gate.wait(30)
        finished.set()
        return "done"

    async with ThreadRunner() as runner:
        scope = anyio.CancelScope()
        outcome: list[str] = []

        async def caller() -> None:
            with scope:
                outcome.append(await runner.run(work, hold=lease))

        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(started.wait)
            scope.cancel()
        assert scope.cancelled_caught
        assert outcome == []
        lease.release()  # the caller lets go of its own reference
        # the thread is still blocked and still reads the slots: they stay leased
        assert not finished.is_set()
        assert not lease.released
        assert pool.in_use == 2
        assert runner.running == 1
        await _checkpoints()
        assert pool.in_use == 2
        gate.set()
        # can only be served once the thread has returned and let go of the lease
        again = await pool.acquire(2)
        assert finished.is_set()
        assert lease.released
        assert runner.running == 0
        again.release()
    assert pool.in_use == 0
    assert pool.leases == 0


async def start_then_abandon(
    runner: ThreadRunner, fn: Callable[[], None], lease: StagingLease, started: threading.Event
) -> None:
    """Call ``fn`` through ``runner`` and stop waiting for it once its thread has started."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(runner.run, fn, hold=lease))
            await anyio.to_thread.run_sync(started.wait)
            scope.cancel()


async def test_call_cancelled_before_its_thread_starts_never_runs() -> None:
    """A caller cancelled before the thread picked the call up: ``fn`` never runs (not
    later either), and nothing keeps the staging."""
    pool = StagingPool(16, 3)
    lease = await pool.acquire(2)
    ran = threading.Event()

    async with ThreadRunner() as runner:
        with anyio.move_on_after(0) as scope:
            await runner.run(ran.set, hold=lease)
        assert scope.cancelled_caught
        assert runner.running == 0
        lease.release()
        assert lease.released and pool.in_use == 0
        await anyio.to_thread.run_sync(time.sleep, 0.05)  # a worker had time to start it
    assert not ran.is_set()


async def test_leaving_runner_waits_for_running_threads() -> None:
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    gate = threading.Event()
    started = threading.Event()
    events: list[str] = []
    about_to_exit = anyio.Event()

    def work() -> None:
        started.set()
        gate.wait(30)
        events.append("thread-done")

    async def closer() -> None:
        async with ThreadRunner() as runner:
            await start_then_abandon(runner, work, lease, started)
            lease.release()
            about_to_exit.set()
        events.append("runner-exited")

    async with anyio.create_task_group() as tg:
        tg.start_soon(closer)
        await about_to_exit.wait()
        await _checkpoints()
        assert events == []  # the closer is still waiting for the thread
        assert pool.in_use == 1
        gate.set()
    assert events == ["thread-done", "runner-exited"]
    assert pool.in_use == 0


async def test_limiter_bounds_threads() -> None:
    limiter = anyio.CapacityLimiter(1)
    gate = threading.Event()
    first_started = threading.Event()
    second_started = threading.Event()

    def first() -> int:
        first_started.set()
        gate.wait(30)
        return 1

    def second() -> int:
        second_started.set()
        return 2

    results: list[int] = []
    async with ThreadRunner() as runner, anyio.create_task_group() as tg:

        async def call(fn: Callable[[], int]) -> None:
            results.append(await runner.run(fn, limiter=limiter))

        tg.start_soon(call, first)
        await anyio.to_thread.run_sync(first_started.wait)
        tg.start_soon(call, second)
        await _until(lambda: limiter.statistics().tasks_waiting == 1)
        assert not second_started.is_set()
        assert runner.running == 2
        gate.set()
    assert results == [1, 2]


@pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}))]
)
async def test_close_timeout_keeps_lease_of_abandoned_thread() -> None:
    """A thread abandoned at close still reads its slots: they must not return to the pool."""
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    gate = threading.Event()
    started = threading.Event()

    def work() -> None:
        started.set()
        gate.wait(30)

    try:
        async with ThreadRunner(close_timeout=5.0) as runner:
            await start_then_abandon(runner, work, lease, started)
            lease.release()
        # the runner gave up waiting (virtual time); the thread is still blocked
        assert not gate.is_set()
        assert pool.in_use == 1
        assert not lease.released
    finally:
        gate.set()
