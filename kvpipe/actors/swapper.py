"""The swapper: copies between the caller's cache and staging.

Write path: gather a slice's blocks (all layers and roles) into its staging slots and seal
each with its trailer, then pass it to the writer.
Read path: scatter the verified leading blocks of a fetched slice into the caller's cache
blocks.

The copies themselves are the copy engine's (numpy on the host, kernels on a CUDA stream for
device caches, ordered after the producer's mark ``state.after``); sealing runs on the host
either way. A copy is never
abandoned half-way: the copy call is shielded from cancellation (it takes milliseconds), so
when a read ends nothing is still writing into the caller's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from .._hostcopy import scatter_values, seal_slots
from .._plan import copy_plan
from .._staging import private_lease
from ._base import Actor, SliceJob
from ._state import ReadState, RequestState, WriteState

__all__ = ("Swapper",)


class Swapper(Actor[SliceJob]):
    """Gathers write slices and scatters read slices (see the module docstring)."""

    name = "swapper"

    @staticmethod
    def state_of(msg: SliceJob) -> RequestState:
        return msg.state

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
        ctx, state, spec = self.ctx, job.state, job.spec
        if state.done:
            return False
        blocks = state.block_ids[spec.first_block : spec.end_block]
        if ctx.keep_values:
            job.data = private_lease(ctx.pool.slot_nbytes, spec.count)
        # Not shielded: a gather cut off by the actor's cancellation (a crash nearby, or a
        # close past its deadline) leaves its thread running with its own hold on the
        # staging, and the job is dropped, so no half-gathered slot is ever sent.
        await self._gather_and_seal(job, blocks, ctx.digests_of(state, spec))
        sent = await self.send_until(ctx.outboxes.writer, job, state.deadline)
        if sent is None:
            assert isinstance(state, WriteState)
            state.end("total_timeout", "deadline passed waiting for the writer")
        return bool(sent)

    async def _gather_and_seal(self, job: SliceJob, blocks: Any, digests: list[bytes]) -> None:
        ctx, state, staging = self.ctx, job.state, job.staging
        plan = copy_plan(ctx.segments, blocks, staging.slots)

        def seal() -> None:
            seal_slots(
                staging.pool.buffer,
                staging.slots,
                ctx.payload_nbytes,
                digests,
                ctx.config.verify_checksums,
            )

        async def on_host(fn: Callable[[], None]) -> None:
            nbytes = plan.nbytes if ctx.config.verify_checksums else 0
            await ctx.run_copy(nbytes, fn, hold=staging)

        await ctx.engine.gather_then(plan, staging, state.after, seal, on_host)
        ctx.metrics.counters["bytes_gathered"] += plan.nbytes

    async def _scatter(self, job: SliceJob) -> None:
        ctx, spec = self.ctx, job.spec
        state = job.state
        assert isinstance(state, ReadState)
        if job.valid == 0 or not state.scatter_begin():
            state.resolve(spec.index, 0)
            return
        try:
            first = spec.first_block
            blocks = state.block_ids[first : first + job.valid]
            plan = copy_plan(ctx.segments, blocks, job.lease.slots[: job.valid])
            with anyio.CancelScope(shield=True):
                if job.lent:  # some values lent by the store: copied from where they lie
                    sources = job.sources(0, job.valid)
                    await ctx.run_copy(
                        plan.nbytes,
                        scatter_values,
                        ctx.segments,
                        sources,
                        blocks,
                        ctx.cache.byte_rows,
                        hold=job.lease,
                    )
                else:
                    await ctx.engine.scatter(plan, job.lease, after=state.after)
            ctx.metrics.counters["blocks_read"] += job.valid
            ctx.metrics.counters["bytes_read"] += plan.nbytes
            state.resolve(spec.index, job.valid)
        finally:
            state.scatter_end()
