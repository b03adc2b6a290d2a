"""The pure side of the kernels: parameter packing, launch shapes, the 16-byte vector split,
pair and slot tables, path choice, and the reference implementations checked against the
host copy plan and a naive byte-by-byte reference for every layout and odd sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._hostcopy import gather as host_gather
from kvpipe._hostcopy import scatter as host_scatter
from kvpipe._plan import copy_plan, layout_segments
from kvpipe._staging import stride_for
from kvpipe.cuda._kernels import (
    CHUNK_BYTES,
    GATHER,
    MAX_GRID_Y,
    SCATTER,
    SEGMENT_NBYTES,
    THREADS,
    CopyArgs,
    CopyPath,
    choose_path,
    dense_pairs,
    launch_shape,
    pack_args,
    plan_pairs,
    reference_launch,
    segment_table,
    slot_runs,
    unpack_args,
)
from tests.cuda.devcache import ODD_LAYOUTS
from tests.cuda.memory import RegionMemory
from tests.helpers import LAYOUTS

ALL_LAYOUTS = {**LAYOUTS, **ODD_LAYOUTS}

# ---------------------------------------------------------------- packing


def test_pack_unpack_round_trip() -> None:
    args = CopyArgs(
        0xD000_0000_0000_1000, 7, 0xD000_0000_0020_0000, 9, 0xE000_0000_0000_0040, 704, 32
    )
    packed = pack_args(args)
    assert [len(p) for p in packed] == [8, 4, 8, 8, 8, 8, 8]
    assert unpack_args(packed) == args


def test_unpack_rejects_wrong_count_and_sizes() -> None:
    packed = list(pack_args(CopyArgs(1, 2, 3, 4, 5, 6, 16)))
    with pytest.raises(ValueError, match="expected 7"):
        unpack_args(packed[:-1])
    packed[1] = b"\0" * 8  # int given as 8 bytes
    with pytest.raises(ValueError, match="n_seg"):
        unpack_args(packed)


def test_segment_table_bytes() -> None:
    layout = ODD_LAYOUTS["gqa_fp8_odd"]()
    segs = layout_segments(layout)
    pointers = [0x1000 * (i + 1) for i in range(len(segs))]
    table = np.frombuffer(segment_table(pointers, segs), "<u8").reshape(-1, 3)
    assert table.shape == (len(segs), 3)
    assert len(segment_table(pointers, segs)) == len(segs) * SEGMENT_NBYTES
    assert list(table[:, 0]) == pointers
    assert list(table[:, 1]) == [s.offset for s in segs]
    assert list(table[:, 2]) == [s.nbytes for s in segs]
    with pytest.raises(ValueError):
        segment_table(pointers[:-1], segs)


# ---------------------------------------------------------------- launch shapes


@given(
    n_pairs=st.integers(1, 5000),
    n_seg=st.integers(1, 400),
    max_seg=st.integers(1, 1 << 34),
)
def test_launch_shape_covers_the_work(n_pairs: int, n_seg: int, max_seg: int) -> None:
    shape = launch_shape(n_pairs, n_seg, max_seg)
    x, y, z = shape.grid
    assert shape.block == (THREADS, 1, 1)
    assert x == n_pairs * n_seg and z == 1
    assert shape.chunk_bytes % 16 == 0
    assert (y - 1) * shape.chunk_bytes < max_seg <= y * shape.chunk_bytes
    assert 1 <= y <= MAX_GRID_Y
    if max_seg <= CHUNK_BYTES * MAX_GRID_Y:
        assert shape.chunk_bytes <= CHUNK_BYTES


@pytest.mark.parametrize(("pairs", "segs", "nbytes"), [(0, 1, 1), (1, 0, 1), (1, 1, 0)])
def test_launch_shape_rejects_empty(pairs: int, segs: int, nbytes: int) -> None:
    with pytest.raises(ValueError):
        launch_shape(pairs, segs, nbytes)


def test_launch_shape_rejects_grid_overflow() -> None:
    with pytest.raises(ValueError, match="grid limit"):
        launch_shape(2**30, 4, 16)


# ---------------------------------------------------------------- pair and slot tables


def test_plan_pairs_and_dense_pairs() -> None:
    layout = ODD_LAYOUTS["gqa_odd"]()
    plan = copy_plan(layout_segments(layout), [4, 5, 9, 0, 1], [2, 3, 4, 7, 8])
    pairs = plan_pairs(plan)
    assert pairs.tolist() == [[4, 2], [5, 3], [9, 4], [0, 7], [1, 8]]
    assert dense_pairs(pairs, 2)[:, 1].tolist() == [0, 1, 0, 1, 0]
    assert dense_pairs(pairs, 2)[:, 0].tolist() == [4, 5, 9, 0, 1]


@given(st.lists(st.integers(0, 50), min_size=0, max_size=30, unique=True))
def test_slot_runs_partition_the_slots(slots: list[int]) -> None:
    runs = slot_runs(slots)
    rebuilt: list[int] = []
    for r in runs:
        assert r.index == len(rebuilt)
        rebuilt.extend(range(r.slot_start, r.slot_start + r.length))
    assert rebuilt == slots
    for a, b in itertools.pairwise(runs):
        assert a.slot_start + a.length != b.slot_start  # maximal


@pytest.mark.parametrize(
    ("direction", "mode", "consecutive", "mapped", "path"),
    [
        ("gather", "auto", True, True, CopyPath.GATHER_MAPPED),
        ("gather", "auto", False, True, CopyPath.GATHER_STAGED),
        ("gather", "auto", True, False, CopyPath.GATHER_STAGED),
        ("gather", "mapped", False, True, CopyPath.GATHER_MAPPED),
        ("gather", "staged", True, True, CopyPath.GATHER_STAGED),
        ("scatter", "auto", True, True, CopyPath.SCATTER_MAPPED),
        ("scatter", "auto", True, False, CopyPath.SCATTER_STAGED),
        ("scatter", "auto", False, True, CopyPath.SCATTER_STAGED),
        ("scatter", "mapped", False, True, CopyPath.SCATTER_MAPPED),
        ("scatter", "mapped", True, False, CopyPath.SCATTER_STAGED),
    ],
)
def test_choose_path(
    direction: str, mode: str, consecutive: bool, mapped: bool, path: CopyPath
) -> None:
    assert choose_path(direction, mode, consecutive, mapped) is path  # type: ignore[arg-type]


# ---------------------------------------------------------------- reference implementations


def _naive_gather(layout: kvpipe.CacheLayout, tensors: list[bytes], blocks: list[int]) -> bytes:
    """Byte by byte, straight from the format's definition: every (layer, role) block of
    each cache block, in contract order."""
    out = bytearray()
    for b in blocks:
        for (role, _layer), data in zip(layout.tensor_order(), tensors, strict=True):
            n = layout.role(role).block_nbytes
            out += data[b * n : (b + 1) * n]
    return bytes(out)


def _setup(layout: kvpipe.CacheLayout, num_blocks: int, capacity: int, seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    mem = RegionMemory()
    rows = [
        rng.integers(0, 256, (num_blocks, layout.role(r).block_nbytes), dtype=np.uint8)
        for r, _ in layout.tensor_order()
    ]
    pointers = [mem.add(r.reshape(-1)) for r in rows]
    segs = layout_segments(layout)
    table = np.frombuffer(segment_table(pointers, segs), np.uint8).copy()
    stride = stride_for(value_nbytes(layout.block_nbytes))
    staging = rng.integers(0, 256, (capacity, stride), dtype=np.uint8)
    return mem, rows, segs, mem.add(table), staging, mem.add(staging.reshape(-1)), stride


def _launch(kernel, mem, table, segs, pairs, staging_addr, stride) -> None:  # type: ignore[no-untyped-def]
    shape = launch_shape(len(pairs), len(segs), max(s.nbytes for s in segs))
    pair_bytes = np.ascontiguousarray(pairs, dtype="<i8").view(np.uint8).reshape(-1).copy()
    args = CopyArgs(
        table, len(segs), mem.add(pair_bytes), len(pairs), staging_addr, stride, shape.chunk_bytes
    )
    reference_launch(kernel, args, shape.grid, shape.block, mem)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(ALL_LAYOUTS)),
    data=st.data(),
)
def test_reference_kernels_match_plan_and_naive(name: str, data: st.DataObject) -> None:
    layout = ALL_LAYOUTS[name]()
    num_blocks, capacity = 9, 12
    blocks = data.draw(
        st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=6, unique=True)
    )
    slots = data.draw(
        st.lists(
            st.integers(0, capacity - 1), min_size=len(blocks), max_size=len(blocks), unique=True
        )
    )
    mem, rows, segs, table, staging, staging_addr, stride = _setup(layout, num_blocks, capacity, 7)
    plan = copy_plan(segs, blocks, slots)
    pairs = plan_pairs(plan)

    expected = staging.copy()
    host_gather(plan, rows, expected)
    _launch(GATHER, mem, table, segs, pairs, staging_addr, stride)
    assert (staging == expected).all()  # every payload byte, and nothing else touched
    naive = _naive_gather(layout, [r.tobytes() for r in rows], [int(p[0]) for p in pairs])
    payload = layout.block_nbytes
    got = b"".join(staging[int(p[1]), :payload].tobytes() for p in pairs)
    assert got == naive

    # scatter the same slots into other blocks
    targets = [(b + 3) % num_blocks for b in blocks]
    plan2 = copy_plan(segs, targets, slots)
    expected_rows = [r.copy() for r in rows]
    host_scatter(plan2, staging, expected_rows)
    _launch(SCATTER, mem, table, segs, plan_pairs(plan2), staging_addr, stride)
    for got_rows, want in zip(rows, expected_rows, strict=True):
        assert (got_rows == want).all()


def test_reference_rejects_unknown_kernel() -> None:
    with pytest.raises(ValueError):
        reference_launch(
            "nope", CopyArgs(0, 1, 0, 1, 0, 64, 16), (1, 1, 1), (1, 1, 1), RegionMemory()
        )


def test_reference_checks_pointer_arithmetic() -> None:
    layout = ODD_LAYOUTS["gqa_odd"]()
    mem, _rows, segs, table, _staging, staging_addr, stride = _setup(layout, 4, 2, 0)
    pairs = np.array([[4, 0]], dtype=np.int64)  # block 4 of a 4-block cache: one past the end
    with pytest.raises(AssertionError, match="overrun"):
        _launch(GATHER, mem, table, segs, pairs, staging_addr, stride)
