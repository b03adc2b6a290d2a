"""The pipeline end to end with a device cache, through ``open_pipeline(device_driver=...)``
and the driver's test double: round trips for every layout, ordering after the model's
stream, concurrency, registration of pinned staging, failures and leaks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe import _runtime
from kvpipe._keys import as_tokens, block_keys
from kvpipe.actors import SliceJob, Swapper
from kvpipe.backends import BlockStatus, GetBatch
from kvpipe.backends.file._native import block_paths
from kvpipe.benchmarks._file_baselines import drop_cached
from kvpipe.cuda import probe_device
from kvpipe.cuda._engine import CudaEngine
from tests.cuda.devcache import (
    ODD_LAYOUTS,
    Rows,
    device_rows,
    fake_device_cache,
    fill_device,
    free_device_cache,
)
from tests.cuda.fake_driver import FakeDriver, Gate
from tests.fakes import Act, ScriptedStore
from tests.helpers import LAYOUTS, checkpoints, until

ALL = {**LAYOUTS, **ODD_LAYOUTS}


def _config(**kw: int) -> kvpipe.PipelineConfig:
    return kvpipe.PipelineConfig(slice_block_num=kw.pop("slice", 3), **kw)


@pytest.mark.parametrize("name", sorted(ALL))
async def test_write_then_read_every_layout(fake: FakeDriver, producer: int, name: str) -> None:
    layout = ALL[name]()
    src = fake_device_cache(fake, layout, 12)
    rows = fill_device(fake, src, seed=5)
    dst = fake_device_cache(fake, layout, 12)
    store = kvpipe.MemoryStore()
    tokens = np.arange(7 * layout.block_size)
    src_ids, dst_ids = [11, 3, 4, 5, 0, 9, 8], [0, 1, 2, 6, 7, 10, 11]
    async with kvpipe.open_pipeline(src, store, config=_config(), device_driver=fake) as pipe:
        result = await pipe.write(tokens, src_ids, stream=producer)
        assert result.complete and result.written == 7
        stats = pipe.statistics()
        assert stats.device_path == "cuda" and "FakeDriver" in stats.device_note
    async with kvpipe.open_pipeline(dst, store, config=_config(), device_driver=fake) as pipe:
        got = await pipe.read(tokens, dst_ids, stream=producer)
        assert got.complete and got.loaded == 7
    for want, have in zip(rows, device_rows(fake, dst), strict=True):
        assert (have[dst_ids] == want[src_ids]).all()
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


async def test_statistics_after_close_still_name_the_device_path(fake: FakeDriver) -> None:
    """A closed device pipeline's statistics say which path it ran (they used to say
    ``"host"`` once the engine was let go, as if it never had the device)."""
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 4)
    async with kvpipe.open_pipeline(
        src, kvpipe.MemoryStore(), config=_config(), device_driver=fake
    ) as pipe:
        pass
    stats = pipe.statistics()
    assert not stats.open
    assert stats.device_path == "cuda" and "FakeDriver" in stats.device_note
    free_device_cache(fake, src)


async def _polled(fake: FakeDriver, polls: int, done: Callable[[], bool]) -> None:
    """Return once the driver has answered ``polls`` event queries in all, or ``done()``.

    With the model's op gated, the request's copy is then waiting for it (polling the
    model's mark), or, queued without that wait, has been run by the driver's progress (a
    violation the double raises): a count of polls, not a time, so a loaded machine cannot
    end the wait before the request got there. (A 60 s guard against a hang, not a timing.)
    """
    with anyio.fail_after(60):
        while True:
            if fake.calls.count("event_query") >= polls or done():
                return
            await anyio.sleep(0.001)


def _blocks_of(cache: kvpipe.KVCache, block: int) -> list[tuple[int, int]]:
    out = []
    for (role, _l), ptr in zip(cache.layout.tensor_order(), cache.pointers, strict=True):
        n = cache.layout.role(role).block_nbytes
        out.append((ptr + block * n, n))
    return out


async def test_write_stores_what_the_model_wrote_before_the_call(
    fake: FakeDriver, producer: int
) -> None:
    """The model's kernel writing block 1 is still queued when write() is called: kvpipe
    must store its result, not the stale bytes (the offload bug of vLLM/LMCache)."""
    layout = LAYOUTS["mla"]()
    cache = fake_device_cache(fake, layout, 4)
    fill_device(fake, cache, seed=1)
    gate = Gate()
    ranges = _blocks_of(cache, 1)

    def model_kernel() -> None:
        for addr, n in ranges:
            fake.write_device(addr, b"\x42" * n)

    store = kvpipe.MemoryStore()
    tokens = np.arange(2 * layout.block_size)
    async with kvpipe.open_pipeline(cache, store, config=_config(), device_driver=fake) as pipe:
        fake.host_op(producer, model_kernel, writes=ranges, gate=gate, label="model")
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def write() -> None:
                assert (await pipe.write(tokens, [0, 1], stream=producer)).complete
                done.set()

            polls = fake.calls.count("event_query")
            tg.start_soon(write)
            await _polled(fake, polls + 3, done.is_set)  # the write is at its gather
            assert not done.is_set()
            gate.open()
    other = fake_device_cache(fake, layout, 4)
    async with kvpipe.open_pipeline(other, store, config=_config(), device_driver=fake) as pipe:
        assert (await pipe.read(tokens, [2, 3], stream=producer)).complete
    assert all((r[3] == 0x42).all() for r in device_rows(fake, other))
    free_device_cache(fake, cache)
    free_device_cache(fake, other)


async def test_read_does_not_overwrite_blocks_the_model_still_reads(
    fake: FakeDriver, producer: int
) -> None:
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 4)
    fill_device(fake, src, seed=2)
    dst = fake_device_cache(fake, layout, 4)
    fill_device(fake, dst, seed=3)
    store = kvpipe.MemoryStore()
    tokens = np.arange(layout.block_size)
    async with kvpipe.open_pipeline(src, store, config=_config(), device_driver=fake) as pipe:
        assert (await pipe.write(tokens, [0], stream=producer)).complete
    ranges = _blocks_of(dst, 2)
    old = [fake.read_device(a, n) for a, n in ranges]
    seen: list[list[bytes]] = []
    gate = Gate()
    fake.host_op(
        producer,
        lambda: seen.append([fake.read_device(a, n) for a, n in ranges]),
        reads=ranges,
        gate=gate,
        label="model reads block 2",
    )
    async with kvpipe.open_pipeline(dst, store, config=_config(), device_driver=fake) as pipe:
        done = anyio.Event()

        async def read() -> None:
            await pipe.read(tokens, [2], stream=producer)
            done.set()

        async with anyio.create_task_group() as tg:
            polls = fake.calls.count("event_query")
            tg.start_soon(read)
            await _polled(fake, polls + 3, done.is_set)  # the read is at its scatter
            gate.open()
    assert seen == [old]
    assert [fake.read_device(a, n) for a, n in ranges] == [
        fake.read_device(a, n) for a, n in _blocks_of(src, 0)
    ]
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


async def test_streams_are_checked(fake: FakeDriver) -> None:
    layout = LAYOUTS["gqa"]()
    cache = fake_device_cache(fake, layout, 2)
    tokens = np.arange(layout.block_size)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), device_driver=fake) as pipe:
        with pytest.raises(kvpipe.RequestError, match="pass stream="):
            await pipe.write(tokens, [0])  # no framework current stream for this cache
        with pytest.raises(kvpipe.RequestError):
            await pipe.read(tokens, [0], stream=-5)
    host = kvpipe.create_kv_cache(layout, 2)
    async with kvpipe.open_pipeline(host, kvpipe.MemoryStore()) as pipe:
        with pytest.raises(kvpipe.RequestError, match="device caches only"):
            await pipe.write(tokens, [0], stream=7)
    free_device_cache(fake, cache)


async def test_concurrent_writes_and_reads(producer: int, fake: FakeDriver) -> None:
    fake.latency = 3
    layout = ODD_LAYOUTS["dsa_real_rows"]()
    cache = fake_device_cache(fake, layout, 32)
    rows = fill_device(fake, cache, seed=8)
    store = kvpipe.MemoryStore()
    cfg = _config(slice=2, copy_threads=3)
    seqs = [np.arange(100 * i, 100 * i + 4 * layout.block_size) for i in range(4)]
    async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(
                    functools.partial(
                        pipe.write, seqs[i], list(range(4 * i, 4 * i + 4)), stream=producer
                    )
                )
        async with anyio.create_task_group() as tg:
            for i in range(4):  # read each back into blocks 16.. while writing again
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
        assert pipe.statistics().counters["blocks_read"] == 16
    have = device_rows(fake, cache)
    for want, got in zip(rows, have, strict=True):
        assert (got[16:32] == want[0:16]).all()
    free_device_cache(fake, cache)


class RegisteringStore(kvpipe.MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    async def register_staging(self, buffer: memoryview) -> None:
        self.registered.append(np.frombuffer(buffer, np.uint8).ctypes.data)

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistered.append(np.frombuffer(buffer, np.uint8).ctypes.data)


async def test_pinned_staging_is_registered_with_the_store(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    store = RegisteringStore()
    cfg = kvpipe.PipelineConfig(staging_bytes=1 << 20)
    async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:
        engine = pipe._runtime.engine
        assert engine is not None
        staging = engine.staging  # type: ignore[attr-defined]
        assert store.registered == [staging.host_ptr]
        assert staging.allocated_bytes == pipe.statistics().staging_capacity_bytes <= 1 << 20
    assert store.unregistered == [staging.host_ptr]
    free_device_cache(fake, cache)
    fake.assert_clean()  # the engine freed everything at close


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_close_cancelled_by_asyncio_while_unregistering_still_closes_the_engine(
    fake: FakeDriver,
) -> None:
    """asyncio's own cancellation (``Task.cancel``: a timeout around the pipeline's exit, a
    shutdown) gets through anyio's shield: cut short while unregistering staging, the
    release raised before it closed the engine, whose streams, scratch, pointer table,
    module and context were then never freed. The staging (registered still) is kept; the
    rest is freed, and the cancellation is raised."""

    class SlowUnregister(RegisteringStore):
        def __init__(self) -> None:
            super().__init__()
            self.unregistering = anyio.Event()

        async def unregister_staging(self, buffer: memoryview) -> None:
            self.unregistering.set()
            await anyio.sleep_forever()

    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    store = SlowUnregister()
    cfg = kvpipe.PipelineConfig(staging_bytes=1 << 20)

    async def use() -> None:
        async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake):
            pass

    task = asyncio.ensure_future(use())
    await store.unregistering.wait()
    task.cancel("shutting down")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()  # the cancellation is not swallowed
    free_device_cache(fake, cache)
    live = fake.live()
    assert live["pinned_allocations"] == 1  # still registered with the store: kept
    assert (live["device_allocations"], live["modules"], live["streams"]) == (0, 0, 0)


async def test_a_close_that_reached_its_deadline_still_frees_the_idle_engine(
    fake: FakeDriver, producer: int
) -> None:
    """A write's put hangs through the whole ``close_timeout``: the close fails it at the
    deadline, and the engine, idle by then, is still freed (it leaked its pinned staging,
    device memory and context on every close that reached its deadline)."""
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 4)
    store = ScriptedStore(puts={0: Act(hang=True)})
    cfg = kvpipe.PipelineConfig(slice_block_num=2, close_timeout=0.2, staging_bytes=1 << 20)
    failed: list[kvpipe.PipelineClosed] = []
    async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:

        async def write() -> None:
            with pytest.raises(kvpipe.PipelineClosed) as info:
                await pipe.write(np.arange(32), [0, 1], stream=producer)
            failed.append(info.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await store.wait_calls("put")
            await pipe.aclose()
    assert len(failed) == 1
    free_device_cache(fake, cache)
    live = fake.live()
    assert (live["pinned_allocations"], live["device_allocations"], live["modules"]) == (0, 0, 0)
    assert live["streams"] == 1  # the model's (the producer fixture's) only


async def test_a_read_slice_waiting_for_room_in_the_swapper_lets_go_when_its_read_ends(
    fake: FakeDriver, producer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swapper is busy (read a's scatter waits, as behind the model's stream) and its
    inbox full (read b); read c's slice, fetched, waits in the reader for room there. Its
    caller cancels: the reader stops waiting and lets go of c's staging. It waited on for
    room or c's deadline (an hour here), holding the staging of a read that had ended; and
    where closing an inbox wakes no sender (anyio before 4.16), one waiting for an inbox
    whose actor escalated kept the actors from leaving until the close deadline."""
    layout = LAYOUTS["gqa"]()
    cache = fake_device_cache(fake, layout, 8)
    tokens = np.arange(layout.block_size)
    entered, go = anyio.Event(), anyio.Event()
    scatter = Swapper._scatter

    async def slow_scatter(self: Swapper, job: SliceJob) -> None:
        if job.state.request_id == "a":
            entered.set()
            await go.wait()
        await scatter(self, job)

    monkeypatch.setattr(Swapper, "_scatter", slow_scatter)
    cfg = kvpipe.PipelineConfig(
        slice_block_num=1, queue_depth=1, copy_threads=1, total_timeout=3600, slice_timeout=3600
    )
    async with kvpipe.open_pipeline(
        cache, kvpipe.MemoryStore(), config=cfg, device_driver=fake
    ) as pipe:
        assert (await pipe.write(tokens, [0], stream=producer)).complete
        results: dict[str, kvpipe.ReadResult] = {}
        c_scope = anyio.CancelScope()

        async def read(rid: str, block: int) -> None:
            with c_scope if rid == "c" else contextlib.nullcontext():
                results[rid] = await pipe.read(tokens, [block], stream=producer, request_id=rid)

        def in_use() -> int:
            return pipe.statistics().staging_in_use_bytes

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, "a", 1)
            await entered.wait()
            tg.start_soon(read, "b", 2)
            await until(lambda: pipe.statistics().queue_depths["swapper"] == 1)
            slot = in_use() // 2  # a's and b's
            tg.start_soon(read, "c", 3)
            await until(lambda: in_use() == 3 * slot)  # c's slice fetched, waiting for room
            await checkpoints()
            c_scope.cancel()
            await until(lambda: pipe.statistics().in_flight == {"read": 2})
            await until(lambda: in_use() == 2 * slot)
            go.set()
        assert sorted(results) == ["a", "b"] and all(r.complete for r in results.values())
        assert in_use() == 0
    free_device_cache(fake, cache)


class _EscalatingSwapper:
    """A device pipeline whose swapper crashes on reads with request ids ``crash*``, each
    held at its scatter (``entered``) until released (``go``), with max_restarts=1: after
    :meth:`open`'s first crash, the next one escalates."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.go = anyio.Event(), anyio.Event()
        scatter = Swapper._scatter

        async def crashing_scatter(swapper: Swapper, job: SliceJob) -> None:
            if job.state.request_id.startswith("crash"):
                self.entered.set()
                await self.go.wait()
                raise RuntimeError("injected copy failure")
            await scatter(swapper, job)

        monkeypatch.setattr(Swapper, "_scatter", crashing_scatter)
        self.outcomes: dict[str, object] = {}

    @contextlib.asynccontextmanager
    async def open(
        self, fake: FakeDriver, producer: int, cache: kvpipe.KVCache, queue_depth: int
    ) -> AsyncIterator[kvpipe.Pipeline]:
        cfg = kvpipe.PipelineConfig(
            slice_block_num=1,
            queue_depth=queue_depth,
            copy_threads=1,
            max_restarts=1,
            total_timeout=3600,
            slice_timeout=3600,
        )
        tokens = np.arange(cache.layout.block_size)
        async with kvpipe.open_pipeline(
            cache, kvpipe.MemoryStore(), config=cfg, device_driver=fake
        ) as pipe:
            assert (await pipe.write(tokens, [0], stream=producer)).complete
            self.go.set()
            first = await pipe.read(tokens, [1], stream=producer, request_id="crash-1")
            assert first.stop_reason == "actor_crashed"  # restarted; the next crash escalates
            self.entered, self.go = anyio.Event(), anyio.Event()
            yield pipe

    async def read(self, pipe: kvpipe.Pipeline, producer: int, rid: str, block: int) -> None:
        """A read the escalation fails with ``PipelineClosed``, recorded in ``outcomes``."""
        tokens = np.arange(pipe.cache.layout.block_size)
        with pytest.raises(kvpipe.PipelineClosed) as info:
            await pipe.read(tokens, [block], stream=producer, request_id=rid)
        self.outcomes[rid] = info.value


async def test_an_escalation_lets_go_of_the_slices_waiting_for_the_escalated_actor(
    fake: FakeDriver, producer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swapper crashes past its restart intensity while two reads' fetched slices wait
    in its inbox. Every caller gets ``PipelineClosed`` at once; the slices, which no actor
    receives any more (the escalated one is not restarted), kept their staging until
    ``aclose``, where escalation behaves like a close, at once (docs/architecture.md)."""
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 8)
    esc = _EscalatingSwapper(monkeypatch)
    async with esc.open(fake, producer, cache, queue_depth=2) as pipe:
        async with anyio.create_task_group() as tg:
            tg.start_soon(esc.read, pipe, producer, "crash-2", 1)
            await esc.entered.wait()
            for rid, block in (("b", 2), ("c", 3)):
                tg.start_soon(esc.read, pipe, producer, rid, block)
            await until(lambda: pipe.statistics().queue_depths["swapper"] == 2)
            esc.go.set()
        assert sorted(esc.outcomes) == ["b", "c", "crash-2"] and pipe.closed
        await until(lambda: pipe._runtime._supervisor is None or pipe._runtime._supervisor.stopped)
        stats = pipe.statistics()
        assert stats.queue_depths["swapper"] == 0
        assert stats.staging_in_use_bytes == 0
    free_device_cache(fake, cache)


async def test_an_escalation_lets_go_of_a_slice_waiting_to_enter_the_escalated_inbox_once(
    fake: FakeDriver, producer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swapper escalates while one read's slice waits in its full inbox and another's
    waits for room there (its reader in ``send_until``). Draining the inbox at escalation
    moves the waiting slice in, and must not release it: its sender, whose wait the failed
    request cancels, must not let go of it again. Released by both before, the reader
    crashed on "staging lease released twice" after the escalation. (With anyio 4.16 and
    later, closing the inboxes first withdraws the waiting slice, so this fails with anyio
    4.15 only, which kvpipe supports; tests/actors/test_base.py shows the hand-over on any
    anyio.)"""
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 8)
    esc = _EscalatingSwapper(monkeypatch)
    async with esc.open(fake, producer, cache, queue_depth=1) as pipe:
        swapper = pipe._runtime._outboxes.swapper  # type: ignore[union-attr]
        async with anyio.create_task_group() as tg:
            tg.start_soon(esc.read, pipe, producer, "crash-2", 1)
            await esc.entered.wait()
            tg.start_soon(esc.read, pipe, producer, "b", 2)
            await until(lambda: pipe.statistics().queue_depths["swapper"] == 1)
            tg.start_soon(esc.read, pipe, producer, "c", 3)
            await until(lambda: swapper.statistics().tasks_waiting_send == 1)
            esc.go.set()
        assert sorted(esc.outcomes) == ["b", "c", "crash-2"] and pipe.closed
        await until(lambda: pipe._runtime._supervisor is None or pipe._runtime._supervisor.stopped)
        assert [c.actor for c in pipe.crashes()] == ["swapper", "swapper"]
        assert pipe.statistics().staging_in_use_bytes == 0
    free_device_cache(fake, cache)


async def test_a_copy_failure_fails_the_slice_and_the_pipeline_goes_on(
    fake: FakeDriver, producer: int
) -> None:
    layout = LAYOUTS["gqa"]()
    cache = fake_device_cache(fake, layout, 4)
    tokens = np.arange(2 * layout.block_size)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), device_driver=fake) as pipe:
        fake.fail_next("launch", "CUDA_ERROR_LAUNCH_FAILED")
        first = await pipe.write(tokens, [0, 1], stream=producer)
        assert not first.complete and first.stop_reason == "actor_crashed"
        assert "CUDA_ERROR_LAUNCH_FAILED" in (first.error or "")
        again = await pipe.write(tokens, [0, 1], stream=producer)
        assert again.complete
    free_device_cache(fake, cache)


async def test_a_scatter_failure_fails_the_read_and_the_pipeline_goes_on(
    fake: FakeDriver, producer: int
) -> None:
    """A read's scatter that the driver fails is the swapper's crash: the read ends
    ``actor_crashed`` with the error, the swapper is restarted, and the next read loads."""
    layout = LAYOUTS["gqa"]()
    cache = fake_device_cache(fake, layout, 4)
    tokens = np.arange(2 * layout.block_size)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), device_driver=fake) as pipe:
        assert (await pipe.write(tokens, [0, 1], stream=producer)).complete
        fake.fail_next("launch", "CUDA_ERROR_LAUNCH_FAILED")
        first = await pipe.read(tokens, [2, 3], stream=producer)
        assert first.loaded == 0 and first.stop_reason == "actor_crashed"
        assert "CUDA_ERROR_LAUNCH_FAILED" in (first.error or "")
        [crash] = pipe.crashes()
        assert crash.actor == "swapper" and crash.restarted
        again = await pipe.read(tokens, [2, 3], stream=producer)
        assert again.complete and again.loaded == 2
    free_device_cache(fake, cache)


async def test_opening_failure_leaves_nothing(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    fake.fail_next("module_load", "CUDA_ERROR_NO_BINARY_FOR_GPU")
    with pytest.raises(kvpipe.DeviceError, match="NO_BINARY"):
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), device_driver=fake):
            pytest.fail("opened")  # pragma: no cover
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_failed_open_leaves_no_cycle(fake: FakeDriver, no_cyclic_gc: None) -> None:
    """The engine's open fails in its worker thread: the error comes back through the frames
    that awaited the thread's result; none of them may keep the pipeline, its store and the
    driver in a reference cycle."""
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    store = kvpipe.MemoryStore()
    ref = weakref.ref(store)
    fake.fail_next("module_load", "CUDA_ERROR_NO_BINARY_FOR_GPU")
    try:
        async with kvpipe.open_pipeline(cache, store, device_driver=fake):
            pytest.fail("opened")  # pragma: no cover
    except kvpipe.DeviceError as exc:
        assert "NO_BINARY" in str(exc)
    del store
    # The worker thread lets go of its last call just after handing back the result: by
    # the time it has run another.
    await anyio.to_thread.run_sync(int)
    assert ref() is None, "the pipeline and its store are held in a reference cycle"
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_registration_failure_frees_the_engine(fake: FakeDriver) -> None:
    class Refuses(kvpipe.MemoryStore):
        async def register_staging(self, buffer: memoryview) -> None:
            raise RuntimeError("no")

    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    with pytest.raises(kvpipe.ConfigError, match="register"):
        async with kvpipe.open_pipeline(cache, Refuses(), device_driver=fake):
            pytest.fail("opened")  # pragma: no cover
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_device_cache_without_cuda_is_unsupported(fake: FakeDriver) -> None:
    if probe_device().available:
        pytest.skip("a CUDA driver is present here")
    cache = fake_device_cache(fake, LAYOUTS["gqa"](), 2)
    with pytest.raises(kvpipe.Unsupported, match="not usable here"):
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()):
            pytest.fail("opened")  # pragma: no cover
    free_device_cache(fake, cache)


def _assert_loaded_up_to(n: int, written: list[Rows], before: list[Rows], now: list[Rows]) -> None:
    """Blocks ``[0, n)`` hold what was written; the rest hold what they held before."""
    for want, old, have in zip(written, before, now, strict=True):
        assert (have[:n] == want[:n]).all() and (have[n:] == old[n:]).all()


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        import trio.testing

        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    @pytest.fixture(autouse=True)
    def _coarse_polls(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The engine polls a pending copy every ``poll_max`` (2 ms) at most: in virtual
        time each poll costs real time, so seconds of waiting cost thousands of them. The
        deadlines these tests check are cancel scopes, not polls: poll every 0.25 s."""
        from kvpipe.cuda import _open
        from kvpipe.cuda._resources import CudaOptions

        monkeypatch.setattr(_open, "CudaOptions", functools.partial(CudaOptions, poll_max=0.25))

    async def test_a_scatter_not_started_by_the_read_s_deadline_never_starts(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """The swapper's one worker is held by a gather waiting for the model's stream; a
        read's verified slice waits in its inbox past the read's deadline. The read ends at
        its deadline (queued, no actor's scope would end it: it used to wait for the
        ``deadline_slack`` guard) as ``total_timeout`` with nothing loaded; when the worker
        frees, that slice must not be scattered into the cache: the cache as it was."""
        layout = LAYOUTS["gqa"]()
        cache = fake_device_cache(fake, layout, 6)
        fill_device(fake, cache, seed=4)
        stored, other = np.arange(2 * layout.block_size), np.arange(500, 500 + layout.block_size)
        cfg = _config(slice=2, copy_threads=1, deadline_slack=60)
        async with kvpipe.open_pipeline(
            cache, kvpipe.MemoryStore(), config=cfg, device_driver=fake
        ) as pipe:
            assert (await pipe.write(stored, [0, 1], stream=producer)).complete
            engine = pipe._runtime.engine
            assert engine is not None
            gate = Gate()
            fake.host_op(producer, lambda: None, gate=gate, label="the model, still running")
            before = device_rows(fake, cache)
            results: dict[str, object] = {}

            async def write() -> None:
                results["write"] = await pipe.write(other, [5], stream=producer, timeout=1000)

            read_done = anyio.Event()

            async def read() -> None:
                results["read"] = await pipe.read(stored, [3, 4], stream=producer, timeout=10)
                read_done.set()

            async with anyio.create_task_group() as tg:
                polls = fake.calls.count("event_query")
                tg.start_soon(write)
                # The gather holds the worker, polling the model's mark. Not bare checkpoints
                # here: past its real-time spin it polls between (virtual) sleeps, which the
                # clock jumps only while every task sleeps.
                for _ in range(1000):
                    if fake.calls.count("event_query") >= polls + 3:
                        break
                    await anyio.sleep(0.0005)
                else:
                    pytest.fail("the gather did not poll the model's mark")
                start = anyio.current_time()
                tg.start_soon(read)
                await read_done.wait()
                assert anyio.current_time() == pytest.approx(start + 10)  # not the slack's
                gate.open()
            got = results["read"]
            assert isinstance(got, kvpipe.ReadResult)
            assert (got.loaded, got.stop_reason) == (0, "total_timeout")
        after = device_rows(fake, cache)
        for old, new in zip(before, after, strict=True):
            assert np.array_equal(old[3:5], new[3:5])  # nothing scattered after the deadline
        free_device_cache(fake, cache)

    async def test_a_read_whose_producer_is_busy_past_its_deadline_ends_by_it(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """The model's stream (the read is ordered after it) stays busy past the read's
        deadline: the read ends by its deadline as ``total_timeout`` with nothing loaded, and
        nothing is scattered into the cache when the model's work ends. (The scatter used to
        queue behind the model's work and the read waited for it, past its deadline and past
        ``deadline_slack``, however long the stream stayed busy.)"""
        layout = LAYOUTS["gqa"]()
        cache = fake_device_cache(fake, layout, 6)
        fill_device(fake, cache, seed=5)
        stored = np.arange(2 * layout.block_size)
        cfg = _config(slice=2, deadline_slack=60)
        async with kvpipe.open_pipeline(
            cache, kvpipe.MemoryStore(), config=cfg, device_driver=fake
        ) as pipe:
            assert (await pipe.write(stored, [0, 1], stream=producer)).complete
            gate = Gate()
            fake.host_op(producer, lambda: None, gate=gate, label="the model, still running")
            before = device_rows(fake, cache)
            results: dict[str, object] = {}
            start = anyio.current_time()

            async def read() -> None:
                results["read"] = await pipe.read(stored, [3, 4], stream=producer, timeout=10)
                results["after"] = anyio.current_time() - start

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                try:
                    await anyio.sleep_until(start + 30)  # past the deadline, in the slack
                finally:
                    gate.open()  # the model's work ends
            got = results["read"]
            assert isinstance(got, kvpipe.ReadResult)
            assert (got.loaded, got.stop_reason) == (0, "total_timeout")
            assert results["after"] == pytest.approx(10, abs=0.1)
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            fake.run_until_idle()
        after = device_rows(fake, cache)
        for old, new in zip(before, after, strict=True):
            assert np.array_equal(old[3:5], new[3:5])  # nothing scattered after the deadline
        free_device_cache(fake, cache)

    async def test_a_write_whose_producer_is_busy_past_its_deadline_ends_by_it(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """The model's stream (the write is ordered after it) stays busy past the write's
        deadline: the write ends at its deadline as ``total_timeout`` with nothing stored,
        and no gather runs when the model's work ends. (The gather used to queue behind the
        model's work at once, shielded: the write waited for it past its deadline, until
        the model's work ended or the ``deadline_slack`` guard cut it off, and the swapper's
        worker stayed held all that time.)"""
        layout = LAYOUTS["gqa"]()
        cache = fake_device_cache(fake, layout, 6)
        fill_device(fake, cache, seed=9)
        tokens = np.arange(2 * layout.block_size)
        store = kvpipe.MemoryStore()
        cfg = _config(slice=2, deadline_slack=60)
        async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:
            gate = Gate()
            fake.host_op(producer, lambda: None, gate=gate, label="the model, still running")
            results: dict[str, object] = {}
            start = anyio.current_time()

            async def write() -> None:
                results["write"] = await pipe.write(tokens, [0, 1], stream=producer, timeout=10)
                results["after"] = anyio.current_time() - start

            async with anyio.create_task_group() as tg:
                tg.start_soon(write)
                try:
                    await anyio.sleep_until(start + 30)  # past the deadline, in the slack
                finally:
                    gate.open()  # the model's work ends
            got = results["write"]
            assert isinstance(got, kvpipe.WriteResult)
            assert (got.written, got.stop_reason) == (0, "total_timeout")
            assert results["after"] == pytest.approx(10, abs=0.1)
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            fake.run_until_idle()
            assert fake.launches == []  # no gather queued, then or later
            assert await pipe.lookup(tokens) == 0
        free_device_cache(fake, cache)

    @pytest.mark.parametrize("kind", ["write", "read"])
    @pytest.mark.parametrize("held", ["producer", "copy"])
    @pytest.mark.parametrize("first", ["close", "copy"])
    async def test_a_device_copy_abandoned_at_the_close_deadline_fails_its_request_as_closed(
        self,
        fake: FakeDriver,
        producer: int,
        caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch,
        kind: str,
        held: str,
        first: str,
    ) -> None:
        """A write's gather or a read's scatter is still waiting at the close deadline: for
        the model's stream (``producer``: it has queued nothing) or for its own copy, queued
        on the engine's stream, which the device never finishes (``copy``). The engine ends
        the wait at the deadline (``DeviceError``, "abandoned at the close deadline"), which
        no actor caught: the swapper crashed, logged with its traceback and counted in
        ``crashes()``; and where the copy's wait woke before the close's at that deadline
        (``first="copy"``; the event loop picks), before the close failed the requests, the
        swapper was restarted as after any crash and the request ended ``actor_crashed``
        instead of failing with ``PipelineClosed``, as a request whose host copy a close
        abandons does. And a copy left running on the device was logged as "did not drain
        after a failed copy", naming no cache. Now the request fails with ``PipelineClosed``
        either way, no actor crashes, and a copy left running on the device is logged at
        ERROR as abandoned at the close deadline, naming the cache it may still use."""
        cache, tokens, store = await _two_blocks(fake, producer, kind, seed=6)
        cfg = _config(slice=2, close_timeout=5, deadline_slack=60)
        gate = Gate()
        outcome: list[object] = []
        with caplog.at_level(logging.INFO, "kvpipe"):
            async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:
                engine = pipe._runtime.engine
                assert isinstance(engine, CudaEngine)
                if held == "producer":
                    stream = producer  # the model's work, which never ends
                else:  # a copy of kvpipe's own queued behind work that never ends
                    stream = engine._streams["gather" if kind == "write" else "scatter"]
                fake.host_op(stream, lambda: None, gate=gate, label="never done")
                if first == "copy":  # the close's wait wakes after the copy's has ended
                    real_shielded, held_back = _runtime.shielded, []

                    async def shielded(*args: Any, **kwargs: Any) -> bool:
                        done = await real_shielded(*args, **kwargs)
                        if not held_back:  # the first: the close's for the requests in flight
                            held_back.append(True)
                            for _ in range(1000):
                                if engine._calls == 0:
                                    break
                                await anyio.lowlevel.checkpoint()
                            for _ in range(20):  # the swapper handles what the copy raised
                                await anyio.lowlevel.checkpoint()
                        return done

                    monkeypatch.setattr(_runtime, "shielded", shielded)

                async def call() -> None:
                    try:
                        if kind == "write":
                            await pipe.write(tokens, [0, 1], stream=producer, timeout=1000)
                        else:
                            await pipe.read(tokens, [3, 4], stream=producer, timeout=1000)
                    except kvpipe.KVPipeError as exc:
                        outcome.append(exc)
                    else:
                        outcome.append("returned")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call)
                    await anyio.sleep(1)  # the copy waits (polling) by now
                    assert engine._calls == 1
                    start = anyio.current_time()
                    await pipe.aclose()
                    assert anyio.current_time() - start < 5 + 1.01  # by its bound
        gate.open()
        fake.run_until_idle()
        assert len(outcome) == 1 and isinstance(outcome[0], kvpipe.PipelineClosed), outcome
        assert pipe.crashes() == ()
        crashed = [r.getMessage() for r in caplog.records if "crashed" in r.getMessage()]
        assert crashed == []
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        if held == "copy":  # the close says what it left running on the device, and where
            copy = "gather" if kind == "write" else "scatter"
            left = f"a CUDA {copy} still running at the close deadline was abandoned"
            assert any(left in e and repr(cache) in e for e in errors), errors
            assert not any("failed copy" in e for e in errors), errors
        else:  # nothing was queued: nothing is left running, and everything is freed
            assert errors == []
            live = fake.live()
            assert (live["pinned_allocations"], live["modules"]) == (0, 0), live
        free_device_cache(fake, cache)

    @pytest.mark.parametrize("kind", ["write", "read"])
    async def test_a_device_failure_while_closing_is_still_the_swapper_s_crash(
        self, fake: FakeDriver, producer: int, kind: str
    ) -> None:
        """A copy that the driver fails (a launch error) while the close waits for its
        request, before the close deadline, is a device failure, not a copy the close
        abandoned: the swapper crashes with it and the request ends ``actor_crashed``
        carrying the error (``docs/cuda.md``), as outside a close."""
        cache, tokens, store = await _two_blocks(fake, producer, kind, seed=7)
        cfg = _config(slice=2, close_timeout=50, deadline_slack=60)
        gate = Gate()
        results: list[kvpipe.WriteResult | kvpipe.ReadResult] = []
        async with kvpipe.open_pipeline(cache, store, config=cfg, device_driver=fake) as pipe:
            engine = pipe._runtime.engine
            assert isinstance(engine, CudaEngine)
            fake.host_op(producer, lambda: None, gate=gate, label="the model, still running")

            async def call() -> None:
                if kind == "write":
                    results.append(await pipe.write(tokens, [0, 1], stream=producer, timeout=100))
                else:
                    results.append(await pipe.read(tokens, [3, 4], stream=producer, timeout=100))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.sleep(1)  # the copy waits for the model by now
                assert engine._calls == 1
                tg.start_soon(pipe.aclose)
                await anyio.sleep(1)  # closing, its deadline 49 s away
                fake.fail_next("launch", "CUDA_ERROR_LAUNCH_FAILED")
                gate.open()
        [got] = results
        assert got.stop_reason == "actor_crashed"
        assert "CUDA_ERROR_LAUNCH_FAILED" in (got.error or "")
        [crash] = pipe.crashes()
        assert crash.actor == "swapper" and "CUDA_ERROR_LAUNCH_FAILED" in crash.error
        free_device_cache(fake, cache)

    async def test_a_fetch_that_hangs_ends_the_read_at_its_slice_deadline(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """The store's fetch of the second slice never returns: the read ends when that
        slice's time is up (``slice_timeout``), with exactly the first slice's blocks
        loaded and the rows of the others as they were; the pipeline reads on after."""
        layout = LAYOUTS["mla"]()
        src = fake_device_cache(fake, layout, 6)
        rows = fill_device(fake, src, seed=14)
        dst = fake_device_cache(fake, layout, 6)
        before = fill_device(fake, dst, seed=15)
        store = ScriptedStore(gets={1: Act(hang=True)})
        tokens, ids = np.arange(6 * layout.block_size), list(range(6))
        cfg = kvpipe.PipelineConfig(slice_block_num=3, slice_timeout=4, total_timeout=100)
        async with kvpipe.open_pipeline(src, store, config=cfg, device_driver=fake) as pipe:
            assert (await pipe.write(tokens, ids, stream=producer)).complete
        async with kvpipe.open_pipeline(dst, store, config=cfg, device_driver=fake) as pipe:
            start = anyio.current_time()
            got = await pipe.read(tokens, ids, stream=producer)
            took = anyio.current_time() - start
            assert (got.loaded, got.stop_reason) == (3, "slice_timeout")
            # Virtual seconds, but floats: the deadline (the clock when slice 1 began, plus
            # 4) less ``start`` can come out one rounding under 4 (3.9999999999999996).
            assert 4 - 1e-9 <= took < 4.1
            _assert_loaded_up_to(3, rows, before, device_rows(fake, dst))
            again = await pipe.read(tokens, ids, stream=producer)  # the third get: no script
            assert again.complete and again.loaded == 6
        for want, have in zip(rows, device_rows(fake, dst), strict=True):
            assert (have == want).all()
        free_device_cache(fake, src)
        free_device_cache(fake, dst)


class _CorruptingStore(kvpipe.MemoryStore):
    """Flips a byte of block ``block``'s value as it is fetched: on every fetch
    (``times=None``: stored corrupt) or on the first ``times`` (corrupted in transit)."""

    def __init__(self, block: int, times: int | None) -> None:
        super().__init__()
        self.block, self.times, self.fetches = block, times, 0

    async def get_blocks(self, batch: GetBatch) -> list[BlockStatus]:
        statuses = list(await super().get_blocks(batch))
        for i, buffer in enumerate(batch.buffers):
            if batch.first_block + i == self.block:
                self.fetches += 1
                if self.times is None or self.fetches <= self.times:
                    buffer[100] ^= 0xFF
        return statuses


@pytest.mark.parametrize("stored_corrupt", [False, True])
async def test_a_device_read_refetches_a_block_that_fails_verification(
    fake: FakeDriver, producer: int, stored_corrupt: bool
) -> None:
    """Block 2 of 4 (the last of the first 3-block slice) fails verification. Corrupted in
    transit: fetched again, it passes, and all four are loaded. Stored corrupt: it fails
    again, loading stops before it, its stored value is deleted, and its cache rows and those
    after it keep what they held."""
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 4)
    rows = fill_device(fake, src, seed=7)
    dst = fake_device_cache(fake, layout, 4)
    before = fill_device(fake, dst, seed=8)
    store = _CorruptingStore(block=2, times=None if stored_corrupt else 1)
    tokens = np.arange(4 * layout.block_size)
    async with kvpipe.open_pipeline(src, store, config=_config(), device_driver=fake) as pipe:
        assert (await pipe.write(tokens, [0, 1, 2, 3], stream=producer)).complete
    async with kvpipe.open_pipeline(dst, store, config=_config(), device_driver=fake) as pipe:
        got = await pipe.read(tokens, [0, 1, 2, 3], stream=producer)
        counters = pipe.statistics().counters
    assert store.fetches == 2 and counters["blocks_refetched"] >= 1
    after = device_rows(fake, dst)
    if stored_corrupt:
        assert (got.loaded, got.stop_reason) == (2, "failed_block")
        assert counters["corrupt_blocks_deleted"] == 1 and len(store.keys()) == 3
        _assert_loaded_up_to(2, rows, before, after)
    else:
        assert got.complete and got.loaded == 4 and len(store.keys()) == 4
        for want, have in zip(rows, after, strict=True):
            assert (have == want).all()
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


async def test_a_device_write_that_fails_mid_slice_stores_a_prefix_the_read_loads(
    fake: FakeDriver, producer: int
) -> None:
    """The store fails block 4 of 6 (the second of the second 3-block slice): the write
    stops there with exactly blocks 0-3 counted and stored, and a read of all six loads
    those four into the device cache and leaves the rows of the other two as they were."""
    layout = LAYOUTS["mla"]()
    src = fake_device_cache(fake, layout, 6)
    rows = fill_device(fake, src, seed=11)
    dst = fake_device_cache(fake, layout, 6)
    before = fill_device(fake, dst, seed=12)
    store = ScriptedStore(puts={1: Act(fail=[1])})
    tokens = np.arange(6 * layout.block_size)
    ids = list(range(6))
    async with kvpipe.open_pipeline(src, store, config=_config(), device_driver=fake) as pipe:
        w = await pipe.write(tokens, ids, stream=producer)
    assert (w.written, w.stop_reason) == (4, "incomplete_slice")
    async with kvpipe.open_pipeline(dst, store, config=_config(), device_driver=fake) as pipe:
        r = await pipe.read(tokens, ids, stream=producer)
    assert (r.loaded, r.stop_reason) == (4, "not_stored")
    _assert_loaded_up_to(4, rows, before, device_rows(fake, dst))
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


async def test_a_device_cache_hands_a_partial_last_block_to_decode(
    fake: FakeDriver, producer: int
) -> None:
    """Prefill -> decode through the store from a device cache: two and a half blocks of
    tokens, written with the partial last block (``:partial:N``) and read back whole."""
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 3)
    rows = fill_device(fake, src, seed=13)
    dst = fake_device_cache(fake, layout, 3)
    store = kvpipe.MemoryStore()
    tokens = np.arange(2 * layout.block_size + layout.block_size // 2)
    async with kvpipe.open_pipeline(src, store, config=_config(), device_driver=fake) as pipe:
        w = await pipe.write(tokens, [0, 1, 2], include_partial=True, stream=producer)
    assert w.complete and w.written == 3
    assert sum(":partial:" in k for k in store.keys()) == 1
    async with kvpipe.open_pipeline(dst, store, config=_config(), device_driver=fake) as pipe:
        r = await pipe.read(
            tokens, [2, 1, 0], include_partial=True, require_all=True, stream=producer
        )
    assert r.complete and r.loaded == 3
    for want, have in zip(rows, device_rows(fake, dst), strict=True):
        assert (have[[2, 1, 0]] == want).all()
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


@pytest.mark.parametrize("durability", ["data", "none"])
async def test_a_device_cache_round_trips_through_the_file_store(
    fake: FakeDriver, producer: int, tmp_path: Path, durability: str
) -> None:
    """A device cache written to a :class:`kvpipe.FileStore` and read back, evicted from the
    page cache in between: the store reads into the engine's pinned staging (direct I/O
    where it can) and the engine scatters from it; a block file changed on disk is refused
    and loading stops before it."""
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 6)
    rows = fill_device(fake, src, seed=31)
    dst = fake_device_cache(fake, layout, 6)
    before = fill_device(fake, dst, seed=32)
    tokens, ids = np.arange(6 * layout.block_size), list(range(6))
    config = _config(slice=2)
    async with kvpipe.FileStore(tmp_path / "store", durability=durability) as store:  # type: ignore[arg-type]
        async with kvpipe.open_pipeline(src, store, config=config, device_driver=fake) as pipe:
            assert (await pipe.write(tokens, ids, stream=producer)).complete
        files = sorted((tmp_path / "store" / "blocks").rglob("*.kvb"))
        assert len(files) == 6
        drop_cached(str(tmp_path / "store"))
        # the file of block 4 changed on disk (the pipeline's own keys name it: the 5th key)
        async with kvpipe.open_pipeline(dst, store, config=config, device_driver=fake) as pipe:
            key = block_keys(pipe.scope, as_tokens(tokens), layout.block_size, False)[4]
            path = tmp_path / "store" / os.fsdecode(block_paths([key])[0])
            raw = bytearray(path.read_bytes())
            raw[-100] ^= 0xFF
            path.write_bytes(bytes(raw))
            got = await pipe.read(tokens, ids, stream=producer)
    assert (got.loaded, got.stop_reason) == (4, "failed_block")
    _assert_loaded_up_to(4, rows, before, device_rows(fake, dst))
    free_device_cache(fake, src)
    free_device_cache(fake, dst)


async def _two_blocks(
    fake: FakeDriver, producer: int, kind: str, seed: int
) -> tuple[Any, Any, kvpipe.MemoryStore]:
    """A 6-block GQA device cache filled from ``seed``, two blocks' tokens and a memory store,
    which holds those two blocks already when ``kind`` is ``"read"``."""
    layout = LAYOUTS["gqa"]()
    cache = fake_device_cache(fake, layout, 6)
    fill_device(fake, cache, seed=seed)
    tokens = np.arange(2 * layout.block_size)
    store = kvpipe.MemoryStore()
    if kind == "read":
        async with kvpipe.open_pipeline(
            cache, store, config=_config(slice=2), device_driver=fake
        ) as pipe:
            assert (await pipe.write(tokens, [0, 1], stream=producer)).complete
    return cache, tokens, store
