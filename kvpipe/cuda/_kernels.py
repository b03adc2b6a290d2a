"""The copy kernels of ``ext/kvpipe_copy.cu``, seen from Python: pure functions only.

Kernel names, parameter packing, table bytes, launch shapes, the choice of copy path, and a
numpy reference implementation of each kernel that the driver's test double runs on launch.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, Literal, Protocol, final

import numpy as np
import numpy.typing as npt

from .._plan import CopyPlan, CopySegment

__all__ = (
    "CHUNK_BYTES",
    "GATHER",
    "KERNELS",
    "PAIR_NBYTES",
    "SCATTER",
    "SEGMENT_NBYTES",
    "THREADS",
    "CopyArgs",
    "CopyPath",
    "LaunchShape",
    "Memory",
    "Mode",
    "SlotRun",
    "choose_path",
    "dense_pairs",
    "launch_shape",
    "pack_args",
    "plan_pairs",
    "reference_launch",
    "segment_table",
    "slot_runs",
    "unpack_args",
)

#: ``extern "C"`` kernel names in ``ext/kvpipe_copy.cu``.
GATHER: Final = "kvpipe_gather_blocks"
SCATTER: Final = "kvpipe_scatter_blocks"
KERNELS: Final = (GATHER, SCATTER)

#: Threads per CTA (matches ``__launch_bounds__(256)``).
THREADS: Final = 256
#: Bytes one CTA copies at most (a multiple of 16; 8 passes of 256 threads x 16 B).
CHUNK_BYTES: Final = 32 * 1024
#: Hardware limits of a launch.
MAX_GRID_X: Final = 2**31 - 1
MAX_GRID_Y: Final = 65535
#: Bytes of one ``KvSegment`` (three u64: base, offset, nbytes).
SEGMENT_NBYTES: Final = 24
#: Bytes of one (cache block, slot) pair (two int64).
PAIR_NBYTES: Final = 16

IntArray = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]

# Parameter order and struct codes of both kernels:
# (const KvSegment* segs, int n_seg, const long long* pairs, long long n_pairs,
#  unsigned char* staging, unsigned long long stride, unsigned long long chunk_bytes)
_PARAMS: Final = (
    ("segs", "<Q"),
    ("n_seg", "<i"),
    ("pairs", "<Q"),
    ("n_pairs", "<q"),
    ("staging", "<Q"),
    ("stride", "<Q"),
    ("chunk_bytes", "<Q"),
)


@final
@dataclass(frozen=True, slots=True)
class CopyArgs:
    """The arguments of one launch of either kernel (device addresses are ints)."""

    segs: int
    n_seg: int
    pairs: int
    n_pairs: int
    staging: int
    stride: int
    chunk_bytes: int


def pack_args(args: CopyArgs) -> tuple[bytes, ...]:
    """Each kernel parameter's bytes (``kernelParams[i]`` points at ``result[i]``)."""
    return tuple(struct.pack(code, getattr(args, name)) for name, code in _PARAMS)


def unpack_args(params: Sequence[bytes]) -> CopyArgs:
    """The inverse of :func:`pack_args`.

    Raises:
        ValueError: Wrong number of parameters or a parameter of the wrong size.
    """
    if len(params) != len(_PARAMS):
        raise ValueError(f"expected {len(_PARAMS)} kernel parameters, got {len(params)}")
    values = {}
    for (name, code), raw in zip(_PARAMS, params, strict=True):
        if len(raw) != struct.calcsize(code):
            raise ValueError(
                f"parameter {name}: {len(raw)} bytes, expected {struct.calcsize(code)}"
            )
        (values[name],) = struct.unpack(code, raw)
    return CopyArgs(**values)


def segment_table(pointers: Sequence[int], segments: Sequence[CopySegment]) -> bytes:
    """The pointer table: one ``KvSegment{base, offset, nbytes}`` per (layer, role).

    Raises:
        ValueError: ``pointers`` and ``segments`` disagree in length.
    """
    if len(pointers) != len(segments):
        raise ValueError(f"{len(pointers)} tensor pointers for {len(segments)} segments")
    return b"".join(
        struct.pack("<QQQ", ptr, seg.offset, seg.nbytes)
        for ptr, seg in zip(pointers, segments, strict=True)
    )


def plan_pairs(plan: CopyPlan) -> IntArray:
    """``[n, 2]`` int64: (cache block, staging slot) of every block of ``plan``, in order."""
    out = np.empty((plan.blocks, 2), dtype=np.int64)
    i = 0
    for run in plan.runs:
        out[i : i + run.length, 0] = np.arange(run.cache_start, run.cache_start + run.length)
        out[i : i + run.length, 1] = np.arange(run.slot_start, run.slot_start + run.length)
        i += run.length
    return out


def dense_pairs(pairs: IntArray, chunk_blocks: int) -> IntArray:
    """Pairs whose slot is the index inside a chunk of ``chunk_blocks`` (device scratch)."""
    out = pairs.copy()
    out[:, 1] = np.arange(len(pairs), dtype=np.int64) % chunk_blocks
    return out


@final
@dataclass(frozen=True, slots=True)
class SlotRun:
    """``length`` consecutive staging slots from ``slot_start`` ↔ scratch rows from ``index``."""

    index: int
    slot_start: int
    length: int


def slot_runs(slots: Sequence[int] | IntArray) -> tuple[SlotRun, ...]:
    """Maximal runs of consecutive staging slots (one DMA each)."""
    s = np.asarray(slots, dtype=np.int64)
    if len(s) == 0:
        return ()
    breaks = np.flatnonzero(np.diff(s) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(s)]))
    return tuple(SlotRun(int(a), int(s[a]), int(b - a)) for a, b in zip(starts, ends, strict=True))


@final
@dataclass(frozen=True, slots=True)
class LaunchShape:
    """Grid and CTA shape of one launch, and the bytes one CTA copies."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    chunk_bytes: int


def launch_shape(n_pairs: int, n_seg: int, max_seg_nbytes: int) -> LaunchShape:
    """Grid ``x = n_pairs * n_seg`` (block-major), ``y`` = chunks of the largest segment.

    Raises:
        ValueError: An empty launch, or one beyond the hardware's grid limits.
    """
    if n_pairs < 1 or n_seg < 1 or max_seg_nbytes < 1:
        raise ValueError(f"empty launch: {n_pairs} pairs, {n_seg} segments, {max_seg_nbytes} B")
    x = n_pairs * n_seg
    if x > MAX_GRID_X:
        raise ValueError(f"{n_pairs} blocks x {n_seg} segments exceed the grid limit")
    chunk = min(_ceil_div(max_seg_nbytes, 16) * 16, CHUNK_BYTES)
    if _ceil_div(max_seg_nbytes, chunk) > MAX_GRID_Y:
        chunk = _ceil_div(_ceil_div(max_seg_nbytes, MAX_GRID_Y), 16) * 16
    return LaunchShape((x, _ceil_div(max_seg_nbytes, chunk), 1), (THREADS, 1, 1), chunk)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class CopyPath(Enum):
    """How one call moves its blocks (see ``docs/cuda.md``)."""

    #: Gather kernel writes straight into mapped pinned staging (device → host fast path).
    GATHER_MAPPED = "gather_mapped"
    #: Gather kernel into device scratch, then one DMA per run of consecutive slots.
    GATHER_STAGED = "gather_staged"
    #: One DMA per run of consecutive slots into device scratch, then the scatter kernel
    #: (one DMA in all when the slots are consecutive: the host → device fast path).
    SCATTER_STAGED = "scatter_staged"
    #: Scatter kernel reads straight from mapped pinned staging.
    SCATTER_MAPPED = "scatter_mapped"


Mode = Literal["auto", "mapped", "staged"]


def choose_path(
    direction: Literal["gather", "scatter"], mode: Mode, consecutive: bool, mapped: bool
) -> CopyPath:
    """The path for one call.

    ``auto``: mapped pinned staging directly when the staging slots are consecutive (as fast,
    with fewer driver calls: ``docs/cuda.md``), else through device scratch. ``mapped`` /
    ``staged`` force a path; without mapped staging the staged path is used.
    """
    use_mapped = mapped and (mode == "mapped" or (mode == "auto" and consecutive))
    if direction == "gather":
        return CopyPath.GATHER_MAPPED if use_mapped else CopyPath.GATHER_STAGED
    return CopyPath.SCATTER_MAPPED if use_mapped else CopyPath.SCATTER_STAGED


class Memory(Protocol):
    """Device-visible memory as the reference kernels see it (a test double provides it)."""

    def read(self, address: int, nbytes: int) -> Bytes:
        """The ``nbytes`` bytes at ``address``; raises when they are not all allocated."""
        ...

    def write(self, address: int, data: Bytes) -> None:
        """Store ``data`` at ``address``; raises when the range is not all allocated."""
        ...


def reference_launch(
    kernel: str,
    args: CopyArgs,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    memory: Memory,
) -> None:
    """Run one launch of ``kernel`` the way the CUDA code does, CTA by CTA, on ``memory``.

    Every access goes through ``memory``, so a double that bounds-checks them checks the
    kernel's pointer arithmetic. A CTA's chunk is copied whole (its threads only split it).

    Raises:
        ValueError: Unknown kernel or an empty CTA.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}")
    if block[0] < 1:
        raise ValueError(f"empty CTA {block}")
    to_staging = kernel == GATHER
    if args.n_seg <= 0 or args.n_pairs <= 0:
        return
    table = memory.read(args.segs, args.n_seg * SEGMENT_NBYTES).view("<u8").reshape(-1, 3)
    pairs = memory.read(args.pairs, args.n_pairs * PAIR_NBYTES).view("<i8").reshape(-1, 2)
    for bx in range(grid[0]):
        pair, seg = divmod(bx, args.n_seg)
        if pair >= args.n_pairs:
            continue
        base, offset, nbytes = (int(v) for v in table[seg])
        cache_block, slot = (int(v) for v in pairs[pair])
        for by in range(grid[1]):
            lo = by * args.chunk_bytes
            if lo >= nbytes:
                continue
            n = min(args.chunk_bytes, nbytes - lo)
            cache = base + cache_block * nbytes + lo
            stage = args.staging + slot * args.stride + offset + lo
            src, dst = (cache, stage) if to_staging else (stage, cache)
            memory.write(dst, memory.read(src, n))
