"""The CUDA C++ itself, run on the CPU: ``ext/kvpipe_copy.cu`` built as host C++ with
``-DKVPIPE_HOST_EMULATION`` (every CTA and thread in turn; a CTA's threads share nothing, so
sequential execution is exact). This checks the kernel's own byte arithmetic — head, aligned
vector body, tail — for odd sizes and every alignment, and counts vector accesses that would
be misaligned on a GPU. It does not check anything about the GPU (memory model, speed)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._blockformat import value_nbytes
from kvpipe._hostcopy import gather as host_gather
from kvpipe._hostcopy import scatter as host_scatter
from kvpipe._plan import copy_plan, layout_segments
from kvpipe._staging import stride_for
from kvpipe.cuda._kernels import THREADS, launch_shape, plan_pairs, segment_table
from kvpipe.cuda._nvrtc import ext_dir
from tests.cuda.devcache import ODD_LAYOUTS
from tests.helpers import LAYOUTS

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++) to emulate with")


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    assert CXX is not None
    out = tmp_path_factory.mktemp("emu") / "kvpipe_copy_emu.so"
    src = ext_dir() / "kvpipe_copy.cu"
    subprocess.run(
        [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fno-strict-aliasing",
         "-x", "c++", "-DKVPIPE_HOST_EMULATION", "-shared", "-fPIC", str(src), "-o", str(out)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    lib = ctypes.CDLL(str(out))
    u64, vp = ctypes.c_ulonglong, ctypes.c_void_p
    lib.kvpipe_emulate.restype = u64
    lib.kvpipe_emulate.argtypes = (
        ctypes.c_int, vp, ctypes.c_int, vp, ctypes.c_longlong, vp, u64, u64, u64, u64,
        ctypes.c_uint,
    )  # fmt: skip
    return lib


def _ptr(a: np.ndarray) -> int:  # type: ignore[type-arg]
    return int(a.ctypes.data)


def _run(lib: ctypes.CDLL, gather: bool, table: np.ndarray, pairs: np.ndarray,  # type: ignore[type-arg]
         staging_addr: int, stride: int, max_seg: int, threads: int = THREADS) -> int:  # fmt: skip
    n_seg = len(table) // 24
    shape = launch_shape(len(pairs), n_seg, max_seg)
    return int(
        lib.kvpipe_emulate(
            int(gather),
            _ptr(table),
            n_seg,
            _ptr(pairs),
            len(pairs),
            staging_addr,
            stride,
            shape.chunk_bytes,
            shape.grid[0],
            shape.grid[1],
            threads,
        )
    )


@settings(max_examples=150, deadline=None)
@given(
    nbytes=st.integers(1, 3000),
    src_off=st.integers(0, 31),
    dst_off=st.integers(0, 31),
    threads=st.sampled_from([1, 7, 32, 256]),
)
def test_one_segment_any_size_any_alignment(
    emu: ctypes.CDLL, nbytes: int, src_off: int, dst_off: int, threads: int
) -> None:
    """One block of one segment, at arbitrary offsets of 16-byte-aligned buffers: every byte
    copied, nothing outside touched, no misaligned vector access."""
    rng = np.random.default_rng(nbytes)
    cache = np.zeros(nbytes + 64, np.uint8)
    base = 16 - _ptr(cache) % 16 + src_off
    cache[base : base + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    stage = np.full(nbytes + 128, 0xAB, np.uint8)
    soff = 16 - _ptr(stage) % 16 + dst_off
    table = np.frombuffer(segment_table([_ptr(cache) + base], [_seg(nbytes)]), np.uint8).copy()
    pairs = np.array([[0, 0]], dtype=np.int64)
    before = stage.copy()
    misaligned = _run(emu, True, table, pairs, _ptr(stage) + soff, nbytes, nbytes, threads)
    assert misaligned == 0
    assert stage[soff : soff + nbytes].tobytes() == cache[base : base + nbytes].tobytes()
    assert (stage[:soff] == before[:soff]).all() and (stage[soff + nbytes :] == 0xAB).all()


def _seg(nbytes: int) -> object:
    from kvpipe._plan import CopySegment

    return CopySegment(0, "key", 0, 0, nbytes)


@pytest.mark.parametrize("name", sorted({**LAYOUTS, **ODD_LAYOUTS}))
def test_whole_layout_matches_the_plan(emu: ctypes.CDLL, name: str) -> None:
    """Gather then scatter a scattered slice through the emulated kernels, for every layout
    (DSA's 656-byte rows, 60-byte GQA blocks, fp8 scales, MLA): byte-exact against the host
    copy plan, and no misaligned access."""
    layout = {**LAYOUTS, **ODD_LAYOUTS}[name]()
    rng = np.random.default_rng(1)
    num_blocks, capacity = 8, 10
    rows = [
        rng.integers(0, 256, (num_blocks, layout.role(r).block_nbytes), dtype=np.uint8)
        for r, _ in layout.tensor_order()
    ]
    segs = layout_segments(layout)
    table = np.frombuffer(segment_table([_ptr(r) for r in rows], segs), np.uint8).copy()
    stride = stride_for(value_nbytes(layout.block_nbytes))
    staging = rng.integers(0, 256, (capacity, stride), dtype=np.uint8)
    plan = copy_plan(segs, [6, 0, 1, 2, 7], [9, 3, 4, 5, 0])
    expected = staging.copy()
    host_gather(plan, rows, expected)
    max_seg = max(s.nbytes for s in segs)
    assert _run(emu, True, table, plan_pairs(plan), _ptr(staging), stride, max_seg) == 0
    assert (staging == expected).all()
    plan2 = copy_plan(segs, [1, 2, 3, 4, 5], [9, 3, 4, 5, 0])
    want = [r.copy() for r in rows]
    host_scatter(plan2, staging, want)
    assert _run(emu, False, table, plan_pairs(plan2), _ptr(staging), stride, max_seg) == 0
    for got, exp in zip(rows, want, strict=True):
        assert (got == exp).all()
