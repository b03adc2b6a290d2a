"""kvpipe's own worker threads (calls run, idle threads are reused and leave, the threads
run at the lower priority asked for) and the ThreadRunner over them (results, exceptions,
cancellation, the staging it holds until a thread returns, the close deadline)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from trio.testing import MockClock

from kvpipe import _workers as workers_module
from kvpipe._staging import StagingLease, StagingPool
from kvpipe._workers import (
    Abandoned,
    Lane,
    NotStarted,
    ThreadRunner,
    WorkerThreads,
    lower_priority,
)
from tests.helpers import checkpoints, record_thread_starts, until


def _run(pool: WorkerThreads, fn: object) -> None:
    done = threading.Event()

    def call() -> None:
        fn()  # type: ignore[operator]
        done.set()

    pool.submit(call)
    assert done.wait(10)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_threads_run_at_the_lower_priority_asked_for() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    pool = WorkerThreads(nice=5)
    seen: list[int] = []
    _run(pool, lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    pool.shutdown()
    assert seen == [min(19, base + 5)]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched


def test_an_idle_thread_is_reused_and_leaves_after_its_timeout() -> None:
    pool = WorkerThreads(idle_timeout=0.2)
    names: list[int] = []
    _run(pool, lambda: names.append(threading.get_ident()))
    ended = threading.Event()
    _run(pool, lambda: names.append(threading.get_ident()))
    assert names[0] == names[1] and pool.threads == 1
    # it leaves once idle for its timeout (polled, not timed)
    for _ in range(200):
        if pool.threads == 0:
            break
        ended.wait(0.05)
    assert pool.threads == 0
    _run(pool, lambda: None)  # and a new one starts for the next call
    pool.shutdown()


def test_new_threads_are_started_by_the_pool_not_by_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Thread.start`` waits until the new thread runs (5-60 ms on busy processors, measured
    on the event loop's thread): the caller starts the pool's starter once, never a worker."""
    starts = record_thread_starts(monkeypatch)
    pool = WorkerThreads()
    go_on, entered = threading.Event(), threading.Semaphore(0)

    def busy() -> None:  # each call holds its thread: every submit needs a new one
        entered.release()
        go_on.wait(10)

    try:
        for _ in range(4):
            pool.submit(busy)
        for _ in range(4):
            assert entered.acquire(timeout=10)
    finally:
        go_on.set()
        pool.shutdown()
    me = threading.get_ident()
    assert [name for who, name in starts if who == me] == ["kvpipe-worker-starter"]
    assert [name for who, name in starts if who != me] == ["kvpipe-worker"] * 4


@pytest.mark.parametrize("error", [RuntimeError, MemoryError])
def test_a_call_whose_thread_cannot_start_runs_in_the_starter(
    monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """Whatever a refused start raises (a MemoryError used to end the starter thread: that
    call never ran, and no later call needing a new thread would ever run)."""
    pool = WorkerThreads()
    _run(pool, lambda: None)  # the starter runs
    start = threading.Thread.start

    def refused(self: threading.Thread) -> None:
        if self.name == "kvpipe-worker":
            raise error("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refused)
    go_on = threading.Event()
    ran: list[str] = []
    pool.submit(lambda: go_on.wait(10))  # takes the idle worker
    try:
        _run(pool, lambda: ran.append(threading.current_thread().name))  # needs a new one
        _run(pool, lambda: ran.append(threading.current_thread().name))  # and again
    finally:
        go_on.set()
        pool.shutdown()
    assert ran == ["kvpipe-worker-starter"] * 2


def test_a_starter_that_could_not_start_leaves_the_pool_and_its_lane_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call whose submit raised never runs, and the next calls (in and out of the lane
    the refused call was counted in) run: no inbox stranded, no lane slot kept."""
    start = threading.Thread.start
    refused: list[threading.Thread] = []

    def refuse_the_first_starter(self: threading.Thread) -> None:
        if self.name == "kvpipe-worker-starter" and not refused:
            refused.append(self)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refuse_the_first_starter)
    pool, lane = WorkerThreads(), Lane(1)
    ran: list[str] = []
    with pytest.raises(RuntimeError, match="can't start"):
        pool.submit(lambda: ran.append("refused"), lane)
    try:
        plain, in_lane = threading.Event(), threading.Event()
        pool.submit(plain.set)
        assert plain.wait(5), "a call after the refused start never ran"
        pool.submit(in_lane.set, lane)
        assert in_lane.wait(5), "the lane kept the refused call's slot"
    finally:
        pool.shutdown()
    assert ran == []
    assert lane.running == 0 and lane.waiting == 0


def test_a_shut_down_pool_takes_no_work() -> None:
    pool = WorkerThreads()
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_no_priority_change_asked_is_none_made() -> None:
    assert lower_priority(0) is False


# ---------------------------------------------------------------- ThreadRunner


async def test_runner_returns_values_and_forwards_args() -> None:
    async with ThreadRunner() as runner:
        assert await runner.run(lambda a, b: a * b, 6, 7) == 42
        assert await runner.run(threading.get_ident) != threading.get_ident()
        assert await runner.run(sorted, [3, 1, 2], lane=Lane(1)) == [1, 2, 3]
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
        await checkpoints()
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
        await checkpoints()
        assert events == []  # the closer is still waiting for the thread
        assert pool.in_use == 1
        gate.set()
    assert events == ["thread-done", "runner-exited"]
    assert pool.in_use == 0


async def test_leaving_a_runner_cancelled_by_asyncio_waits_on_and_shuts_the_threads_down() -> None:
    """asyncio's own cancellation (``Task.cancel``: a timeout around a close, a shutdown)
    gets through anyio's shield: leaving the runner then returned at once, with the thread
    still running and the pool never shut down (its starter thread waiting for good, the
    runner still taking calls). It waits on, shuts the threads down, then is cancelled."""
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    gate, started = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        gate.wait(30)

    runner = ThreadRunner()
    await runner.__aenter__()
    await start_then_abandon(runner, work, lease, started)
    lease.release()
    task = asyncio.ensure_future(runner.__aexit__(None, None, None))
    try:
        await checkpoints()
        task.cancel("shutting down")
        await checkpoints()
        assert not task.done()  # still waiting for the thread
    finally:
        gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()  # the cancellation is not swallowed
    assert runner.running == 0 and pool.in_use == 0
    with pytest.raises(RuntimeError):
        await runner.run(time.sleep, 0)  # shut down: no more calls
    with pytest.raises(RuntimeError):
        runner._threads.submit(lambda: None)


async def test_lane_bounds_threads_and_hands_its_next_call_to_the_same_thread() -> None:
    lane = Lane(1)
    gate = threading.Event()
    first_started = threading.Event()
    second_started = threading.Event()
    threads: list[int] = []

    def first() -> int:
        threads.append(threading.get_ident())
        first_started.set()
        gate.wait(30)
        return 1

    def second() -> int:
        threads.append(threading.get_ident())
        second_started.set()
        return 2

    results: list[int] = []
    async with ThreadRunner() as runner, anyio.create_task_group() as tg:

        async def call(fn: Callable[[], int]) -> None:
            results.append(await runner.run(fn, lane=lane))

        tg.start_soon(call, first)
        await anyio.to_thread.run_sync(first_started.wait)
        tg.start_soon(call, second)
        await until(lambda: lane.waiting == 1)
        assert not second_started.is_set()
        assert runner.running == 2 and lane.running == 1
        gate.set()
    assert results == [1, 2]
    # the thread that ran the first call took the second from the lane itself
    assert threads[0] == threads[1]
    # (the thread leaves the lane just after its last call reported back)
    await until(lambda: (lane.running, lane.waiting) == (0, 0))


async def test_a_call_cancelled_while_waiting_in_its_lane_never_runs() -> None:
    lane = Lane(1)
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    gate = threading.Event()
    started = threading.Event()
    ran: list[str] = []

    def blocker() -> None:
        started.set()
        gate.wait(30)

    async def cancel_once_queued(scope: anyio.CancelScope) -> None:
        await until(lambda: lane.waiting == 1)
        scope.cancel()

    try:
        async with ThreadRunner() as runner, anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(runner.run, blocker, lane=lane))
            await anyio.to_thread.run_sync(started.wait)
            with anyio.CancelScope() as scope:
                tg.start_soon(cancel_once_queued, scope)
                await runner.run(ran.append, "queued", hold=lease, lane=lane)
            assert scope.cancelled_caught
            lease.release()
            assert pool.in_use == 0  # let go at once: the call never started
            gate.set()
    finally:
        gate.set()
    assert ran == []
    await until(lambda: (lane.running, lane.waiting) == (0, 0))


def test_a_lane_runs_at_least_one_call() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Lane(0)


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


async def test_a_runner_closed_past_its_deadline_with_nothing_running_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with ThreadRunner() as runner:
        await runner.run(int)
        runner.close_by(anyio.current_time() - 1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_call_not_started_by_its_start_by_never_runs_and_one_started_runs_on() -> None:
    lane = Lane(1)
    pool = StagingPool(16, 2)
    queued, running = await pool.acquire(1), await pool.acquire(1)
    gates = [threading.Event(), threading.Event()]
    started = threading.Event()
    ran: list[str] = []

    def blocker(gate: threading.Event) -> str:
        started.set()
        gate.wait(30)
        return "done"

    async def open_later(gate: threading.Event) -> None:
        await anyio.sleep(0.05)
        gate.set()

    try:
        async with ThreadRunner() as runner, anyio.create_task_group() as tg:
            first = functools.partial(runner.run, blocker, gates[0], lane=lane, hold=running)
            tg.start_soon(first)
            await anyio.to_thread.run_sync(started.wait)
            with pytest.raises(NotStarted):
                await runner.run(
                    ran.append, "queued", hold=queued, lane=lane, start_by=anyio.current_time()
                )
            queued.release()
            assert pool.in_use == 1  # the queued call's hold went at once, not the running one's
            gates[0].set()
            await until(lambda: (lane.running, lane.waiting) == (0, 0))
            # Started before its start_by: waited for to its end, past start_by.
            tg.start_soon(open_later, gates[1])
            start_by = anyio.current_time() + 0.01
            assert await runner.run(blocker, gates[1], lane=lane, start_by=start_by) == "done"
            assert anyio.current_time() > start_by
    finally:
        for gate in gates:
            gate.set()
    running.release()
    assert ran == [] and pool.in_use == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_call_cancelled_just_as_its_thread_reports_lets_go_of_its_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller (with ``start_by``) is cancelled in the turn of the loop its thread's
    report arrives in (a crash, the close deadline): the call raises the cancellation, and
    its hold on the staging goes all the same, not kept leased for good."""
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    scope = anyio.CancelScope()
    call_soon = workers_module._call_soon

    def report_then_cancel(token: Any, fn: Callable[..., None], *args: Any) -> None:
        def both() -> None:  # in one turn of the loop: the caller cannot resume in between
            fn(*args)
            scope.cancel()

        call_soon(token, both)

    monkeypatch.setattr(workers_module, "_call_soon", report_then_cancel)
    async with ThreadRunner(0.1) as runner:
        with scope:
            await runner.run(int, hold=lease, start_by=anyio.current_time() + 100)
        assert scope.cancelled_caught
        assert runner.running == 0
    lease.release()
    assert lease.released and pool.in_use == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_call_whose_start_by_has_passed_never_starts_though_a_thread_is_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start_by`` already past when the call is made: it never starts (as inline work),
    though an idle thread could take it at once. Here the thread takes every call before
    the event loop looks again (the common case: it wakes in microseconds)."""
    pool = StagingPool(16, 1)
    lease = await pool.acquire(1)
    ran = threading.Event()
    async with ThreadRunner() as runner:
        await runner.run(int)  # a thread is idle now
        submit = runner._threads.submit

        def submit_and_let_it_start(fn: Callable[[], None], lane: Lane | None = None) -> None:
            submit(fn, lane)
            ran.wait(5)  # the thread starts the call before the loop runs on

        monkeypatch.setattr(runner._threads, "submit", submit_and_let_it_start)
        with anyio.CancelScope(shield=True), pytest.raises(NotStarted):
            await runner.run(ran.set, hold=lease, start_by=anyio.current_time())
        assert runner.running == 0
    assert not ran.is_set()
    lease.release()
    assert pool.in_use == 0


async def test_an_error_raised_in_a_worker_thread_leaves_no_cycle() -> None:
    """The call's outcome, kept in a local of ``run`` after the error was raised from it,
    held the error: ``run``'s frame is on its traceback, so the error, the frames it passed
    and what they hold (the call's arguments: a batch, its staging) stayed in a reference
    cycle until the collector ran."""
    import gc
    import weakref

    class Big:
        pass

    enabled = gc.isenabled()
    gc.disable()
    try:
        async with ThreadRunner() as runner:
            big = Big()
            ref = weakref.ref(big)

            def boom(held: Big = big) -> None:
                raise ValueError("injected")

            with pytest.raises(ValueError, match="injected"):
                await runner.run(boom)
            del big, boom
            assert ref() is None, "the call's arguments are held in a reference cycle"
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
async def test_anyio_from_thread_needs_no_token_in_a_worker_thread() -> None:
    """The runner's threads are claimed as anyio's own, so a blocking call (a backend's
    ``batch.run_sync``) can call back into the loop with ``anyio.from_thread`` and no token.
    On trio that raised ``RuntimeError: this thread wasn't created by Trio``: anyio hands trio
    no token then, and trio looks in thread-locals that only its own threads had."""

    async def plus_one(x: int) -> int:
        await anyio.lowlevel.checkpoint()
        return x + 1

    def blocking() -> tuple[int, int]:
        return anyio.from_thread.run_sync(threading.get_ident), anyio.from_thread.run(plus_one, 1)

    async with ThreadRunner() as runner:
        assert await runner.run(blocking) == (threading.get_ident(), 2)
        assert await runner.run(blocking) == (threading.get_ident(), 2)  # a reused thread


async def test_abandoned_waits_end_shielded_ones_too_and_the_thread_keeps_what_it_uses() -> None:
    """At a close's bound every wait for a call ends, a shielded one (a copy into the cache)
    too: the running call's caller gets :class:`Abandoned`, its thread runs on holding its
    staging and what it uses; a call queued in its lane, and any made later, never runs."""
    lane = Lane(1)
    pool = StagingPool(16, 2)
    running, queued = await pool.acquire(1), await pool.acquire(1)
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []
    outcomes: dict[str, str] = {}

    def stuck() -> None:
        started.set()
        gate.wait(30)

    class Cache:
        pass

    async def shielded(
        name: str, fn: Callable[[], object], hold: StagingLease, uses: object
    ) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await runner.run(fn, lane=lane, hold=hold, uses=uses)
        except Abandoned:
            outcomes[name] = "abandoned"

    cache = Cache()
    kept = weakref.ref(cache)
    try:
        async with ThreadRunner() as runner, anyio.create_task_group() as tg:
            tg.start_soon(shielded, "running", stuck, running, cache)
            await anyio.to_thread.run_sync(started.wait, 30)
            tg.start_soon(shielded, "queued", partial(ran.append, "queued"), queued, cache)
            await until(lambda: lane.waiting == 1)
            running.release()
            queued.release()
            await checkpoints()
            assert outcomes == {}
            runner.abandon_waits()
            await until(lambda: len(outcomes) == 2)
            assert outcomes == {"running": "abandoned", "queued": "abandoned"}
            with anyio.CancelScope(shield=True), pytest.raises(Abandoned):
                await runner.run(ran.append, "later")  # never starts
            assert pool.in_use == 1  # the running call's slots: its thread still uses them
            assert runner.running == 1
            runner.close_by(anyio.current_time())
        assert not gate.is_set()
        del cache
        assert kept() is not None  # the running call's thread still uses it
        gate.set()
        for _ in range(3000):  # until its thread has returned (30 s at most)
            if not runner.running:
                break
            await anyio.sleep(0.01)
        assert (runner.running, pool.in_use, kept()) == (0, 0, None)
        assert ran == []
    finally:
        gate.set()
