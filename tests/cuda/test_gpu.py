"""On a real GPU (``@pytest.mark.cuda``; skipped with the reason where there is none):
byte-exact round trips for every layout and odd sizes through the real driver and the
NVRTC-compiled kernels, concurrent reads and writes, leak checks, and a bandwidth benchmark
against ``cuMemcpyAsync`` of one contiguous buffer of the same size (the link's limit).

First run on hardware on 2026-11-25: an H200 (sm_90), driver 580.159.04, NVRTC 13.0, all
passing; the figures are in docs/performance.md ("CUDA device path").
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._layout import numpy_dtype
from kvpipe._plan import copy_plan, layout_segments
from kvpipe._staging import StagingPool, stride_for
from kvpipe.cuda._driver import CudaDriver
from kvpipe.cuda._open import open_cuda_engine
from kvpipe.cuda._pinned import PinnedBuffer
from kvpipe.cuda._resources import CudaOptions
from tests.cuda.devcache import ODD_LAYOUTS
from tests.helpers import LAYOUTS

pytestmark = pytest.mark.cuda
ALL = {**LAYOUTS, **ODD_LAYOUTS}


@pytest.fixture(scope="module")
def gpu() -> Iterator[CudaDriver]:
    drv = CudaDriver()
    drv.open(0)
    drv.make_current()
    yield drv
    drv.close()


def _sync_copy(drv: CudaDriver, fn: Any, *args: int) -> None:
    stream, event = drv.stream_create(), drv.event_create()
    fn(*args, stream)
    drv.event_record(event, stream)
    while not drv.event_query(event):
        time.sleep(1e-5)
    drv.event_destroy(event)
    drv.stream_destroy(stream)


class GpuTensor:
    """Device memory shaped like a CUDA tensor (no framework needed)."""

    def __init__(self, drv: CudaDriver, shape: tuple[int, ...], dtype: str) -> None:
        self.drv = drv
        self.nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        self.ptr = drv.mem_alloc(self.nbytes)
        self.shape, self.dtype = shape, f"torch.{dtype}"
        self.device = SimpleNamespace(type="cuda", index=0)

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return True

    def upload(self, data: bytes) -> None:
        buf = PinnedBuffer(self.drv, self.nbytes, mapped=False)
        buf.array()[:] = np.frombuffer(data, np.uint8)
        _sync_copy(self.drv, self.drv.memcpy_htod_async, self.ptr, buf.host_ptr, self.nbytes)
        buf.free()

    def download(self) -> bytes:
        buf = PinnedBuffer(self.drv, self.nbytes, mapped=False)
        _sync_copy(self.drv, self.drv.memcpy_dtoh_async, buf.host_ptr, self.ptr, self.nbytes)
        out = buf.array().tobytes()
        buf.free()
        return out


def _cache(drv: CudaDriver, layout: kvpipe.CacheLayout, n: int, seed: int) -> kvpipe.KVCache:
    rng = np.random.default_rng(seed)
    tensors = []
    for role, _l in layout.tensor_order():
        spec = layout.role(role)
        t = GpuTensor(drv, (n, *spec.block_shape), spec.dtype)
        t.upload(rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes())
        tensors.append(t)
    return kvpipe.KVCache.from_tensors(layout, tensors)


def _rows(cache: kvpipe.KVCache) -> list[np.ndarray]:  # type: ignore[type-arg]
    return [
        np.frombuffer(t.download(), np.uint8).reshape(cache.num_blocks, -1) for t in cache.tensors()
    ]


def _free(cache: kvpipe.KVCache) -> None:
    for t in cache.tensors():
        t.drv.mem_free(t.ptr)


async def _engine(cache: kvpipe.KVCache, capacity: int, max_blocks: int, opts: CudaOptions):  # type: ignore[no-untyped-def]
    slot = value_nbytes(cache.layout.block_nbytes)
    stride = stride_for(slot)
    opener = functools.partial(
        open_cuda_engine, cache, slot_nbytes=slot, capacity=capacity,
        budget=capacity * stride, max_blocks=max_blocks, options=opts,
    )  # fmt: skip
    eng = await anyio.to_thread.run_sync(opener)
    return eng, StagingPool(slot, capacity, buffer=eng.staging.array((capacity, stride)))


@pytest.mark.parametrize("mode", ["auto", "staged", "mapped"])
@pytest.mark.parametrize("name", sorted(ALL))
async def test_round_trip_on_the_gpu(gpu: CudaDriver, name: str, mode: str) -> None:
    layout = ALL[name]()
    cache = _cache(gpu, layout, 12, seed=1)
    segs = layout_segments(layout)
    before = _rows(cache)
    eng, pool = await _engine(cache, 16, 8, CudaOptions(d2h=mode, h2d=mode))  # type: ignore[arg-type]
    try:
        lease = await pool.acquire(8)
        for slots in (list(lease.slots[:5]), [lease.slots[i] for i in (0, 2, 3, 6, 7)]):
            blocks, targets = [7, 2, 3, 4, 11], [0, 1, 5, 6, 9]
            await eng.gather(copy_plan(segs, blocks, slots), lease)
            for b, s in zip(blocks, slots, strict=True):
                want = np.concatenate([r[b] for r in before])
                assert pool.buffer[s, : layout.block_nbytes].tobytes() == want.tobytes()
            await eng.scatter(copy_plan(segs, targets, slots), lease)
            after = _rows(cache)
            for r0, r1 in zip(before, after, strict=True):
                assert (r1[targets] == r0[blocks]).all()
            before = after
        lease.release()
    finally:
        await eng.aclose()
    acct = eng.accounting()
    assert acct.device_bytes == 0 and acct.pinned_bytes == 0 and acct.streams == 0
    _free(cache)


async def test_pipeline_concurrent_writes_and_reads_and_no_leak(gpu: CudaDriver) -> None:
    from cuda.bindings import driver as cu  # the test may; kvpipe imports it only in kvpipe.cuda

    layout = ODD_LAYOUTS["dsa_real_rows"]()
    free_before = cu.cuMemGetInfo()[1]
    cache = _cache(gpu, layout, 32, seed=2)
    rows = _rows(cache)
    producer = gpu.stream_create()
    cfg = kvpipe.PipelineConfig(slice_block_num=2, copy_threads=3)
    seqs = [np.arange(100 * i, 100 * i + 4 * layout.block_size) for i in range(4)]
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), config=cfg) as pipe:
        assert pipe.statistics().device_path == "cuda"
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(
                    functools.partial(
                        pipe.write, seqs[i], list(range(4 * i, 4 * i + 4)), stream=producer
                    )
                )
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(
                    functools.partial(
                        pipe.read, seqs[i], list(range(16 + 4 * i, 20 + 4 * i)), stream=producer
                    )
                )
                tg.start_soon(
                    functools.partial(
                        pipe.write, seqs[i], list(range(4 * i, 4 * i + 4)), stream=producer
                    )
                )
    for want, got in zip(rows, _rows(cache), strict=True):
        assert (got[16:32] == want[0:16]).all()
    gpu.stream_destroy(producer)
    _free(cache)
    assert cu.cuMemGetInfo()[1] - free_before <= 2 << 20  # everything returned (driver slack)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def test_bandwidth_against_one_contiguous_copy(
    gpu: CudaDriver, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reports GB/s of every path against cuMemcpyAsync of one contiguous buffer of the same
    size (pinned host, both directions). Run with ``-s`` to see the table."""
    layout = kvpipe.CacheLayout.gqa(num_layers=16, num_kv_heads=8, head_dim=128, block_size=64)
    blocks = 32
    nbytes = blocks * layout.block_nbytes
    cache = _cache(gpu, layout, blocks, seed=3)
    segs = layout_segments(layout)
    lines = [f"{nbytes / 2**20:.0f} MiB per call ({blocks} blocks of {layout.block_nbytes} B)"]
    dev = gpu.mem_alloc(nbytes)
    host = PinnedBuffer(gpu, nbytes, mapped=False)
    for label, fn, args in (
        ("cuMemcpyAsync D2H contiguous", gpu.memcpy_dtoh_async, (host.host_ptr, dev, nbytes)),
        ("cuMemcpyAsync H2D contiguous", gpu.memcpy_htod_async, (dev, host.host_ptr, nbytes)),
    ):
        _sync_copy(gpu, fn, *args)  # warm up
        t0 = time.perf_counter()
        for _ in range(5):
            _sync_copy(gpu, fn, *args)
        lines.append(f"{label:34s} {_gbps(5 * nbytes, time.perf_counter() - t0):7.2f} GB/s")
    host.free()
    gpu.mem_free(dev)
    for mode in ("mapped", "staged"):
        eng, pool = await _engine(
            cache, blocks, blocks, CudaOptions(d2h=mode, h2d=mode, scratch_bytes=nbytes)
        )  # type: ignore[arg-type]
        try:
            lease = await pool.acquire(blocks)
            plan = copy_plan(segs, list(range(blocks)), lease.slots)
            for op in ("gather", "scatter"):
                call = eng.gather if op == "gather" else eng.scatter
                await call(plan, lease)  # warm up
                t0 = time.perf_counter()
                for _ in range(5):
                    await call(plan, lease)
                rate = _gbps(5 * nbytes, time.perf_counter() - t0)
                lines.append(f"kvpipe {op:7s} {mode:6s} (consecutive)  {rate:7.2f} GB/s")
                assert rate > 0
            lease.release()
        finally:
            await eng.aclose()
    _free(cache)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
