"""The host executor of copy plans: numpy copies between cache rows and staging slots.

These functions block (they copy megabytes); the swapper and reader run them in worker
threads. numpy releases the GIL while it copies, so the event loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._blockformat import check_block, seal_block
from ._plan import CopyPlan, CopySegment

__all__ = (
    "gather",
    "scatter",
    "scatter_values",
    "seal_slots",
    "verify_slots",
    "verify_values",
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


def scatter_values(
    segments: Sequence[CopySegment],
    values: Sequence[Rows],
    cache_blocks: Sequence[int] | npt.NDArray[np.int64],
    rows: Sequence[Rows],
) -> None:
    """Copy each value's segments into its cache block (``values[i]`` → ``cache_blocks[i]``):
    the scatter for values that are not in staging (lent by an in-memory store)."""
    for value, block in zip(values, cache_blocks, strict=True):
        b = int(block)
        for seg in segments:
            rows[seg.tensor][b] = value[seg.offset : seg.offset + seg.nbytes]


def verify_values(
    values: Sequence[Rows], payload_nbytes: int, digests: Sequence[bytes], verify: bool
) -> list[str | None]:
    """Check every value's trailer (and checksum); ``None`` for a sound block."""
    return [
        check_block(value, payload_nbytes, digest, verify)
        for value, digest in zip(values, digests, strict=True)
    ]
