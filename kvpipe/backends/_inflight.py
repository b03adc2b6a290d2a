"""Counting a backend's worker-thread calls, so it never closes under one still running,
and never starts a thread per call on storage that stopped answering.

A call abandoned on a timeout keeps running in its thread, and closing a client under it can
crash the process: backends wrap each blocking function with :meth:`InFlight.track` and wait
with :meth:`InFlight.drain` before releasing anything. Short calls whose callers may give up
go through a :class:`ThreadGate`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, final

import anyio

from .._errors import BackendError
from .._workers import ThreadRunner

__all__ = ("InFlight", "ThreadGate")

T = TypeVar("T")


@final
class InFlight:
    """Worker calls running now (thread-safe).

    Args:
        refuse: Builds the exception a call starting after :meth:`drain` began raises.
    """

    def __init__(self, refuse: Callable[[], Exception]) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._closing = False
        self._refuse = refuse

    @property
    def running(self) -> int:
        """Calls running now."""
        return self._running

    @property
    def closing(self) -> bool:
        """Whether :meth:`drain` has begun (new calls are refused)."""
        return self._closing

    def track(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, counted from the moment its worker thread starts it until it returns."""

        def run(*args: Any) -> T:
            with self._cond:
                if self._closing:
                    raise self._refuse()
                self._running += 1
            try:
                return fn(*args)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

        return run

    def drain(self, timeout: float) -> bool:
        """Refuse new calls and wait (blocking) until none runs; ``False`` on timeout."""
        with self._cond:
            self._closing = True
            return self._cond.wait_for(lambda: self._running == 0, timeout)


@final
class ThreadGate:
    """Runs a backend's short blocking calls in worker threads, ``width`` at once, for callers
    that may stop waiting: the thread then runs on and its place is free at once (as anyio's
    ``abandon_on_cancel``). Once ``width`` calls beyond that are still running (storage that
    stopped answering), new calls are refused rather than each given one more thread.

    The threads are kvpipe's own (:class:`~kvpipe._workers.ThreadRunner`), not the event loop
    library's shared ones: a new one is never started by the event loop's thread (anyio's
    are, and the start waited for the new thread to run: 5-60 ms on busy processors).
    :meth:`close` lets them go.

    Args:
        backend: The backend's name, for errors.
        width: Calls running at once.
    """

    def __init__(self, backend: str, width: int) -> None:
        self.backend = backend
        self.width = width
        self._limiter = anyio.CapacityLimiter(width)
        self._calls = InFlight(RuntimeError)  # counts only: it is never drained
        self._runner = ThreadRunner()
        self._runner.open()
        self._closed = False

    @property
    def running(self) -> int:
        """Calls running in their threads now, those given up on included."""
        return self._calls.running

    async def run(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread.

        Cancellation: stops waiting at once; the thread runs on to the end of ``fn``.

        Raises:
            BackendError: ``width`` calls given up on are still running, or the gate is
                closed (``op``: the call's name in the error). Exceptions from ``fn``
                propagate.
        """
        if self._closed:
            raise BackendError(self.backend, op, "the store is closed")
        self._check(op, self._calls.running)

        def capped(*a: Any) -> T:  # checked again: it may have waited for its place
            self._check(op, self._calls.running - 1)  # counted already
            return fn(*a)

        async with self._limiter:  # let go of at once by a caller that stops waiting
            return await self._runner.run(self._calls.track(capped), *args)

    def close(self) -> None:
        """Take no more calls; idle threads leave now, those of calls given up on when their
        call returns."""
        self._closed = True
        self._runner.shutdown()

    def _check(self, op: str, running: int) -> None:
        if running >= 2 * self.width:
            raise BackendError(
                self.backend,
                op,
                f"{running} earlier calls still running (storage not answering?); refused",
            )
