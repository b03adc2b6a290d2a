"""The host executor of copy plans: numpy copies between cache rows and staging slots.

These functions block (they copy megabytes); the swapper and reader run them in worker
threads. numpy releases the GIL while it copies, so the event loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._blockformat import TRAILER_NBYTES, check_block, seal_block, seal_pieces
from ._plan import CopyPlan, CopySegment

__all__ = (
    "block_pieces",
    "gather",
    "piece_addresses",
    "scatter",
    "seal_pieces_into",
    "seal_slots",
    "verify_slots",
)

Rows = npt.NDArray[np.uint8]


def gather(plan: CopyPlan, rows: Sequence[Rows], staging: Rows) -> None:
    """Copy cache blocks into staging slots per ``plan`` (cache → staging)."""
    for run in plan.runs:
        dst = staging[run.slot_start : run.slot_start + run.length]
        src_lo, src_hi = run.cache_start, run.cache_start + run.length
        for seg in plan.segments:
            dst[:, seg.offset : seg.offset + seg.nbytes] = rows[seg.tensor][src_lo:src_hi]


def scatter(plan: CopyPlan, staging: Rows, rows: Sequence[Rows]) -> None:
    """Copy staging slots into cache blocks per ``plan`` (staging → cache)."""
    for run in plan.runs:
        src = staging[run.slot_start : run.slot_start + run.length]
        dst_lo, dst_hi = run.cache_start, run.cache_start + run.length
        for seg in plan.segments:
            rows[seg.tensor][dst_lo:dst_hi] = src[:, seg.offset : seg.offset + seg.nbytes]


def seal_slots(
    staging: Rows,
    slots: Sequence[int],
    payload_nbytes: int,
    digests: Sequence[bytes],
    checksum: bool,
) -> None:
    """Write the trailer of every slot (its payload already gathered)."""
    for slot, digest in zip(slots, digests, strict=True):
        seal_block(staging[slot], payload_nbytes, digest, checksum)


def verify_slots(
    staging: Rows, slots: Sequence[int], payload_nbytes: int, digests: Sequence[bytes], verify: bool
) -> list[str | None]:
    """Check every slot's trailer (and checksum); ``None`` for a sound block."""
    return [
        check_block(staging[slot], payload_nbytes, digest, verify)
        for slot, digest in zip(slots, digests, strict=True)
    ]


def block_pieces(
    segments: Sequence[CopySegment], rows: Sequence[Rows], block: int
) -> list[memoryview]:
    """The read-only pieces of one cache block's payload, in contract order, where they lie
    in the cache (no copy)."""
    return [rows[seg.tensor][block].data.toreadonly() for seg in segments]


def piece_addresses(
    segments: Sequence[CopySegment], rows: Sequence[Rows], blocks: Sequence[int]
) -> list[list[int]]:
    """The address of every piece :func:`block_pieces` gives, per block (arithmetic on each
    tensor's base address and row stride)."""
    bases = [(rows[seg.tensor].ctypes.data, rows[seg.tensor].strides[0]) for seg in segments]
    return [[base + int(b) * stride for base, stride in bases] for b in blocks]


def seal_pieces_into(
    pieces: Sequence[Sequence[memoryview]],
    staging: Rows,
    slots: Sequence[int],
    payload_nbytes: int,
    digests: Sequence[bytes],
    checksum: bool,
) -> None:
    """Seal blocks whose payloads stay in the cache: each trailer goes into its slot at
    ``payload_nbytes`` (where :func:`seal_slots` puts it)."""
    for block, slot, digest in zip(pieces, slots, digests, strict=True):
        trailer = staging[slot][payload_nbytes : payload_nbytes + TRAILER_NBYTES]
        seal_pieces(trailer, block, payload_nbytes, digest, checksum)
