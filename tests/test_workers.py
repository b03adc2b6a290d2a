"""kvpipe's own worker threads: calls run, idle threads are reused and leave, and the
threads run at the lower priority asked for."""

from __future__ import annotations

import os
import threading

import pytest

from kvpipe._workers import WorkerThreads, lower_priority


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


def test_a_shut_down_pool_takes_no_work() -> None:
    pool = WorkerThreads()
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)


def test_no_priority_change_asked_is_none_made() -> None:
    assert lower_priority(0) is False
