"""The backend writer: sends each gathered slice to the store, strictly in order.

Slices of a host cache come to it from the slicer and it gathers and seals them itself (in
parallel, up to the copy threads), then waits for each slice's turn; a device cache's come
gathered from the swapper.

Each slice runs in its own cancel scope with deadline ``min(now + slice_timeout, request
deadline)``. Only the leading run of blocks the backend reports stored counts. The first slice
that stores fewer blocks than it carries, times out or fails ends the request: no later slice
of it is sent. Blocks the backend reported stored after a failed one are never counted. They
are left in place: keys are content-chained, so such a block holds exactly the right bytes for
its key and simply cannot be reached until its predecessors are stored, while deleting it could
remove a block that a concurrent writer of the same prefix has just stored and counted.
"""

from __future__ import annotations

import logging

import anyio

from .._errors import BackendError
from .._plan import leading_run
from .._results import SliceOutcome, SliceStatus
from ..backends._base import BlockStatus, PutBatch
from ._base import Actor, SliceJob, backend_call, check_statuses
from ._state import RequestState, WriteState, describe_error

__all__ = ("Writer",)

log = logging.getLogger("kvpipe.writer")


class Writer(Actor[SliceJob]):
    """Writes slices (see the module docstring)."""

    name = "writer"

    @staticmethod
    def state_of(msg: SliceJob) -> RequestState:
        return msg.state

    async def handle(self, msg: SliceJob) -> None:
        try:
            if self.ctx.host_copies:  # a host cache's slices come straight from the slicer
                if msg.state.done:
                    return
                await self.ctx.gather_and_seal(msg)
            await self._write(msg)
        finally:
            msg.release()

    async def _write(self, job: SliceJob) -> None:
        ctx, spec, state = self.ctx, job.spec, job.state
        assert isinstance(state, WriteState)
        if not state.machine.is_turn(spec.index):
            with anyio.move_on_at(state.deadline) as waited:
                if not await state.wait_turn(spec.index):
                    return
            if waited.cancelled_caught:
                return
        if state.done:
            # The deadline passed while an earlier slice was still in flight: that slice's
            # own scope ends at the same deadline and reports the outcome. Just drop this one.
            return
        if anyio.current_time() >= state.deadline:
            state.end("total_timeout", "deadline passed before the slice was sent")
            return
        started = anyio.current_time()
        deadline = min(started + ctx.config.slice_timeout, state.deadline)
        batch = ctx.staged_batch(job, PutBatch)
        batch.checksums = job.checksums  # from the seal: the store need not hash again
        statuses: list[BlockStatus] | None = None
        # The error's description, not the error: a local holding the exception would hold
        # this frame (and the job's staging) in a cycle through its traceback.
        error: str | None = None
        with state.bound(deadline, ("put", spec.index), spec.first_block) as scope:
            try:
                raw = await backend_call(ctx.backend, "put_blocks", ctx.backend.put_blocks, batch)
                statuses = check_statuses(ctx.backend, "put_blocks", raw, spec.count)
            except BackendError as exc:
                error = describe_error(exc)
        if state.done:
            return
        elapsed = anyio.current_time() - started
        written = 0
        detail: str | None = None
        outcome: SliceStatus
        if scope.cancelled_caught or (statuses is None and error is None):
            outcome = "total_timeout" if deadline >= state.deadline else "slice_timeout"
            detail = f"slice {spec.index} ran out of time after {elapsed:.3f} s"
        elif error is not None:
            outcome = "backend_error"
            detail = error
        else:
            assert statuses is not None
            written = leading_run(s is BlockStatus.OK for s in statuses)
            outcome = "complete" if written == spec.count else "incomplete"
            if written < spec.count:
                detail = f"block {spec.first_block + written}: {statuses[written].value}"
        ctx.observe("write_slice", elapsed, outcome)
        self._account(
            state, spec.index, spec.first_block, spec.count, written, elapsed, outcome, detail
        )
        state.slice_done(
            SliceOutcome(spec.index, spec.first_block, spec.count, written, elapsed, outcome),
            detail,
        )
        if statuses is not None:
            strays = sum(s is BlockStatus.OK for s in statuses[written + 1 :])
            if strays:
                ctx.metrics.counters["blocks_stored_past_a_failure"] += strays

    def _account(
        self,
        state: WriteState,
        index: int,
        first: int,
        count: int,
        written: int,
        elapsed: float,
        outcome: str,
        detail: str | None,
    ) -> None:
        m = self.ctx.metrics
        m.slices[outcome] += 1
        m.counters["blocks_written"] += written
        m.counters["bytes_written"] += written * self.ctx.payload_nbytes
        # One line per slice, at DEBUG only: a write that stops short is reported once, at
        # WARNING, when it ends (WriteState), whatever stopped it.
        log.debug(
            "write %s slice %d (blocks %d-%d): %s, %d of %d written in %.4f s%s",
            state.request_id,
            index,
            first,
            first + count - 1,
            outcome,
            written,
            count,
            elapsed,
            f" ({detail})" if detail else "",
        )
