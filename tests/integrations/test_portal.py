"""kvpipe.integrations._portal's LoopThread: what a synchronous caller gets back from a call
hopped onto the loop thread."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from typing import Any

import anyio
import pytest

import kvpipe
from kvpipe.integrations._portal import LoopThread
from kvpipe.integrations.fastdeploy import KVPipeStorage


def test_a_timeout_raised_by_the_call_itself_comes_back_as_raised() -> None:
    """``call`` took any ``TimeoutError`` out of the future for its own wait running out:
    a coroutine that raised ``kvpipe.OperationTimeout`` at once (a lookup past its own
    deadline) came back as a plain ``TimeoutError`` saying "no result within <wait> s", so
    the adapters' WARNING blamed the loop thread, with the wrong type and number."""
    loop = LoopThread("test-own-timeout")
    try:

        async def lookup() -> int:
            raise kvpipe.OperationTimeout("lookup: no answer within 0.100 s")

        with pytest.raises(kvpipe.OperationTimeout, match=r"no answer within 0\.100 s"):
            loop.call(lookup, wait=30.0)
    finally:
        loop.close()


class NeverAnswers(kvpipe.MemoryStore):
    async def exists(self, batch: kvpipe.KeyBatch) -> list[bool]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def test_storage_deadline_still_named_in_its_warning(caplog: pytest.LogCaptureFixture) -> None:
    """KVPipeStorage's own deadline (here 1 ms: a store that never answers) is reported
    as such, with its seconds."""
    with KVPipeStorage(store=NeverAnswers(), timeout=1e-3) as fs, caplog.at_level(logging.WARNING):
        assert fs.exists(["k"]) == {"k": False}
    (record,) = [r for r in caplog.records if "KVPipeStorage exists" in r.getMessage()]
    assert "TimeoutError" in record.getMessage()
    assert "within 0.001 s" in record.getMessage()


class _Held:
    """Something a call's coroutine refers to (a pipeline, the caller's caches)."""


async def _fails(held: _Held) -> int:
    raise kvpipe.BackendError("memory", "exists", "injected")


def test_a_call_that_raised_leaves_no_cycle(no_cyclic_gc: None) -> None:
    """A coroutine that raises (a store's failure, as the adapters' calls do): anyio's portal
    task keeps the error it hands back in a frame on the error's own traceback, a reference
    cycle that held every frame the error passed, and what they refer to (the adapter, its
    pipeline and the caller's caches), until the cyclic collector ran."""
    loop = LoopThread("test-call-cycle")
    try:
        held = _Held()
        ref = weakref.ref(held)
        with pytest.raises(kvpipe.BackendError, match="injected"):
            loop.call(_fails, held, wait=30.0)
        del held
        assert ref() is None, "the call's error is held in a reference cycle"
    finally:
        loop.close()
    lt = weakref.ref(loop)
    del loop
    assert lt() is None, "the loop thread is held in a reference cycle"


class _FailsToEnter:
    """An async context manager whose entering raises (a pipeline whose open failed), or
    never ends (one whose store does not answer)."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    async def __aenter__(self) -> None:
        if self.hang:
            await anyio.sleep_forever()
        raise kvpipe.ConfigError("store", "injected")

    async def __aexit__(self, *exc_info: object) -> None:
        pass


@pytest.mark.parametrize("hang", [False, True], ids=["raised", "timed-out"])
def test_an_enter_that_failed_leaves_no_cycle(hang: bool, no_cyclic_gc: None) -> None:
    """Entering raised, or was cancelled past its ``wait``: the error was kept by the future
    that hands it over, which a frame on its traceback (the entering task's) holds, a cycle
    that kept the context manager (a pipeline opening: the store, the caller's caches)."""
    loop = LoopThread("test-enter-cycle")
    try:
        cm = _FailsToEnter(hang)
        ref = weakref.ref(cm)
        with pytest.raises(TimeoutError if hang else kvpipe.ConfigError):
            loop.enter(cm, wait=0.0 if hang else 30.0)
        del cm
    finally:
        loop.close()  # the cancelled entering has unwound once the loop stopped
    assert ref() is None, "the context manager is held in a reference cycle"


class _Abort(BaseException):
    """A ``BaseException`` that is no cancellation (as ``KeyboardInterrupt``, ``SystemExit``)."""


class _AbortsEntering:
    async def __aenter__(self) -> None:
        raise _Abort("entering aborted")

    async def __aexit__(self, *exc_info: object) -> None:
        pass


def test_a_base_exception_raised_while_entering_comes_back_as_raised() -> None:
    """Entering that raised a ``BaseException`` other than a cancellation (a
    ``KeyboardInterrupt`` or ``SystemExit`` raised in a store's open) was no longer handed
    over once errors went back in a box of ``Exception`` only: the entering task ended
    unentered, and ``enter`` took that for the loop stopping, raising
    ``PipelineClosed("... is closed")`` though close had not begun (the FastDeploy adapter
    then logged "opening the pipeline failed: PipelineClosed" and answered 0)."""
    loop = LoopThread("test-enter-base-exception")
    try:
        with pytest.raises(_Abort, match="entering aborted"):
            loop.enter(_AbortsEntering(), wait=30.0)
        assert not loop.closed
    finally:
        loop.close()


class _FailsToExit:
    """An async context manager whose exit raises (a pipeline's close re-raising an actor's
    error); it refers to what a pipeline does (the store, the caller's caches)."""

    def __init__(self) -> None:
        self.held = _Held()

    async def __aenter__(self) -> _FailsToExit:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        raise kvpipe.BackendError("memory", "close", "injected")


def _entered_failing_to_exit(loop: LoopThread, early: bool) -> weakref.ref[object]:
    """Enter a :class:`_FailsToExit` in ``loop`` and keep no reference to it (its exit
    started now when ``early``: its outcome is read once it ends, close() or not, else left
    to ``close()``); returns a weak reference to what it holds."""
    cm = _FailsToExit()
    ref: weakref.ref[object] = weakref.ref(cm.held)
    _, leave_soon = loop.enter(cm, wait=30.0)
    del cm, _
    if early:
        leave_soon()
    return ref


@pytest.mark.parametrize("early", [True, False], ids=["leave-soon", "at-close"])
def test_an_exit_that_raised_leaves_no_cycle(
    early: bool, no_cyclic_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exit that raised, started early (the function ``enter`` returns beside its value,
    which retires a pipeline over replaced caches) or run by ``close()``: anyio's portal
    task keeps the error it sets on the exit's future in a frame on the error's own
    traceback, and the closer that read it held the future in its frame there too; those
    cycles kept the context manager (a pipeline, its store, FastDeploy's caches) and the
    loop thread alive after ``close()`` until the cyclic collector ran."""
    from kvpipe.integrations import _portal

    # no handler keeps the "error while closing" record, and with it the error
    monkeypatch.setattr(_portal.log, "propagate", False)
    monkeypatch.setattr(_portal.log, "handlers", [logging.NullHandler()])
    loop = LoopThread("test-exit-cycle")
    try:
        ref = _entered_failing_to_exit(loop, early)
    finally:
        assert loop.close() is True
    lt = weakref.ref(loop)
    del loop
    assert ref() is None, "the exited context manager is held in a reference cycle"
    assert lt() is None, "the loop thread is held in a reference cycle"


async def _aborts() -> None:
    raise _Abort("call aborted")


async def _answers() -> int:
    return 42


class _Exits:
    """An async context manager that records its exit."""

    def __init__(self) -> None:
        self.exited = False

    async def __aenter__(self) -> _Exits:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.exited = True


@pytest.mark.parametrize("how", ["enter", "call"])
def test_a_base_exception_raised_in_the_loop_leaves_it_running(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``BaseException`` other than a cancellation (``SystemExit`` from a vendor library
    a store's open or a call ran) was handed to the caller and also let through into the
    loop, where it ended the portal's task group: the loop thread died, every later call
    and enter raised ``PipelineClosed("... is closed")`` though ``closed`` was False, what
    had been entered was exited by the loop's death, and ``close()`` logged "error while
    closing" (a ``CancelledError``) and "stopping the loop failed" at ERROR. The error is
    the caller's alone; the loop goes on."""
    loop = LoopThread("test-base-exception")
    held = _Exits()
    try:
        loop.enter(held, wait=30.0)
        with pytest.raises(_Abort):
            if how == "enter":
                loop.enter(_AbortsEntering(), wait=30.0)
            else:
                loop.call(_aborts, wait=30.0)
        assert loop.call(_answers, wait=30.0) == 42
        assert not held.exited
    finally:
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert loop.close() is True
    assert held.exited
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("early", [True, False], ids=["leave-soon", "at-close"])
def test_a_kept_record_of_an_exit_that_raised_keeps_nothing_alive(
    early: bool, no_cyclic_gc: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The "error while closing" record of an exit that raised held the error itself
    (``exc_info``), so a handler that keeps records (pytest's capture, a
    ``MemoryHandler``) kept its traceback's frames, and through them the context manager
    (a pipeline, its store, FastDeploy's caches) and the loop thread. The record holds
    the error's text, its traceback included."""
    loop = LoopThread("test-exit-record")
    with caplog.at_level(logging.ERROR, "kvpipe.integrations"):
        try:
            ref = _entered_failing_to_exit(loop, early)
        finally:
            assert loop.close() is True
    (record,) = [r for r in caplog.records if "error while closing" in r.getMessage()]
    assert "BackendError: memory.close: injected" in caplog.text
    assert "__aexit__" in caplog.text  # where it was raised
    lt = weakref.ref(loop)
    del loop, record
    assert ref() is None, "a kept log record holds the exited context manager"
    assert lt() is None, "a kept log record holds the loop thread"


class _EntersLateFailsToExit:
    """An async context manager whose entering ends once ``gate`` is set (a pipeline whose
    open finishes just as its caller stops waiting) and whose exit raises."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.exited = threading.Event()

    async def __aenter__(self) -> _EntersLateFailsToExit:
        await anyio.to_thread.run_sync(self.gate.wait)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.exited.set()
        raise kvpipe.BackendError("memory", "close", "injected")


def test_an_exit_that_raised_after_entering_timed_out_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entering that ended just as ``enter``'s ``wait`` ran out: the caller cancelled the
    task's future, so what had been entered was exited on the cancellation path, and the
    error that exit raised was returned to a future already cancelled, which drops it:
    lost, not a line in the log. It is logged, as any exit's error."""
    from kvpipe.integrations import _portal

    cm = _EntersLateFailsToExit()
    real_wait = concurrent.futures.wait
    caller = threading.get_ident()

    def wait_out(fs: Any, timeout: float | None = None, return_when: str = "ALL_COMPLETED") -> Any:
        done, not_done = real_wait(fs, timeout, return_when)
        if threading.get_ident() == caller and not done and not cm.gate.is_set():
            # the wait ran out; entering ends just then, before the caller gives up
            cm.gate.set()
            real_wait([next(iter(fs))], 30.0)  # held.entered, waited first
        return done, not_done

    monkeypatch.setattr(_portal.concurrent.futures, "wait", wait_out)
    loop = LoopThread("test-exit-after-timeout")
    with caplog.at_level(logging.ERROR, "kvpipe.integrations"):
        try:
            with pytest.raises(TimeoutError):
                loop.enter(cm, wait=0.0)
            assert cm.exited.wait(30.0), "what was entered is exited"
        finally:
            assert loop.close() is True
    assert "BackendError: memory.close: injected" in caplog.text


class _Owner:
    """What closes a loop thread (an adapter): it refers to what its pipelines do."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.held = _Held()

    def close(self) -> None:
        self.loop.close()


def test_a_kept_record_of_a_failed_loop_stop_keeps_nothing_alive(
    no_cyclic_gc: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Stopping the loop failed at ``close()`` (its thread had already ended under its
    users: anyio's "This portal is not running"): the "stopping the loop failed" record held
    the error itself (``exc_info``), so a handler that keeps records (pytest's capture, a
    ``MemoryHandler``) kept its traceback's frames, and through them ``close()``'s callers
    (an adapter, its store, what its own caller held) after close. The record holds the
    error's text, its traceback included."""
    loop = LoopThread("test-stop-record")
    owner = _Owner(loop)
    ref = weakref.ref(owner.held)
    loop.portal.call(loop.portal.stop, True)  # the loop thread ends under its users
    with caplog.at_level(logging.ERROR, "kvpipe.integrations"):
        owner.close()
    (record,) = [r for r in caplog.records if "stopping the loop failed" in r.getMessage()]
    assert "RuntimeError: This portal is not running" in caplog.text
    lt = weakref.ref(loop)
    del owner, loop, record
    assert ref() is None, "a kept log record holds close()'s caller"
    assert lt() is None, "a kept log record holds the loop thread"


class _AbortsExiting:
    async def __aenter__(self) -> _AbortsExiting:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        raise _Abort("exit aborted")


@pytest.mark.parametrize("early", [True, False], ids=["leave-soon", "at-close"])
def test_a_base_exception_raised_by_an_exit_leaves_the_loop_running(
    early: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An exit that raised a ``BaseException`` other than a cancellation (``SystemExit``
    from a vendor library a store's close ran) was let through into the loop, where it
    ended the portal's task group: the loop thread died under every other user (their
    pipelines exited by its death, later calls raising ``PipelineClosed`` though
    ``closed`` was False), the error itself went nowhere (raised in the exit's done
    callback, or ending close's helper thread before the closers after it ran), and
    ``close()`` logged "stopping the loop failed". It is logged as that exit's error, and
    the loop goes on."""
    loop = LoopThread("test-exit-base-exception")
    held = _Exits()
    try:
        loop.enter(held, wait=30.0)
        _, leave_soon = loop.enter(_AbortsExiting(), wait=30.0)
        if early:
            leave_soon()
            assert loop.call(_answers, wait=30.0) == 42  # after the exit's step
            assert loop.call(_answers, wait=30.0) == 42
            assert not held.exited
    finally:
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert loop.close() is True
    assert held.exited
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, loud
    assert loud[0].startswith("test-exit-base-exception: error while closing")
    assert "_Abort: exit aborted" in loud[0]
