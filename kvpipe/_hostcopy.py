"""The host executor of copy plans: numpy copies between cache rows and staging slots.

These functions block (they copy megabytes); the swapper and reader run them in worker
threads. numpy releases the GIL while it copies, so the event loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._blockformat import check_block, seal_block
from ._plan import CopyPlan

__all__ = ("gather", "scatter", "seal_slots", "verify_slots")

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
