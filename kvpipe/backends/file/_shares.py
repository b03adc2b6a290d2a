"""A file store batch run in shares across the store's threads (:func:`in_shares`)."""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar, final

__all__ = ("in_shares",)

log = logging.getLogger("kvpipe.file_store")
T = TypeVar("T")
U = TypeVar("U")


def in_shares(
    pool: Executor, threads: int, fn: Callable[[list[T]], list[U]], items: list[T], path: str
) -> list[U]:
    """``fn`` over ``threads`` consecutive shares of ``items`` in ``pool``, the results in
    order. Returns (or raises the first share's error) only once every share has returned:
    they read into and write from the batch's staging. A share the pool cannot start a
    thread for (the system's limit) runs in the calling thread, with the ones after it:
    never after this call has returned (``path``: the store's, for the log)."""
    step = max(1, -(-len(items) // threads))
    shares = [_Share(fn, items[lo : lo + step]) for lo in range(0, len(items), step)]
    for at, share in enumerate(shares):
        try:
            pool.submit(share.run)
        except Exception as exc:  # a thread could not be started (the system's limit)
            # The pool may have queued the share all the same: whoever runs it first
            # does, once; the rest run here rather than after this call has returned.
            log.warning(
                "file store %s: could not start a worker thread (%s); running %d "
                "share(s) of a batch in the calling thread",
                path,
                repr(exc),
                len(shares) - at,
            )
            for rest in shares[at:]:
                rest.run()
            break
    for share in shares:  # every share done before any error is raised
        share.wait()
    return [r for share in shares for r in share.result()]


@final
class _Share(Generic[T, U]):
    """One share of a batch: ``fn(items)``, run once, by whichever thread comes first (a
    thread of the store's pool, or the caller where the pool could not start one)."""

    def __init__(self, fn: Callable[[list[T]], list[U]], items: list[T]) -> None:
        self._fn = fn
        self._items = items
        self._lock = threading.Lock()
        self._taken = False
        self._done = threading.Event()
        self._result: list[U] = []
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the share here, unless another thread has taken it."""
        with self._lock:
            if self._taken:
                return
            self._taken = True
        try:
            self._result = self._fn(self._items)
        except BaseException as exc:  # raised by result(), in the caller's thread
            # The error's frames lead back to this one, which holds this share, which will
            # hold the error: a cycle. Their locals (the batch's keys and staging) go now.
            traceback.clear_frames(exc.__traceback__)
            self._error = exc
        finally:
            self._items = []
            self._done.set()

    def wait(self) -> None:
        """Wait until it has run."""
        self._done.wait()

    def result(self) -> list[U]:
        """Its results, once it has run (its error raised)."""
        self._done.wait()
        error, self._error = self._error, None  # this share, on its traceback, kept it
        if error is None:
            return self._result
        try:
            raise error
        finally:
            error = None
