"""The pipeline's channels: one bounded inbox per actor, typed by what travels on it.

Requests (:class:`~kvpipe.actors._state.RequestState`) go to the scheduler; a device cache's
planned writes and reads to the slicer; slice jobs (:class:`~kvpipe.actors._base.SliceJob`)
to the swapper, the writer and the reader; a host cache's planned writes and reads to the
writer and the reader whole. An inbox outlives a crashed actor, so its restart resumes on the
same queue; closing the send ends (:meth:`Outboxes.close`) lets every actor leave its loop
once its inbox is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

if TYPE_CHECKING:
    from ._base import SliceJob
    from ._state import ReadState, RequestState, WriteState

__all__ = ("Inboxes", "Outboxes", "open_channels")


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
