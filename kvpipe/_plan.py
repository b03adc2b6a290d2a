"""Pure decisions of the pipeline: slicing, copy plans, prefix counting.

Nothing here touches an event loop, a backend or memory; the actors call these functions and
the tests check them directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import final

import numpy as np
import numpy.typing as npt

from ._layout import CacheLayout

__all__ = (
    "BlockRun",
    "CopyPlan",
    "CopySegment",
    "SliceSpec",
    "block_runs",
    "copy_plan",
    "layout_segments",
    "leading",
    "leading_run",
    "plan_slices",
)

IntArray = npt.NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class SliceSpec:
    """One slice of a request: a contiguous range of sequence blocks.

    Attributes:
        index: Slice number within the request.
        first_block: Sequence index of its first block.
        count: Blocks in it.
        token_end: Length of the token prefix it carries,
            ``min((first_block + count) * block_size, len(tokens))``.
    """

    index: int
    first_block: int
    count: int
    token_end: int

    @property
    def end_block(self) -> int:
        """One past its last block."""
        return self.first_block + self.count


def plan_slices(
    first_block: int, end_block: int, slice_blocks: int, block_size: int, num_tokens: int
) -> tuple[SliceSpec, ...]:
    """Cut blocks ``[first_block, end_block)`` into slices of at most ``slice_blocks``.

    Raises:
        ValueError: ``slice_blocks < 1`` or the range is reversed.
    """
    if slice_blocks < 1:
        raise ValueError(f"slice_blocks must be >= 1, got {slice_blocks}")
    if first_block < 0 or end_block < first_block:
        raise ValueError(f"bad block range [{first_block}, {end_block})")
    out = []
    for index, start in enumerate(range(first_block, end_block, slice_blocks)):
        count = min(slice_blocks, end_block - start)
        out.append(SliceSpec(index, start, count, min((start + count) * block_size, num_tokens)))
    return tuple(out)


def leading_run(flags: Iterable[bool]) -> int:
    """How many leading items are true (stop at the first false)."""
    return sum(1 for _ in itertools.takewhile(bool, flags))


def leading(items: Sequence[object], value: object) -> int:
    """How many leading ``items`` are ``value`` (stop at the first other): one C call in the
    common case, where all are (a clean slice's statuses or checks)."""
    n = len(items)
    if items.count(value) == n:
        return n
    return next(i for i, item in enumerate(items) if item != value)


@final
@dataclass(frozen=True, slots=True)
class CopySegment:
    """Where one tensor's block lands inside a stored block value.

    Attributes:
        tensor: Index of the tensor in contract order.
        role: Its role.
        layer: Its layer.
        offset: Byte offset inside the block value.
        nbytes: Bytes of one block of this tensor.
    """

    tensor: int
    role: str
    layer: int
    offset: int
    nbytes: int


def layout_segments(layout: CacheLayout) -> tuple[CopySegment, ...]:
    """The packing of one block value: every tensor's block, in contract order, back to back."""
    segments = []
    offset = 0
    for index, (role, layer) in enumerate(layout.tensor_order()):
        nbytes = layout.role(role).block_nbytes
        segments.append(CopySegment(index, role, layer, offset, nbytes))
        offset += nbytes
    return tuple(segments)


@final
@dataclass(frozen=True, slots=True)
class BlockRun:
    """``length`` cache blocks from ``cache_start`` pair with staging slots from ``slot_start``."""

    cache_start: int
    slot_start: int
    length: int


#: Up to this many blocks, runs are found in plain Python (numpy's fixed cost per call is
#: larger for a slice of a few blocks).
_SMALL_RUNS = 64


def block_runs(
    cache_blocks: Sequence[int] | IntArray, slots: Sequence[int] | IntArray
) -> tuple[BlockRun, ...]:
    """Compress (cache block, staging slot) pairs into runs where both step by one."""
    if len(cache_blocks) <= _SMALL_RUNS and len(slots) == len(cache_blocks):
        c = cache_blocks.tolist() if isinstance(cache_blocks, np.ndarray) else list(cache_blocks)
        s = slots.tolist() if isinstance(slots, np.ndarray) else list(slots)
        if all(type(x) is int for x in c) and all(type(x) is int for x in s):
            runs: list[BlockRun] = []
            a = 0
            for i in range(1, len(c) + 1):
                if i == len(c) or c[i] != c[i - 1] + 1 or s[i] != s[i - 1] + 1:
                    runs.append(BlockRun(c[a], s[a], i - a))
                    a = i
            return tuple(runs)
    c_arr = np.asarray(cache_blocks, dtype=np.int64)
    s_arr = np.asarray(slots, dtype=np.int64)
    if c_arr.shape != s_arr.shape or c_arr.ndim != 1:
        raise ValueError("cache_blocks and slots must be 1-D and of equal length")
    if len(c_arr) == 0:
        return ()
    breaks = np.flatnonzero((np.diff(c_arr) != 1) | (np.diff(s_arr) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(c_arr)]))
    return tuple(
        BlockRun(int(c_arr[a]), int(s_arr[a]), int(b - a))
        for a, b in zip(starts, ends, strict=True)
    )


@final
@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Exactly which bytes move between a cache and staging for one slice.

    For every run and every segment: cache tensor ``segment.tensor`` rows
    ``[run.cache_start, +run.length)`` ↔ staging slots ``[run.slot_start, +run.length)``,
    bytes ``[segment.offset, +segment.nbytes)`` of each slot.
    """

    segments: tuple[CopySegment, ...]
    runs: tuple[BlockRun, ...]
    payload_nbytes: int
    #: Blocks the plan moves.
    blocks: int = field(init=False)
    #: Payload bytes the plan moves.
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        blocks = sum(r.length for r in self.runs)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "nbytes", blocks * self.payload_nbytes)


def copy_plan(
    segments: tuple[CopySegment, ...],
    cache_blocks: Sequence[int] | IntArray,
    slots: Sequence[int] | IntArray,
) -> CopyPlan:
    """The plan that moves ``cache_blocks[i]`` ↔ staging slot ``slots[i]`` for every i."""
    payload = sum(s.nbytes for s in segments)
    return CopyPlan(segments, block_runs(cache_blocks, slots), payload)
