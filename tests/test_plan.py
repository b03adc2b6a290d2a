"""Pure planning functions: slicing, leading runs, block runs, segments and copy plans."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._layout import CacheLayout
from kvpipe._plan import (
    BlockRun,
    CopySegment,
    SliceSpec,
    block_runs,
    copy_plan,
    layout_segments,
    leading_run,
    plan_slices,
)

# ---------------------------------------------------------------- plan_slices


def test_plan_slices_example() -> None:
    slices = plan_slices(2, 9, 3, 16, 9 * 16 - 5)
    assert slices == (
        SliceSpec(0, 2, 3, 5 * 16),
        SliceSpec(1, 5, 3, 8 * 16),
        SliceSpec(2, 8, 1, 9 * 16 - 5),
    )
    assert [s.end_block for s in slices] == [5, 8, 9]


def test_plan_slices_empty_range() -> None:
    assert plan_slices(4, 4, 3, 16, 100) == ()
    assert plan_slices(0, 0, 1, 16, 0) == ()


def test_plan_slices_single_slice_when_large() -> None:
    assert plan_slices(0, 4, 500, 16, 64) == (SliceSpec(0, 0, 4, 64),)


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_plan_slices_rejects_small_slice_blocks(bad: int) -> None:
    with pytest.raises(ValueError):
        plan_slices(0, 4, bad, 16, 64)


@pytest.mark.parametrize(("first", "end"), [(5, 4), (1, 0), (-1, 3)])
def test_plan_slices_rejects_bad_range(first: int, end: int) -> None:
    with pytest.raises(ValueError):
        plan_slices(first, end, 2, 16, 64)


@settings(max_examples=150, deadline=None)
@given(
    first=st.integers(0, 50),
    length=st.integers(0, 80),
    slice_blocks=st.integers(1, 20),
    block_size=st.integers(1, 32),
    tail=st.integers(0, 31),
)
def test_plan_slices_properties(
    first: int, length: int, slice_blocks: int, block_size: int, tail: int
) -> None:
    end = first + length
    tail = tail % block_size
    # tokens cover the range; the last block may be partial
    num_tokens = end * block_size - (tail if length else 0)
    slices = plan_slices(first, end, slice_blocks, block_size, num_tokens)
    assert len(slices) == -(-length // slice_blocks)
    pos = first
    for i, s in enumerate(slices):
        assert s.index == i
        assert s.first_block == pos
        assert 1 <= s.count <= slice_blocks
        assert s.end_block == s.first_block + s.count
        assert s.token_end == min((s.first_block + s.count) * block_size, num_tokens)
        pos = s.end_block
    assert pos == end
    # every slice but the last is full
    assert all(s.count == slice_blocks for s in slices[:-1])
    if slices:
        assert slices[-1].token_end == num_tokens


# ---------------------------------------------------------------- leading_run


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], 0),
        ([False], 0),
        ([True], 1),
        ([True, True, False, True], 2),
        ([False, True, True], 0),
        ([True] * 7, 7),
    ],
)
def test_leading_run(flags: list[bool], expected: int) -> None:
    assert leading_run(flags) == expected
    assert leading_run(iter(flags)) == expected


def test_leading_run_stops_consuming_at_first_false() -> None:
    consumed: list[int] = []

    def gen() -> object:
        for i, f in enumerate([True, False, True]):
            consumed.append(i)
            yield f

    assert leading_run(gen()) == 1  # type: ignore[arg-type]
    assert consumed == [0, 1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=30))
def test_leading_run_property(flags: list[bool]) -> None:
    n = leading_run(flags)
    assert all(flags[:n])
    assert n == len(flags) or not flags[n]


# ---------------------------------------------------------------- block_runs


def test_block_runs_example() -> None:
    runs = block_runs([3, 4, 5, 9, 10, 2], [0, 1, 2, 3, 4, 7])
    assert runs == (BlockRun(3, 0, 3), BlockRun(9, 3, 2), BlockRun(2, 7, 1))


def test_block_runs_break_when_either_side_jumps() -> None:
    assert block_runs([0, 1, 2], [0, 2, 3]) == (BlockRun(0, 0, 1), BlockRun(1, 2, 2))
    assert block_runs([0, 2, 3], [5, 6, 7]) == (BlockRun(0, 5, 1), BlockRun(2, 6, 2))
    # descending does not form a run
    assert block_runs([3, 2], [0, 1]) == (BlockRun(3, 0, 1), BlockRun(2, 1, 1))


def test_block_runs_empty_and_single() -> None:
    assert block_runs([], []) == ()
    assert block_runs([7], [3]) == (BlockRun(7, 3, 1),)


@pytest.mark.parametrize(("cache", "slots"), [([1, 2], [1]), ([[1, 2]], [[1, 2]]), ([1], [])])
def test_block_runs_rejects_bad_shapes(cache: object, slots: object) -> None:
    with pytest.raises(ValueError):
        block_runs(cache, slots)  # type: ignore[arg-type]


def _pairs() -> st.SearchStrategy[tuple[list[int], list[int]]]:
    def build(runs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
        c: list[int] = []
        s: list[int] = []
        for cstart, sstart, length in runs:
            c.extend(range(cstart, cstart + length))
            s.extend(range(sstart, sstart + length))
        return c, s

    runs = st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6)), max_size=8
    )
    return st.one_of(
        runs.map(build),
        st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30).map(
            lambda ps: ([p[0] for p in ps], [p[1] for p in ps])
        ),
        # past the plain-Python path's limit (64 pairs): numpy's
        st.lists(
            st.tuples(st.integers(0, 200), st.integers(0, 200), st.integers(1, 40)),
            min_size=3,
            max_size=8,
        ).map(build),
    )


@settings(max_examples=200, deadline=None)
@given(_pairs())
def test_block_runs_expand_back_to_pairs(pairs: tuple[list[int], list[int]]) -> None:
    cache, slots = pairs
    runs = block_runs(cache, slots)
    expanded = [(r.cache_start + k, r.slot_start + k) for r in runs for k in range(r.length)]
    assert expanded == list(zip(cache, slots, strict=True))
    assert all(r.length >= 1 for r in runs)
    # maximal: consecutive runs could not be merged
    for a, b in itertools.pairwise(runs):
        assert not (
            b.cache_start == a.cache_start + a.length and b.slot_start == a.slot_start + a.length
        )


# ---------------------------------------------------------------- layout_segments / copy_plan


def test_layout_segments_contiguous(any_layout: CacheLayout) -> None:
    segs = layout_segments(any_layout)
    assert len(segs) == len(any_layout.tensor_order())
    offset = 0
    for i, (seg, (role, layer)) in enumerate(zip(segs, any_layout.tensor_order(), strict=True)):
        assert seg.tensor == i
        assert (seg.role, seg.layer) == (role, layer)
        assert seg.offset == offset
        assert seg.nbytes == any_layout.role(role).block_nbytes
        offset += seg.nbytes
    assert offset == any_layout.block_nbytes


def test_layout_segments_fp8_example() -> None:
    layout = CacheLayout.gqa(
        num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, fp8_scales=True
    )
    assert layout_segments(layout) == (
        CopySegment(0, "key", 0, 0, 8),
        CopySegment(1, "value", 0, 8, 8),
        CopySegment(2, "key_scale", 0, 16, 4),
        CopySegment(3, "value_scale", 0, 20, 4),
        CopySegment(4, "key", 1, 24, 8),
        CopySegment(5, "value", 1, 32, 8),
        CopySegment(6, "key_scale", 1, 40, 4),
        CopySegment(7, "value_scale", 1, 44, 4),
    )


def test_copy_plan(any_layout: CacheLayout) -> None:
    segs = layout_segments(any_layout)
    plan = copy_plan(segs, [4, 5, 6, 1], [0, 1, 2, 3])
    assert plan.segments == segs
    assert plan.runs == (BlockRun(4, 0, 3), BlockRun(1, 3, 1))
    assert plan.payload_nbytes == any_layout.block_nbytes
    assert plan.blocks == 4
    assert plan.nbytes == 4 * any_layout.block_nbytes


def test_copy_plan_empty() -> None:
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    plan = copy_plan(layout_segments(layout), [], [])
    assert plan.runs == ()
    assert plan.blocks == 0
    assert plan.nbytes == 0
