"""The CUDA copy engine: device cache ↔ pinned staging with the kernels of ``ext/``.

A call (a slice's gather or scatter) runs on its direction's stream (the two overlap): wait
for a scratch set (a call given ``start_by``, a write's or a read's, first polls the
producer's mark until it completes: it never sits queued behind the model's work; these
waits are the only points where a cancelled call takes nothing); wait on the producer's
mark; upload the
(cache block, slot) pairs; run the copy path (:func:`._kernels.choose_path`); record the
scratch set's event and poll it. Everything after the scratch wait is shielded: once work
is queued the call returns only when it finished.
Completion is polled (``SPIN_SECONDS`` of yields, then back-off up to ``poll_max``), not
awaited in a thread that could not be interrupted (``docs/cuda.md``).

The engine's driver calls run on the event loop's thread, the server's own, whose framework
may have another device's context current there: the engine's context is current only
around each run of driver calls between two awaits (:meth:`Driver.current`), and whatever
was current before is current again after it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import Final, Literal, final

import anyio
import anyio.lowlevel

from .._cache import KVCache
from .._device_tensors import current_stream
from .._engine import CopyEngine, OrderMark
from .._errors import AbandonedAtClose, DeviceError, RequestError
from .._plan import CopyPlan, layout_segments
from .._shield import DeferredCancel, shielded
from .._staging import StagingLease, stride_for
from .._workers import NotStarted
from ._driver import DeviceInfo, Driver
from ._kernels import (
    GATHER,
    PAIR_NBYTES,
    SCATTER,
    CopyArgs,
    CopyPath,
    SlotRun,
    choose_path,
    dense_pairs,
    launch_shape,
    pack_args,
    plan_pairs,
    slot_runs,
)
from ._pinned import PinnedBuffer
from ._resources import (
    CudaOptions,
    EngineAccounting,
    EventPool,
    Ledger,
    ProducerMark,
    Scratch,
    ScratchPool,
)

__all__ = ("CudaEngine",)

log = logging.getLogger("kvpipe.cuda")
Direction = Literal["gather", "scatter"]

SPIN_SECONDS: Final = 100e-6  #: poll without sleeping this long, then back off
POLL_MIN: Final = 100e-6  #: the first back-off sleep


@final
class CudaEngine(CopyEngine):
    """Moves a device cache's blocks to and from pinned staging (see the module docstring).

    Build one with :func:`kvpipe.cuda.open_cuda_engine`; close it with :meth:`aclose`.

    Attributes:
        info: The device.
        staging: The pinned staging (exactly ``capacity * stride`` bytes).
        paths: How many calls took each :class:`CopyPath`.
    """

    name = "cuda"

    def __init__(
        self,
        *,
        driver: Driver,
        info: DeviceInfo,
        cache: KVCache,
        ledger: Ledger,
        events: EventPool,
        staging: PinnedBuffer,
        slot_nbytes: int,
        max_blocks: int,
        module: int,
        functions: dict[str, int],
        streams: dict[Direction, int],
        table: int,
        options: CudaOptions,
        note: str,
    ) -> None:
        self.info = info
        self.note = note
        self.staging = staging
        self.options = options
        self.paths: Counter[CopyPath] = Counter()
        self._driver = driver
        self._cache = cache
        self._ledger = ledger
        self._events = events
        self._module = module
        self._functions = functions
        self._streams = streams
        self._table = table
        self._stride = stride_for(slot_nbytes)
        segments = layout_segments(cache.layout)
        self._n_seg = len(segments)
        self._max_seg = max(s.nbytes for s in segments)
        self._payload = cache.layout.block_nbytes
        self._chunk_blocks = max(1, min(max_blocks, options.scratch_bytes // self._stride))
        self._scratch = ScratchPool(
            ledger, events, max_blocks, self._chunk_blocks * self._stride, options.max_calls
        )
        self._calls = 0  #: calls in flight: waiting to start, or with work queued
        self._queued = 0  #: calls in flight that queued work on the device
        self._idle = anyio.Event()
        self._idle.set()
        self._closed = False
        #: Close has decided whether copies still run: no call starts any more.
        self._sealed = False
        #: Past this (event-loop clock) no wait of this engine goes on: see close_by.
        self._abandon_at: float | None = None
        #: The scopes of calls waiting to start (for the producer, for scratch): close_by
        #: moves their deadlines up to its own.
        self._starting: set[anyio.CancelScope] = set()

    def mark(self, stream: int | None) -> ProducerMark:
        """Record an event on ``stream`` (default: the framework's current stream) now; copies
        given the mark start only after the work queued there before this call.

        Raises:
            RequestError: ``stream`` is not a stream handle, or none was given and the
                framework's current stream cannot be found.
            DeviceError: The driver refused to record (e.g. an invalid stream).
        """
        self._check_open()
        if stream is None:
            stream = current_stream(self._cache.framework, self.info.ordinal)
        elif isinstance(stream, bool) or not isinstance(stream, int) or stream < 0:
            raise RequestError(f"stream must be a CUstream handle (an int >= 0), got {stream!r}")
        return ProducerMark(self._record(stream), self._events.put)

    def _record(self, stream: int) -> int:
        """A pooled event recorded on ``stream`` now (back in the pool if recording fails)."""
        with self._driver.current():
            event = self._events.get()
            try:
                self._driver.event_record(event, stream)
            except BaseException:
                self._events.put(event)
                raise
        return event

    async def gather(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """Device cache blocks → staging slots, after ``after``; returns once the bytes are
        in staging.

        Args:
            start_by: As for :meth:`scatter`: by then the copy must have started (the
                producer's work before the mark completed, polled, and a scratch set
                taken), else it queues nothing and raises
                :class:`~kvpipe._workers.NotStarted`.

        Cancellation: before any work is queued (while waiting for scratch, or for the
        producer given ``start_by``) the call stops at once and takes nothing; after, it is
        shielded and returns when the device is done.

        Raises:
            DeviceError: The driver failed; if the device may still be writing, the
                lease's slots and the scratch are retired, never reused.
            AbandonedAtClose: (a :class:`DeviceError`) Still waiting at the close
                deadline (see :meth:`close_by`).
        """
        await self._copy("gather", plan, lease, after, start_by)

    async def scatter(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """Staging slots → device cache blocks, after ``after``; returns once the bytes are
        in the cache. Cancellation and errors: as for :meth:`gather`.

        Args:
            start_by: An event-loop time by which the copy must have started: the work
                queued on ``after``'s stream before the mark has completed (polled, before
                anything is queued) and the copy has its scratch set. One still waiting for
                either then queues nothing and raises :class:`~kvpipe._workers.NotStarted`;
                one that has both runs to its end.
        """
        await self._copy("scatter", plan, lease, after, start_by)

    def close_by(self, deadline: float) -> None:
        """Every wait of this engine ends by ``deadline``: one still pending then raises
        :class:`~kvpipe._errors.AbandonedAtClose` (a :class:`DeviceError`); its staging
        slots and scratch are retired (never reused or freed). A call not started by then
        (waiting for scratch or the producer) queues nothing."""
        if self._abandon_at is None or deadline < self._abandon_at:
            self._abandon_at = deadline
        for scope in self._starting:  # calls not started yet: they queue nothing after it
            scope.deadline = min(scope.deadline, deadline)

    async def aclose(self, *, staging_in_use: bool = False, deadline: float | None = None) -> None:
        """Wait for calls in flight and for both streams to drain, then free everything.

        Args:
            staging_in_use: Something may still use the staging (a worker thread abandoned
                at close): it is left allocated, and logged.
            deadline: When closing must be over (event-loop clock; default ``drain_timeout``
                from now): copies still waiting then are abandoned (see :meth:`close_by`).
                One still waiting to start has queued nothing: it does not keep the memory
                from being freed, and never starts (:class:`~kvpipe._errors.AbandonedAtClose`),
                whichever of it and close the event loop wakes first at the deadline.

        Cancellation: shielded, from asyncio's own (``Task.cancel``) too, which is raised
        once closed; bounded by ``deadline``. Memory the device may still use then is leaked
        rather than freed, and logged.
        """
        if self._closed:
            return
        self._closed = True
        if deadline is None:
            deadline = anyio.current_time() + self.options.drain_timeout
        self.close_by(deadline)
        deferred = DeferredCancel()
        with anyio.CancelScope(shield=True):
            await self._close(staging_in_use, deadline, deferred)
        deferred.raise_if_received()

    async def _close(self, staging_in_use: bool, deadline: float, deferred: DeferredCancel) -> None:
        """:meth:`aclose`'s work, each wait through ``deferred`` (asyncio's own cancel)."""
        await shielded(self._idle.wait, deadline, deferred)
        # Whether any still runs, not whether the wait was cut: a close whose deadline
        # has passed (the pipeline's requests took it all) finds an idle engine too. A call
        # still waiting to start (its wait ends at the same deadline, woken before or after
        # this) has queued nothing: it is not running, and from here it never starts.
        self._sealed = True
        self._scratch.stop()
        if self._queued:
            log.error("CUDA copies still running at the close deadline; leaking the memory")
            return
        drained = False

        async def drain() -> None:  # begun again (a new event recorded) after a cancel
            nonlocal drained
            drained = await self._drain(drain_by)

        drain_by = anyio.current_time() + self.options.drain_timeout
        await shielded(drain, deferred=deferred)
        if not drained:
            log.error("CUDA streams did not drain at close; leaking the engine's memory")
            return
        try:
            with self._driver.current():
                self._scratch.close()
                self._ledger.mem_free(self._table)
                for stream in self._streams.values():
                    self._driver.stream_destroy(stream)
                self._streams = {}
                self._events.close()
                self._driver.module_unload(self._module)
                if not staging_in_use:
                    self._ledger.pinned_free(self.staging)
        except DeviceError as exc:
            log.error("freeing CUDA resources at close failed: %s", str(exc))
        if staging_in_use:
            # Pinned memory lives as long as its context: keep both for the thread.
            log.error("staging may still be in use at close; leaving it allocated")
            return
        self._driver.close()

    def accounting(self) -> EngineAccounting:
        """What the engine holds now, exactly."""
        return EngineAccounting(
            staging_budget=self.staging.budget or 0,
            staging_requested=self.staging.allocated_bytes,  # equal: kvpipe never rounds
            staging_allocated=self.staging.allocated_bytes,
            pinned_bytes=self._ledger.pinned_bytes,
            pinned_allocations=len(self._ledger.pinned),
            device_bytes=self._ledger.device_bytes,
            device_allocations=len(self._ledger.device),
            streams=len(self._streams),
            events=self._events.live,
            scratch_buffers=self._scratch.allocated,
            scratch_in_use=self._scratch.in_use,
        )

    @property
    def chunk_blocks(self) -> int:
        """Blocks one scratch data buffer holds (staged paths work in chunks of this)."""
        return self._chunk_blocks

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the CUDA engine is closed")

    async def _copy(
        self,
        direction: Direction,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None,
        start_by: float | None = None,
    ) -> None:
        self._check_open()
        if after is not None and not isinstance(after, ProducerMark):
            raise TypeError(f"a CUDA copy must be ordered after a ProducerMark, not {after!r}")
        if plan.blocks == 0:
            await anyio.lowlevel.checkpoint()
            return
        if plan.blocks > self._scratch.max_blocks:
            raise ValueError(f"{plan.blocks} blocks exceed {self._scratch.max_blocks} per call")
        if after is not None:
            after.retain()
        # In flight from here, while it waits for scratch too: a call that gets its scratch
        # only after close began still queues work, which close must wait for.
        self._calls += 1
        self._idle = anyio.Event() if self._calls == 1 else self._idle
        try:
            scratch: Scratch | None = None
            try:
                # Until start_by, and the close deadline (close_by may set it meanwhile).
                limit = math.inf if start_by is None else start_by
                if self._abandon_at is not None:
                    limit = min(limit, self._abandon_at)
                scope = anyio.CancelScope(deadline=limit)
                self._starting.add(scope)
                try:
                    with scope:
                        if start_by is not None and after is not None:
                            # Queued, the copy would wait on the device for the producer's
                            # work, however late it ends, and its caller with it (shielded):
                            # first let that work complete, by start_by, with nothing
                            # queued yet.
                            await self._wait(after.event, starting=True)
                        # None once close decided (self._sealed).
                        scratch = await self._scratch.acquire()
                finally:
                    self._starting.discard(scope)
                if scratch is None:  # still waiting at its deadline (a cancelled wait takes none)
                    if start_by is not None and anyio.current_time() >= start_by:
                        raise NotStarted(
                            f"not started by {start_by:.3f}: the producer's work or a CUDA "
                            "scratch set still pending"
                        )
                    raise AbandonedAtClose(
                        "cuEventQuery", "", "abandoned at the close deadline before it started"
                    )
            except BaseException:
                if after is not None:
                    after.release()
                raise
            # No await since the scratch was taken: close has not decided yet.
            self._queued += 1
            try:
                with anyio.CancelScope(shield=True):
                    await self._execute(direction, plan, lease, scratch, after)
            finally:
                self._queued -= 1
        finally:
            self._calls -= 1
            if self._calls == 0:
                self._idle.set()

    async def _execute(
        self,
        direction: Direction,
        plan: CopyPlan,
        lease: StagingLease,
        scratch: Scratch,
        after: ProducerMark | None,
    ) -> None:
        stream = self._streams[direction]
        try:
            try:
                with self._driver.current():
                    if after is not None:
                        self._driver.stream_wait_event(stream, after.event)
                    path = self._enqueue(direction, plan, scratch, stream)
            finally:
                if after is not None:
                    after.release()
            await self._wait(scratch.done)
        except BaseException as exc:
            left = direction if isinstance(exc, AbandonedAtClose) else None
            await self._recover(stream, scratch, lease, left)
            raise
        self._scratch.release(scratch)
        self.paths[path] += 1

    def _enqueue(
        self, direction: Direction, plan: CopyPlan, scratch: Scratch, stream: int
    ) -> CopyPath:
        drv = self._driver
        pairs = plan_pairs(plan)
        n = len(pairs)
        slots = pairs[:, 1]
        mode = self.options.d2h if direction == "gather" else self.options.h2d
        consecutive = len(slot_runs(slots)) == 1
        path = choose_path(direction, mode, consecutive, self.staging.device_ptr is not None)
        mapped = path in (CopyPath.GATHER_MAPPED, CopyPath.SCATTER_MAPPED)
        scratch.pairs[:n] = pairs if mapped else dense_pairs(pairs, self._chunk_blocks)
        drv.memcpy_htod_async(
            scratch.pairs_dev, scratch.pairs_host.host_ptr, n * PAIR_NBYTES, stream
        )
        kernel = GATHER if direction == "gather" else SCATTER
        if mapped:
            assert self.staging.device_ptr is not None
            self._launch(kernel, scratch.pairs_dev, n, self.staging.device_ptr, stream)
        else:
            data = self._scratch.data(scratch)
            for first in range(0, n, self._chunk_blocks):
                count = min(self._chunk_blocks, n - first)
                pairs_at = scratch.pairs_dev + first * PAIR_NBYTES
                dmas = [self._dma(run, data) for run in slot_runs(slots[first : first + count])]
                if direction == "scatter":  # staging -> scratch, then the kernel
                    for device, host, nbytes in dmas:
                        drv.memcpy_htod_async(device, host, nbytes, stream)
                self._launch(kernel, pairs_at, count, data, stream)
                if direction == "gather":  # the kernel, then scratch -> staging
                    for device, host, nbytes in dmas:
                        drv.memcpy_dtoh_async(host, device, nbytes, stream)
        drv.event_record(scratch.done, stream)
        return path

    def _dma(self, run: SlotRun, data: int) -> tuple[int, int, int]:
        """(scratch address, staging address, bytes) of one run: whole slots, the last one
        only to the end of its payload (the trailer is the host's)."""
        nbytes = (run.length - 1) * self._stride + self._payload
        host = self.staging.host_ptr + run.slot_start * self._stride
        return data + run.index * self._stride, host, nbytes

    def _launch(self, kernel: str, pairs: int, count: int, staging: int, stream: int) -> None:
        shape = launch_shape(count, self._n_seg, self._max_seg)
        args = CopyArgs(
            self._table, self._n_seg, pairs, count, staging, self._stride, shape.chunk_bytes
        )
        self._driver.launch(
            self._functions[kernel], shape.grid, shape.block, stream, pack_args(args)
        )

    async def _wait(self, event: int, *, starting: bool = False) -> None:
        """Poll until ``event`` has completed: yielding, then backing off (never sleeping
        past the close deadline, if one is set).

        Args:
            starting: The wait of a call not started yet: it polls nothing once close
                decided (close may have freed the event and the context).

        Raises:
            AbandonedAtClose: The close deadline passed first (see :meth:`close_by`); a wait
                begun after it still spins first, so that an idle stream's event (which
                the device completes within microseconds) is seen completed. Or, a
                ``starting`` wait: close decided.
        """
        start = time.monotonic()
        delay = POLL_MIN
        while True:
            if starting and self._sealed:
                raise AbandonedAtClose(
                    "cuEventQuery", "", "abandoned at the close deadline before it started"
                )
            if self._done(event):
                return
            if time.monotonic() - start < SPIN_SECONDS:
                await anyio.lowlevel.checkpoint()
                continue
            if self._abandon_at is not None and anyio.current_time() >= self._abandon_at:
                raise AbandonedAtClose("cuEventQuery", "", "abandoned at the close deadline")
            sleep = delay
            if self._abandon_at is not None:  # wake at the close deadline, not past it
                sleep = max(0.0, min(sleep, self._abandon_at - anyio.current_time()))
            await anyio.sleep(sleep)
            delay = min(delay * 2, self.options.poll_max)

    def _done(self, event: int) -> bool:
        """Whether ``event`` has completed (one query, the engine's context current)."""
        with self._driver.current():
            return self._driver.event_query(event)

    async def _recover(
        self,
        stream: int,
        scratch: Scratch,
        lease: StagingLease,
        left: Direction | None = None,
    ) -> None:
        """Wait for the stream after a failure before reusing anything; if even that fails,
        retire the scratch and the lease's slots.

        The wait goes on through asyncio's own cancellation (``Task.cancel``), which is
        raised once the scratch is given back or retired: the device may still write both.

        Args:
            left: Not a failure: the close deadline ended the wait for this copy, a gather
                or a scatter, which may still run on the device. Logged as such (what it
                may still read or write), not as a failed copy.
        """
        deferred = DeferredCancel()
        try:
            with self._driver.current():
                self._driver.event_record(scratch.done, stream)
            drain_by = anyio.current_time() + self.options.drain_timeout
            if not await shielded(lambda: self._wait(scratch.done), drain_by, deferred):
                raise TimeoutError(f"not drained in {self.options.drain_timeout} s")
        except (DeviceError, TimeoutError) as exc:
            if left is None:
                log.error(
                    "CUDA stream did not drain after a failed copy (%s); retiring staging slots %s",
                    str(exc),
                    lease.slots,
                )
            else:
                log.error(
                    "a CUDA %s still running at the close deadline was abandoned; retiring "
                    "staging slots %s; it may still %s %r: do not free or reuse its memory "
                    "until the device is done",
                    left,
                    lease.slots,
                    "read" if left == "gather" else "write into",
                    self._cache,
                )
            lease.retain()  # never released: the slots are never handed out again
            self._scratch.quarantine(scratch)
        else:
            self._scratch.release(scratch)
        deferred.raise_if_received()

    async def _drain(self, deadline: float) -> bool:
        """Whether both streams completed their work by ``deadline``."""
        try:
            with anyio.fail_at(deadline):
                for stream in self._streams.values():
                    event = self._record(stream)
                    try:
                        await self._wait(event)
                    finally:
                        self._events.put(event)
        except (DeviceError, TimeoutError) as exc:
            log.error("draining CUDA streams at close failed: %s", str(exc))
            return False
        return True
