"""Log lines that repeat for a steady failure, bounded: the first of each kind at its level,
then at most one per :data:`INTERVAL` seconds, naming how many like it were logged at DEBUG
meanwhile; the others at DEBUG.

A store that is down fails every request the same way; at thousands of requests a second one
WARNING each would bury everything else in the log and cost the event loop the formatting.
The metrics (:meth:`kvpipe.Pipeline.statistics`) count every one; the log shows that it
happens, an example, and how often. Kinds are a fixed vocabulary (a stop reason, an
operation), so the table stays small.

Limits are per owner: each pipeline has its :class:`LogLimiters` (the actors' and its own
lines), each adapter its limiter. In a process with several pipelines over several stores
one store's flood must not hide another's first line of the same kind.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

__all__ = ("INTERVAL", "LogLimiter", "LogLimiters", "reset_all")

#: Seconds between two lines of one kind at their own level.
INTERVAL: Final = 10.0

_LIMITERS: weakref.WeakSet[LogLimiter] = weakref.WeakSet()


class LogLimiter:
    """Repeated lines of one logger, bounded per kind.

    Args:
        logger: Where the lines go.
        interval: Seconds between two lines of one kind at their own level.
        clock: Seconds, monotonic (injected by tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()  # the FastDeploy adapters log from FastDeploy's threads
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (last shown, demoted since)
        _LIMITERS.add(self)

    def log(self, level: int, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg % args`` at ``level`` if no line of ``kind`` was shown at its level in
        the last :attr:`interval` seconds (with how many were demoted since), else at DEBUG;
        the record names the caller's file, line and function."""
        logger = self.logger
        if not logger.isEnabledFor(level):  # nor, then, at DEBUG
            return
        # An exception is shown as its text: the record (kept by a handler, a queue) must not
        # hold it, its traceback's frames and what they refer to (a pipeline, its caches).
        args = tuple(_Shown(a) if isinstance(a, BaseException) else a for a in args)
        now = self.clock()
        with self._lock:
            last = self._kinds.get(kind)
            show = last is None or now - last[0] >= self.interval
            self._kinds[kind] = (now, 0) if show or last is None else (last[0], last[1] + 1)
        if not show:
            logger.debug(msg, *args, stacklevel=2)
        elif last is not None and last[1]:
            logger.log(
                level,
                msg + " [and %d more like it in the last %.0f s, at DEBUG]",
                *args,
                last[1],
                now - last[0],
                stacklevel=2,
            )
        else:
            logger.log(level, msg, *args, stacklevel=2)

    def reset(self) -> None:
        """Forget every kind: the next line of each is shown."""
        with self._lock:
            self._kinds.clear()


class LogLimiters:
    """One owner's limiters (a pipeline's), one per logger, made when first used: what
    another owner logs never holds back this one's lines. They refer to nothing but their
    loggers, so they keep no owner alive.

    Args:
        interval: Seconds between two lines of one kind at their own level.
        clock: Seconds, monotonic (injected by tests), for the limiters made from now on.
    """

    __slots__ = ("_by_logger", "_lock", "clock", "interval")

    def __init__(
        self, interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self._lock = threading.Lock()  # some lines are logged from worker threads
        self._by_logger: dict[str, LogLimiter] = {}

    def of(self, logger: logging.Logger) -> LogLimiter:
        """This owner's limiter of ``logger``'s lines."""
        with self._lock:
            limiter = self._by_logger.get(logger.name)
            if limiter is None:
                limiter = LogLimiter(logger, self.interval, self.clock)
                self._by_logger[logger.name] = limiter
            return limiter


class _Shown:
    """An exception's ``repr`` and ``str``, without the exception."""

    __slots__ = ("_repr", "_str")

    def __init__(self, exc: BaseException) -> None:
        self._repr, self._str = repr(exc), str(exc)

    def __repr__(self) -> str:
        return self._repr

    def __str__(self) -> str:
        return self._str


def reset_all() -> None:
    """Reset every limiter (tests: each starts as a fresh process would)."""
    for limiter in list(_LIMITERS):
        limiter.reset()
