"""What calls return: write and read results, residency records, statistics snapshots."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, final

__all__ = (
    "ActorCrash",
    "BlockLocation",
    "Holder",
    "PipelineStatistics",
    "ReadResult",
    "ReadStopReason",
    "Residency",
    "ResidencyEntry",
    "SliceOutcome",
    "StopReason",
    "WriteResult",
)

#: Why a write stopped before its last block (``None``: it did not stop).
StopReason = Literal[
    "incomplete_slice",
    "slice_timeout",
    "total_timeout",
    "backend_error",
    "cancelled",
    "actor_crashed",
]

#: Why a read loaded fewer blocks than requested.
ReadStopReason = Literal[
    "not_stored",
    "failed_block",
    "slice_timeout",
    "total_timeout",
    "backend_error",
    "cancelled",
    "actor_crashed",
]

#: Outcome of one slice.
SliceStatus = Literal["complete", "incomplete", "slice_timeout", "total_timeout", "backend_error"]


@final
@dataclass(frozen=True, slots=True)
class SliceOutcome:
    """One slice of a write.

    Attributes:
        index: Slice number within the request, from 0.
        first_block: Sequence index of its first block.
        blocks: Blocks it carried.
        written: Leading blocks of it the backend stored (what counts).
        elapsed: Seconds from sending it to the backend to its outcome.
        outcome: ``"complete"``, ``"incomplete"``, ``"slice_timeout"``, ``"total_timeout"``,
            or ``"backend_error"``. A slice the write's deadline cut off in its store call
            is ``"total_timeout"`` with nothing written, whichever part of the pipeline
            reached the deadline first; one cut short by the caller's cancellation or an
            actor's crash is not recorded (the request had already ended).
    """

    index: int
    first_block: int
    blocks: int
    written: int
    elapsed: float
    outcome: SliceStatus


@final
@dataclass(frozen=True, slots=True)
class WriteResult:
    """The outcome of :meth:`Pipeline.write`.

    Invariant: blocks ``[start_block, start_block + skipped + written)`` are all stored and
    readable when this is returned.

    Attributes:
        request_id: The request's id (given or generated).
        requested: Blocks the call asked to write.
        skipped: Leading blocks found already stored and not rewritten.
        written: Blocks newly stored, contiguous right after the skipped ones.
        complete: ``skipped + written == requested``.
        stop_reason: Why it stopped early, or ``None``.
        slices: One :class:`SliceOutcome` per slice sent to the backend (but for one an
            actor's crash cut off in its store call: see :attr:`SliceOutcome.outcome`).
        elapsed: Seconds from the call to the result.
        error: A description of the error behind ``backend_error`` / ``actor_crashed``.
    """

    request_id: str
    requested: int
    skipped: int
    written: int
    complete: bool
    stop_reason: StopReason | None
    slices: tuple[SliceOutcome, ...]
    elapsed: float
    error: str | None = None


@final
@dataclass(frozen=True, slots=True)
class ReadResult:
    """The outcome of :meth:`Pipeline.read`.

    Attributes:
        request_id: The request's id.
        requested: Blocks the call asked to load.
        loaded: Leading blocks now in the cache, verified.
        complete: ``loaded == requested``.
        failed_blocks: Sequence indices of blocks kvpipe tried to load and could not
            (missing at read time, corrupt, failed, timed out), plus the first block found
            not stored; ascending.
        stop_reason: Why fewer blocks loaded, or ``None``.
        elapsed: Seconds from the call to the result.
        error: A description of the error behind ``backend_error`` / ``actor_crashed``.
    """

    request_id: str
    requested: int
    loaded: int
    complete: bool
    failed_blocks: tuple[int, ...]
    stop_reason: ReadStopReason | None
    elapsed: float
    error: str | None = None


class Residency(enum.Enum):
    """Where a node holds a block (flush-only index)."""

    GPU = "gpu"
    CPU = "cpu"
    EVICTED = "evicted"


@final
@dataclass(frozen=True, slots=True)
class ResidencyEntry:
    """One node's record for one block.

    Attributes:
        key: The block's storage key.
        node_id: The node that flushed the record.
        residency: Where that node holds the block.
        updated_at: Wall-clock time (``time.time()``) of the flush.
    """

    key: str
    node_id: str
    residency: Residency
    updated_at: float


@final
@dataclass(frozen=True, slots=True)
class Holder:
    """A node and where it holds a block."""

    node_id: str
    residency: Residency
    updated_at: float


@final
@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where one leading block of a prefix resides, per :meth:`Pipeline.locate`.

    Attributes:
        block: Sequence index of the block.
        key: Its storage key.
        holders: Every node with a record for it (``EVICTED`` records included).
    """

    block: int
    key: str
    holders: tuple[Holder, ...]

    def held_by(self, node_id: str) -> Residency | None:
        """This block's residency on ``node_id``, or ``None`` when it has no record."""
        return next((h.residency for h in self.holders if h.node_id == node_id), None)


@final
@dataclass(frozen=True, slots=True)
class ActorCrash:
    """One crash of an actor, as the supervisor handled it.

    Attributes:
        actor: The actor that crashed.
        at: Event-loop time of the crash.
        request_ids: The requests it held (each failed with ``actor_crashed``, or with
            ``PipelineClosed`` when the crash closed the pipeline).
        error: The exception, as text.
        restarted: Whether the actor was restarted (``False``: the pipeline closed).
    """

    actor: str
    at: float
    request_ids: tuple[str, ...]
    error: str
    restarted: bool


@final
@dataclass(frozen=True, slots=True)
class PipelineStatistics:
    """An immutable snapshot of a pipeline's state and counters.

    Attributes:
        open: Whether the pipeline accepts requests.
        device_path: ``"host"`` (numpy copies) or ``"cuda"``; ``device_note`` says why.
        device_note: Why this device path was chosen.
        in_flight: Requests accepted and not yet finished, by kind.
        queue_depths: Items waiting in each actor's inbox.
        queue_capacity: The bound of every inbox.
        restarts: Restarts per actor since open.
        slices: Slices by outcome.
        counters: Blocks and bytes written / skipped / read, probe errors, and so on.
        staging_capacity_bytes: Size of the staging pool.
        staging_in_use_bytes: Staging currently leased (including by abandoned threads).
        staging_waiters: Tasks waiting for staging.
        slice_blocks: Effective blocks per slice (``slice_block_num`` cut to the pool).
        backend: The backend's own statistics.
        threads_running: kvpipe's worker threads still running (including ones whose caller
            gave up); 0 after ``aclose`` unless a thread outlived the close timeout.
    """

    open: bool
    device_path: str
    device_note: str
    in_flight: Mapping[str, int]
    queue_depths: Mapping[str, int]
    queue_capacity: int
    restarts: Mapping[str, int]
    slices: Mapping[str, int]
    counters: Mapping[str, int]
    staging_capacity_bytes: int
    staging_in_use_bytes: int
    staging_waiters: int
    slice_blocks: int
    backend: Mapping[str, float] = field(default_factory=dict)
    threads_running: int = 0
