"""Opening a CUDA engine over the test double, with a staging pool on its pinned memory."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import numpy as np
import numpy.typing as npt

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._hostcopy import gather as host_gather
from kvpipe._plan import CopyPlan
from kvpipe._staging import StagingPool, stride_for
from kvpipe.cuda._engine import CudaEngine
from kvpipe.cuda._open import open_cuda_engine
from kvpipe.cuda._resources import CudaOptions
from tests.cuda.devcache import device_rows
from tests.cuda.fake_driver import FakeDriver


async def open_engine(
    fake: FakeDriver,
    cache: kvpipe.KVCache,
    *,
    capacity: int = 16,
    max_blocks: int = 8,
    options: CudaOptions | None = None,
) -> tuple[CudaEngine, StagingPool]:
    engine = await anyio.to_thread.run_sync(
        engine_opener(fake, cache, capacity=capacity, max_blocks=max_blocks, options=options)
    )
    slot = value_nbytes(cache.layout.block_nbytes)
    pool = StagingPool(slot, capacity, buffer=engine.staging.array((capacity, stride_for(slot))))
    return engine, pool


def engine_opener(
    fake: FakeDriver,
    cache: kvpipe.KVCache,
    *,
    capacity: int = 16,
    max_blocks: int = 8,
    options: CudaOptions | None = None,
) -> functools.partial[CudaEngine]:
    """``open_cuda_engine`` over ``cache`` with staging of ``capacity`` slots, to call in a
    worker thread."""
    slot = value_nbytes(cache.layout.block_nbytes)
    return functools.partial(
        open_cuda_engine,
        cache,
        slot_nbytes=slot,
        capacity=capacity,
        budget=capacity * stride_for(slot),
        max_blocks=max_blocks,
        driver=fake,
        options=options,
    )


@asynccontextmanager
async def engine(
    fake: FakeDriver,
    cache: kvpipe.KVCache,
    *,
    capacity: int = 16,
    max_blocks: int = 8,
    options: CudaOptions | None = None,
) -> AsyncIterator[tuple[CudaEngine, StagingPool]]:
    eng, pool = await open_engine(
        fake, cache, capacity=capacity, max_blocks=max_blocks, options=options
    )
    try:
        yield eng, pool
    finally:
        await eng.aclose()


def expected_staging(
    fake: FakeDriver, cache: kvpipe.KVCache, plan: CopyPlan, pool: StagingPool
) -> npt.NDArray[np.uint8]:
    """What staging must hold after gathering ``plan`` (the host executor's answer)."""
    out = pool.buffer.copy()
    host_gather(plan, device_rows(fake, cache), out)
    return out
