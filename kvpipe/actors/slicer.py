"""The slicer: leases staging for each slice of a device cache's request, in order, and sends
it on: write slices to the swapper, read slices to the reader.

Staging is leased here, before any copy, so no copy waits for memory and the read and write
paths cannot deadlock on the pool. A request that has stopped gets no further slices.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream

from .._plan import SliceSpec
from ._base import Actor
from ._channels import SliceJob
from ._state import ReadState, WriteState

__all__ = ("Slicer",)


class Slicer(Actor[WriteState | ReadState]):
    """Cuts planned requests into staged slice jobs (see the module docstring)."""

    name = "slicer"

    async def handle(self, msg: WriteState | ReadState) -> None:
        outboxes = self.ctx.outboxes
        outbox: MemoryObjectSendStream[SliceJob]
        outbox = outboxes.swapper if isinstance(msg, WriteState) else outboxes.reader
        for spec in msg.slices:
            if isinstance(msg, WriteState):
                if msg.done:
                    return
            elif msg.stopped_before(spec.first_block):
                msg.resolve(spec.index, 0)
                continue
            if not await self._lease_and_send(msg, spec, outbox):
                detail = "deadline passed waiting for staging or a full queue"
                if isinstance(msg, WriteState):
                    msg.end("total_timeout", detail)  # no-op when it had already ended
                    return
                msg.time_out(spec, detail)

    async def _lease_and_send(
        self, msg: WriteState | ReadState, spec: SliceSpec, outbox: MemoryObjectSendStream[SliceJob]
    ) -> bool:
        """Lease the slice's staging and send it on; ``False`` when that could not be done by
        the deadline (or the request ended, or the pipeline is closing). Any wait is in a
        cancel scope that also ends when the request ends or (reads) loading stops before
        this slice."""
        lease = self.ctx.pool.try_acquire(spec.count)
        if lease is not None:
            sent = self.try_send(outbox, SliceJob(msg, spec, lease))
            if sent is not None:
                if not sent:
                    lease.release()
                # Let the receiver start on it first: slices reach the store in planned order.
                await anyio.lowlevel.checkpoint()
                return sent
        sent = False
        with msg.bound(msg.deadline, ("lease", spec.index), spec.first_block):
            if lease is None:
                lease = await self.ctx.pool.acquire(spec.count)
            try:
                sent = await self.send(outbox, SliceJob(msg, spec, lease))
            finally:
                if not sent:
                    lease.release()
        return sent
