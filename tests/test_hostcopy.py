"""Host copies: gather/scatter against a naive per-block, per-tensor reference for every
layout (odd sizes included), and sealing/verifying staging slots."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpipe
import kvpipe._blockformat as blockformat
from kvpipe import CacheLayout, create_kv_cache
from kvpipe._blockformat import TRAILER_NBYTES, value_nbytes
from kvpipe._hostcopy import (
    gather,
    gather_sealed,
    scatter,
    seal_slots,
    verify_slots,
)
from kvpipe._keys import key_digest
from kvpipe._plan import copy_plan, layout_segments
from tests.helpers import LAYOUTS, fill_random, needs_native_digests

CACHE_BLOCKS = 16
SLOTS = 16

HOST_LAYOUTS: dict[str, Callable[[], CacheLayout]] = {
    **LAYOUTS,
    # byte rows that are not multiples of 16 (or even of 4)
    "gqa_odd": lambda: CacheLayout.gqa(
        num_layers=2, num_kv_heads=1, head_dim=3, block_size=5, dtype="bfloat16"
    ),
    "gqa_fp8_odd": lambda: CacheLayout.gqa(
        num_layers=2, num_kv_heads=3, head_dim=3, block_size=5, fp8_scales=True
    ),
    "mla_odd": lambda: CacheLayout.mla(
        num_layers=3, kv_lora_rank=5, rope_dim=2, block_size=3, dtype="float8_e4m3fn"
    ),
    "dsa_odd": lambda: CacheLayout.dsa(
        num_layers=1, kv_lora_rank=7, rope_dim=3, index_head_dim=5, quant_block=2, block_size=3
    ),
}
NAMES = sorted(HOST_LAYOUTS)


def _stride(layout: CacheLayout) -> int:
    # deliberately odd: slots longer than a value, not aligned
    return value_nbytes(layout.block_nbytes) + 7


def _ref_gather(
    layout: CacheLayout,
    rows: list[np.ndarray],
    staging: np.ndarray,
    blocks: list[int],
    slots: list[int],
) -> None:
    """Naive reference: offsets recomputed from the layout, one block and tensor at a time."""
    for block, slot in zip(blocks, slots, strict=True):
        offset = 0
        for t, (role, _) in enumerate(layout.tensor_order()):
            n = layout.role(role).block_nbytes
            staging[slot, offset : offset + n] = rows[t][block]
            offset += n


def _ref_scatter(
    layout: CacheLayout,
    staging: np.ndarray,
    rows: list[np.ndarray],
    blocks: list[int],
    slots: list[int],
) -> None:
    for block, slot in zip(blocks, slots, strict=True):
        offset = 0
        for t, (role, _) in enumerate(layout.tensor_order()):
            n = layout.role(role).block_nbytes
            rows[t][block] = staging[slot, offset : offset + n]
            offset += n


def _ids(universe: int, n: int) -> st.SearchStrategy[list[int]]:
    """Distinct ids: random, consecutive, or sorted (mixed runs and gaps)."""
    return st.one_of(
        st.lists(st.integers(0, universe - 1), min_size=n, max_size=n, unique=True),
        st.integers(0, universe - n).map(lambda s: list(range(s, s + n))),
        st.lists(st.integers(0, universe - 1), min_size=n, max_size=n, unique=True).map(sorted),
    )


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    n = draw(st.integers(1, 12))
    return draw(_ids(CACHE_BLOCKS, n)), draw(_ids(SLOTS, n))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(pairs=_pairs(), seed=st.integers(0, 2**16))
def test_gather_matches_reference(name: str, pairs: tuple[list[int], list[int]], seed: int) -> None:
    layout = HOST_LAYOUTS[name]()
    blocks, slots = pairs
    cache = create_kv_cache(layout, CACHE_BLOCKS)
    fill_random(cache, seed)
    rows = list(cache.byte_rows)
    before = [r.copy() for r in rows]
    staging = np.full((SLOTS, _stride(layout)), 0xEE, dtype=np.uint8)
    expected = staging.copy()
    _ref_gather(layout, rows, expected, blocks, slots)
    gather(copy_plan(layout_segments(layout), blocks, slots), rows, staging)
    assert np.array_equal(staging, expected)  # also: nothing else in staging touched
    assert all(np.array_equal(a, b) for a, b in zip(rows, before, strict=True))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(pairs=_pairs(), seed=st.integers(0, 2**16))
def test_scatter_matches_reference(
    name: str, pairs: tuple[list[int], list[int]], seed: int
) -> None:
    layout = HOST_LAYOUTS[name]()
    blocks, slots = pairs
    rng = np.random.default_rng(seed)
    staging = rng.integers(0, 256, size=(SLOTS, _stride(layout)), dtype=np.uint8)
    staging_before = staging.copy()
    cache = create_kv_cache(layout, CACHE_BLOCKS)
    fill_random(cache, seed + 1)
    rows = list(cache.byte_rows)
    expected = [r.copy() for r in rows]
    _ref_scatter(layout, staging, expected, blocks, slots)
    scatter(copy_plan(layout_segments(layout), blocks, slots), staging, rows)
    for got, want in zip(rows, expected, strict=True):
        assert np.array_equal(got, want)  # also: blocks not named are untouched
    assert np.array_equal(staging, staging_before)


@pytest.mark.parametrize("name", NAMES)
def test_gather_scatter_round_trip_into_other_blocks(name: str) -> None:
    layout = HOST_LAYOUTS[name]()
    src = create_kv_cache(layout, CACHE_BLOCKS)
    fill_random(src, 3)
    dst = create_kv_cache(layout, CACHE_BLOCKS)
    src_blocks = [2, 3, 4, 9, 0, 15]
    dst_blocks = [7, 1, 2, 3, 14, 15]
    slots = [5, 6, 0, 1, 2, 10]
    segs = layout_segments(layout)
    staging = np.zeros((SLOTS, _stride(layout)), dtype=np.uint8)
    gather(copy_plan(segs, src_blocks, slots), list(src.byte_rows), staging)
    scatter(copy_plan(segs, dst_blocks, slots), staging, list(dst.byte_rows))
    for s_rows, d_rows in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(d_rows[dst_blocks], s_rows[src_blocks])
        untouched = sorted(set(range(CACHE_BLOCKS)) - set(dst_blocks))
        assert not d_rows[untouched].any()
    # tensors seen through their own dtype agree, too
    for role, layer in layout.tensor_order():
        a = src[role, layer].view(np.uint8)
        b = dst[role, layer].view(np.uint8)
        assert np.array_equal(a[src_blocks], b[dst_blocks])


def test_gather_into_paddle_cache_rows() -> None:
    layout = HOST_LAYOUTS["gqa_fp8_odd"]()
    src = create_kv_cache(layout, CACHE_BLOCKS, framework="paddle")
    fill_random(src, 9)
    dst = create_kv_cache(layout, CACHE_BLOCKS, framework="paddle")
    segs = layout_segments(layout)
    staging = np.zeros((4, _stride(layout)), dtype=np.uint8)
    gather(copy_plan(segs, [3, 8, 9], [0, 1, 2]), list(src.byte_rows), staging)
    scatter(copy_plan(segs, [0, 1, 5], [0, 1, 2]), staging, list(dst.byte_rows))
    for s, d in zip(src.tensors(), dst.tensors(), strict=True):
        sn = s.numpy().view(np.uint8)
        dn = d.numpy().view(np.uint8)
        assert np.array_equal(dn[[0, 1, 5]], sn[[3, 8, 9]])


# ---------------------------------------------------------------- seal / verify


def _sealed_staging(
    layout: CacheLayout, slots: list[int], checksum: bool = True
) -> tuple[np.ndarray, list[bytes]]:
    cache = create_kv_cache(layout, CACHE_BLOCKS)
    fill_random(cache, 11)
    blocks = list(range(len(slots)))
    digests = [key_digest(f"ns@0123456789abcdef@0-1@{i:032x}") for i in blocks]
    staging = np.zeros((SLOTS, _stride(layout)), dtype=np.uint8)
    plan = copy_plan(layout_segments(layout), blocks, slots)
    gather(plan, list(cache.byte_rows), staging)
    seal_slots(staging, slots, layout.block_nbytes, digests, checksum)
    return staging, digests


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=10, deadline=None)
@given(pairs=_pairs())
def test_gather_sealed_matches_a_gather_then_seal(
    name: str, checksum: bool, native: bool, pairs: tuple[list[int], list[int]]
) -> None:
    """One pass where the extension is built, a gather and a seal without it: the same
    slots, bytes and digests either way, for every layout."""
    if native:
        needs_native_digests()
    layout = HOST_LAYOUTS[name]()
    cache = create_kv_cache(layout, CACHE_BLOCKS)
    fill_random(cache, 3)
    blocks, slots = pairs
    digests = [key_digest(f"ns@0123456789abcdef@0-1@{b:032x}") for b in blocks]
    segments = layout_segments(layout)
    want = np.full((SLOTS, _stride(layout)), 0x5A, dtype=np.uint8)
    _ref_gather(layout, list(cache.byte_rows), want, blocks, slots)
    want_sums = seal_slots(want, slots, layout.block_nbytes, digests, checksum)
    got = np.full_like(want, 0x5A)
    saved = blockformat.native
    try:
        if not native:
            blockformat.native = None
        sums = gather_sealed(
            cache.row_groups(segments),
            got,
            slots,
            np.array(blocks, np.int64),
            layout.block_nbytes,
            digests,
            checksum,
        )
    finally:
        blockformat.native = saved
    assert sums == want_sums
    assert np.array_equal(got, want)


SEAL_SLOTS = [4, 0, 9, 10]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("verify", [True, False])
def test_seal_verify_round_trip(name: str, verify: bool) -> None:
    layout = HOST_LAYOUTS[name]()
    staging, digests = _sealed_staging(layout, SEAL_SLOTS)
    assert verify_slots(staging, SEAL_SLOTS, layout.block_nbytes, digests, verify) == [None] * 4


# (offset from payload end, expected message prefix); offset None = inside the payload
CORRUPTIONS = [
    (None, "checksum mismatch"),
    (0, "bad magic"),
    (3, "bad magic"),
    (4, "unknown format version"),
    (8, "payload length"),
    (15, "payload length"),
    (16, "value belongs to another key"),
    (31, "value belongs to another key"),
    (32, "checksum mismatch"),
]


@pytest.mark.parametrize("name", ["gqa_fp8", "dsa_odd", "gqa_odd"])
@pytest.mark.parametrize(("where", "message"), CORRUPTIONS)
@settings(max_examples=8, deadline=None)
@given(victim=st.integers(0, len(SEAL_SLOTS) - 1), pos=st.integers(0, 2**20), bit=st.integers(0, 7))
def test_one_flipped_byte_is_detected(
    name: str, where: int | None, message: str, victim: int, pos: int, bit: int
) -> None:
    layout = HOST_LAYOUTS[name]()
    payload = layout.block_nbytes
    staging, digests = _sealed_staging(layout, SEAL_SLOTS)
    offset = pos % payload if where is None else payload + where
    staging[SEAL_SLOTS[victim], offset] ^= 1 << bit
    result = verify_slots(staging, SEAL_SLOTS, payload, digests, True)
    for i, verdict in enumerate(result):
        if i == victim:
            assert verdict is not None and verdict.startswith(message)
        else:
            assert verdict is None


@settings(max_examples=30, deadline=None)
@given(victim=st.integers(0, len(SEAL_SLOTS) - 1), pos=st.integers(0, 2**20))
def test_payload_flip_not_detected_without_verify(victim: int, pos: int) -> None:
    layout = HOST_LAYOUTS["gqa_odd"]()
    payload = layout.block_nbytes
    staging, digests = _sealed_staging(layout, SEAL_SLOTS)
    staging[SEAL_SLOTS[victim], pos % payload] ^= 0xFF
    assert verify_slots(staging, SEAL_SLOTS, payload, digests, False) == [None] * 4
    assert verify_slots(staging, SEAL_SLOTS, payload, digests, True)[victim] == "checksum mismatch"


@pytest.mark.parametrize("verify", [True, False])
def test_key_mismatch_detected_with_or_without_verify(verify: bool) -> None:
    layout = HOST_LAYOUTS["mla_odd"]()
    staging, digests = _sealed_staging(layout, SEAL_SLOTS)
    swapped = [digests[1], digests[0], *digests[2:]]
    result = verify_slots(staging, SEAL_SLOTS, layout.block_nbytes, swapped, verify)
    assert result == ["value belongs to another key"] * 2 + [None, None]


def test_verify_reads_the_given_slots_only() -> None:
    layout = HOST_LAYOUTS["gqa_odd"]()
    staging, digests = _sealed_staging(layout, SEAL_SLOTS)
    # slot 1 was never sealed
    result = verify_slots(staging, [4, 1], layout.block_nbytes, digests[:2], True)
    assert result[0] is None
    assert result[1] == "bad magic"
    assert TRAILER_NBYTES == 48


def test_seal_slots_length_mismatch_raises() -> None:
    staging = np.zeros((2, 100), dtype=np.uint8)
    with pytest.raises(ValueError):
        seal_slots(staging, [0, 1], 10, [bytes(16)], True)


def test_scatter_values_matches_block_by_block_for_runs_and_strays() -> None:
    """Values lent from one buffer at a stride go as 2-D views, the others block by block;
    either way every block lands where a plain per-block copy puts it."""
    from kvpipe._hostcopy import scatter_values
    from kvpipe._plan import layout_segments

    layout = CacheLayout.gqa(
        num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16"
    )
    segments = layout_segments(layout)
    payload = layout.block_nbytes
    rng = np.random.default_rng(7)
    kept = rng.integers(0, 256, (5, payload + 112), dtype=np.uint8)  # one put's buffer
    values = [
        np.frombuffer(memoryview(kept[i, :payload]).toreadonly(), np.uint8) for i in (0, 1, 2)
    ]
    values.insert(1, rng.integers(0, 256, payload, dtype=np.uint8))  # a stray in between
    values += [np.frombuffer(memoryview(kept[i, :payload]).toreadonly(), np.uint8) for i in (3, 4)]
    blocks = np.array([9, 2, 5, 6, 0, 11])
    got = create_kv_cache(layout, 12)
    want = create_kv_cache(layout, 12)
    scatter_values(segments, values, blocks, got.byte_rows)
    for value, block in zip(values, blocks, strict=True):
        for seg in segments:
            want.byte_rows[seg.tensor][block] = value[seg.offset : seg.offset + seg.nbytes]
    for a, b in zip(got.byte_rows, want.byte_rows, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("native", [True, False])
def test_values_out_of_order_or_not_contiguous_go_block_by_block(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs are found by address alone (the C helper, or numpy without it): values of one
    buffer in reverse order, or one that is not contiguous, are not taken for a run, and
    every block still lands where a per-block copy puts it."""
    from kvpipe import _hostcopy
    from kvpipe._plan import layout_segments

    if not native:
        monkeypatch.setattr(_hostcopy, "_native", None)
    layout = CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)
    segments = layout_segments(layout)
    payload = layout.block_nbytes
    kept = np.random.default_rng(5).integers(0, 256, (4, 2 * payload), dtype=np.uint8)
    backwards = [kept[i, :payload] for i in (3, 2, 1)]
    strided = kept[0, : 2 * payload : 2]  # every other byte: one value, not contiguous
    values = [*backwards, strided, kept[1, :payload], kept[2, :payload]]
    assert _hostcopy._addresses(values)[3] == -1
    runs = [(lo, hi) for lo, hi, _view in _hostcopy._value_runs(values) if hi - lo > 1]
    assert runs == [(4, 6)]  # only the two values in order, one stride apart
    blocks = [7, 1, 4, 0, 2, 3]
    got = create_kv_cache(layout, 8)
    _hostcopy.scatter_values(segments, values, blocks, got.byte_rows)
    for value, block in zip(values, blocks, strict=True):
        for seg in segments:
            want = value[seg.offset : seg.offset + seg.nbytes]
            assert np.array_equal(got.byte_rows[seg.tensor][block], want)


def test_values_kept_in_a_stores_value_memory_go_as_one_view() -> None:
    """A store's value memory (``ValueMemory``) exports its buffer through a wrapper object,
    not an array that owns it: the values of one put are still found to lie at one stride
    in it and copied as one 2-D view (not block by block), and land where they belong."""
    from kvpipe._hostcopy import _value_runs, scatter_values
    from kvpipe._staging import ValueMemory

    layout = CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)
    segments = layout_segments(layout)
    payload = layout.block_nbytes
    lease = ValueMemory(1 << 20).lease(payload + TRAILER_NBYTES, 4)
    lease.pool.buffer[:] = np.random.default_rng(3).integers(0, 256, lease.pool.buffer.shape)
    values = [np.frombuffer(lease.view(i).data.toreadonly(), np.uint8)[:payload] for i in range(4)]
    assert [(lo, hi, view is not None) for lo, hi, view in _value_runs(values)] == [(0, 4, True)]
    cache = create_kv_cache(layout, 8)
    scatter_values(segments, values, [4, 5, 6, 7], cache.byte_rows)
    for value, block in zip(values, [4, 5, 6, 7], strict=True):
        for seg in segments:
            want = value[seg.offset : seg.offset + seg.nbytes]
            assert np.array_equal(cache.byte_rows[seg.tensor][block], want)


# ---------------------------------------------------------------- row groups


def test_row_groups_of_a_cache_in_one_buffer_copy_all_tensors_at_once() -> None:
    layout = HOST_LAYOUTS["gqa_odd"]()
    cache = create_kv_cache(layout, CACHE_BLOCKS)
    groups = cache.row_groups(layout_segments(layout)).groups
    assert [g.count for g in groups] == [len(layout.tensor_order())]
    # roles of other sizes (fp8 scales) split the groups, as their segments differ
    fp8 = HOST_LAYOUTS["gqa_fp8_odd"]()
    counts = [g.count for g in create_kv_cache(fp8, 4).row_groups(layout_segments(fp8)).groups]
    assert sum(counts) == len(fp8.tensor_order()) and len(counts) > 1


@pytest.mark.parametrize("order", ["descending", "scattered"])
def test_row_groups_follow_the_tensors_wherever_they_lie(order: str) -> None:
    """Tensors at one negative stride (one buffer, back to front) form one group; at uneven
    distances (0, 2, 6, 12 sizes in) a group ends where the step changes; both copy exactly
    as the per-tensor reference."""
    from kvpipe import KVCache
    from kvpipe._hostcopy import RowGroups
    from kvpipe._layout import numpy_dtype

    layout = HOST_LAYOUTS["gqa_odd"]()
    shapes = [(CACHE_BLOCKS, *layout.role(role).block_shape) for role, _ in layout.tensor_order()]
    dtype = numpy_dtype(layout.role("key").dtype)
    n = len(shapes)
    size = int(np.prod(shapes[0])) * dtype.itemsize
    if order == "descending":
        raw = np.zeros(size * n, np.uint8)
        tensors = [raw[(n - 1 - i) * size : (n - i) * size] for i in range(n)]
    else:
        raw = np.zeros(size * (n * n + n + 1), np.uint8)
        tensors = [raw[(i * i + i) * size : (i * i + i + 1) * size] for i in range(n)]
    arrays = [t.view(dtype).reshape(s) for t, s in zip(tensors, shapes, strict=True)]
    cache = KVCache.from_tensors(layout, arrays)
    fill_random(cache, 5)
    segs = layout_segments(layout)
    grouped = RowGroups(segs, cache.byte_rows)
    assert n == 4
    assert [g.count for g in grouped.groups] == ([4] if order == "descending" else [2, 2])
    blocks, slots = [3, 4, 5, 0, 9], [1, 2, 3, 7, 0]
    staging = np.zeros((SLOTS, _stride(layout)), dtype=np.uint8)
    expected = staging.copy()
    _ref_gather(layout, list(cache.byte_rows), expected, blocks, slots)
    gather(copy_plan(segs, blocks, slots), grouped, staging)
    assert np.array_equal(staging, expected)
    want = [r.copy() for r in cache.byte_rows]
    _ref_scatter(layout, staging, want, [8, 9, 10, 15, 1], slots)
    scatter(copy_plan(segs, [8, 9, 10, 15, 1], slots), staging, grouped)
    for got, w in zip(cache.byte_rows, want, strict=True):
        assert np.array_equal(got, w)


def test_a_freed_cache_has_no_row_groups() -> None:
    layout = HOST_LAYOUTS["gqa_odd"]()
    cache = create_kv_cache(layout, 4)
    segs = layout_segments(layout)
    assert cache.row_groups(segs) is cache.row_groups(segs)  # made once
    cache.free()
    with pytest.raises(kvpipe.LayoutError):
        cache.row_groups(segs)


def test_tensors_of_separate_buffers_are_never_one_view() -> None:
    """Rows of separate allocations that happen to lie at one step (here: views through
    memoryviews of one array, with staging between them) are not grouped into one view: its
    extent would take in the staging, and numpy's overlap handling then recursed until the
    stack ran out (a segfault in gather, seen in a full test run). The gather is exact."""
    from kvpipe._hostcopy import RowGroups, gather
    from kvpipe._plan import layout_segments

    layout = CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4)
    segments = layout_segments(layout)
    nbytes, blocks = segments[0].nbytes, 4
    stride = layout.block_nbytes + 64
    step = nbytes * blocks + 2 * stride  # each row, then room for the staging
    arena = np.random.default_rng(9).integers(0, 256, len(segments) * step, dtype=np.uint8)
    rows = [
        np.frombuffer(memoryview(arena[k * step : k * step + nbytes * blocks]), np.uint8).reshape(
            blocks, nbytes
        )
        for k in range(len(segments))
    ]
    groups = RowGroups(segments, rows).groups
    assert len(groups) == len(segments)  # one per separate buffer
    staging = arena[nbytes * blocks : nbytes * blocks + 2 * stride].reshape(2, stride)
    before = arena.copy()
    gather(copy_plan(segments, [3, 1], [0, 1]), rows, staging)
    for slot, block in enumerate([3, 1]):
        for seg in segments:
            want = before[seg.tensor * step + block * nbytes :][:nbytes]
            assert np.array_equal(staging[slot, seg.offset : seg.offset + nbytes], want)


# ---------------------------------------------------------------- check and scatter

BIG = CacheLayout.gqa(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16)  # 256 KiB


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("victim", [0, 2, 5, None])
def test_check_and_scatter_places_the_leading_sound_values_only(
    monkeypatch: pytest.MonkeyPatch, native: bool, staged: bool, victim: int | None
) -> None:
    """Values checked and copied one by one natively (payloads of 256 KiB), or checked
    together and copied with numpy: the same checks, the leading sound values in their
    blocks, and nothing of the first bad value or any after it."""
    import kvpipe._hostcopy as hostcopy

    needs_native_digests()
    payload = BIG.block_nbytes
    assert payload >= hostcopy.PLACE_EACH_FROM_NBYTES
    calls: list[int] = []
    real = hostcopy.place_if_sound

    def counted(*args: object, **kwargs: object) -> int | None:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hostcopy, "place_if_sound", counted)
    if not native:
        monkeypatch.setattr(hostcopy, "_native", None)
    slots = [0, 1, 2, 3, 4, 5]
    staging, digests = _sealed_staging(BIG, slots)
    if victim is not None:
        staging[slots[victim], 1000] ^= 1
    want = verify_slots(staging, slots, payload, digests, True)
    values = [staging[s, : value_nbytes(payload)] for s in slots]
    if not staged:
        values = [v.copy() for v in values]
    segments = layout_segments(BIG)
    cache = create_kv_cache(BIG, CACHE_BLOCKS)
    before = [r.copy() for r in cache.byte_rows]
    blocks = [9, 3, 4, 12, 0, 7]
    rows = hostcopy.RowGroups(segments, list(cache.byte_rows))
    got = hostcopy.check_and_scatter(
        segments, values, payload, digests, True, blocks, rows, (staging, slots) if staged else None
    )
    assert got == want
    sound = len(slots) if victim is None else victim
    for i, block in enumerate(blocks):
        for seg in segments:
            row = cache.byte_rows[seg.tensor][block]
            if i < sound:
                assert np.array_equal(row, values[i][seg.offset : seg.offset + seg.nbytes])
            else:
                assert np.array_equal(row, before[seg.tensor][block])
    assert len(calls) == (min(sound + 1, len(slots)) if native else 0)


def test_check_and_scatter_leaves_a_trailer_without_checksum_to_the_slow_way() -> None:
    """Values whose writer recorded no checksum: the extension does not decide them, numpy
    copies them all the same."""
    import kvpipe._hostcopy as hostcopy

    needs_native_digests()
    payload, slots = BIG.block_nbytes, [0, 1, 2]
    staging, digests = _sealed_staging(BIG, slots, checksum=False)
    segments = layout_segments(BIG)
    cache = create_kv_cache(BIG, CACHE_BLOCKS)
    rows = hostcopy.RowGroups(segments, list(cache.byte_rows))
    got = hostcopy.check_and_scatter(
        segments, [staging[s] for s in slots], payload, digests, True, [5, 6, 7], rows
    )
    assert got == [None] * 3
    for i, block in enumerate([5, 6, 7]):
        seg = segments[-1]
        want = staging[slots[i], seg.offset : seg.offset + seg.nbytes]
        assert np.array_equal(cache.byte_rows[seg.tensor][block], want)


def test_values_merge_into_one_view_only_within_one_buffer() -> None:
    """Values at equal address steps are scattered as one strided view only when they lie
    in one buffer: values of separate allocations that happen to be adjacent made a view
    spanning them (which can overlap other arrays: numpy's overlap handling then recursed
    to a segfault). Values lent by a store keep merging through their memoryviews."""
    import ctypes

    from kvpipe._hostcopy import _value_runs

    size = 64
    raw = np.arange(4 * size, dtype=np.uint8)
    one = [
        np.frombuffer(memoryview(raw[i * size : (i + 1) * size]).toreadonly(), np.uint8)
        for i in range(4)
    ]
    assert [(lo, hi) for lo, hi, _ in _value_runs(one)] == [(0, 4)]
    # Two exporters over adjacent halves of one allocation: two owners, at equal steps.
    halves = [(ctypes.c_ubyte * (2 * size)).from_buffer(raw, h * 2 * size) for h in range(2)]
    two = [
        np.frombuffer(memoryview(halves[i // 2]), np.uint8)[(i % 2) * size :][:size]
        for i in range(4)
    ]
    assert [v.ctypes.data for v in two] == [raw.ctypes.data + i * size for i in range(4)]
    runs = _value_runs(two)
    assert [(lo, hi) for lo, hi, _ in runs] == [(0, 2), (2, 4)]
    for lo, hi, view in runs:
        assert view is not None and np.array_equal(view.ravel(), raw[lo * size : hi * size])
