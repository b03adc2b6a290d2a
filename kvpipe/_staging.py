"""The bounded staging pool: one host buffer cut into equal slots (one block value each).

Slices lease slots, first come, first served (a large slice is not starved by small ones).
Leases are reference-counted: slots go back only when every holder, including a worker thread
whose caller stopped waiting, has let go. A store that keeps the values it is given gets each
put gathered into memory of its own (:func:`private_lease`, :class:`ValueMemory`).
"""

from __future__ import annotations

import ctypes
import heapq
import logging
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Final, final

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from ._errors import ConfigError

__all__ = ("StagingLease", "StagingPool", "ValueMemory", "private_lease", "stride_for")

log = logging.getLogger("kvpipe.staging")

Rows = npt.NDArray[np.uint8]
_LINE = 64
_PAGE = 4096
#: Slots at least this large start on a page, so a file store can write them with direct I/O.
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
        # Free slots: every index from ``_fresh`` on (never leased), and the heap ``_free`` of
        # those given back (all below ``_fresh``): no per-slot object until a slot is used, so
        # a pool of millions of tiny slots costs nothing at open.
        self._free: list[int] = []
        self._fresh = 0
        self._waiters: deque[_Waiter] = deque()
        self._leases = 0

    @property
    def in_use(self) -> int:
        """Slots leased now."""
        return self.capacity - self._available()

    @property
    def waiters(self) -> int:
        """Tasks waiting for slots."""
        return len(self._waiters)

    @property
    def leases(self) -> int:
        """Leases not yet fully released."""
        return self._leases

    def try_acquire(self, count: int) -> StagingLease | None:
        """Lease ``count`` slots if they are free now and nobody is waiting; else ``None``."""
        if not self._waiters and 1 <= count <= self._available():
            return self._lease(self._take(count))
        return None

    async def acquire(self, count: int) -> StagingLease:
        """Lease ``count`` slots, waiting (first come, first served) until they are free.

        Cancellation: a cancelled wait takes nothing from the pool; wrap the call in a cancel
        scope to bound the wait.

        Raises:
            ValueError: ``count`` is not in ``[1, capacity]``.
        """
        if not 1 <= count <= self.capacity:
            raise ValueError(f"cannot lease {count} of {self.capacity} staging slots")
        if not self._waiters and self._available() >= count:
            await anyio.lowlevel.checkpoint()
            if not self._waiters and self._available() >= count:
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

    def _available(self) -> int:
        return len(self._free) + self.capacity - self._fresh

    def _take(self, count: int) -> list[int]:
        """The ``count`` lowest free slots (given-back ones lie below the never-leased)."""
        free = self._free
        given = [heapq.heappop(free) for _ in range(min(count, len(free)))]
        fresh = self._fresh
        self._fresh = fresh + count - len(given)
        return given + list(range(fresh, self._fresh))

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
        while self._waiters and self._available() >= self._waiters[0].count:
            waiter = self._waiters.popleft()
            waiter.slots = self._take(waiter.count)
            waiter.event.set()

    def close(self) -> bool:
        """Let go of the buffer, so it is freed as soon as no view of it is left, whatever
        still refers to the pool. Kept, and ``False`` returned, while a lease is outstanding
        (a worker thread abandoned at close may still use it)."""
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


def private_lease(slot_nbytes: int, count: int, buffer: Rows | None = None) -> StagingLease:
    """``count`` slots of memory of their own (a pool made for them alone, over ``buffer``
    or new memory): what a put is gathered into when the store keeps the values it is
    given."""
    pool = StagingPool(slot_nbytes, count, buffer)
    return pool._lease(pool._take(count))


@final
class ValueMemory:
    """Memory for values a store keeps, reused once nothing refers to them any more (memory
    already mapped costs no page faults).

    The arrays over each lease's buffer refer to it through a small wrapper object; when the
    last of them is gone, reference counting alone returns the buffer here, for a later lease
    of the same shape. Up to ``limit_bytes`` of buffers are held, the rest freed. Thread-safe:
    a buffer returns in whichever thread drops the last reference to it.

    Args:
        limit_bytes: Bytes of unused buffers held for reuse at most (0: none, every lease
            gets new memory).
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self._free: dict[tuple[int, int], list[Rows]] = {}
        self._held = 0
        # Reentrant: a cycle collection can start while a thread holds it (Python 3.12 on,
        # at any call) and return a buffer in that same thread (:meth:`_returned`).
        self._lock = threading.RLock()
        #: Leases served from a returned buffer / from new memory.
        self.reused = 0
        self.allocated = 0

    @property
    def held_bytes(self) -> int:
        """Bytes of unused buffers held for reuse now."""
        return self._held

    def lease(self, slot_nbytes: int, count: int) -> StagingLease:
        """``count`` slots for values of ``slot_nbytes`` (as :func:`private_lease`), in a
        returned buffer of the same shape when one is held."""
        shape = (count, stride_for(slot_nbytes))
        with self._lock:
            free = self._free.get(shape)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._held -= buffer.nbytes
                self.reused += 1
            else:
                self.allocated += 1
        if buffer is None:
            buffer = _page_aligned(shape)
        # Views refer to the wrapper, not ``buffer``: it dies with the last of them.
        wrapper = (ctypes.c_ubyte * buffer.nbytes).from_buffer(buffer.data)
        weakref.finalize(wrapper, self._returned, shape, buffer).atexit = False
        return private_lease(
            slot_nbytes, count, np.frombuffer(memoryview(wrapper), np.uint8).reshape(shape)
        )

    def clear(self) -> None:
        """Free every buffer held for reuse, and hold none from now on (those still in use
        are freed when let go)."""
        with self._lock:
            self.limit_bytes = 0  # first: a buffer returned while the others go is not held
            self._free.clear()
            self._held = 0

    def _returned(self, shape: tuple[int, int], buffer: Rows) -> None:
        spare: list[Rows] = []
        with self._lock:
            # Counted before the calls below, where a collection may return another buffer
            # in this thread: that one sees this one's bytes held.
            held = self._held + buffer.nbytes
            if held <= self.limit_bytes:
                self._held = held
                self._free.setdefault(shape, spare).append(buffer)
