"""The backend writer: sends each gathered slice to the store, strictly in order.

A host cache's write comes to it whole, and it leases, gathers, seals and puts the request's
slices itself, large gathers up to ``copy_threads`` slices ahead of the put. A device cache's
slices come one by one from the swapper (possibly out of order), and each waits its turn.

Each put runs in its own cancel scope (``min(now + slice_timeout, request deadline)``). Only
the leading run of blocks the backend reports stored counts, and the first slice that stores
fewer than it carries, times out or fails ends the request. Blocks reported stored past a
failed one are left in place: keys are content-chained, so such a block holds the right bytes
for its key, while deleting it could remove one a concurrent writer has just stored.
"""

from __future__ import annotations

import logging
from collections import deque

import anyio
import anyio.abc

from .._clock import current_time
from .._errors import BackendError
from .._plan import SliceSpec
from .._results import SliceOutcome
from .._workers import INLINE_COPY_BYTES
from .._write_machine import put_outcome
from ..backends._base import BlockStatus, PutBatch
from ._base import Actor, block_statuses, task
from ._channels import SliceJob
from ._state import WriteState, describe_error

__all__ = ("Writer",)

log = logging.getLogger("kvpipe.writer")

#: A slice gathered in a task of its own on its way to the store: the job, and the event set
#: once its gather is done.
_Ahead = tuple[SliceJob, anyio.Event]


class Writer(Actor[WriteState | SliceJob]):
    """Writes slices (see the module docstring)."""

    name = "writer"

    async def handle(self, msg: WriteState | SliceJob) -> None:
        if isinstance(msg, WriteState):
            await self._run_request(msg)
            return
        try:
            await self._write(msg)
        finally:
            msg.release()

    async def _run_request(self, state: WriteState) -> None:
        """A host cache's write: each slice leased, gathered and sealed, then put, in order.
        Staging is never waited for while this request holds some: those slices are put
        first. Small gathers run on the event loop; larger ones in their own tasks."""
        ahead: deque[_Ahead] = deque()
        try:
            slices = state.slices
            if slices and slices[0].count * self.ctx.payload_nbytes > INLINE_COPY_BYTES:
                async with anyio.create_task_group() as tg:
                    await self._run_slices(state, ahead, tg)
            else:  # every slice is gathered inline (the first one is the largest)
                await self._run_slices(state, ahead, None)
        finally:
            for job, _ in ahead:
                job.release()

    async def _run_slices(
        self, state: WriteState, ahead: deque[_Ahead], tg: anyio.abc.TaskGroup | None
    ) -> None:
        """The loop of :meth:`_run_request`; large gathers start as tasks of ``tg``."""
        ctx = self.ctx
        for spec in state.slices:
            lease = ctx.pool.try_acquire(spec.count)
            while lease is None and ahead and not state.done:
                await self._put_first(ahead)
                lease = ctx.pool.try_acquire(spec.count)
            if lease is None and not state.done:
                lease = await self.lease(state, spec)
                if lease is None:  # a no-op if the write had ended
                    state.end("total_timeout", "deadline passed waiting for staging")
            if state.done:
                if lease is not None:
                    lease.release()
                break
            assert lease is not None
            job = SliceJob(state, spec, lease)
            if tg is not None and spec.count * ctx.payload_nbytes > INLINE_COPY_BYTES:
                gathered = anyio.Event()
                ahead.append((job, gathered))
                tg.start_soon(task, self._gather, job, gathered)
                if len(ahead) > ctx.config.copy_threads:
                    await self._put_first(ahead)
            else:
                try:  # the job's staging is let go whatever ends the wait for the puts ahead
                    while ahead:
                        await self._put_first(ahead)
                    if not state.done:  # a put ahead may have ended the write
                        await ctx.gather_and_seal(job)
                    if not state.done:
                        await self._write(job)
                finally:
                    job.release()
        while ahead:
            await self._put_first(ahead)

    async def _gather(self, job: SliceJob, gathered: anyio.Event) -> None:
        """Gather and seal a slice (not once its request has ended), then say so."""
        if not job.state.done:
            await self.ctx.gather_and_seal(job)
        gathered.set()

    async def _put_first(self, ahead: deque[_Ahead]) -> None:
        """Put the first slice of ``ahead`` once it is gathered (not once its request has
        ended), and let go of it."""
        job, gathered = ahead[0]
        try:
            await gathered.wait()
            if not job.state.done:
                await self._write(job)
        finally:
            ahead.popleft()
            job.release()

    async def _write(self, job: SliceJob) -> None:
        """Put one slice when its turn comes, and record its outcome."""
        ctx, spec, state = self.ctx, job.spec, job.state
        assert isinstance(state, WriteState)
        if not state.machine.is_turn(spec.index):
            with anyio.move_on_at(state.deadline):
                await state.wait_turn(spec.index)
            if not state.machine.is_turn(spec.index):
                # The write ended, or the deadline passed while an earlier slice was in
                # flight: that slice reports it. (A turn that came as the deadline passed
                # is this slice's to end, below.)
                return
        started = current_time()
        if started >= state.deadline:
            state.end("total_timeout", "deadline passed before the slice was sent")
            return
        deadline = min(started + ctx.config.slice_timeout, state.deadline)
        batch = ctx.staged_batch(job, PutBatch)
        statuses: list[BlockStatus] | None = None
        # The error's description, not the error: a local holding the exception would hold
        # this frame (and the job's staging) in a cycle through its traceback.
        error: str | None = None
        state.machine.sent(spec.index, started)
        try:
            with state.bound(deadline, job, spec.first_block):
                statuses = await block_statuses(ctx.backend, "put_blocks", batch, spec.count)
        except BackendError as exc:  # the store's own errors too, translated
            error = describe_error(exc)
        finally:
            if state.done:
                # Another task ended the write first. At the total deadline that recorded
                # this slice's outcome (``total_timeout``, nothing counted); it is counted
                # here, once, also when the writer is cancelled in the put (a close's
                # deadline, a crash in another of its tasks): else it is in the result only.
                cut_off = state.machine.cut_off
                if cut_off is not None and cut_off.index == spec.index:
                    self._count(state, spec, cut_off, "the write's deadline passed during the put")
        if state.done:
            return
        now = current_time()
        total = deadline >= state.deadline
        done, detail, strays = put_outcome(spec, now - started, statuses, error, total)
        self._count(state, spec, done, detail)
        state.slice_done(done, detail, now)
        if strays:
            ctx.metrics.counters["blocks_stored_past_a_failure"] += strays

    def _count(
        self, state: WriteState, spec: SliceSpec, done: SliceOutcome, detail: str | None
    ) -> None:
        """Count and report a slice's outcome (once per slice sent to the store)."""
        ctx = self.ctx
        ctx.observe("write_slice", done.elapsed, done.outcome)
        m = ctx.metrics
        m.slices[done.outcome] += 1
        m.counters["blocks_written"] += done.written
        m.counters["bytes_written"] += done.written * ctx.payload_nbytes
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "write %s slice %d (blocks %d-%d): %s, %d of %d written in %.4f s%s",
                state.request_id,
                spec.index,
                spec.first_block,
                spec.end_block - 1,
                done.outcome,
                done.written,
                spec.count,
                done.elapsed,
                f" ({detail})" if detail else "",
            )
