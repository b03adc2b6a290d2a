"""The host executor of copy plans: numpy copies between cache rows and staging slots.

These functions block (they copy megabytes); the swapper and reader run them in worker
threads. numpy releases the GIL while it copies, so the event loop keeps running.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ._blockformat import check_block, seal_and_digest, seal_block
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
) -> list[int] | None:
    """Write the trailer of every slot (its payload already gathered). With ``checksum``,
    also return each whole value's XXH3-64, from the same pass over the payload (for a store
    that keeps one per value: ``PutBatch.checksums``); else ``None``."""
    if not checksum:
        for slot, digest in zip(slots, digests, strict=True):
            seal_block(staging[slot], payload_nbytes, digest, False)
        return None
    return [
        seal_and_digest(staging[slot], payload_nbytes, digest, True)
        for slot, digest in zip(slots, digests, strict=True)
    ]


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
    the scatter for values that are not in staging (lent by an in-memory store).

    Values that lie at equal steps in one buffer (blocks a store kept from one put) are
    copied as one 2-D view per segment, as staging is; the others block by block.
    """
    blocks = np.asarray(cache_blocks, dtype=np.int64)
    for lo, hi, view in _value_runs(values):
        dst = blocks[lo:hi]
        if view is None:
            b = int(dst[0])
            for seg in segments:
                rows[seg.tensor][b] = values[lo][seg.offset : seg.offset + seg.nbytes]
        else:
            lo_b = int(dst[0])
            consecutive = int(dst[-1]) - lo_b == len(dst) - 1 and bool(np.all(np.diff(dst) == 1))
            where = slice(lo_b, lo_b + len(dst)) if consecutive else dst
            for seg in segments:
                rows[seg.tensor][where] = view[:, seg.offset : seg.offset + seg.nbytes]


def _value_runs(values: Sequence[Rows]) -> list[tuple[int, int, Rows | None]]:
    """Split ``values`` into runs ``[lo, hi)`` that lie at one stride inside one buffer,
    each with a 2-D view of it (``None`` for a run of one)."""
    out: list[tuple[int, int, Rows | None]] = []
    roots = [_owner(v) for v in values]
    n = len(values)
    # Each address once (``ndarray.ctypes`` costs ~1 µs), and only of values that share their
    # owner with a neighbour.
    addrs = [
        v.ctypes.data
        if r is not None and ((i + 1 < n and roots[i + 1] is r) or (i > 0 and roots[i - 1] is r))
        else 0
        for i, (v, r) in enumerate(zip(values, roots, strict=True))
    ]
    lo = 0
    while lo < n:
        first, root = values[lo], roots[lo]
        hi = lo + 1
        if root is not None and hi < n and roots[hi] is root:
            base = addrs[lo]
            stride = addrs[hi] - base
            start = root.ctypes.data
            end = start + root.nbytes
            while (
                hi < n
                and stride >= first.size
                and roots[hi] is root
                and values[hi].size == first.size
                and addrs[hi] == base + (hi - lo) * stride
                and start <= addrs[hi]
                and addrs[hi] + first.size <= end
            ):
                hi += 1
        if hi - lo > 1 and start <= base:
            # Every row lies inside the buffer they share: so does the view.
            view = np.lib.stride_tricks.as_strided(
                first, shape=(hi - lo, first.size), strides=(stride, 1), writeable=False
            )
            out.append((lo, hi, view))
        else:
            hi = lo + 1
            out.append((lo, hi, None))
        lo = hi
    return out


def _owner(value: Rows) -> Rows | None:
    """The array that owns ``value``'s memory (through views and memoryviews), if any."""
    obj: object = value
    while True:
        if isinstance(obj, np.ndarray):
            if obj.base is None:
                return obj if obj.flags.owndata else None
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return None


def verify_values(
    values: Sequence[Rows], payload_nbytes: int, digests: Sequence[bytes], verify: bool
) -> list[str | None]:
    """Check every value's trailer (and checksum); ``None`` for a sound block."""
    return [
        check_block(value, payload_nbytes, digest, verify)
        for value, digest in zip(values, digests, strict=True)
    ]
