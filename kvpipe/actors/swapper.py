"""The swapper: copies between a device cache and staging.

Write path: gather a slice's blocks (all layers and roles) into its staging slots, seal each
with its trailer, and pass it to the writer. Read path: scatter the verified leading blocks of
a fetched slice into the caller's cache blocks. A host cache's slices pass it by, but for the
sound blocks before a failed one, which the reader leaves it to scatter.

Copies are the copy engine's, ordered after the producer's mark ``state.after``. A scatter is
shielded from cancellation, so when a read ends nothing is still writing into its cache; one
that has not started by the read's deadline (its job waited in the inbox, or the copy waited
for a copy thread, device scratch, or the model's work on the read's stream) never starts:
the read stops there as ``total_timeout``. A device copy whose wait the close deadline ended
(:class:`~kvpipe._errors.AbandonedAtClose`) is no crash: its request is left to the close,
which fails it (``PipelineClosed``) at that deadline. Any other copy failure
(:class:`~kvpipe.DeviceError`) is the swapper's crash: the request ends ``actor_crashed``.
"""

from __future__ import annotations

from .._clock import current_time
from .._errors import AbandonedAtClose
from .._hostcopy import scatter_values
from .._plan import copy_plan
from .._workers import NotStarted
from ._base import Actor, shielded_copy
from ._channels import SliceJob
from ._state import ReadState, WriteState

__all__ = ("Swapper",)


class Swapper(Actor[SliceJob]):
    """Gathers write slices and scatters read slices (see the module docstring)."""

    name = "swapper"

    async def handle(self, msg: SliceJob) -> None:
        owned = True
        try:
            if isinstance(msg.state, ReadState):
                await self._scatter(msg)
            else:
                owned = not await self._gather(msg)
        finally:
            if owned:
                msg.release()

    async def _gather(self, job: SliceJob) -> bool:
        """Gather and seal, then pass on; ``True`` when the writer took it."""
        ctx, state = self.ctx, job.state
        if state.done or not await ctx.gather_and_seal(job):
            return False
        sent = await self.send_until(ctx.outboxes.writer, job, state)
        if sent is None:  # the deadline passed (else the write had ended: then a no-op)
            assert isinstance(state, WriteState)
            state.end("total_timeout", "deadline passed waiting for the writer")
        return bool(sent)

    async def _scatter(self, job: SliceJob) -> None:
        ctx, spec = self.ctx, job.spec
        state = job.state
        assert isinstance(state, ReadState)
        first = spec.first_block
        valid = state.machine.loadable(first, job.valid)  # nothing past where loading stopped
        late = current_time() >= state.deadline
        if valid and late and not state.stopped_before(first):
            self._not_started(state, job)  # its job waited for the swapper until too late
            return
        if valid == 0 or not state.scatter_begin():
            state.resolve(spec.index, 0)
            return
        try:
            blocks = state.block_ids[first : first + valid]
            plan = copy_plan(ctx.segments, blocks, job.lease.slots[:valid])
            try:
                if job.lent:  # some values lent by the store: copied from where they lie
                    sources = job.sources(0, valid)
                    copy = ctx.run_copy(
                        plan.nbytes,
                        scatter_values,
                        ctx.segments,
                        sources,
                        blocks,
                        ctx.cache.row_groups(ctx.segments),
                        hold=job.lease,
                        start_by=state.deadline,
                        on_cache=True,
                    )
                else:
                    copy = ctx.engine.scatter(
                        plan, job.lease, after=state.after, start_by=state.deadline
                    )
                await shielded_copy(copy)
            except NotStarted:  # a copy thread, device scratch or the model's stream was busy
                self._not_started(state, job)
                return
            except AbandonedAtClose:  # still waiting at the close deadline: no crash
                return  # the close fails the read, as every request it cuts off
            state.resolve(spec.index, valid)
        finally:
            state.scatter_end()

    def _not_started(self, state: ReadState, job: SliceJob) -> None:
        """The slice's scatter did not start by the read's deadline: loading stops at the
        slice (``total_timeout``), which is resolved with nothing loaded. No slice outcome is
        counted: the reader counted the slice's fetch, its one count."""
        spec = job.spec
        detail = f"slice {spec.index}: deadline passed before its scatter started"
        everything = list(range(spec.first_block, spec.end_block))
        state.stop_at(spec.first_block, "total_timeout", everything, detail)
        state.resolve(spec.index, 0)
