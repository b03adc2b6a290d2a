"""A backend's worker-thread calls: the gate that refuses calls once too many given up on
still run (storage that stopped answering), rather than start a thread for each."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import pytest

import kvpipe
from kvpipe.backends._inflight import ThreadGate
from tests.helpers import record_thread_starts


def _hung() -> tuple[threading.Event, threading.Semaphore, Callable[[], str]]:
    """A call that hangs until ``go_on`` is set (storage not answering); ``entered`` is
    released each time one starts."""
    go_on, entered = threading.Event(), threading.Semaphore(0)

    def hung() -> str:
        entered.release()
        go_on.wait(30)
        return "done"

    return go_on, entered, hung


async def test_the_gate_refuses_once_as_many_calls_given_up_on_as_its_width_still_run() -> None:
    gate = ThreadGate("test", 1)
    go_on, entered, hung = _hung()

    try:
        for _ in range(2):  # one in the gate's place, one more beyond it
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(gate.run, "probe", hung)
                    await anyio.to_thread.run_sync(entered.acquire)  # its thread runs it
                    scope.cancel()
        assert gate.running == 2
        with anyio.fail_after(5), pytest.raises(kvpipe.BackendError, match=r"probe.*refused"):
            await gate.run("probe", hung)
    finally:
        go_on.set()
    while gate.running:  # the threads given up on end once storage answers again
        await anyio.to_thread.run_sync(go_on.wait)
        await anyio.sleep(0.001)
    assert await gate.run("probe", lambda: "answered") == "answered"


async def test_a_call_that_waited_for_its_place_is_checked_again_when_it_gets_it() -> None:
    """Calls made while none was stuck all pass the first check and wait for a place; each
    one that gets a place freed by a caller giving up is checked again, in its thread."""
    gate = ThreadGate("test", 1)
    go_on, entered, hung = _hung()

    outcomes: list[str] = []
    answered = anyio.Event()

    async def call(scope: anyio.CancelScope) -> None:
        with scope:
            try:
                outcomes.append(await gate.run("probe", hung))
            except kvpipe.BackendError:
                outcomes.append("refused")
            answered.set()

    scopes = [anyio.CancelScope() for _ in range(3)]
    try:
        async with anyio.create_task_group() as tg:
            for scope in scopes:  # all three pass the first check: none runs yet
                tg.start_soon(call, scope)
            for scope in scopes[:2]:  # each in turn gets the place, and is given up on
                await anyio.to_thread.run_sync(entered.acquire)
                scope.cancel()
            with anyio.fail_after(5):  # a guard against a hang, not a timing
                await answered.wait()
    finally:
        go_on.set()
    assert outcomes == ["refused"]


async def test_the_gate_never_starts_a_worker_thread_from_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread start waits until the new thread runs (5-60 ms of a stalled event loop on
    busy processors): the gate's threads are started by its pool's starter, not the loop."""
    starts = record_thread_starts(monkeypatch)
    gate = ThreadGate("test", 3)
    go_on, entered, hung = _hung()
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(3):  # three at once: three threads
                tg.start_soon(gate.run, "probe", hung)
            for _ in range(3):
                await anyio.to_thread.run_sync(entered.acquire)
            go_on.set()
    finally:
        go_on.set()
        gate.close()
    loop = threading.get_ident()
    mine = [(who, name) for who, name in starts if name.startswith("kvpipe")]  # not the test's
    assert [name for who, name in mine if who == loop] == ["kvpipe-worker-starter"]
    assert [name for who, name in mine if who != loop] == ["kvpipe-worker"] * 3
    with pytest.raises(kvpipe.BackendError, match="closed"):
        await gate.run("probe", lambda: None)
