"""What the CUDA engine owns, and an exact account of it.

:class:`CudaOptions` (tuning); :class:`Ledger` (every device and pinned allocation, known to
the byte); :class:`EventPool` and :class:`ProducerMark` (an event on the producer's stream,
reference-counted: :class:`kvpipe._engine.OrderMark`); :class:`ScratchPool` (per-call device
scratch: a call holds one set from before it queues work until that work has completed, so
concurrent calls never share one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import final

import anyio
import numpy as np
import numpy.typing as npt

from .._engine import OrderMark
from ._driver import Driver
from ._kernels import PAIR_NBYTES, Mode
from ._pinned import PinnedBuffer

__all__ = (
    "CudaOptions",
    "EngineAccounting",
    "EventPool",
    "Ledger",
    "ProducerMark",
    "Scratch",
    "ScratchPool",
)

IntArray = npt.NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class CudaOptions:
    """Tuning of the CUDA engine.

    Attributes:
        d2h: Device → host path: ``"auto"`` (mapped writes when the slots are consecutive),
            ``"mapped"`` or ``"staged"``.
        h2d: Host → device path: ``"auto"`` / ``"staged"`` (DMA into scratch, scatter) or
            ``"mapped"`` (the scatter kernel reads mapped pinned staging).
        scratch_bytes: Data bytes of one scratch set (at least one slot); larger calls are
            done in chunks of ``scratch_bytes // stride`` blocks.
        max_calls: Scratch sets, i.e. calls in flight at once (more wait).
        poll_max: Longest sleep between two completion polls, in seconds.
        drain_timeout: How long close waits for the device before leaking (not freeing)
            memory it may still be using; also how long opening waits for the pointer
            table's upload (then :class:`~kvpipe.DeviceError`).
        kernel_cache: Directory of compiled kernels (default: :func:`kernel_cache_dir`).
    """

    d2h: Mode = "auto"
    h2d: Mode = "auto"
    scratch_bytes: int = 16 * 1024 * 1024
    max_calls: int = 4
    poll_max: float = 2e-3
    drain_timeout: float = 30.0
    kernel_cache: Path | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown path or a non-positive size, count or time."""
        for name in ("d2h", "h2d"):
            if getattr(self, name) not in ("auto", "mapped", "staged"):
                raise ValueError(f"{name} must be 'auto', 'mapped' or 'staged'")
        if self.scratch_bytes < 1 or self.max_calls < 1:
            raise ValueError("scratch_bytes and max_calls must be positive")
        if not (self.poll_max > 0 and self.drain_timeout > 0):
            raise ValueError("poll_max and drain_timeout must be positive")


@final
@dataclass(frozen=True, slots=True)
class EngineAccounting:
    """An immutable snapshot of what a CUDA engine holds.

    Attributes:
        staging_budget: The pinned staging budget (the pipeline's ``staging_bytes``).
        staging_requested: Pinned staging bytes requested (``capacity * stride``).
        staging_allocated: Pinned staging bytes allocated (equal: kvpipe never rounds).
        pinned_bytes: Live pinned bytes in all (staging and the pair tables' host copies).
        pinned_allocations: Live pinned allocations.
        device_bytes: Live device bytes (pointer table, scratch pair tables and data).
        device_allocations: Live device allocations.
        streams: Live streams.
        events: Live events.
        scratch_buffers: Scratch sets allocated (at most ``max_calls``).
        scratch_in_use: Scratch sets held by calls now.
    """

    staging_budget: int
    staging_requested: int
    staging_allocated: int
    pinned_bytes: int
    pinned_allocations: int
    device_bytes: int
    device_allocations: int
    streams: int
    events: int
    scratch_buffers: int
    scratch_in_use: int


@final
class Ledger:
    """Allocates through a driver and remembers every live allocation."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.device: dict[int, int] = {}
        self.pinned: dict[int, PinnedBuffer] = {}

    def mem_alloc(self, nbytes: int) -> int:
        """Device memory."""
        ptr = self.driver.mem_alloc(nbytes)
        self.device[ptr] = nbytes
        return ptr

    def mem_free(self, ptr: int) -> None:
        """Free device memory from :meth:`mem_alloc` (still counted if the driver fails)."""
        self.driver.mem_free(ptr)
        del self.device[ptr]

    def pinned_alloc(self, nbytes: int, *, budget: int | None = None, mapped: bool) -> PinnedBuffer:
        """Pinned host memory of exactly ``nbytes``."""
        buf = PinnedBuffer(self.driver, nbytes, budget=budget, mapped=mapped)
        self.pinned[buf.host_ptr] = buf
        return buf

    def pinned_free(self, buf: PinnedBuffer) -> None:
        """Free pinned memory from :meth:`pinned_alloc` (still counted if the driver fails)."""
        buf.free()
        del self.pinned[buf.host_ptr]

    @property
    def device_bytes(self) -> int:
        """Live device bytes."""
        return sum(self.device.values())

    @property
    def pinned_bytes(self) -> int:
        """Live pinned bytes."""
        return sum(b.allocated_bytes for b in self.pinned.values())


@final
class EventPool:
    """Events to reuse (recording an event again is allowed once its waiters have captured
    the previous record, which ``cuStreamWaitEvent`` does at call time)."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver
        self._free: list[int] = []
        self._closed = False
        self.live = 0

    def get(self) -> int:
        """An event (a new one when none is free)."""
        if self._free:
            return self._free.pop()
        event = self._driver.event_create()
        self.live += 1
        return event

    def put(self, event: int) -> None:
        """Return an event for reuse (after :meth:`close`, it is left to the context)."""
        if not self._closed:
            self._free.append(event)

    def close(self) -> None:
        """Destroy the free events (call after every event has been put back)."""
        self._closed = True
        while self._free:
            self._driver.event_destroy(self._free.pop())
            self.live -= 1


@final
class ProducerMark(OrderMark):
    """An event recorded on the producer's stream; see :class:`kvpipe._engine.OrderMark`."""

    __slots__ = ("_give_back", "_refs", "event")

    def __init__(self, event: int, give_back: Callable[[int], None]) -> None:
        self.event = event
        self._give_back = give_back
        self._refs = 1

    @property
    def released(self) -> bool:
        """Whether every reference has been dropped."""
        return self._refs == 0

    def retain(self) -> None:
        """Add a reference.

        Raises:
            RuntimeError: The mark was already released.
        """
        if self._refs == 0:
            raise RuntimeError("retain() on a released producer mark")
        self._refs += 1

    def release(self) -> None:
        """Drop a reference; the last one returns the event to its pool."""
        if self._refs == 0:
            raise RuntimeError("producer mark released twice")
        self._refs -= 1
        if self._refs == 0:
            self._give_back(self.event)


@final
class Scratch:
    """One call's device scratch: a pair table and (lazily) a data buffer, plus the event
    that marks the end of the call's work."""

    __slots__ = ("data", "done", "pairs", "pairs_dev", "pairs_host")

    def __init__(self, pairs_dev: int, pairs_host: PinnedBuffer, done: int, max_blocks: int):
        self.pairs_dev = pairs_dev
        self.pairs_host = pairs_host
        self.pairs: IntArray = pairs_host.array().view(np.int64).reshape(max_blocks, 2)
        self.done = done
        self.data: int | None = None


@final
class ScratchPool:
    """At most ``limit`` scratch sets, created on demand, handed to one call at a time.

    Args:
        ledger: Allocates (and accounts for) the memory.
        events: Supplies each set's completion event.
        max_blocks: Blocks one call moves at most (its pair table's rows).
        data_nbytes: Bytes of a data buffer (``chunk_blocks * stride``).
        limit: Sets at most (calls that can be in flight at once).
    """

    def __init__(
        self, ledger: Ledger, events: EventPool, max_blocks: int, data_nbytes: int, limit: int
    ) -> None:
        if max_blocks < 1 or data_nbytes < 1 or limit < 1:
            raise ValueError("scratch pool needs positive sizes and limit")
        self._ledger = ledger
        self._events = events
        self.max_blocks = max_blocks
        self.data_nbytes = data_nbytes
        self._sem = anyio.Semaphore(limit)
        self._free: list[Scratch] = []
        self._all: list[Scratch] = []
        self._stopped = False
        self.in_use = 0

    @property
    def allocated(self) -> int:
        """Scratch sets created and not freed."""
        return len(self._all)

    async def acquire(self) -> Scratch | None:
        """A scratch set for one call, waiting while ``limit`` are in use; ``None`` once
        :meth:`stop` was called (before or during the wait).

        Cancellation: a cancelled wait takes nothing.

        Raises:
            DeviceError: Creating a new set failed.
        """
        await self._sem.acquire()
        if self._stopped:
            self._sem.release()
            return None
        try:
            scratch = self._free.pop() if self._free else self._create()
        except BaseException:
            self._sem.release()
            raise
        self.in_use += 1
        return scratch

    def _create(self) -> Scratch:
        nbytes = self.max_blocks * PAIR_NBYTES
        # Called on the caller's (event loop's) thread; a failure gives back what it took.
        with self._ledger.driver.current(), contextlib.ExitStack() as undo:
            done = self._events.get()
            undo.callback(self._events.put, done)
            host = self._ledger.pinned_alloc(nbytes, mapped=False)
            undo.callback(self._ledger.pinned_free, host)
            dev = self._ledger.mem_alloc(nbytes)
            undo.pop_all()
        scratch = Scratch(dev, host, done, self.max_blocks)
        self._all.append(scratch)
        return scratch

    def data(self, scratch: Scratch) -> int:
        """The set's data buffer (allocated on first use)."""
        if scratch.data is None:
            scratch.data = self._ledger.mem_alloc(self.data_nbytes)
        return scratch.data

    def release(self, scratch: Scratch) -> None:
        """Give a set back; only once the work that used it has completed."""
        self.in_use -= 1
        self._free.append(scratch)
        self._sem.release()

    def quarantine(self, scratch: Scratch) -> None:
        """Retire a set whose work may still be running (the device failed): it is never
        handed out again, and freed only at close after the streams drained."""
        self.in_use -= 1
        self._sem.release()

    def stop(self) -> None:
        """Hand out no set any more (the engine is closing): :meth:`acquire` returns ``None``,
        and creates nothing, also in a call that was already waiting."""
        self._stopped = True

    def close(self) -> None:
        """Free every set (call only when no work can be using them)."""
        for scratch in self._all:
            if scratch.data is not None:
                self._ledger.mem_free(scratch.data)
            self._ledger.mem_free(scratch.pairs_dev)
            self._ledger.pinned_free(scratch.pairs_host)
            self._events.put(scratch.done)
        self._all.clear()
        self._free.clear()
