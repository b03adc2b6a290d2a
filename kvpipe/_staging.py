"""The bounded staging pool and the worker-thread runner that respects it.

Staging is one host buffer cut into equal slots (one stored block value each). A slice leases
the slots it needs; the lease is reference-counted and its slots go back to the pool only
when every holder has let go — including a worker thread whose caller stopped waiting for it
on a timeout (:meth:`ThreadRunner.run` keeps its own reference until the thread returns).

Waiters are served first come, first served, so a large slice is not starved by small ones.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, final

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from ._errors import ConfigError
from ._workers import WorkerThreads

__all__ = ("StagingLease", "StagingPool", "ThreadRunner", "private_lease", "stride_for")

log = logging.getLogger("kvpipe.staging")

T = TypeVar("T")
Rows = npt.NDArray[np.uint8]
_LINE = 64
_PAGE = 4096
#: Slots at least this large start on a page: a file store can then write them with direct
#: I/O, which needs page-aligned memory (the padding costs under 7 % of a slot at this size).
PAGE_ALIGNED_SLOT: Final = 64 << 10


def stride_for(slot_nbytes: int) -> int:
    """Bytes between slot starts: ``slot_nbytes`` rounded up to a page when it is at least
    :data:`PAGE_ALIGNED_SLOT`, else to 64 bytes (a cache line)."""
    align = _PAGE if slot_nbytes >= PAGE_ALIGNED_SLOT else _LINE
    return -(-slot_nbytes // align) * align


def _available() -> str:
    """How much memory the OS reports available (``MemAvailable``), for error messages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return f"{int(line.split()[1]) * 1024} B"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return f"{os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')} B"
    except (AttributeError, ValueError, OSError):
        return "an unknown amount"


def _page_aligned(shape: tuple[int, int]) -> Rows:
    """An uninitialised ``uint8`` array of ``shape`` whose first byte starts a page."""
    nbytes = shape[0] * shape[1]
    raw = np.empty(nbytes + _PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % _PAGE
    out: Rows = raw[skip : skip + nbytes].reshape(shape)
    return out


@dataclass(eq=False)
class _Waiter:
    count: int
    event: anyio.Event = field(default_factory=anyio.Event)
    slots: list[int] | None = None


@final
class StagingPool:
    """A fixed number of equal slots of host memory.

    Args:
        slot_nbytes: Bytes one slot must hold (a stored block value).
        capacity_slots: Number of slots.
        buffer: Memory to use instead of allocating it (the CUDA engine's pinned staging):
            ``uint8``, C-contiguous, shape ``(capacity_slots, stride_for(slot_nbytes))``.
            The pool does not own it; whoever allocated it frees it after the pool is done.

    Raises:
        ValueError: No slot, an empty slot, or a ``buffer`` of the wrong shape or type.
        ConfigError: The buffer cannot be allocated (names the bytes asked and available).
    """

    def __init__(self, slot_nbytes: int, capacity_slots: int, buffer: Rows | None = None) -> None:
        if slot_nbytes < 1 or capacity_slots < 1:
            raise ValueError("a staging pool needs at least one slot of at least one byte")
        self.slot_nbytes = slot_nbytes
        self.stride = stride_for(slot_nbytes)
        self.capacity = capacity_slots
        if buffer is None:
            # Uninitialised: pages are touched (and so resident) only as slots are first used.
            try:
                buffer = _page_aligned((capacity_slots, self.stride))
            except MemoryError:
                raise ConfigError(
                    "staging_bytes",
                    f"could not allocate {capacity_slots * self.stride} B of staging "
                    f"({capacity_slots} slots of {self.stride} B); {_available()} of memory is "
                    "available now",
                ) from None
        elif (
            buffer.dtype != np.uint8
            or buffer.shape != (capacity_slots, self.stride)
            or not buffer.flags.c_contiguous
            or not buffer.flags.writeable
        ):
            raise ValueError(
                f"staging buffer must be writable C-contiguous uint8 of shape "
                f"{(capacity_slots, self.stride)}, got {buffer.dtype} {buffer.shape}"
            )
        self.buffer: Rows = buffer
        self._free = list(range(capacity_slots))
        self._waiters: deque[_Waiter] = deque()
        self._leases = 0

    @property
    def in_use(self) -> int:
        """Slots leased now."""
        return self.capacity - len(self._free)

    @property
    def waiters(self) -> int:
        """Tasks waiting for slots."""
        return len(self._waiters)

    @property
    def leases(self) -> int:
        """Leases not yet fully released."""
        return self._leases

    async def acquire(self, count: int) -> StagingLease:
        """Lease ``count`` slots, waiting (first come, first served) until they are free.

        Cancellation: a cancelled wait takes nothing from the pool; wrap the call in a cancel
        scope to bound the wait.

        Raises:
            ValueError: ``count`` is not in ``[1, capacity]``.
        """
        if not 1 <= count <= self.capacity:
            raise ValueError(f"cannot lease {count} of {self.capacity} staging slots")
        if not self._waiters and len(self._free) >= count:
            await anyio.lowlevel.checkpoint()
            if not self._waiters and len(self._free) >= count:
                return self._lease(self._take(count))
        waiter = _Waiter(count)
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.slots is not None:
                self._give_back(waiter.slots)
            else:
                self._waiters.remove(waiter)
                self._serve()
            raise
        assert waiter.slots is not None
        return self._lease(waiter.slots)

    def _take(self, count: int) -> list[int]:
        return [heapq.heappop(self._free) for _ in range(count)]

    def _lease(self, slots: list[int]) -> StagingLease:
        self._leases += 1
        return StagingLease(self, sorted(slots))

    def _give_back(self, slots: list[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)
        self._serve()

    def _released(self, slots: list[int]) -> None:
        self._leases -= 1
        self._give_back(slots)

    def _serve(self) -> None:
        while self._waiters and len(self._free) >= self._waiters[0].count:
            waiter = self._waiters.popleft()
            waiter.slots = self._take(waiter.count)
            waiter.event.set()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has let go of the buffer."""
        return self.buffer.size == 0

    def close(self) -> bool:
        """Let go of the buffer, so it is freed by reference counting as soon as no view of
        it is left — whatever else still refers to the pool (a traceback, a reference cycle).
        Kept, and ``False`` returned, while a lease is outstanding (a worker thread abandoned
        at close may still use it)."""
        if self._leases:
            return False
        self.buffer = np.empty((0, self.stride), np.uint8)
        return True

    def slot(self, index: int) -> Rows:
        """The bytes of one slot (``slot_nbytes`` long)."""
        row: Rows = self.buffer[index, : self.slot_nbytes]
        return row


@final
class StagingLease:
    """Slots leased from a :class:`StagingPool`, reference-counted.

    The creator holds one reference; :meth:`retain` adds one, :meth:`release` drops one; the
    slots return to the pool when the count reaches zero. Only the event loop's thread may
    call these.
    """

    __slots__ = ("_pool", "_refs", "slots")

    def __init__(self, pool: StagingPool, slots: list[int]) -> None:
        self._pool = pool
        self._refs = 1
        self.slots = tuple(slots)

    @property
    def pool(self) -> StagingPool:
        """The pool the slots belong to."""
        return self._pool

    @property
    def released(self) -> bool:
        """Whether every reference has been released."""
        return self._refs == 0

    def retain(self) -> None:
        """Add a reference."""
        if self._refs == 0:
            raise RuntimeError("retain() on a released staging lease")
        self._refs += 1

    def release(self) -> None:
        """Drop a reference; the last one returns the slots to the pool."""
        if self._refs == 0:
            raise RuntimeError("staging lease released twice")
        self._refs -= 1
        if self._refs == 0:
            self._pool._released(list(self.slots))

    def view(self, i: int) -> Rows:
        """The bytes of the ``i``-th leased slot."""
        return self._pool.slot(self.slots[i])

    def memoryviews(self, count: int | None = None) -> list[memoryview]:
        """Writable memoryviews of the first ``count`` leased slots (all by default)."""
        n = len(self.slots) if count is None else count
        return [self.view(i).data for i in range(n)]


def private_lease(slot_nbytes: int, count: int) -> StagingLease:
    """``count`` slots of new memory of their own (a pool made for them alone): what a put
    is gathered into when the store keeps the values it is given."""
    pool = StagingPool(slot_nbytes, count)
    return pool._lease(pool._take(count))


@final
class _Call:
    """Who finishes a worker-thread call: its caller, or, when the caller stopped waiting
    while the thread ran, the thread itself (through the event loop). A call whose caller
    gave up before the thread started never starts."""

    __slots__ = ("abandoned", "lock", "outcome", "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.abandoned = False
        self.outcome: tuple[bool, Any] | None = None


@final
class ThreadRunner:
    """Runs blocking functions in worker threads, holding staging until they return.

    A caller waiting in :meth:`run` may be cancelled (a slice timeout); the thread cannot be,
    so the runner keeps its own reference on the lease and returns it when the thread ends.
    Use as an async context manager; leaving it waits (bounded) for running threads.
    """

    def __init__(self, close_timeout: float = 10.0, *, nice: int = 0) -> None:
        self._threads = WorkerThreads(nice)
        self._open = False
        self._running = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._close_timeout = close_timeout
        self._deadline: float | None = None

    @property
    def running(self) -> int:
        """Threads running now (including ones whose caller gave up)."""
        return self._running

    async def __aenter__(self) -> ThreadRunner:
        self._open = True
        return self

    def close_by(self, deadline: float) -> None:
        """Wait for running threads at exit until ``deadline`` (event-loop clock) rather than
        ``close_timeout`` from then: the pipeline's one close deadline."""
        self._deadline = deadline

    async def __aexit__(self, *exc_info: Any) -> None:
        deadline = self._deadline
        if deadline is None:
            deadline = anyio.current_time() + self._close_timeout
        with anyio.move_on_at(deadline, shield=True) as scope:
            await self._idle.wait()
        self._open = False
        self._threads.shutdown()
        if scope.cancelled_caught:
            log.error(
                "%d worker thread(s) still running at the close deadline; abandoning them "
                "(their staging slots stay leased)",
                self._running,
            )

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        hold: StagingLease | None = None,
        limiter: anyio.CapacityLimiter | None = None,
    ) -> T:
        """Call ``fn(*args)`` in one of the runner's worker threads and return its result.

        Cancellation: cancelling the caller stops the wait at once; the thread runs on, and
        ``hold`` stays leased until it returns. Exceptions from ``fn`` propagate.

        Raises:
            RuntimeError: The runner is not running.
        """
        if not self._open:
            raise RuntimeError("ThreadRunner is not running")
        if hold is not None:
            hold.retain()
        self._running += 1
        if self._running == 1:
            self._idle = anyio.Event()
        call = _Call()
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        # The thread takes the call out of this box, so nothing of the arguments (staging
        # views) outlives the call in a worker thread's frame.
        box: list[Any] = [fn, args]

        def report(ok: bool, value: Any) -> None:  # on the event loop's thread
            if call.abandoned:
                self._finish(hold)  # the caller gave up while the thread ran
            else:
                call.outcome = (ok, value)
                done.set()

        def work() -> None:
            f, a = box
            box.clear()
            with call.lock:
                if call.abandoned:
                    return  # the caller gave up before it started: do nothing
                call.started = True
            try:
                ok, value = True, f(*a)
            except BaseException as exc:
                ok, value = False, exc
            del f, a
            try:
                token.backend_class.run_sync_soon(report, (ok, value), token.native_token)
            except Exception as exc:  # the event loop is gone: nothing to release
                log.debug("worker thread ended after its event loop: %r", exc)

        try:
            async with limiter if limiter is not None else contextlib.nullcontext():
                await anyio.lowlevel.checkpoint_if_cancelled()
                self._threads.submit(work)
                await done.wait()
        except BaseException:
            with call.lock:
                started = call.started
                call.abandoned = True
            if not started:
                self._finish(hold)  # it never ran, and now never will
            raise  # else its report finishes the call when it returns
        self._finish(hold)
        outcome, call.outcome = call.outcome, None
        assert outcome is not None
        ok, value = outcome
        if ok:
            return value  # type: ignore[no-any-return]
        try:
            raise value
        finally:
            value = None

    def _finish(self, hold: StagingLease | None) -> None:
        if hold is not None:
            hold.release()
        self._running -= 1
        if self._running == 0:
            self._idle.set()
