"""Nothing a closed pipeline owned stays alive: with the cyclic garbage collector disabled,
the staging is freed by reference counting the moment ``open_pipeline`` exits — after a
normal close, after the body raised, after an actor crash, after the task that opened it was
cancelled — and resident memory stays flat over many open/close rounds."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe import _engine as engine_module
from kvpipe import _lograte
from kvpipe.actors import _base as base_module
from kvpipe.actors import writer as writer_module
from tests.fakes import Act, CrashHooks, ScriptedStore
from tests.helpers import until

pytestmark = pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)

STAGING = 64 << 20
LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
TOKENS = np.arange(16 * 8)


class _Held:
    """Something an observer refers to."""


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


class _HoldingStore(kvpipe.MemoryStore):
    """Keeps no values (puts and gets go through staging); once armed, its next put or get
    holds the batch's staging views and never returns."""

    keeps_values = False

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.hung = anyio.Event()

    async def _hold(self, views: object) -> None:
        if self.armed:
            self.armed = False
            self.hung.set()
            await anyio.sleep_forever()

    async def put_blocks(self, batch: kvpipe.backends.PutBatch) -> list[kvpipe.BlockStatus]:
        await self._hold(batch.values)
        return list(await super().put_blocks(batch))

    async def get_blocks(self, batch: kvpipe.backends.GetBatch) -> list[kvpipe.BlockStatus]:
        await self._hold(batch.buffers)
        return list(await super().get_blocks(batch))


@pytest.mark.parametrize("actor", ["writer", "reader"])
async def test_a_crash_beside_a_store_call_on_staging_leaves_no_cycle(
    actor: str, no_cyclic_gc: None
) -> None:
    """An actor crashes while another of its requests waits in a store call over staging:
    that call's task ends cancelled with the actor (on asyncio anyio keeps such a task's
    exception in a reference cycle, frames and all). The staging and the actors are still
    freed by reference counting when the block exits."""
    store = _HoldingStore()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    async with kvpipe.open_pipeline(
        cache, store, config=config, hooks=CrashHooks(actor, ["crash"])
    ) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        actors = weakref.ref(pipe._runtime._ctx)
        call = pipe.write if actor == "writer" else pipe.read
        if actor == "reader":
            await pipe.write(TOKENS, np.arange(8))
        store.armed = True
        outcomes: list[str | None] = []

        async def run(call: Any, request_id: str) -> None:
            result = await call(TOKENS, np.arange(8, 16), request_id=request_id)
            outcomes.append(result.stop_reason)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, call, "held")
            await store.hung.wait()
            tg.start_soon(run, call, "crash")
        assert outcomes == ["actor_crashed", "actor_crashed"]
        del pipe, call
    await store.aclose()
    assert staging() is None, "the staging outlived the pipeline"
    assert actors() is None, "the actors' context is held in a reference cycle"


async def test_a_crash_beside_a_gather_in_a_thread_leaves_no_cycle(
    no_cyclic_gc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer crashes while another write's slice is being gathered in a copy thread,
    from a task of that write's own (cancelled with the actor): once the thread is done the
    staging and the actors are freed by reference counting when the block exits."""
    go_on = threading.Event()
    gather_sealed = base_module.gather_sealed

    def held(*args: Any) -> Any:
        go_on.wait(30)
        return gather_sealed(*args)

    monkeypatch.setattr(base_module, "INLINE_COPY_BYTES", 0)

    monkeypatch.setattr(engine_module, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(base_module, "gather_sealed", held)
    store = _HoldingStore()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    async with kvpipe.open_pipeline(
        cache, store, config=config, hooks=CrashHooks("writer", ["crash"])
    ) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        actors = weakref.ref(pipe._runtime._ctx)
        runner = pipe._runtime._runner
        assert runner is not None
        outcomes: list[str | None] = []

        async def write(pipe: kvpipe.Pipeline, request_id: str) -> None:
            result = await pipe.write(TOKENS, np.arange(8), request_id=request_id)
            outcomes.append(result.stop_reason)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write, pipe, "held")
            await until(lambda: runner.running == 1)
            tg.start_soon(write, pipe, "crash")
            await until(lambda: len(outcomes) == 2)
            go_on.set()
        assert outcomes == ["actor_crashed", "actor_crashed"]
        await until(lambda: runner.running == 0)
        del pipe
    await store.aclose()
    assert staging() is None, "the staging outlived the pipeline"
    assert actors() is None, "the actors' context is held in a reference cycle"


@pytest.mark.parametrize("call", ["lookup", "write"])
async def test_a_call_that_raised_leaves_no_cycle(call: str, no_cyclic_gc: None) -> None:
    """A call raises the error its request ended with (a lookup's BackendError; a write's
    PipelineClosed when the pipeline closes under it, here by escalation). The request
    keeps that error, and the error's traceback the frames it passed: none of them may hold
    the request, or the pipeline stays in a reference cycle."""
    store = ScriptedStore(exists={0: Act(error=OSError("injected"))})
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING, max_restarts=1)
    hooks = CrashHooks("writer", ["crash", "crash"])  # the second crash escalates
    async with kvpipe.open_pipeline(cache, store, config=config, hooks=hooks) as pipe:
        refs = (weakref.ref(pipe), weakref.ref(pipe._runtime))
        if call == "write":
            first = await pipe.write(TOKENS, np.arange(8), request_id="crash")
            assert first.stop_reason == "actor_crashed"
        with pytest.raises(kvpipe.BackendError if call == "lookup" else kvpipe.PipelineClosed):
            if call == "lookup":
                await pipe.lookup(TOKENS)
            else:
                await pipe.write(TOKENS, np.arange(8), request_id="crash")
        del pipe
    assert [ref() for ref in refs] == [None, None], "the pipeline is held in a reference cycle"


@pytest.mark.parametrize("op", ["write", "read"])
async def test_a_close_that_cancels_the_actors_at_its_deadline_leaves_no_cycle(
    op: str, no_cyclic_gc: None
) -> None:
    """A put or get hangs through the whole ``close_timeout``: the close fails the request at
    the deadline and cancels the actors. Their supervising tasks end cancelled too (on
    asyncio anyio keeps such a task's exception, frames and all, in a reference cycle): the
    actors' context, and through it the cache and the store, must still be freed by
    reference counting when the block exits."""
    inner = kvpipe.MemoryStore()
    if op == "read":
        async with kvpipe.open_pipeline(
            kvpipe.create_kv_cache(LAYOUT, num_blocks=16), inner
        ) as pipe:
            assert (await pipe.write(TOKENS, np.arange(8))).complete
    hang = {0: Act(hang=True)}
    store = ScriptedStore(puts=hang, gets=hang, inner=inner)
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING, close_timeout=0.2, slice_block_num=2)
    async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
        refs = (
            weakref.ref(pipe._runtime._pool.buffer.base),  # type: ignore[union-attr]
            weakref.ref(pipe._runtime._ctx),
            weakref.ref(pipe),
        )

        async def call(pipe: kvpipe.Pipeline) -> None:
            with pytest.raises(kvpipe.PipelineClosed):
                if op == "write":
                    await pipe.write(TOKENS, np.arange(8))
                else:
                    await pipe.read(TOKENS, np.arange(8, 16))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, pipe)
            await store.wait_calls("put" if op == "write" else "get")
            await pipe.aclose()
        del pipe
    staging, actors, pipe_ref = refs
    assert staging() is None, "the staging outlived the pipeline"
    assert actors() is None, "the actors' context is held in a reference cycle"
    assert pipe_ref() is None, "the pipeline is held in a reference cycle"


class _FailingProbes(kvpipe.MemoryStore):
    """Once armed, every ``exists`` raises a fresh error (the store keeps none)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    async def exists(self, batch: kvpipe.backends.KeyBatch) -> list[bool]:
        if self.armed:
            raise OSError("injected exists failure")
        return list(await super().exists(batch))


async def test_a_probe_the_store_failed_leaves_no_cycle(no_cyclic_gc: None) -> None:
    """The store's ``exists`` raises during a read's probe: the read stops with
    ``backend_error``. The error translated for it must not be held by the frame that
    translated it (that frame is on its traceback), or the actors' context, and through it
    the store, stay in a reference cycle. The pipeline's log limiters (its own, made by
    the failure's lines) go with it."""
    store = _FailingProbes()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    limiters = len(_lograte._LIMITERS)
    async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
        refs = (weakref.ref(pipe._runtime._ctx), weakref.ref(store))
        assert (await pipe.write(TOKENS, np.arange(8))).complete
        store.armed = True
        assert (await pipe.read(TOKENS, np.arange(8, 16))).stop_reason == "backend_error"
        del pipe
    await store.aclose()
    del store
    actors, store_ref = refs
    assert actors() is None, "the actors' context is held in a reference cycle"
    assert store_ref() is None, "the store is held in a reference cycle"
    assert len(_lograte._LIMITERS) == limiters, "the pipeline's log limiters outlive it"


async def test_a_kept_log_record_of_a_failed_probe_keeps_no_pipeline(
    no_cyclic_gc: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A write whose dedup probe the store failed logs a WARNING. The record held the
    exception itself, so a handler that keeps records (pytest's capture, a MemoryHandler)
    kept its traceback's frames, and through them the actors' context and the store; the
    record now holds the error's text."""
    store = _FailingProbes()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    with caplog.at_level("WARNING", logger="kvpipe"):
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            refs = (weakref.ref(pipe._runtime._ctx), weakref.ref(store))
            store.armed = True
            assert (await pipe.write(TOKENS, np.arange(8))).complete
            del pipe
        await store.aclose()
        del store
    assert "dedup probe failed" in caplog.text
    actors, store_ref = refs
    assert actors() is None, "a kept log record holds the actors' context"
    assert store_ref() is None, "a kept log record holds the store"


async def test_an_observer_that_refers_to_its_pipeline_keeps_it_in_no_cycle(
    no_cyclic_gc: None,
) -> None:
    """An observer that holds its pipeline (a closure reading its statistics, say): the
    pipeline held it through its runtime after close, a cycle only the collector freed."""
    store = kvpipe.MemoryStore()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)
    seen: list[str] = []
    async with kvpipe.open_pipeline(cache, store, config=config) as pipe:

        def observer(kind: str, seconds: float, outcome: str, pipe: object = pipe) -> None:
            seen.append(kind)

        pipe.add_observer(observer)
        ref = weakref.ref(pipe)
        assert (await pipe.write(TOKENS, np.arange(8))).complete
        del pipe, observer
    assert seen
    assert ref() is None, "the pipeline is held in a cycle through its observer"


async def test_a_kept_log_record_of_an_observer_error_keeps_no_pipeline(
    no_cyclic_gc: None, caplog: pytest.LogCaptureFixture
) -> None:
    """An observer that raised: its first error is logged at WARNING. The record held the
    exception itself (``exc_info``), so a handler that keeps records (pytest's capture, a
    MemoryHandler) kept its traceback's frames, and through their callers the pipeline,
    its actors' context, its staging and the store after close (and, through ``%r``, the
    observer and what it refers to); the record now holds the error's text, traceback
    included, and the observer's ``repr``."""
    store = kvpipe.MemoryStore()
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=16)
    config = kvpipe.PipelineConfig(staging_bytes=STAGING)

    held = _Held()  # what the observer refers to (a metrics registry, say)

    def broken(kind: str, seconds: float, outcome: str, held: object = held) -> None:
        raise RuntimeError("injected observer bug")

    with caplog.at_level("WARNING", logger="kvpipe"):
        async with kvpipe.open_pipeline(cache, store, config=config, observer=broken) as pipe:
            refs = (
                weakref.ref(pipe),
                weakref.ref(pipe._runtime._ctx),
                weakref.ref(pipe._runtime._pool.buffer.base),  # type: ignore[union-attr]
                weakref.ref(store),
                weakref.ref(held),
            )
            assert (await pipe.write(TOKENS, np.arange(8))).complete
            del pipe
        await store.aclose()
        del store, broken, held
    assert "RuntimeError: injected observer bug" in caplog.text
    assert "in broken" in caplog.text  # where it was raised
    pipe_ref, actors, staging, store_ref, observer_ref = refs
    assert observer_ref() is None, "a kept log record holds the observer"
    assert pipe_ref() is None, "a kept log record holds the pipeline"
    assert actors() is None, "a kept log record holds the actors' context"
    assert staging() is None, "a kept log record holds the staging"
    assert store_ref() is None, "a kept log record holds the store"
