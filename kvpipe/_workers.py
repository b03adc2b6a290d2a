"""kvpipe's own worker threads, at a lower CPU priority than the event loop's thread.

The copies and checksums of a slice keep whole cores busy for milliseconds. On a machine with
few cores, threads doing that at the same priority as the event loop's thread take the CPU
from it, and the server embedding kvpipe answers late. kvpipe's blocking work therefore runs
in threads of its own whose nice value is raised by ``nice`` (Linux: the priority of one
thread; lowering it again would need privileges, which is why these threads are not the
event loop library's shared ones). Threads are started on demand and leave after
``idle_timeout`` seconds without work, or when the pool shuts down.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Final, final

__all__ = ("WorkerThreads", "lower_priority")

log = logging.getLogger("kvpipe.workers")

#: How long an idle worker thread waits for work before it leaves.
IDLE_TIMEOUT: Final = 10.0
_warned = False


def lower_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice`` (at most to 19); whether it did."""
    global _warned
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("could not lower kvpipe's worker thread priority: %s", exc)
        return False
    return True


@final
class WorkerThreads:
    """A pool of daemon threads that run submitted calls, one at a time each.

    Args:
        nice: How much lower than the process's own priority they run (0: the same).
        idle_timeout: Seconds an idle thread waits for work before it leaves.
    """

    def __init__(self, nice: int = 0, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.nice = nice
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._threads = 0
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads alive now."""
        return self._threads

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in a thread of the pool (an idle one, else a new one). ``fn`` must
        not raise: it reports its own outcome.

        Raises:
            RuntimeError: The pool is shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker threads are shut down")
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._threads += 1
        if inbox is None:
            inbox = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._work, args=(inbox,), name="kvpipe-worker", daemon=True
            )
            inbox.put(fn)
            thread.start()
        else:
            inbox.put(fn)

    def shutdown(self) -> None:
        """Idle threads leave now; busy ones when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    def _work(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        lower_priority(self.nice)
        try:
            while True:
                try:
                    fn = inbox.get(timeout=self._idle_timeout)
                except queue.Empty:
                    with self._lock:
                        if inbox in self._idle and inbox.empty():
                            self._idle.remove(inbox)
                            return
                    continue  # handed work just as it timed out
                if fn is None:
                    return
                fn()
                del fn
                with self._lock:
                    if self._closed:
                        return
                    self._idle.append(inbox)
        finally:
            with self._lock:
                self._threads -= 1
