"""Pipeline behaviour end to end: staging bounds, backpressure, full stores, bad requests."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

import kvpipe
import kvpipe._runtime
import kvpipe.pipeline
from kvpipe.backends import BlockStatus, PutBatch
from tests.fakes import Act, ScriptedStore, StuckInThreadStore
from tests.helpers import fill_random

BLOCK = 16


def _cache(blocks: int = 64) -> kvpipe.KVCache:
    layout = kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK)
    cache = kvpipe.create_kv_cache(layout, blocks)
    fill_random(cache, seed=11)
    return cache


@pytest.mark.parametrize(
    "anyio_backend",
    [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})],
    ids=["asyncio", "uvloop", "trio"],
)
async def test_round_trip_on_every_event_loop(anyio_backend: object) -> None:
    src, dst = _cache(), _cache()
    store = kvpipe.MemoryStore()
    tokens = np.arange(BLOCK * 12)
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(tokens, np.arange(12))).complete
    async with kvpipe.open_pipeline(dst, store) as pipe:
        assert (await pipe.read(tokens, np.arange(40, 52), require_all=True)).loaded == 12
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[0:12], b[40:52])


class BlockingStore(ScriptedStore):
    """Puts run in a worker thread that waits for ``release`` (a wedged disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.thread_done = threading.Event()

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        def wedged() -> None:
            self.entered.set()
            self.release.wait(30)
            self.thread_done.set()

        await batch.run_sync(wedged)
        return [BlockStatus.OK] * len(batch)


async def test_staging_stays_leased_until_an_abandoned_thread_returns() -> None:
    store = BlockingStore()
    config = kvpipe.PipelineConfig(slice_timeout=0.05, total_timeout=5)
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
        # Until a put's thread ran: on a loaded machine a thread may not start before the
        # slice's deadline (the call is then not started, and nothing is left behind).
        with anyio.fail_after(30):  # a hang guard only
            while not store.entered.is_set():
                w = await pipe.write(np.arange(BLOCK * 4), np.arange(4))
                assert (w.written, w.stop_reason) == (0, "slice_timeout")
        # The caller has its answer; the thread still reads the staging buffer.
        assert not store.thread_done.is_set()
        assert pipe.statistics().staging_in_use_bytes > 0
        store.release.set()
        with anyio.fail_after(10):
            while pipe.statistics().staging_in_use_bytes:  # noqa: ASYNC110 (a thread, no event)
                await anyio.sleep(0.01)
        assert store.thread_done.is_set()


async def test_full_store_gives_a_clean_incomplete_result() -> None:
    cache = _cache()
    value = cache.layout.block_nbytes + 48
    store = kvpipe.MemoryStore(capacity_bytes=5 * value)
    async with kvpipe.open_pipeline(
        cache, store, config=kvpipe.PipelineConfig(slice_block_num=4)
    ) as pipe:
        w = await pipe.write(np.arange(BLOCK * 12), np.arange(12))
        assert (w.written, w.stop_reason) == (5, "incomplete_slice")
        assert [s.written for s in w.slices] == [4, 1]
        assert await pipe.lookup(np.arange(BLOCK * 12)) == 5
        assert pipe.statistics().staging_in_use_bytes == 0


async def test_many_concurrent_requests_through_tiny_queues_and_staging() -> None:
    """queue_depth=1 and room for 2 slices: everyone waits their turn, nothing is lost."""
    cache = _cache(blocks=256)
    slot = -(-(cache.layout.block_nbytes + 48) // 64) * 64
    config = kvpipe.PipelineConfig(slice_block_num=2, queue_depth=1, staging_bytes=4 * slot)
    store = kvpipe.MemoryStore()
    async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
        results: list[kvpipe.WriteResult] = []

        async def one(i: int) -> None:
            tokens = np.arange(i * 10_000, i * 10_000 + BLOCK * 6)
            results.append(await pipe.write(tokens, np.arange(i * 6, i * 6 + 6)))

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(one, i)
        assert len(results) == 40 and all(r.complete and r.written == 6 for r in results)
        stats = pipe.statistics()
        assert stats.staging_in_use_bytes == 0 and stats.in_flight == {}
        assert stats.counters["blocks_written"] == 240


async def test_start_block_writes_and_reads_from_there() -> None:
    src = _cache()
    dst = kvpipe.create_kv_cache(src.layout, 64)
    store = kvpipe.MemoryStore()
    tokens = np.arange(BLOCK * 8)
    async with kvpipe.open_pipeline(src, store) as pipe:
        w = await pipe.write(tokens, np.arange(8), start_block=3)
        assert (w.requested, w.written, w.complete) == (5, 5, True)
        assert await pipe.lookup(tokens) == 0  # block 0 is not stored: no leading run
        # from block 3 on, blocks 3..7 are: the blocks before the start are not asked about
        assert await pipe.lookup(tokens, start_block=3) == 5
        assert await pipe.lookup(tokens, start_block=np.int64(6)) == 2
        assert await pipe.lookup(tokens, start_block=8) == 0
        assert await pipe.lookup(tokens, start_block=2) == 0  # block 2: the first miss
        w = await pipe.write(tokens, np.arange(8))
        assert (w.requested, w.skipped, w.written) == (8, 0, 8)
        w = await pipe.write(tokens, np.arange(8), start_block=2)
        assert (w.requested, w.skipped, w.written) == (6, 6, 0)
    async with kvpipe.open_pipeline(dst, store) as pipe:
        r = await pipe.read(tokens, np.arange(20, 28), start_block=5)
        assert (r.requested, r.loaded) == (3, 3)
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[5:8], b[25:28])
        assert not b[20:25].any()  # blocks before start_block untouched


async def test_bad_requests_fail_before_anything_is_queued() -> None:
    store = ScriptedStore()
    async with kvpipe.open_pipeline(_cache(), store) as pipe:
        tokens = np.arange(BLOCK * 4)
        bad = [
            ((tokens, np.arange(3)), {}),
            ((tokens, np.arange(4) + 61), {}),
            ((tokens, np.array([0, 1, 1, 2])), {}),
            ((-tokens, np.arange(4)), {}),
            ((tokens, np.arange(4)), {"start_block": 5}),
            ((tokens, np.arange(4)), {"timeout": 0}),
            ((tokens.astype(float), np.arange(4)), {}),
        ]
        for args, kwargs in bad:
            with pytest.raises(kvpipe.RequestError):
                await pipe.write(*args, **kwargs)  # type: ignore[arg-type]
            with pytest.raises(kvpipe.RequestError):
                await pipe.read(*args, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(kvpipe.RequestError):
            await pipe.flush_index(tokens, residency="gpu")  # type: ignore[arg-type]
        with pytest.raises(kvpipe.RequestError):
            await pipe.lookup([])
        for start in (5, -1, True, 1.0):
            with pytest.raises(kvpipe.RequestError, match="start_block"):
                await pipe.lookup(tokens, start_block=start)  # type: ignore[arg-type]
        # 3 full blocks and a partial one: block 4 is the end only with the partial one
        with pytest.raises(kvpipe.RequestError, match=r"start_block 4 is outside \[0, 3\]"):
            await pipe.lookup(tokens[:-1], start_block=4)
        assert store.calls == []
        assert await pipe.lookup(tokens[:-1], start_block=4, include_partial=True) == 0
        store.calls.clear()
        assert store.calls == []
        assert pipe.statistics().in_flight == {}


async def test_paddle_tensors_from_the_caller() -> None:
    import paddle

    layout = kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK, fp8_scales=True
    )
    tensors = {
        (role, layer): paddle.randint(0, 120, [16, *layout.role(role).block_shape]).astype(
            layout.role(role).dtype
        )
        for role, layer in layout.tensor_order()
    }
    src = kvpipe.KVCache.from_tensors(layout, tensors)
    dst = kvpipe.create_kv_cache(layout, 16, framework="paddle")
    store = kvpipe.MemoryStore()
    tokens = np.arange(BLOCK * 5 + 3)
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(tokens, [4, 2, 0, 9, 7, 1], include_partial=True)).written == 6
    async with kvpipe.open_pipeline(dst, store) as pipe:
        r = await pipe.read(
            tokens, [10, 11, 12, 13, 14, 15], include_partial=True, require_all=True
        )
        assert r.loaded == 6
    for role, layer in layout.tensor_order():
        a = src[role, layer].astype("float32").numpy()[[4, 2, 0, 9, 7, 1]]
        b = dst[role, layer].astype("float32").numpy()[10:16]
        assert np.array_equal(a, b), (role, layer)


async def test_closed_pipeline_rejects_calls() -> None:
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore()) as pipe:
        pass
    assert pipe.closed
    with pytest.raises(kvpipe.PipelineClosed):
        await pipe.write(np.arange(BLOCK), [0])
    assert pipe.statistics().open is False


def test_staging_too_small_for_one_block_is_a_config_error() -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        kvpipe.Pipeline(
            _cache(), kvpipe.MemoryStore(), config=kvpipe.PipelineConfig(staging_bytes=100)
        )
    assert info.value.field == "staging_bytes"


def test_namespace_is_validated() -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        kvpipe.Pipeline(_cache(), kvpipe.MemoryStore(), namespace="../../etc")
    assert info.value.field == "namespace"


class RaisesKVPipeError(ScriptedStore):
    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        raise kvpipe.RequestError("a backend bug raising one of kvpipe's own errors")

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[kvpipe.ResidencyEntry]]:
        return []  # the wrong number of answers


async def test_any_backend_exception_is_a_backend_error_never_a_crash() -> None:
    store = RaisesKVPipeError()
    async with kvpipe.open_pipeline(_cache(), store) as pipe:
        w = await pipe.write(np.arange(BLOCK * 4), np.arange(4))
        assert (w.written, w.stop_reason) == (0, "backend_error")
        assert w.error is not None and "own errors" in w.error
        with pytest.raises(kvpipe.BackendError, match="answers"):
            await pipe.locate(np.arange(BLOCK * 4))
        assert pipe.statistics().restarts == {}


async def test_backends_get_a_read_only_private_copy_of_the_tokens() -> None:
    seen: list[np.ndarray] = []

    class Peek(ScriptedStore):
        async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
            seen.append(batch.token_prefix)
            with pytest.raises(ValueError):
                batch.token_prefix[0] = 99
            return await super().put_blocks(batch)

    tokens = np.arange(BLOCK * 4, dtype=np.int64)
    async with kvpipe.open_pipeline(_cache(), Peek()) as pipe:
        assert (await pipe.write(tokens, np.arange(4))).complete
    assert not np.shares_memory(seen[0], tokens) and tokens[0] == 0


@pytest.mark.parametrize("op", ["lookup", "locate", "flush_index"])
async def test_key_only_calls_copy_the_tokens_once(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long sequence's tokens are checked and copied once per call, not once more on the
    way to the actors (flush_index checks them before the call, to bound start_block)."""
    import kvpipe.pipeline as pipeline_module

    copies: list[int] = []
    check = pipeline_module.check_tokens

    def counted(token_ids: object) -> np.ndarray:
        copies.append(1)
        return check(token_ids)

    monkeypatch.setattr(pipeline_module, "check_tokens", counted)
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore()) as pipe:
        await getattr(pipe, op)(np.arange(BLOCK * 4, dtype=np.int64))
    assert len(copies) == 1


class HangingUnregisterStore(kvpipe.MemoryStore):
    """A store whose ``unregister_staging`` never returns (a vendor call waiting on a server
    that is gone)."""

    async def unregister_staging(self, buffer: memoryview) -> None:
        await anyio.Event().wait()


async def test_close_is_bounded_when_the_store_never_unregisters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Closing is shielded from cancellation, so it bounds its own waits: a store stuck in
    ``unregister_staging`` costs ``close_timeout`` seconds, is logged, and the staging is kept
    alive rather than freed under the store."""
    from kvpipe.backends import _registration

    config = kvpipe.PipelineConfig(close_timeout=0.2, staging_bytes=1 << 20)
    kept = len(_registration.KEPT)
    with caplog.at_level("ERROR", logger="kvpipe.pipeline"), anyio.fail_after(10):
        async with kvpipe.open_pipeline(_cache(), HangingUnregisterStore(), config=config) as pipe:
            assert (await pipe.write(np.arange(2 * BLOCK), [0, 1])).written == 2
    assert pipe.closed
    assert any("unregistering staging" in r.getMessage() for r in caplog.records)
    assert len(_registration.KEPT) == kept + 1


async def _read_until_its_thread_is_stuck(
    pipe: kvpipe.Pipeline, store: StuckInThreadStore, tokens: np.ndarray[Any, Any]
) -> None:
    """Read blocks 2-3 (0.1 s each) until a read's get is stuck in its thread: on a loaded
    machine the thread may not start before the read's deadline (the call is then not
    started, and nothing is left behind). The write before has no such short deadline."""
    with anyio.fail_after(30):  # a hang guard only
        while not store.running.is_set():
            assert (await pipe.read(tokens, [2, 3], timeout=0.1)).loaded == 0


class _UnregisteredStuckStore(StuckInThreadStore):
    """A :class:`StuckInThreadStore` that registers no staging (the default
    ``register_staging`` and ``unregister_staging``, as the memory and file stores)."""

    unregister_staging = kvpipe.StorageBackend.unregister_staging


@pytest.mark.parametrize("registers", [True, False], ids=["registered", "not-registered"])
async def test_staging_a_call_abandoned_at_close_still_uses_stays_registered(
    registers: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A store's thread call that outlived its request and the close deadline may still
    write into staging: the staging is neither unregistered from the store under it nor
    freed, and that is logged. Staging registered with the store is then kept allocated for
    good; staging a store never registered (one that keeps the default ``register_staging``:
    the memory and file stores) was kept for good too, a leak of the whole staging per such
    close, and is now freed once the thread has returned."""
    from kvpipe.backends import _registration

    store = StuckInThreadStore("get") if registers else _UnregisteredStuckStore("get")
    config = kvpipe.PipelineConfig(close_timeout=0.2, staging_bytes=1 << 20)
    kept = len(_registration.KEPT)
    try:
        with caplog.at_level("ERROR", logger="kvpipe"), anyio.fail_after(10):
            async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
                staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
                tokens = np.arange(2 * BLOCK)
                assert (await pipe.write(tokens, [0, 1])).written == 2
                await _read_until_its_thread_is_stuck(pipe, store, tokens)
        assert store.running.is_set()  # still running after close
        assert staging() is not None
        assert True not in store.unregistered
        assert len(_registration.KEPT) == kept + registers
        assert any("still" in r.getMessage() for r in caplog.records)
    finally:
        store.go_on.set()
    with anyio.fail_after(10):
        while pipe.statistics().threads_running:  # noqa: ASYNC110 (a thread, no event)
            await anyio.sleep(0.01)
    del pipe
    assert (staging() is not None) == registers


async def test_statistics_after_close_still_count_a_thread_the_close_abandoned() -> None:
    """A store's thread call that outlived the close deadline still runs, and still holds its
    staging, after the block is left: the final snapshot (what an operator or a metrics
    scrape of the closed pipeline sees) says so, and says 0 once the thread has returned."""
    store = StuckInThreadStore("get")
    config = kvpipe.PipelineConfig(close_timeout=0.2, staging_bytes=1 << 20)
    try:
        with anyio.fail_after(10):
            async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
                tokens = np.arange(2 * BLOCK)
                assert (await pipe.write(tokens, [0, 1])).written == 2
                await _read_until_its_thread_is_stuck(pipe, store, tokens)
        assert store.running.is_set()  # still running after close
        after = pipe.statistics()
        assert not after.open
        assert after.threads_running == 1
        assert after.staging_in_use_bytes > 0
    finally:
        store.go_on.set()
    with anyio.fail_after(10):
        while pipe.statistics().threads_running:  # noqa: ASYNC110 (a thread, no event)
            await anyio.sleep(0.01)
    assert pipe.statistics().staging_in_use_bytes == 0


class HangingPutStore(kvpipe.MemoryStore):
    """A store whose puts never return (until cancelled)."""

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_each_caller_failed_by_the_close_gets_an_error_of_its_own() -> None:
    """Requests still in flight when the pipeline closes end with PipelineClosed, each its
    own (one instance raised in several callers would carry all their tracebacks)."""
    config = kvpipe.PipelineConfig(close_timeout=0.1, staging_bytes=1 << 20)
    errors: list[BaseException] = []

    async def write(pipe: kvpipe.Pipeline, first: int) -> None:
        try:
            await pipe.write(np.arange(first, first + BLOCK), [first // BLOCK])
        except kvpipe.PipelineClosed as exc:
            errors.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async with kvpipe.open_pipeline(_cache(), HangingPutStore(), config=config) as pipe:
                tg.start_soon(write, pipe, 0)
                tg.start_soon(write, pipe, 10 * BLOCK)
                await anyio.wait_all_tasks_blocked()
    assert len(errors) == 2 and errors[0] is not errors[1]


class RefusingUnregisterStore(kvpipe.MemoryStore):
    """A store that refuses to unregister staging (its vendor calls stuck, say)."""

    async def unregister_staging(self, buffer: memoryview) -> None:
        raise kvpipe.BackendError("refusing", "unregister_staging", "refused")


async def test_staging_the_store_would_not_unregister_is_kept_not_freed() -> None:
    from kvpipe.backends import _registration

    config = kvpipe.PipelineConfig(staging_bytes=1 << 20)
    kept = len(_registration.KEPT)
    async with kvpipe.open_pipeline(_cache(), RefusingUnregisterStore(), config=config) as pipe:
        assert (await pipe.write(np.arange(2 * BLOCK), [0, 1])).written == 2
    assert len(_registration.KEPT) == kept + 1


async def test_a_registration_cancelled_while_opening_is_unregistered() -> None:
    """The open was cancelled while the store registered staging (a vendor call that may
    complete): the close unregisters it before the staging is freed."""
    from tests.backends.test_values import SlowRegisterStore

    store = SlowRegisterStore()
    config = kvpipe.PipelineConfig(staging_bytes=1 << 20)
    with anyio.move_on_after(0.1) as scope:
        async with kvpipe.open_pipeline(_cache(), store, config=config):
            pytest.fail("opened")
    assert scope.cancelled_caught
    assert store.registered == []


async def test_a_paddle_float8_tensor_of_block_ids_scatters_nothing() -> None:
    # A float8 tensor reached numpy as int8 bit patterns ([1.0, 2.0] -> [56, 64]): the read
    # loaded the blocks into cache blocks 56 and 64, blocks the caller never named.
    import paddle

    src, dst = _cache(), _cache(128)
    before = [rows.copy() for rows in dst.byte_rows]
    store = kvpipe.MemoryStore()
    tokens = np.arange(BLOCK * 2)
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(tokens, [0, 1])).complete
    ids = paddle.to_tensor([1.0, 2.0]).astype("float8_e4m3fn")
    async with kvpipe.open_pipeline(dst, store) as pipe:
        with pytest.raises(kvpipe.RequestError, match="block_ids must be integers"):
            await pipe.read(tokens, ids)
        assert pipe.statistics().in_flight == {}
    for a, b in zip(before, dst.byte_rows, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("flag", ["no", "false", 0, None])
async def test_require_all_that_is_not_a_bool_loads_nothing(flag: object) -> None:
    # require_all="no" is truthy: the read scattered the stored prefix into the cache,
    # then raised IncompleteRead (0 and None ran as False).
    src, dst = _cache(), _cache()
    before = [rows.copy() for rows in dst.byte_rows]
    store = kvpipe.MemoryStore()
    tokens = np.arange(BLOCK * 4)
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(tokens[: BLOCK * 2], [0, 1])).complete
    async with kvpipe.open_pipeline(dst, store) as pipe:
        with pytest.raises(kvpipe.RequestError, match="require_all must be a bool"):
            await pipe.read(tokens, [4, 5, 6, 7], require_all=flag)  # type: ignore[arg-type]
        assert pipe.statistics().in_flight == {}
    for a, b in zip(before, dst.byte_rows, strict=True):
        assert np.array_equal(a, b)


class _HostTensor:
    """A host tensor reached through ``data_ptr()``, as a Paddle or PyTorch CPU tensor is:
    the cache's byte rows alias its memory without referring to it (its own array here),
    so the memory lives only as long as something keeps the tensor."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def is_contiguous(self) -> bool:
        return bool(self.array.flags.c_contiguous)


async def test_a_close_that_abandons_a_gather_out_of_the_cache_says_so_and_keeps_the_cache(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write's gather out of the cache runs in a copy thread, not shielded (a copy out of
    the cache writes nothing into it), and is stuck past ``close_timeout``. Close returned by
    its bound, the thread still reading the caller's cache, having logged only that worker
    threads were abandoned with their staging slots; and nothing kvpipe kept referred to
    the cache's tensors, so a caller that let go of them (a framework's tensors, whose
    memory the byte rows do not keep) had their freed memory read by that thread. Close now
    names the cache at ERROR (not to be freed or reused), keeps it referenced until the
    thread has ended, and logs that end at WARNING. The abandoned gather's blocks are never
    put."""
    from kvpipe import _engine
    from kvpipe.actors import _base

    go_on, entered = threading.Event(), threading.Event()
    gather_sealed = _base.gather_sealed

    def stuck(*args: Any) -> Any:  # a gather out of the cache that takes its time
        entered.set()
        go_on.wait(30)
        return gather_sealed(*args)

    monkeypatch.setattr(_base, "INLINE_COPY_BYTES", 0)  # every copy in a worker thread
    monkeypatch.setattr(_engine, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(_base, "gather_sealed", stuck)
    layout = _cache().layout
    tensors = [
        _HostTensor(np.zeros((64, *spec.block_shape), dtype=np.dtype(spec.dtype)))
        for _layer in range(layout.num_layers)
        for spec in layout.role_specs
    ]
    tensor = weakref.ref(tensors[0])
    cache = kvpipe.KVCache.from_tensors(layout, tensors)
    described = repr(cache)
    del tensors
    store = kvpipe.MemoryStore()
    config = kvpipe.PipelineConfig(total_timeout=100, slice_timeout=100, close_timeout=0.2)
    try:
        with caplog.at_level(logging.INFO, "kvpipe"), anyio.fail_after(30):  # a hang guard
            async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
                await _close_while_writing(pipe, entered)
            # Closed, by its bound: the gather still reads the cache.
            assert not go_on.is_set() and pipe.statistics().threads_running == 1
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("do not free or reuse" in e and described in e for e in errors), errors
            del pipe, cache
            await _kept_until_the_copy_ends(caplog, tensor, go_on, described)
        assert store.keys() == []  # the abandoned gather's blocks were never put
    finally:
        go_on.set()


def _host_tensor_cache() -> tuple[kvpipe.KVCache, weakref.ref[_HostTensor]]:
    """A cache over :class:`_HostTensor` s that nothing but the cache refers to, and a weak
    reference to its first tensor."""
    layout = _cache().layout
    tensors = [
        _HostTensor(np.zeros((64, *spec.block_shape), dtype=np.dtype(spec.dtype)))
        for _layer in range(layout.num_layers)
        for spec in layout.role_specs
    ]
    return kvpipe.KVCache.from_tensors(layout, tensors), weakref.ref(tensors[0])


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("copy", ["reader", "swapper"])
async def test_a_close_that_abandons_a_read_copy_into_the_cache_is_bounded_and_says_so(
    copy: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read's copy into the cache runs in a copy thread, shielded (a copy into the
    caller's blocks is never cut off by the request): the reader's verify-and-scatter, or
    the swapper's scatter of a slice whose block was fetched again. Stuck past
    ``close_timeout``, it held the close: the actor could not stop, so the close logged
    "actors did not stop ... abandoned: reader" (nothing was abandoned) and then waited for
    the copy, unbounded, at the exit's task group. The wait now stops by the close deadline
    plus its grace: the copy is abandoned to its thread, the close returns by its bound,
    names the cache at ERROR, keeps it referenced until the copy ends, and logs that end at
    WARNING."""
    from kvpipe import _engine
    from kvpipe._runtime import UNWIND_GRACE
    from kvpipe.actors import reader

    module: Any = reader if copy == "reader" else _engine
    name = "check_and_scatter" if copy == "reader" else "scatter"
    go_on, entered, copied = threading.Event(), threading.Event(), threading.Event()
    real = getattr(module, name)

    def stuck(*args: Any) -> Any:  # a copy into the cache that takes its time
        entered.set()
        go_on.wait(10)
        try:
            return real(*args)
        finally:
            copied.set()

    monkeypatch.setattr(reader, "INLINE_COPY_BYTES", 0)  # every copy in a worker thread
    monkeypatch.setattr(_engine, "INLINE_COPY_BYTES", 0)
    memory = kvpipe.MemoryStore()
    tokens = np.arange(4 * BLOCK)
    async with kvpipe.open_pipeline(_cache(), memory) as pipe:
        assert (await pipe.write(tokens, np.arange(4))).complete
    # The swapper scatters a slice whose block 1 failed its check and was fetched again.
    store = memory if copy == "reader" else ScriptedStore(gets={0: Act(corrupt=[1])}, inner=memory)
    cache, tensor = _host_tensor_cache()
    described = repr(cache)
    close_timeout = 0.2
    config = kvpipe.PipelineConfig(
        total_timeout=100, slice_timeout=100, close_timeout=close_timeout
    )
    monkeypatch.setattr(module, name, stuck)
    try:
        with caplog.at_level(logging.INFO, "kvpipe"), anyio.fail_after(30):  # a hang guard
            async with kvpipe.open_pipeline(cache, store, config=config) as pipe:

                async def read(p: kvpipe.Pipeline) -> None:
                    with pytest.raises(kvpipe.PipelineClosed):
                        await p.read(tokens, np.arange(4))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(read, pipe)
                    assert await anyio.to_thread.run_sync(entered.wait, 30)
                    started = anyio.current_time()
                    await pipe.aclose()
            took = anyio.current_time() - started
            # Closed with the copy still running, by its bound (a generous one).
            assert not copied.is_set(), f"the close waited for the copy ({took:.2f} s)"
            assert took < close_timeout + UNWIND_GRACE + 2, took
            assert pipe.statistics().threads_running == 1
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("do not free or reuse" in e and described in e for e in errors), errors
            assert not any("did not stop" in e or "crashed" in e for e in errors), errors
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any(f"were cancelled: {copy}" in w and "were abandoned" in w for w in warnings)
            del pipe, cache
            await _kept_until_the_copy_ends(caplog, tensor, go_on, described)
    finally:
        go_on.set()


async def _close_while_writing(pipe: kvpipe.Pipeline, entered: threading.Event) -> None:
    """Start a 4-block write, wait until its gather has begun in its thread (``entered``),
    then close the pipeline; the write fails with :class:`kvpipe.PipelineClosed`."""

    async def write() -> None:
        with pytest.raises(kvpipe.PipelineClosed):
            await pipe.write(np.arange(4 * BLOCK), np.arange(4))

    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        assert await anyio.to_thread.run_sync(entered.wait, 30)
        await pipe.aclose()


async def _kept_until_the_copy_ends(
    caplog: pytest.LogCaptureFixture,
    tensor: Callable[[], object],
    go_on: threading.Event,
    described: str,
) -> None:
    """The caller has let go of the pipeline and the cache: kvpipe still keeps the cache's
    tensors (``tensor``: a weakref) while the abandoned copy runs; once it is let go on, they
    are freed and its end is logged once, at WARNING, naming the cache (``described``)."""
    gc.collect()
    assert tensor() is not None, "nothing keeps the tensors the copy still uses"
    caplog.clear()
    go_on.set()
    while tensor() is not None:  # until the thread has returned and let go of them
        await anyio.sleep(0.01)
        gc.collect()
    ended = [r for r in caplog.records if "has ended" in r.getMessage()]
    assert [r.levelname for r in ended] == ["WARNING"], ended
    assert described in ended[0].getMessage()


class _RecordingUnregisterStore(kvpipe.MemoryStore):
    """A store that registers staging (as Mooncake's does) and records its unregistering."""

    def __init__(self) -> None:
        super().__init__()
        self.unregistered = 0

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistered += 1
        await super().unregister_staging(buffer)


async def test_a_copy_that_ends_just_past_the_close_deadline_is_not_abandoned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write's gather out of the cache, in its copy thread, ends just after the close
    deadline. The runner waited for worker threads only until the deadline, which had
    passed by the time it was left (after the actors' close): it abandoned the thread at
    once, logged at ERROR that it may still read the cache, and the staging was kept
    registered with the store and allocated for good, for a thread that ended a moment
    later. The runner now waits for them, within the close's bound, until half the grace
    past the deadline (when the actors' waits are abandoned too): the thread ends, nothing
    is abandoned, and the staging is unregistered and freed."""
    from kvpipe import _engine
    from kvpipe._workers import ThreadRunner
    from kvpipe.actors import _base
    from kvpipe.backends import _registration

    go_on, entered = threading.Event(), threading.Event()
    gather_sealed = _base.gather_sealed

    def stuck(*args: Any) -> Any:  # a gather out of the cache, until the runner is left
        entered.set()
        go_on.wait(30)
        return gather_sealed(*args)

    leave = ThreadRunner.__aexit__

    async def left(self: ThreadRunner, *exc_info: Any) -> None:
        go_on.set()  # the thread ends now: after the close deadline, while the runner waits
        await leave(self, *exc_info)

    monkeypatch.setattr(_base, "INLINE_COPY_BYTES", 0)  # every copy in a worker thread
    monkeypatch.setattr(_engine, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(_base, "gather_sealed", stuck)
    monkeypatch.setattr(ThreadRunner, "__aexit__", left)
    # A wide grace: the thread has seconds, not half a second, to end on a loaded machine.
    monkeypatch.setattr(kvpipe.pipeline, "UNWIND_GRACE", 10.0)
    monkeypatch.setattr(kvpipe._runtime, "UNWIND_GRACE", 10.0)
    store = _RecordingUnregisterStore()
    config = kvpipe.PipelineConfig(
        total_timeout=100, slice_timeout=100, close_timeout=0.2, staging_bytes=1 << 20
    )
    kept = len(_registration.KEPT)
    try:
        with caplog.at_level(logging.INFO, "kvpipe"), anyio.fail_after(30):  # a hang guard
            async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
                await _close_while_writing(pipe, entered)
                deadline = pipe._runtime.close_deadline
                assert deadline is not None and anyio.current_time() >= deadline
        assert go_on.is_set()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
        assert pipe.statistics().threads_running == 0
        assert (store.unregistered, len(_registration.KEPT)) == (1, kept)
    finally:
        go_on.set()
