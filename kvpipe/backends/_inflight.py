"""Counting a backend's worker-thread calls, so it never closes under one still running.

A call abandoned on a timeout keeps running in its thread, and closing a client under it can
crash the process: backends wrap each blocking function with :meth:`InFlight.track` and wait
with :meth:`InFlight.drain` before releasing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, final

__all__ = ("InFlight",)

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
