"""The host executor of copy plans: numpy copies between cache rows and staging slots.

These functions block; the swapper and reader run them in worker threads. Each numpy copy
releases the GIL and takes it back, so :class:`RowGroups` finds the cache tensors that lie at
one stride from each other (one buffer, as :func:`~kvpipe.create_kv_cache` allocates) and
copies each run of blocks as one 3-D view per group: one GIL round trip per run, not per
segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import numpy.typing as npt

from ._blockformat import PLACED, check_blocks, gather_seal_blocks, place_if_sound, seal_blocks
from ._blockformat import native as _native
from ._plan import CopyPlan, CopySegment, copy_plan, leading

__all__ = (
    "PLACE_EACH_FROM_NBYTES",
    "RowGroup",
    "RowGroups",
    "check_and_scatter",
    "gather",
    "gather_sealed",
    "scatter",
    "scatter_values",
    "seal_slots",
    "verify_slots",
)

Rows = npt.NDArray[np.uint8]
_as_strided = np.lib.stride_tricks.as_strided


@final
@dataclass(frozen=True, slots=True)
class RowGroup:
    """Consecutive segments of a block value whose cache tensors lie at one stride.

    Attributes:
        offset: Byte offset of the first segment inside a block value.
        count: Segments in the group (each ``nbytes``, back to back in the value).
        nbytes: Bytes of each segment.
        rows: ``(count, num_blocks, nbytes)`` view over the group's cache tensors.
    """

    offset: int
    count: int
    nbytes: int
    rows: npt.NDArray[np.uint8]

    def of(self, values: Rows) -> Rows:
        """The group's bytes of ``(blocks, value bytes)`` values, as ``(count, blocks, nbytes)``."""
        cols = values[:, self.offset : self.offset + self.count * self.nbytes]
        view = _as_strided(
            cols, (len(values), self.count, self.nbytes), (values.strides[0], self.nbytes, 1)
        )
        return view.transpose(1, 0, 2)


@final
class RowGroups:
    """A cache's byte rows, grouped for copies (see the module docstring).

    Args:
        segments: The packing of a block value (:func:`~kvpipe._plan.layout_segments`).
        rows: The cache's byte rows, ``rows[segment.tensor]`` of shape ``(num_blocks,
            segment.nbytes)``, C-contiguous rows.
    """

    __slots__ = ("groups", "rows", "segments", "table")

    def __init__(self, segments: Sequence[CopySegment], rows: Sequence[Rows]) -> None:
        self.segments = tuple(segments)
        self.rows = tuple(rows)
        self.groups = _group(self.segments, self.rows)
        #: The segments as int64 triples (tensor, offset, bytes): a native copy's table.
        self.table = np.array(
            [(s.tensor, s.offset, s.nbytes) for s in self.segments], np.int64
        ).reshape(-1, 3)


def _group(segments: tuple[CopySegment, ...], rows: Sequence[Rows]) -> tuple[RowGroup, ...]:
    out: list[RowGroup] = []
    addrs = [int(rows[s.tensor].ctypes.data) for s in segments]
    # Only tensors of one buffer go in one view: a view spanning separate allocations can
    # overlap other arrays (staging), and numpy's overlap handling then recurses to a segfault.
    roots = [_root(rows[s.tensor]) for s in segments]
    i, n = 0, len(segments)
    while i < n:
        first, r = segments[i], rows[segments[i].tensor]
        j, step = i + 1, 0
        span = r.shape[0] * r.strides[0]  # tensors must not overlap
        while j < n:
            seg, q = segments[j], rows[segments[j].tensor]
            d = addrs[j] - addrs[j - 1]
            if (
                seg.nbytes != first.nbytes
                or seg.offset != first.offset + (j - i) * first.nbytes
                or q.shape != r.shape
                or q.strides != r.strides
                or abs(d) < span
                or (step and d != step)
                or roots[j] is not roots[i]
            ):
                break
            step = d
            j += 1
        view = _as_strided(r, (j - i, *r.shape), (step or span, *r.strides))
        out.append(RowGroup(first.offset, j - i, first.nbytes, view))
        i = j
    return tuple(out)


def _root(array: Rows) -> object:
    """The array (or buffer exporter) at the end of ``array``'s chain of bases."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array if array.base is None else array.base


def _groups(
    segments: Sequence[CopySegment], rows: Sequence[Rows] | RowGroups
) -> tuple[RowGroup, ...]:
    """The groups of ``rows`` for ``segments`` (made now unless ``rows`` has them)."""
    if isinstance(rows, RowGroups):
        if rows.segments is segments or rows.segments == tuple(segments):
            return rows.groups
        rows = rows.rows
    return _group(tuple(segments), rows)


def gather(plan: CopyPlan, rows: Sequence[Rows] | RowGroups, staging: Rows) -> None:
    """Copy cache blocks into staging slots per ``plan`` (cache → staging)."""
    groups = _groups(plan.segments, rows)
    for run in plan.runs:
        dst = staging[run.slot_start : run.slot_start + run.length]
        src_lo, src_hi = run.cache_start, run.cache_start + run.length
        for group in groups:
            group.of(dst)[...] = group.rows[:, src_lo:src_hi]


def scatter(plan: CopyPlan, staging: Rows, rows: Sequence[Rows] | RowGroups) -> None:
    """Copy staging slots into cache blocks per ``plan`` (staging → cache)."""
    groups = _groups(plan.segments, rows)
    for run in plan.runs:
        src = staging[run.slot_start : run.slot_start + run.length]
        dst_lo, dst_hi = run.cache_start, run.cache_start + run.length
        for group in groups:
            group.rows[:, dst_lo:dst_hi] = group.of(src)


def seal_slots(
    staging: Rows,
    slots: Sequence[int],
    payload_nbytes: int,
    digests: Sequence[bytes],
    checksum: bool,
) -> list[int] | None:
    """Write the trailer of every slot (payload already gathered); with ``checksum``, also
    return each whole value's XXH3-64 (``PutBatch.checksums``), else ``None``."""
    return seal_blocks([staging[slot] for slot in slots], payload_nbytes, digests, checksum)


def gather_sealed(
    rows: RowGroups,
    staging: Rows,
    slots: Sequence[int],
    blocks: npt.NDArray[np.int64],
    payload_nbytes: int,
    digests: Sequence[bytes],
    checksum: bool,
) -> list[int] | None:
    """Copy cache blocks ``blocks`` into staging ``slots`` and :func:`seal_slots` them: with
    ``checksum`` and the native extension in one pass (each piece hashed right after its
    copy: :func:`gather_seal_blocks`), else a :func:`gather`, then the seal."""
    if checksum:
        values = [staging[slot] for slot in slots]
        ids = np.ascontiguousarray(blocks, dtype=np.int64)
        sums = gather_seal_blocks(rows.rows, ids, rows.table, values, payload_nbytes, digests)
        if sums is not None:
            return sums
    gather(copy_plan(rows.segments, blocks, slots), rows, staging)
    return seal_slots(staging, slots, payload_nbytes, digests, checksum)


def verify_slots(
    staging: Rows, slots: Sequence[int], payload_nbytes: int, digests: Sequence[bytes], verify: bool
) -> list[str | None]:
    """Check every slot's trailer (and checksum); ``None`` for a sound block."""
    return check_blocks([staging[slot] for slot in slots], payload_nbytes, digests, verify)


#: Payloads of at least this many bytes are checked and copied value by value, one native
#: call each: a value is hashed and then copied while it is still in the processor's cache
#: (2 MiB values: 1.16x the speed of hashing a slice's values, then copying them). Smaller
#: ones are checked together and copied in as few numpy calls as their layout allows.
PLACE_EACH_FROM_NBYTES = 128 * 1024


def check_and_scatter(
    segments: tuple[CopySegment, ...],
    values: Sequence[Rows],
    payload_nbytes: int,
    digests: Sequence[bytes],
    verify: bool,
    cache_blocks: Sequence[int] | npt.NDArray[np.int64],
    rows: RowGroups,
    staged: tuple[Rows, Sequence[int]] | None = None,
) -> list[str | None]:
    """Check fetched ``values`` and copy the leading sound ones into cache blocks
    ``cache_blocks`` (one per value); a value is copied only once it has passed, and none
    after the first that fails.

    Args:
        segments: The packing of a block value.
        values: The fetched values, in block order.
        payload_nbytes: The payload size the layout expects.
        digests: The digest of each value's key.
        verify: Also compare each payload's checksum (:func:`~kvpipe._blockformat.check_blocks`).
        cache_blocks: The cache block of each value.
        rows: The cache's rows.
        staged: ``(staging, slots)`` where the values are staging's slots (their copies then
            follow the staging plan), ``None`` where they are values of a store's own.

    Returns:
        Each value's check, ``None`` for a sound one (as :func:`check_blocks`).
    """
    done = 0  # the leading values checked and copied natively, one call each
    each = _native is not None and payload_nbytes >= PLACE_EACH_FROM_NBYTES
    while each and done < len(values):
        try:
            verdict = place_if_sound(
                values[done],
                payload_nbytes,
                None,
                digests[done],
                verify,
                rows.rows,
                int(cache_blocks[done]),
                rows.table,
            )
        except (ValueError, IndexError, BufferError):  # rows or a value it does not take
            break
        if verdict != PLACED:  # the first that fails, or one it cannot decide: numpy's
            break
        done += 1
    rest = (
        check_blocks(values[done:], payload_nbytes, digests[done:], verify)
        if done < len(values)
        else []
    )
    checks: list[str | None] = [None] * done
    checks += rest
    k = done + leading(rest, None)
    if k > done:
        blocks = cache_blocks[done:k]
        if staged is None:
            scatter_values(segments, values[done:k], blocks, rows)
        else:
            staging, slots = staged
            scatter(copy_plan(segments, blocks, slots[done:k]), staging, rows)
    return checks


def scatter_values(
    segments: Sequence[CopySegment],
    values: Sequence[Rows],
    cache_blocks: Sequence[int] | npt.NDArray[np.int64],
    rows: Sequence[Rows] | RowGroups,
) -> None:
    """Copy ``values[i]`` into cache block ``cache_blocks[i]``: the scatter for values that
    are not in staging (lent by an in-memory store). Values at equal steps in one buffer are
    copied as one view per group, as staging is; the others block by block."""
    groups = _groups(segments, rows)
    blocks = np.asarray(cache_blocks, dtype=np.int64)
    for lo, hi, view in _value_runs(values):
        dst = blocks[lo:hi]
        if view is None:  # a value of its own: a run of one
            view = values[lo][None]
        lo_b, n = int(dst[0]), len(dst)
        consecutive = int(dst[-1]) - lo_b == n - 1 and (n < 3 or bool(np.all(np.diff(dst) == 1)))
        where = slice(lo_b, lo_b + len(dst)) if consecutive else dst
        for group in groups:
            group.rows[:, where] = group.of(view)


def _value_runs(values: Sequence[Rows]) -> list[tuple[int, int, Rows | None]]:
    """Split ``values`` into runs ``[lo, hi)`` at one stride, each with a 2-D view whose rows
    are exactly its values' memory (``None`` for a run of one; a contiguous copy for a value
    that is not contiguous)."""
    out: list[tuple[int, int, Rows | None]] = []
    addrs = _addresses(values)
    n = len(values)
    # Only values of one buffer go in one view (as for the cache's tensors, _group): values
    # of separate allocations that happen to lie at equal steps made a view spanning them,
    # which can overlap other arrays, and numpy's overlap handling then recursed to a
    # segfault (seen once in the pipeline's cancel sweep, scattering lent values).
    roots = [_buffer_root(v) for v in values] if n > 1 else []
    lo = 0
    while lo < n:
        first = values[lo]
        size, base, hi = first.size, addrs[lo], lo + 1
        stride = addrs[hi] - base if hi < n else 0
        if base >= 0 and stride >= size:  # contiguous rows that do not overlap
            while (
                hi < n
                and values[hi].size == size
                and addrs[hi] == base + (hi - lo) * stride
                and roots[hi] is roots[lo]
            ):
                hi += 1
        if hi - lo > 1:
            view = _as_strided(first, shape=(hi - lo, size), strides=(stride, 1), writeable=False)
            out.append((lo, hi, view))
        elif base < 0:  # copied whole first: the copies below take each row as contiguous
            out.append((lo, lo + 1, np.ascontiguousarray(first)[None]))
        else:
            out.append((lo, lo + 1, None))
        lo = hi
    return out


def _buffer_root(obj: object) -> object:
    """The object that owns ``obj``'s memory: the end of its chain of array bases and of
    the exporters of the memoryviews on the way (values lent by a store are arrays over
    memoryviews of its arrays)."""
    while True:
        if isinstance(obj, np.ndarray):
            if obj.base is None:
                return obj
            obj = obj.base
        elif isinstance(obj, memoryview):
            if obj.obj is None:
                return obj
            obj = obj.obj
        else:
            return obj


def _addresses(values: Sequence[Rows]) -> list[int]:
    """Each value's address, -1 for one that is not contiguous (in one call when built)."""
    if _native is not None:
        addrs: list[int] = _native.addresses(values)
        return addrs
    return [v.ctypes.data if v.flags.c_contiguous else -1 for v in values]
