"""Nothing a closed pipeline owned stays alive: with the cyclic garbage collector disabled,
the staging is freed by reference counting the moment ``open_pipeline`` exits — after a
normal close, after the body raised, after an actor crash, after the task that opened it was
cancelled — and resident memory stays flat over many open/close rounds."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import kvpipe
from tests.fakes import CrashHooks

pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

STAGING = 64 << 20
LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
TOKENS = np.arange(16 * 8)


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Boom(Exception):
    pass


async def _round(store: kvpipe.MemoryStore, how: str) -> tuple[weakref.ref[Any], ...]:
    """Open a pipeline, touch all its staging, use it, end the block ``how``; weak
    references to what it owned."""
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    hooks = CrashHooks("writer", ["crash"]) if how == "crash" else None
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    refs: tuple[weakref.ref[Any], ...] = ()
    try:
        with anyio.CancelScope() as opener:
            async with kvpipe.open_pipeline(cache, store, config=config, hooks=hooks) as pipe:
                staging = pipe._runtime._pool.buffer  # type: ignore[union-attr]
                staging.fill(1)  # every page resident
                refs = (
                    weakref.ref(staging.base),
                    weakref.ref(pipe),
                    weakref.ref(pipe._runtime),
                    weakref.ref(pipe._runtime._ctx),
                )
                del staging
                w = await pipe.write(TOKENS, np.arange(8), request_id=how)
                r = await pipe.read(TOKENS, np.arange(8, 16))
                if how == "crash":
                    assert w.stop_reason == "actor_crashed" and pipe.statistics().restarts
                else:
                    assert w.complete and r.complete
                del w, r, pipe
                if how == "raise":
                    raise _Boom
                if how == "cancel":  # the task that opened it is cancelled (a server's lifespan)
                    opener.cancel()
                    await anyio.lowlevel.checkpoint()
    except _Boom:
        pass
    return refs


@pytest.mark.parametrize("how", ["close", "raise", "crash", "cancel"])
async def test_staging_is_freed_when_the_block_exits(how: str, no_cyclic_gc: None) -> None:
    store = kvpipe.MemoryStore()
    staging, pipe, runtime, actors = await _round(store, how)
    assert staging() is None, "the staging outlived the pipeline"
    assert pipe() is None and runtime() is None, "the pipeline is held in a reference cycle"
    if how != "crash":
        assert actors() is None, "the actors' context is held in a reference cycle"


async def test_resident_memory_stays_flat_over_rounds(no_cyclic_gc: None) -> None:
    for how in ("close", "raise", "crash"):
        await _round(kvpipe.MemoryStore(), how)
    before = _resident()
    for _ in range(4):
        for how in ("close", "raise", "crash"):
            await _round(kvpipe.MemoryStore(), how)
    grown = _resident() - before
    # 12 rounds of 64 MiB staging each: a leak of one round's staging shows as >= 64 MiB
    assert grown < STAGING, f"resident memory grew by {grown >> 20} MiB over 12 rounds"


async def test_a_closed_pipeline_kept_by_the_caller_holds_no_staging(no_cyclic_gc: None) -> None:
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    async with kvpipe.open_pipeline(
        cache, kvpipe.MemoryStore(), config=kvpipe.PipelineConfig(staging_bytes=STAGING)
    ) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        await pipe.write(TOKENS, np.arange(8))
    assert staging() is None  # while `pipe` is still in scope
    assert pipe.statistics().counters["blocks_written"] == 8
    await anyio.lowlevel.checkpoint()
