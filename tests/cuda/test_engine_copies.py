"""The CUDA engine over the driver's test double (``FakeDriver``: host memory, reference
kernels — not evidence of GPU speed): byte-exact gather/scatter round trips for every
layout and odd sizes, consecutive and scattered slots, both fast paths and the general
path, chunked scratch, concurrent calls."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe._plan import copy_plan, layout_segments
from kvpipe.cuda._kernels import GATHER, SCATTER, CopyPath
from kvpipe.cuda._resources import CudaOptions
from tests.cuda.devcache import (
    ODD_LAYOUTS,
    device_rows,
    fake_device_cache,
    fill_device,
    free_device_cache,
)
from tests.cuda.engines import engine, expected_staging
from tests.cuda.fake_driver import FakeDriver
from tests.helpers import LAYOUTS

ALL = {**LAYOUTS, **ODD_LAYOUTS}


def _layout(name: str) -> kvpipe.CacheLayout:
    return ALL[name]()


@pytest.mark.parametrize("mode", ["auto", "staged", "mapped"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("name", sorted(ALL))
async def test_round_trip(fake: FakeDriver, name: str, consecutive: bool, mode: str) -> None:
    layout = _layout(name)
    cache = fake_device_cache(fake, layout, 12)
    fill_device(fake, cache, seed=3)
    segs = layout_segments(layout)
    opts = CudaOptions(d2h=mode, h2d=mode)  # type: ignore[arg-type]
    async with engine(fake, cache, options=opts) as (eng, pool):
        lease = await pool.acquire(8)
        slots = list(lease.slots[:5]) if consecutive else [lease.slots[i] for i in (0, 2, 3, 6, 7)]
        blocks = [7, 2, 3, 4, 11]
        plan = copy_plan(segs, blocks, slots)
        want = expected_staging(fake, cache, plan, pool)
        await eng.gather(plan, lease)
        payload = layout.block_nbytes
        for s in slots:
            assert pool.buffer[s, :payload].tobytes() == want[s, :payload].tobytes()
        before = device_rows(fake, cache)
        targets = [0, 1, 5, 6, 9]
        await eng.scatter(copy_plan(segs, targets, slots), lease)
        after = device_rows(fake, cache)
        for t_before, t_after in zip(before, after, strict=True):
            assert (t_after[targets] == t_before[blocks]).all()
            untouched = [b for b in range(12) if b not in targets]
            assert (t_after[untouched] == t_before[untouched]).all()
        lease.release()
        gather_path = {
            "auto": CopyPath.GATHER_MAPPED if consecutive else CopyPath.GATHER_STAGED,
            "staged": CopyPath.GATHER_STAGED,
            "mapped": CopyPath.GATHER_MAPPED,
        }[mode]
        scatter_path = {
            "auto": CopyPath.SCATTER_MAPPED if consecutive else CopyPath.SCATTER_STAGED,
            "staged": CopyPath.SCATTER_STAGED,
            "mapped": CopyPath.SCATTER_MAPPED,
        }[mode]
        assert eng.paths == {gather_path: 1, scatter_path: 1}
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_fast_paths_use_one_launch_and_no_data_dma(fake: FakeDriver) -> None:
    layout = _layout("dsa_real_rows")
    cache = fake_device_cache(fake, layout, 8)
    fill_device(fake, cache, seed=1)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        lease = await pool.acquire(4)
        fake.memcpys.clear()
        await eng.gather(copy_plan(segs, [1, 5, 6, 0], lease.slots), lease)
        # device -> host fast path: the kernel writes mapped pinned staging; only the
        # 64-byte pair table crosses by DMA
        assert [name for name, *_ in fake.launches] == [GATHER]
        assert fake.memcpys == [("htod", 4 * 16)]
        fake.memcpys.clear()
        await eng.scatter(copy_plan(segs, [2, 3, 4, 7], lease.slots), lease)
        # host -> device fast path: likewise, the kernel reads mapped pinned staging
        assert fake.memcpys == [("htod", 64)]
        assert [name for name, *_ in fake.launches] == [GATHER, SCATTER]
        lease.release()
    async with engine(fake, cache, options=CudaOptions(h2d="staged")) as (eng, pool):
        lease = await pool.acquire(4)
        fake.memcpys.clear()
        await eng.scatter(copy_plan(segs, [2, 3, 4, 7], lease.slots), lease)
        # host -> device through scratch: the pair table, then ONE DMA of the consecutive
        # staging range into scratch, then the scatter kernel
        stride = pool.stride
        assert fake.memcpys == [("htod", 64), ("htod", 3 * stride + layout.block_nbytes)]
        assert [name for name, *_ in fake.launches][-1] == SCATTER
        lease.release()
    free_device_cache(fake, cache)


async def test_general_path_one_dma_per_slot_run(fake: FakeDriver) -> None:
    layout = _layout("gqa_odd")
    cache = fake_device_cache(fake, layout, 8)
    fill_device(fake, cache, seed=2)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        lease = await pool.acquire(8)
        slots = [lease.slots[i] for i in (0, 1, 4, 5, 6)]  # runs of 2 and 3 slots
        plan = copy_plan(segs, [3, 4, 5, 0, 1], slots)
        want = expected_staging(fake, cache, plan, pool)
        fake.memcpys.clear()
        await eng.gather(plan, lease)
        stride, payload = pool.stride, layout.block_nbytes
        assert fake.memcpys == [
            ("htod", 80),
            ("dtoh", stride + payload),
            ("dtoh", 2 * stride + payload),
        ]
        for s in slots:
            assert pool.buffer[s, :payload].tobytes() == want[s, :payload].tobytes()
        lease.release()
    free_device_cache(fake, cache)


@pytest.mark.parametrize("name", ["gqa", "dsa_real_rows", "gqa_odd"])
async def test_chunked_scratch(fake: FakeDriver, name: str) -> None:
    """Scratch smaller than a slice: the staged paths go chunk by chunk, still exact."""
    layout = _layout(name)
    cache = fake_device_cache(fake, layout, 10)
    fill_device(fake, cache, seed=4)
    segs = layout_segments(layout)
    async with engine(
        fake, cache, capacity=8, options=CudaOptions(d2h="staged", scratch_bytes=1)
    ) as (eng, pool):
        assert eng.chunk_blocks == 1
        async with engine(
            fake,
            cache,
            capacity=8,
            options=CudaOptions(d2h="staged", scratch_bytes=3 * pool.stride),
        ) as (eng3, pool3):
            assert eng3.chunk_blocks == 3
            for e, p in ((eng, pool), (eng3, pool3)):
                lease = await p.acquire(7)
                blocks = [9, 8, 0, 1, 2, 5, 4]
                plan = copy_plan(segs, blocks, lease.slots)
                want = expected_staging(fake, cache, plan, p)
                fake.launches.clear()
                await e.gather(plan, lease)
                assert len(fake.launches) == -(-7 // e.chunk_blocks)
                for s in lease.slots:
                    assert (
                        p.buffer[s, : layout.block_nbytes].tobytes()
                        == want[s, : layout.block_nbytes].tobytes()
                    )
                before = device_rows(fake, cache)
                await e.scatter(copy_plan(segs, [0, 1, 2, 3, 4, 6, 7], lease.slots), lease)
                after = device_rows(fake, cache)
                for b, a in zip(before, after, strict=True):
                    assert (a[[0, 1, 2, 3, 4, 6, 7]] == b[blocks]).all()
                lease.release()
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_without_mapped_memory_everything_is_staged() -> None:
    fake = FakeDriver(can_map_host_memory=False)
    layout = _layout("mla")
    cache = fake_device_cache(fake, layout, 6)
    fill_device(fake, cache, seed=5)
    segs = layout_segments(layout)
    async with engine(fake, cache, options=CudaOptions(d2h="mapped", h2d="mapped")) as (eng, pool):
        assert eng.staging.device_ptr is None
        lease = await pool.acquire(3)
        plan = copy_plan(segs, [0, 1, 2], lease.slots)
        want = expected_staging(fake, cache, plan, pool)
        await eng.gather(plan, lease)
        await eng.scatter(copy_plan(segs, [3, 4, 5], lease.slots), lease)
        assert (
            pool.buffer[lease.slots[0], : layout.block_nbytes].tobytes()
            == want[lease.slots[0], : layout.block_nbytes].tobytes()
        )
        assert set(eng.paths) == {CopyPath.GATHER_STAGED, CopyPath.SCATTER_STAGED}
        lease.release()
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize("latency", [0, 3])
async def test_concurrent_gathers_and_scatters(latency: int) -> None:
    """Twelve calls at once (gathers from one cache, scatters into another) share the
    engine: each gets its own scratch (at most ``max_calls`` exist), all are exact."""
    fake = FakeDriver(latency=latency)
    layout = _layout("gqa_fp8_odd")
    src = fake_device_cache(fake, layout, 24)
    src_rows = fill_device(fake, src, seed=6)
    segs = layout_segments(layout)
    async with engine(fake, src, capacity=48, max_blocks=4, options=CudaOptions(max_calls=3)) as (
        eng,
        pool,
    ):
        leases = [await pool.acquire(4) for _ in range(12)]

        async def one(i: int) -> None:
            lease = leases[i]
            blocks = [i, i + 8][: 1 + i % 2]  # below 20: never a scatter's target
            if i % 3 == 2:
                # a scatter into blocks nobody gathers: staging slots -> blocks 20+
                await eng.scatter(copy_plan(segs, [20 + i % 4], lease.slots[:1]), lease)
            else:
                plan = copy_plan(segs, blocks, lease.slots[: len(blocks)])
                await eng.gather(plan, lease)
                for b, s in zip(blocks, lease.slots, strict=False):
                    got = pool.buffer[s, : layout.block_nbytes]
                    want = np.concatenate([r[b] for r in src_rows])
                    assert got.tobytes() == want.tobytes()

        for i in (2, 5, 8, 11):
            pool.buffer[leases[i].slots[0], : layout.block_nbytes] = i
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(one, i)
        acct = eng.accounting()
        assert acct.scratch_buffers <= 3 and acct.scratch_in_use == 0
        rows = device_rows(fake, src)
        for i in (2, 5, 8, 11):
            assert all((r[20 + i % 4] == i).all() for r in rows)
        for lease in leases:
            lease.release()
    free_device_cache(fake, src)
    fake.assert_clean()
