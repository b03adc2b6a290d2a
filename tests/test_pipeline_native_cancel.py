"""asyncio's own cancellation (``Task.cancel``: a client disconnect, ``asyncio.timeout``,
``asyncio.wait_for``) is not stopped by anyio's shielded cancel scopes: a native cancel is
thrown into the task wherever it waits, shielded or not. What kvpipe must finish before a
call returns (a read's copy into the caller's cache) or before a close returns (failing the
calls in flight) must hold against it too."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe.actors import reader as reader_module
from tests.fakes import Act, ScriptedStore
from tests.helpers import fill_random

#: asyncio's own event loop and uvloop's (asyncio's tasks on both).
pytestmark = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)

#: A block of 512 KiB: a read's copy into the cache runs in a worker thread.
BIG = kvpipe.CacheLayout.gqa(
    num_layers=2, num_kv_heads=8, head_dim=128, block_size=64, dtype="float16"
)

SMALL = kvpipe.CacheLayout.gqa(
    num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16"
)


async def _until(predicate: Any, what: str) -> None:
    """Short sleeps until ``predicate()`` (a worker thread cannot wake the loop)."""
    for _ in range(5000):
        if predicate():
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


async def test_a_read_cancelled_twice_returns_only_after_its_copy_into_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read cancelled while its copy into the cache runs waits for that copy (shielded);
    a second ``Task.cancel`` (an outer timeout, a shutdown after a client disconnect) went
    through the shield: the read returned with the copy still running, which then wrote
    into blocks the caller had already freed (and may have given to another request)."""
    gate, started, finished = threading.Event(), threading.Event(), threading.Event()
    real = reader_module.check_and_scatter

    def slow_scatter(*args: Any) -> Any:
        started.set()
        gate.wait(30)
        try:
            return real(*args)
        finally:
            finished.set()

    cache = kvpipe.create_kv_cache(BIG, 8)
    fill_random(cache, seed=1)
    tokens = np.arange(64 * 2)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
        assert (await pipe.write(tokens, np.arange(2))).complete
        monkeypatch.setattr(reader_module, "check_and_scatter", slow_scatter)
        task = asyncio.create_task(pipe.read(tokens, np.arange(4, 6)))
        try:
            await _until(started.is_set, "the copy into the cache started")
            task.cancel("client disconnected")
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            task.cancel("server shutting down")
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            returned_during_copy = task.done()
        finally:
            gate.set()
        assert not returned_during_copy, "the read returned while its copy into the cache ran"
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()
        # the pipeline serves on
        assert (await pipe.read(tokens, np.arange(6, 8))).loaded == 2


async def test_a_close_cancelled_by_asyncio_still_fails_the_calls_in_flight() -> None:
    """Closing is shielded: it completes, and the calls still waiting at its deadline raise
    ``PipelineClosed``. A ``Task.cancel`` of the closing task (a lifespan under a timeout,
    the shutdown's cancellation) went through anyio's shield: the close returned at once,
    having failed nothing, and the calls waited on for their own deadlines (30 s by default)
    on a pipeline whose actors were gone."""
    cache = kvpipe.create_kv_cache(SMALL, 24)
    store = ScriptedStore(puts={i: Act(hang=True) for i in range(3)})
    config = kvpipe.PipelineConfig(slice_block_num=2, close_timeout=0.2)
    opened: list[kvpipe.Pipeline] = []
    calls: list[asyncio.Task[kvpipe.WriteResult]] = []

    async def serve() -> None:
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            opened.append(pipe)
            for i in range(3):
                tokens = np.arange(i * 100, i * 100 + 32)
                calls.append(asyncio.create_task(pipe.write(tokens, np.arange(8), timeout=10)))
            await store.wait_calls("put", 3)

    server = asyncio.create_task(serve())
    try:
        await _until(lambda: opened and opened[0].closed, "the close began")
        server.cancel("shutting down")  # the close waits for the calls in flight now
        with pytest.raises(asyncio.CancelledError):
            await server
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert all(c.done() for c in calls), "calls still waiting after the close returned"
        for c in calls:
            assert isinstance(c.exception(), kvpipe.PipelineClosed)
        stats = opened[0].statistics()
        assert not stats.in_flight and stats.staging_in_use_bytes == 0, stats
    finally:
        for c in calls:
            c.cancel()


async def test_a_close_cancelled_by_asyncio_still_bounds_the_threads_by_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """open_pipeline's exit gives the worker threads the close's deadline
    (ThreadRunner.close_by) after aclose. When aclose raised the asyncio cancel it had held
    back, that step was skipped: the threads' wait then ran a whole close_timeout from that
    point, past the close deadline."""
    from kvpipe import _workers

    bounded: list[float] = []
    close_by = _workers.ThreadRunner.close_by

    def record(self: Any, deadline: float) -> None:
        bounded.append(deadline)
        close_by(self, deadline)

    monkeypatch.setattr(_workers.ThreadRunner, "close_by", record)
    cache = kvpipe.create_kv_cache(SMALL, 24)
    store = ScriptedStore(puts={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(slice_block_num=2, close_timeout=0.2)
    opened: list[kvpipe.Pipeline] = []

    calls: list[asyncio.Task[kvpipe.WriteResult]] = []

    async def serve() -> None:
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            opened.append(pipe)
            calls.append(asyncio.create_task(pipe.write(np.arange(32), np.arange(8), timeout=10)))
            await store.wait_calls("put", 1)  # the close waits for it (its put hangs)

    server = asyncio.create_task(serve())
    try:
        await _until(lambda: opened and opened[0].closed, "the close began")
        server.cancel("shutting down")
        with pytest.raises(asyncio.CancelledError):
            await server
        assert bounded, "the threads were not given the close's deadline"
    finally:
        for c in calls:
            c.cancel()
