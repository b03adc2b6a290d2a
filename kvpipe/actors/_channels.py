"""The pipeline's channels: one bounded inbox per actor, typed by what travels on it.

An inbox outlives a crashed actor, so its restart resumes on the same queue; closing the send
ends (:meth:`Outboxes.close`) lets every actor leave its loop once its inbox is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, final

import anyio
import numpy as np
import numpy.typing as npt
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._plan import SliceSpec
from .._staging import StagingLease

if TYPE_CHECKING:
    from ._state import ReadState, RequestState, WriteState

__all__ = ("Inboxes", "Outboxes", "SliceJob", "open_channels")

Rows = npt.NDArray[np.uint8]


@dataclass(eq=False, slots=True)
class SliceJob:
    """One slice of a request travelling between stages, with the staging it owns.

    Whoever holds a job owns its leases: it passes the job on or releases them.

    Attributes:
        state: The request.
        spec: Which blocks.
        lease: Staging slots, one per block, in order: what bounds the pipeline's memory.
        valid: Read path: leading blocks verified and to be scattered.
        data: Write path, for a store that keeps its values: memory of the job's own that
            the blocks are gathered into; ``lease``'s slots are then only counted.
        lent: Read path: values the store lent instead of copying them into staging, by
            block index within the slice.
        checksums: Write path: each sealed value's XXH3-64, for the put batch.
        taken: Set by the receiving actor in the step it takes the job from its inbox:
            a sender whose wait was cancelled in that same step learns the job is no
            longer its own (:meth:`~kvpipe.actors._base.Actor.send`).
        withdrawn: Its sender's wait for room was cancelled before any actor took it: the
            sender kept it (and lets go of it) — though the inbox may have moved it in all
            the same, when a receiver took the job ahead of it in that step — and an actor
            that receives it drops it untouched (:meth:`take`).
    """

    state: WriteState | ReadState
    spec: SliceSpec
    lease: StagingLease
    valid: int = 0
    data: StagingLease | None = None
    lent: dict[int, memoryview] | None = None
    checksums: list[int] | None = None
    taken: bool = False
    withdrawn: bool = False

    def take(self) -> bool:
        """The receiving actor takes the job (:attr:`taken`); ``False`` when its sender
        withdrew it: the sender owns it, and the receiver drops it untouched."""
        if self.withdrawn:
            return False
        self.taken = True
        return True

    @property
    def staging(self) -> StagingLease:
        """Where the job's bytes are: :attr:`data` when it has memory of its own."""
        return self.data if self.data is not None else self.lease

    def sources(self, lo: int, hi: int) -> list[Rows]:
        """The fetched values of blocks ``[lo, hi)`` of the slice: lent, or in staging."""
        lent = self.lent or {}
        out: list[Rows] = []
        for i in range(lo, hi):
            view = lent.get(i)
            out.append(np.frombuffer(view, np.uint8) if view is not None else self.lease.view(i))
        return out

    def release(self) -> None:
        """Let go of the staging (and of lent values)."""
        self.lent = None
        if self.data is not None:
            self.data.release()
            self.data = None
        self.lease.release()


@final
@dataclass(frozen=True, slots=True)
class Outboxes:
    """The sending ends, one per actor."""

    scheduler: MemoryObjectSendStream[RequestState]
    slicer: MemoryObjectSendStream[WriteState | ReadState]
    swapper: MemoryObjectSendStream[SliceJob]
    writer: MemoryObjectSendStream[WriteState | SliceJob]
    reader: MemoryObjectSendStream[ReadState | SliceJob]

    def close(self) -> None:
        """No new message: each actor leaves its loop once its inbox is empty."""
        for f in fields(self):
            getattr(self, f.name).close()


@final
@dataclass(frozen=True, slots=True)
class Inboxes:
    """The receiving ends, one per actor."""

    scheduler: MemoryObjectReceiveStream[RequestState]
    slicer: MemoryObjectReceiveStream[WriteState | ReadState]
    swapper: MemoryObjectReceiveStream[SliceJob]
    writer: MemoryObjectReceiveStream[WriteState | SliceJob]
    reader: MemoryObjectReceiveStream[ReadState | SliceJob]

    def by_name(self) -> dict[str, MemoryObjectReceiveStream[Any]]:
        """Each inbox under its actor's name (for statistics and draining)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def open_channels(depth: int) -> tuple[Outboxes, Inboxes]:
    """Five inboxes of ``depth`` messages each, and their sending ends."""
    ends = [anyio.create_memory_object_stream[Any](depth) for _ in fields(Outboxes)]
    return Outboxes(*(s for s, _ in ends)), Inboxes(*(r for _, r in ends))
