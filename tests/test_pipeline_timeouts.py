"""Deadlines in virtual time (trio's MockClock through anyio): exact, never overrun."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio.testing
import xxhash

import kvpipe
from kvpipe import _engine as engine_module
from kvpipe._keys import as_tokens, block_keys
from kvpipe.actors import _base as base_module
from kvpipe.actors import reader as reader_module
from kvpipe.actors import scheduler as scheduler_module
from kvpipe.actors import writer as writer_module
from kvpipe.backends import BlockStatus, GetBatch
from tests.fakes import Act, ScriptedStore
from tests.helpers import fill_random, until

BLOCK = 4


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def _cache() -> kvpipe.KVCache:
    layout = kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=1, head_dim=8, block_size=BLOCK, dtype="float16"
    )
    cache = kvpipe.create_kv_cache(layout, 64)
    fill_random(cache, seed=7)
    return cache


def _config(**kw: float) -> kvpipe.PipelineConfig:
    base: dict[str, float] = {"slice_block_num": 4, "slice_timeout": 10.0, "total_timeout": 15.0}
    base.update(kw)
    return kvpipe.PipelineConfig(**base)  # type: ignore[arg-type]


class _Held:
    """``fn`` held in its (worker) thread until ``go_on`` is set, ``seconds`` at most."""

    def __init__(self, fn: Callable[..., Any], go_on: threading.Event, seconds: float) -> None:
        self.fn, self.go_on, self.seconds = fn, go_on, seconds
        self.entered = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.entered.set()
        self.go_on.wait(self.seconds)
        return self.fn(*args)

    async def wait_entered(self) -> None:
        """Until a call is held, keeping the loop busy: were it idle, virtual time would jump
        to the deadline of the request waiting for the call's thread to start."""
        # Polled: the call runs in a kvpipe thread, which has no way into the loop's Event.
        while not self.entered.is_set():
            await anyio.lowlevel.checkpoint()


TOKENS = np.arange(16 * BLOCK)  # 16 blocks → 4 slices of 4
IDS = np.arange(16)


async def test_hang_in_slice_2_ends_at_total_deadline_not_slice_deadline() -> None:
    """slice_timeout=10, total=15; slices 0-1 take 5 s each, slice 2 hangs → ends at 15."""
    store = ScriptedStore(puts={0: Act(delay=5), 1: Act(delay=5), 2: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config()) as pipe:
        start = anyio.current_time()
        w = await pipe.write(TOKENS, IDS)
        assert anyio.current_time() - start == pytest.approx(15.0)
        assert w.elapsed == pytest.approx(15.0)
        assert (w.written, w.complete, w.stop_reason) == (8, False, "total_timeout")
        assert [s.outcome for s in w.slices] == ["complete", "complete", "total_timeout"]
        assert [c.first_block for c in store.calls_of("put")] == [0, 4, 8]  # slice 3 never sent
        assert store.calls_of("put")[2].cancelled
        assert await pipe.lookup(TOKENS) == 8
    assert len(store.inner.keys()) == 8


async def test_slice_timeout_when_it_binds() -> None:
    store = ScriptedStore(puts={1: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(total_timeout=30)) as pipe:
        start = anyio.current_time()
        w = await pipe.write(TOKENS, IDS)
        assert anyio.current_time() - start == pytest.approx(10.0)
        assert (w.written, w.stop_reason) == (4, "slice_timeout")
        assert w.slices[1].outcome == "slice_timeout"
        assert w.slices[1].elapsed == pytest.approx(10.0)
        assert len(store.calls_of("put")) == 2


async def test_each_slice_gets_min_of_slice_timeout_and_time_left() -> None:
    """Slices 0-2 take 4 s each; slice 3 hangs: it gets 15 - 12 = 3 s, not 10."""
    store = ScriptedStore(
        puts={0: Act(delay=4), 1: Act(delay=4), 2: Act(delay=4), 3: Act(hang=True)}
    )
    async with kvpipe.open_pipeline(_cache(), store, config=_config()) as pipe:
        w = await pipe.write(TOKENS, IDS)
        assert w.elapsed == pytest.approx(15.0)
        assert w.slices[3].elapsed == pytest.approx(3.0)
        assert (w.written, w.stop_reason) == (12, "total_timeout")


async def test_incomplete_slice_stops_and_never_counts_blocks_after_the_failed_one() -> None:
    store = ScriptedStore(puts={1: Act(fail=[2])})  # blocks 4, 5 stored, 6 failed, 7 stored
    async with kvpipe.open_pipeline(_cache(), store, config=_config()) as pipe:
        w = await pipe.write(TOKENS, IDS)
        assert (w.written, w.complete, w.stop_reason) == (6, False, "incomplete_slice")
        assert [(s.blocks, s.written, s.outcome) for s in w.slices] == [
            (4, 4, "complete"),
            (4, 2, "incomplete"),
        ]
        assert len(store.calls_of("put")) == 2
        key7 = store.calls_of("put")[1].keys[3]
        assert await pipe.lookup(TOKENS) == 6  # block 7 is stored but never counted
        assert key7 in store.inner.keys() and store.deleted == []


async def test_backend_exception_is_a_backend_error_result() -> None:
    store = ScriptedStore(puts={0: Act(error=OSError("disk on fire"))})
    async with kvpipe.open_pipeline(_cache(), store, config=_config()) as pipe:
        w = await pipe.write(TOKENS, IDS)
        assert (w.written, w.stop_reason) == (0, "backend_error")
        assert w.error is not None and "disk on fire" in w.error
        assert len(store.calls_of("put")) == 1


async def test_caller_cancellation_cancels_the_slice_in_flight_and_sends_no_more() -> None:
    store = ScriptedStore(puts={1: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(total_timeout=100)) as pipe:
        with anyio.move_on_after(3):
            await pipe.write(TOKENS, IDS)
        await anyio.sleep(50)
        puts = store.calls_of("put")
        assert len(puts) == 2 and puts[1].cancelled
        assert await pipe.lookup(TOKENS) == 4
        assert pipe.statistics().staging_in_use_bytes == 0


async def test_dedup_probe_hang_gives_up_after_slice_timeout_and_writes_everything() -> None:
    store = ScriptedStore(exists={0: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(total_timeout=30)) as pipe:
        w = await pipe.write(TOKENS, IDS)
        assert w.elapsed == pytest.approx(10.0)
        assert (w.skipped, w.written, w.complete) == (0, 16, True)
        assert pipe.statistics().counters["probe_errors"] == 1


async def test_dedup_probe_hang_ends_at_total_deadline_when_that_comes_first() -> None:
    store = ScriptedStore(exists={0: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(slice_timeout=20)) as pipe:
        w = await pipe.write(TOKENS, IDS)
        assert w.elapsed == pytest.approx(15.0)
        assert (w.written, w.stop_reason, w.slices) == (0, "total_timeout", ())
        assert store.calls_of("put") == []


async def test_read_slice_timeout_loads_only_the_leading_slices() -> None:
    store = ScriptedStore(gets={1: Act(hang=True), 5: Act(hang=True)})
    cache = _cache()
    async with kvpipe.open_pipeline(cache, store, config=_config(total_timeout=30)) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        dst = np.arange(20, 36)
        start = anyio.current_time()
        r = await pipe.read(TOKENS, dst)
        assert anyio.current_time() - start == pytest.approx(10.0)
        assert (r.loaded, r.complete, r.stop_reason) == (4, False, "slice_timeout")
        assert set(range(4, 8)) <= set(r.failed_blocks)
        for rows in cache.byte_rows:
            assert np.array_equal(rows[0:4], rows[20:24])
        start = anyio.current_time()
        with pytest.raises(kvpipe.IncompleteRead) as info:
            await pipe.read(TOKENS, dst, require_all=True, timeout=5)
        assert anyio.current_time() - start == pytest.approx(5.0)
        result = info.value.result
        assert isinstance(result, kvpipe.ReadResult)
        assert (result.loaded, result.stop_reason) == (4, "total_timeout")
        assert info.value.failed_blocks == result.failed_blocks


async def test_lookup_timeout_raises_operation_timeout_at_its_deadline() -> None:
    store = ScriptedStore(exists={0: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(lookup_timeout=2)) as pipe:
        start = anyio.current_time()
        with pytest.raises(kvpipe.OperationTimeout):
            await pipe.lookup(TOKENS)
        assert anyio.current_time() - start == pytest.approx(2.0)


async def test_a_read_probe_or_lookup_whose_exists_hangs_gives_up_after_slice_timeout() -> None:
    """docs/embedding.md, section 7: every ``exists`` call of a probe gets at most
    ``slice_timeout``, not the request's whole budget."""
    config = _config(slice_timeout=2, total_timeout=15, lookup_timeout=10)
    store = ScriptedStore()
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        store.scripts = {"put": {}, "get": {}, "exists": {store.counts["exists"]: Act(hang=True)}}
        r = await pipe.read(TOKENS, np.arange(20, 36))
        assert r.elapsed == pytest.approx(2.0)
        assert (r.loaded, r.stop_reason) == (0, "slice_timeout")
        store.scripts = {"put": {}, "get": {}, "exists": {store.counts["exists"]: Act(hang=True)}}
        start = anyio.current_time()
        with pytest.raises(kvpipe.OperationTimeout, match="slice_timeout"):
            await pipe.lookup(TOKENS)
        assert anyio.current_time() - start == pytest.approx(2.0)


async def test_concurrent_requests_overlap_but_slices_of_one_go_in_order() -> None:
    store = ScriptedStore(puts={i: Act(delay=1) for i in range(8)})
    cache = _cache()
    t2 = np.arange(1000, 1000 + 16 * BLOCK)
    async with kvpipe.open_pipeline(cache, store, config=_config(total_timeout=60)) as pipe:
        results = {}

        async def go(name: str, tokens: np.ndarray, ids: np.ndarray) -> None:
            results[name] = await pipe.write(tokens, ids)

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(go, "a", TOKENS, IDS)
            tg.start_soon(go, "b", t2, np.arange(32, 48))
        # 4 slices of 1 s each per request, two requests overlapping: 4 s, not 8 s.
        assert anyio.current_time() - start == pytest.approx(4.0)
        assert all(r.complete for r in results.values())
        a_calls = [
            c.first_block for c in store.calls_of("put") if c.keys[0] in _keys_of(pipe, TOKENS)
        ]
        b_calls = [c.first_block for c in store.calls_of("put") if c.keys[0] in _keys_of(pipe, t2)]
        assert a_calls == [0, 4, 8, 12] and b_calls == [0, 4, 8, 12]


def _keys_of(pipe: kvpipe.Pipeline, tokens: np.ndarray) -> set[str]:
    from kvpipe._keys import as_tokens, block_keys

    return set(block_keys(pipe.scope, as_tokens(tokens), BLOCK, False))


async def test_a_cancelled_lookup_stops_asking_the_store() -> None:
    store = ScriptedStore(exists={0: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=_config(lookup_timeout=100)) as pipe:
        with anyio.move_on_after(1):
            await pipe.lookup(TOKENS)
        await anyio.sleep(1)  # virtual time: lets the scheduler see the cancellation
        assert store.calls_of("exists")[0].cancelled
        assert pipe.statistics().in_flight == {}


async def test_a_cancelled_write_gives_up_its_place_in_the_staging_queue() -> None:
    """Staging for one slice only; a hung write holds it. A second write waits for staging;
    when its caller is cancelled it leaves the queue at once (not at its deadline)."""
    cache = _cache()
    slot = -(-(cache.layout.block_nbytes + 48) // 64) * 64
    store = ScriptedStore(puts={0: Act(hang=True)})
    config = _config(total_timeout=1000, slice_timeout=1000, staging_bytes=4 * slot)
    async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe.write, TOKENS[: 4 * BLOCK], IDS[:4])  # one slice, hangs
            await store.wait_calls("put")
            with anyio.move_on_after(5):
                await pipe.write(np.arange(5000, 5000 + 4 * BLOCK), np.arange(40, 44))
            await anyio.sleep(0.01)
            stats = pipe.statistics()
            assert stats.staging_waiters == 0 and stats.in_flight == {"write": 1}
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("gathered_ahead", [False, True])
async def test_aclose_returns_only_once_cancelled_actors_have_let_go_of_staging(
    gathered_ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write hangs in its second slice past the close deadline (the third slice gathered
    ahead, holding staging, where gathers run in threads): aclose cancels the actors and
    returns only once they have unwound, so no staging is still leased when it returns."""
    if gathered_ahead:
        monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)
    store = ScriptedStore(puts={1: Act(hang=True)})
    config = _config(total_timeout=100, slice_timeout=100, close_timeout=5)
    failed: list[BaseException] = []

    async def write(pipe: kvpipe.Pipeline) -> None:
        try:
            await pipe.write(TOKENS, IDS)
        except kvpipe.PipelineClosed as exc:
            failed.append(exc)

    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
        async with anyio.create_task_group() as tg:
            tg.start_soon(write, pipe)
            await store.wait_calls("put", 2)
            start = anyio.current_time()
            await pipe.aclose()
            assert anyio.current_time() - start == pytest.approx(5.0)
            assert pipe.statistics().staging_in_use_bytes == 0
    assert len(failed) == 1


async def test_a_gather_waiting_for_a_copy_thread_ends_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy thread is stuck at the deadline (its slice gathered in a thread): the write
    ends at its deadline, not by the deadline guard ``deadline_slack`` later."""
    go_on = threading.Event()
    stuck = _Held(base_module.gather_sealed, go_on, 30)

    monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(base_module, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(engine_module, "INLINE_COPY_BYTES", 0)
    monkeypatch.setattr(base_module, "gather_sealed", stuck)
    try:
        async with kvpipe.open_pipeline(_cache(), ScriptedStore(), config=_config()) as pipe:
            start = anyio.current_time()
            w = await pipe.write(TOKENS, IDS)
            assert anyio.current_time() - start == pytest.approx(15.0)
            assert (w.written, w.stop_reason) == (0, "total_timeout")
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            go_on.set()
    finally:
        go_on.set()


@pytest.mark.parametrize("op", ["write", "lookup"])
async def test_keys_hashed_in_a_busy_thread_end_the_request_at_its_deadline(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long sequence's keys are hashed in a copy thread; that thread is stuck at the
    deadline: the request ends at its deadline, not by the guard ``deadline_slack`` later."""
    go_on = threading.Event()
    stuck = _Held(scheduler_module.block_keys, go_on, 30)

    monkeypatch.setattr(scheduler_module, "_THREAD_KEYS_TOKENS", 0)
    monkeypatch.setattr(scheduler_module, "block_keys", stuck)
    config = _config(lookup_timeout=15)
    try:
        async with kvpipe.open_pipeline(_cache(), ScriptedStore(), config=config) as pipe:
            start = anyio.current_time()
            if op == "write":
                w = await pipe.write(TOKENS, IDS)
                assert (w.written, w.stop_reason) == (0, "total_timeout")
            else:
                with pytest.raises(kvpipe.OperationTimeout):
                    await pipe.lookup(TOKENS)
            assert anyio.current_time() - start == pytest.approx(15.0)
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            go_on.set()
    finally:
        go_on.set()


async def test_a_read_whose_copy_waits_for_a_busy_thread_ends_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one copy thread is stuck (another write's gather) when a read's blocks come
    back: the read's check-and-scatter never starts, and the read ends at its deadline with
    nothing loaded, not once the thread is free."""
    go_on = threading.Event()
    stuck = _Held(base_module.gather_sealed, go_on, 5)

    async def write_stuck(pipe: kvpipe.Pipeline) -> None:
        await pipe.write(TOKENS + 1000, IDS, timeout=1)

    try:
        async with kvpipe.open_pipeline(_cache(), ScriptedStore(), config=_config()) as pipe:
            assert (await pipe.write(TOKENS, IDS)).written == 16
            for module in (writer_module, base_module, engine_module, reader_module):
                monkeypatch.setattr(module, "INLINE_COPY_BYTES", 0)
            monkeypatch.setattr(base_module, "gather_sealed", stuck)
            async with anyio.create_task_group() as tg:
                tg.start_soon(write_stuck, pipe)
                await stuck.wait_entered()
                await anyio.sleep(2)  # that write has ended; its gather's thread has not
                start = anyio.current_time()
                dst = np.arange(16, 32)
                r = await pipe.read(TOKENS, dst, timeout=5)
                assert anyio.current_time() - start == pytest.approx(5.0)
                assert (r.loaded, r.stop_reason) == (0, "total_timeout")
                assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            go_on.set()
    finally:
        go_on.set()


async def test_deleting_a_corrupt_block_does_not_hold_back_the_read() -> None:
    """A host cache's read of small slices from a store that keeps its values runs its
    slices one after another in the reader's loop. Deleting a block that failed verification
    is best effort, after the fact: the read's result must not wait for it (it did, up to
    ``slice_timeout``, while the slices after the failed one stayed unresolved)."""

    class SlowDelete(kvpipe.MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.go_on = anyio.Event()
            self.deleted: list[str] = []

        async def delete(self, keys: Sequence[str]) -> None:
            await self.go_on.wait()
            self.deleted.extend(keys)
            await super().delete(keys)

    store = SlowDelete()
    async with kvpipe.open_pipeline(_cache(), store, config=_config()) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        key = block_keys(pipe.scope, as_tokens(TOKENS), BLOCK, False)[5]
        bad = store._data[key].copy()
        bad[0] ^= 0xFF  # a payload byte: the checksum no longer matches
        store._data[key] = bad
        start = anyio.current_time()
        r = await pipe.read(TOKENS, np.arange(20, 36))
        assert anyio.current_time() - start == 0
        assert (r.loaded, r.stop_reason) == (5, "failed_block")
        assert store.deleted == []  # still being deleted
        store.go_on.set()
        await anyio.sleep(1)
        assert store.deleted == [key]
        assert await pipe.lookup(TOKENS) == 5


async def test_a_refetched_block_whose_check_waits_for_a_busy_thread_ends_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block fails verification and is fetched again; by the time it is back, the one
    copy thread is stuck (another write's gather). Checking it again never starts after the
    read's deadline: the read ends at its deadline with the blocks before it, not by the
    deadline guard ``deadline_slack`` later."""
    go_on = threading.Event()
    stuck = _Held(base_module.gather_sealed, go_on, 5)
    store = ScriptedStore(gets={0: Act(corrupt=[2]), 1: Act(delay=2)})
    outcome: dict[str, kvpipe.ReadResult] = {}

    async def read(pipe: kvpipe.Pipeline) -> None:
        outcome["read"] = await pipe.read(TOKENS[: 4 * BLOCK], np.arange(20, 24), timeout=5)

    async def write_stuck(pipe: kvpipe.Pipeline) -> None:
        await pipe.write(TOKENS + 1000, IDS, timeout=1)

    try:
        config = _config(copy_threads=1)
        async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
            assert (await pipe.write(TOKENS, IDS)).complete
            # Gathers and the second check in a thread; the first check-and-scatter inline,
            # so no thread runs before the stuck one (virtual time jumps while one runs).
            for module in (writer_module, base_module, engine_module):
                monkeypatch.setattr(module, "INLINE_COPY_BYTES", 0)
            monkeypatch.setattr(base_module, "gather_sealed", stuck)
            start = anyio.current_time()
            async with anyio.create_task_group() as tg:
                tg.start_soon(read, pipe)
                await store.wait_calls("get", 2)  # the refetch of blocks 2..: the thread is free
                tg.start_soon(write_stuck, pipe)  # its gather takes the thread
                await stuck.wait_entered()
            r = outcome["read"]
            assert r.elapsed == pytest.approx(5.0)
            assert (r.loaded, r.stop_reason) == (2, "total_timeout")
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            assert anyio.current_time() - start == pytest.approx(5.0)
            go_on.set()
    finally:
        go_on.set()


class _OwnBuffersStore(ScriptedStore):
    """Hands the values before ``own`` to the batch's sink from buffers of its own, as the
    file store does (staging keeps nothing of them: zeroed here); the rest are fetched into
    staging. Its first get damages the value at ``own`` (reported ``OK``)."""

    uses_sink = True

    def __init__(self, own: int) -> None:
        super().__init__(gets={0: Act(corrupt=[own])})
        self.own = own

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        statuses = list(await super().get_blocks(batch))
        sink, buffers = batch.sink, batch.buffers
        if sink is None:
            return statuses

        # On the event loop, not in a thread: virtual time would jump while one runs.
        for i in range(min(self.own, len(buffers))):
            value = bytes(buffers[i])
            buffers[i][:] = bytes(len(value))
            if not sink.fetched(i, xxhash.xxh3_64_intdigest(value), memoryview(value)):
                statuses[i] = BlockStatus.CORRUPT
        return statuses


async def test_a_stage_back_waiting_for_a_busy_thread_ends_the_read_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store hands blocks 0-2 to the sink from its own buffers, and block 3 fails
    verification, then passes when fetched again: blocks 0-2 must be copied back from the
    cache into staging for the swapper. The one copy thread is stuck (another write's
    gather): that copy never starts after the read's deadline, and the read ends at its
    deadline with the blocks placed already, not by the deadline guard later."""
    go_on = threading.Event()
    stuck = _Held(base_module.gather_sealed, go_on, 5)
    store = _OwnBuffersStore(own=3)
    cache = _cache()
    try:
        config = _config(copy_threads=1)
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            assert (await pipe.write(TOKENS, IDS)).complete
            payload = cache.layout.block_nbytes
            # Copies of one block inline (the checks of block 3), of more in a thread (the
            # copy back of blocks 0-2, a write's gather of four).
            monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", 0)
            monkeypatch.setattr(base_module, "INLINE_COPY_BYTES", payload)
            monkeypatch.setattr(engine_module, "INLINE_COPY_BYTES", payload)
            monkeypatch.setattr(base_module, "gather_sealed", stuck)
            written: list[kvpipe.WriteResult] = []

            async def write_stuck() -> None:
                written.append(await pipe.write(TOKENS + 1000, IDS, timeout=1))

            async with anyio.create_task_group() as tg:
                tg.start_soon(write_stuck)  # its gather holds the thread
                await stuck.wait_entered()
            assert [(w.written, w.stop_reason) for w in written] == [(0, "total_timeout")]
            start = anyio.current_time()
            r = await pipe.read(TOKENS[: 4 * BLOCK], np.arange(20, 24), timeout=5)
            assert len(store.calls_of("get")) == 2  # block 3 was fetched again
            assert anyio.current_time() - start == pytest.approx(5.0)
            assert r.elapsed == pytest.approx(5.0)
            assert (r.loaded, r.stop_reason) == (3, "total_timeout")
            stats = pipe.statistics()
            assert stats.counters.get("deadline_guard_expired", 0) == 0
            assert stats.counters["blocks_read"] == 3  # those it loaded, placed already
            # The read's one slice is counted once, as its fetch ended (not again as late).
            assert {k: n for k, n in stats.slices.items() if k.startswith("read_")} == {
                "read_complete": 1
            }
            for rows in cache.byte_rows:
                assert np.array_equal(rows[0:3], rows[20:23])
            go_on.set()
    finally:
        go_on.set()


async def test_cancelling_the_task_that_opened_the_pipeline_lets_in_flight_writes_finish() -> None:
    """A server's lifespan task holds the pipeline; a request handler in another task is
    writing when the lifespan task is cancelled. The close lets the write finish (its put
    takes 1 s of the 5 s close deadline): the actors are not cancelled with the task that
    opened the pipeline, so the caller gets its result at once, not PipelineClosed at the
    close deadline."""
    store = ScriptedStore(puts={0: Act(delay=1.0)})
    config = _config(total_timeout=100, slice_timeout=100, close_timeout=5)
    lifespan = anyio.CancelScope()
    got: list[object] = []

    async def serve(*, task_status: anyio.abc.TaskStatus[kvpipe.Pipeline]) -> None:
        with lifespan:
            async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
                task_status.started(pipe)
                await anyio.sleep_forever()

    async def handle(pipe: kvpipe.Pipeline) -> None:
        start = anyio.current_time()
        try:
            got.append(await pipe.write(TOKENS[: 4 * BLOCK], IDS[:4]))
        except kvpipe.PipelineClosed as exc:
            got.append(exc)
        got.append(anyio.current_time() - start)

    async with anyio.create_task_group() as tg:
        pipe = await tg.start(serve)
        tg.start_soon(handle, pipe)
        await store.wait_calls("put")
        lifespan.cancel()
    result, took = got
    assert isinstance(result, kvpipe.WriteResult) and result.complete, result
    assert took == pytest.approx(1.0)


# The broken close never closes the actors' inboxes: their streams are collected unclosed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_close_that_fails_still_ends_the_shielded_actors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The actors run shielded from the opening task's cancellation; should ``aclose`` fail
    before it stops them, ``open_pipeline`` still ends them and raises, instead of waiting on
    them for ever."""
    from kvpipe._runtime import Runtime

    def broken(self: Runtime, *args: str) -> None:
        raise RuntimeError("close broke")

    monkeypatch.setattr(Runtime, "_stop_all", broken)
    with anyio.fail_after(3600):  # virtual time: a hang shows as TooSlowError
        with pytest.raises(RuntimeError, match="close broke"):
            async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore()):
                pass


async def _write_timed(pipe: kvpipe.Pipeline, out: dict[str, Any]) -> None:
    """A 4-block write with a 2 s deadline: its result as ``out["queued"]``, the seconds it
    took as ``out["took"]``."""
    start = anyio.current_time()
    out["queued"] = await pipe.write(np.arange(100, 100 + 4 * BLOCK), np.arange(8, 12), timeout=2.0)
    out["took"] = anyio.current_time() - start


async def test_a_host_write_queued_behind_hung_ones_ends_at_its_deadline() -> None:
    """A hung put holds the host writer's only slot (``queue_depth=1``): the next write waits
    in the writer's inbox, where no actor's scope bounds it. It ends at its own deadline (it
    waited for the ``deadline_slack`` guard, 0.25 s more, with a WARNING and the guard's
    counter, for every write behind a hung store)."""
    cfg = kvpipe.PipelineConfig(slice_block_num=4, queue_depth=1, total_timeout=15.0)
    store = ScriptedStore(puts={0: Act(hang=True)})
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        out: dict[str, Any] = {}

        async def first() -> None:
            out["first"] = await pipe.write(np.arange(8 * BLOCK), np.arange(8))

        async def queued() -> None:
            await store.wait_calls("put")
            await _write_timed(pipe, out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(queued)
        assert out["took"] == pytest.approx(2.0)
        assert (out["queued"].written, out["queued"].stop_reason) == (0, "total_timeout")
        assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0


async def test_a_device_slice_queued_for_a_busy_swapper_ends_its_write_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device path (slicer, swapper, writer), one copy thread held by a slow gather of
    another write: the second write's only slice waits in the swapper's inbox past the
    second write's deadline. The write ends at that deadline, not the guard's."""
    monkeypatch.setattr(engine_module.HostEngine, "name", "device-like")  # the device path
    gather = engine_module.HostEngine.gather

    async def slow_first(
        self: Any, plan: Any, staging: Any, after: Any, *, start_by: float | None = None
    ) -> Any:
        if len(plan.runs) and anyio.current_time() < 1:  # the first write's gather
            await anyio.sleep(10)
        return await gather(self, plan, staging, after, start_by=start_by)

    monkeypatch.setattr(engine_module.HostEngine, "gather", slow_first)
    cfg = kvpipe.PipelineConfig(slice_block_num=4, copy_threads=1, total_timeout=15.0)
    async with kvpipe.open_pipeline(_cache(), ScriptedStore(), config=cfg) as pipe:
        out: dict[str, Any] = {}

        async def first() -> None:
            out["first"] = await pipe.write(np.arange(8 * BLOCK), np.arange(8))

        async def queued() -> None:
            await anyio.sleep(0.5)
            await _write_timed(pipe, out)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            tg.start_soon(queued)
        assert out["took"] == pytest.approx(2.0)
        assert out["queued"].stop_reason == "total_timeout"
        assert out["first"].complete  # the slow gather was within the first write's deadline
        assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0


async def test_the_close_deadline_log_names_the_actor_still_working_and_its_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose put shields itself from cancellation (a vendor call that cannot be
    interrupted) holds the writer past the close deadline, cancelled or not. One ERROR says
    which actor was abandoned and which request it holds: the line an operator has to go on
    (it named no actor, and came with a second one)."""

    class Stubborn(ScriptedStore):
        async def put_blocks(self, batch: Any) -> Any:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(30)
            return await super().put_blocks(batch)

    store = Stubborn()
    config = _config(total_timeout=100, slice_timeout=100, close_timeout=1)
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:

        async def write() -> None:
            with pytest.raises(kvpipe.PipelineClosed):
                await pipe.write(TOKENS[: 4 * BLOCK], IDS[:4], request_id="stuck-1")

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await until(lambda: sum(pipe.statistics().in_flight.values()) == 1)
            await anyio.sleep(1)  # in its put
            await pipe.aclose()
    lines = [r for r in caplog.records if "close deadline" in r.getMessage()]
    assert [r.levelname for r in lines] == ["ERROR"], lines
    assert (
        lines[0]
        .getMessage()
        .endswith("abandoned: writer (write stuck-1 (0 of 4 blocks stored, at slice 0))")
    )


async def test_a_close_that_fails_a_hung_put_lets_the_actors_leave_without_cancelling_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A put hangs (cancellably) through the whole ``close_timeout``. Failing its request at
    the deadline cancels the put; the writer unwinds and every actor leaves its loop on its
    own, so nothing is logged about the actors (an ERROR 'actors still running at the close
    deadline' came with every such close: the check ran before they had a turn to leave)."""
    store = ScriptedStore(puts={0: Act(hang=True)})
    config = _config(total_timeout=100, slice_timeout=100, close_timeout=1)
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:

        async def write() -> None:
            with pytest.raises(kvpipe.PipelineClosed):
                await pipe.write(TOKENS[: 4 * BLOCK], IDS[:4])

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await store.wait_calls("put")
            start = anyio.current_time()
            await pipe.aclose()
            assert anyio.current_time() - start == pytest.approx(1.0)
    assert not [r for r in caplog.records if "actors" in r.getMessage()]


class _LateFetch(kvpipe.MemoryStore):
    """Its gets come back at the read's deadline: the fetch is done, but the reader takes it
    up only once the deadline has passed (a busy loop; a vendor call done just in time)."""

    late = False

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        statuses = await super().get_blocks(batch)
        if self.late:  # no checkpoint after this: the fetch's scope is left uncancelled
            clock = trio.lowlevel.current_clock()
            assert isinstance(clock, trio.testing.MockClock)
            clock.jump(5)
        return statuses


async def test_a_small_check_and_scatter_never_starts_after_the_reads_deadline() -> None:
    """A host cache's small slice from a store that keeps its values is checked and placed on
    the event loop. Its fetch came back, but the reader took it up at the read's deadline:
    nothing may go into the caller's blocks then (a check-and-scatter in a copy thread
    never starts after the deadline either). It did: the read placed all four blocks after
    its deadline and returned complete."""
    cache = _cache()
    store = _LateFetch()
    async with kvpipe.open_pipeline(cache, store, config=_config()) as pipe:
        tokens = TOKENS[: 4 * BLOCK]
        assert (await pipe.write(tokens, IDS[:4])).complete
        for rows in cache.byte_rows:
            rows[20:24] = 0
        store.late = True
        start = anyio.current_time()
        r = await pipe.read(tokens, np.arange(20, 24), timeout=5)
        assert anyio.current_time() - start == pytest.approx(5.0)
        assert (r.loaded, r.stop_reason) == (0, "total_timeout")
        for rows in cache.byte_rows:
            assert not rows[20:24].any()  # the caller's blocks keep what they held
        assert pipe.statistics().counters.get("blocks_read", 0) == 0


async def test_a_read_whose_last_holder_lets_go_after_its_deadline_ends_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device path, one copy thread. A read's second slice is fetched first and its
    scatter, begun in time, runs 0.1 s past the read's deadline; its first slice waits in
    the swapper's inbox behind another read's long scatter. At the deadline the swapper
    holds the read, so the caller's side leaves it to the actors; but once that scatter was
    out nothing ended the read, and the caller waited for the deadline guard
    (``deadline_slack`` later, with its WARNING and counter) — or, with a guard longer than
    the wait, for the other read's scatter."""
    monkeypatch.setattr(engine_module.HostEngine, "name", "device-like")  # the device path
    scatter = engine_module.HostEngine.scatter
    delays = [2.1, 10.0]  # this read's second slice; the other read's slice

    async def slow(self: Any, plan: Any, lease: Any, after: Any = None, **kw: Any) -> Any:
        if delays:
            await anyio.sleep(delays.pop(0))  # shielded by the swapper
        return await scatter(self, plan, lease, after, **kw)

    store = ScriptedStore(gets={0: Act(delay=1.0)})  # this read's first slice
    cfg = kvpipe.PipelineConfig(slice_block_num=4, copy_threads=1, total_timeout=15.0)
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        tokens = np.arange(8 * BLOCK)
        assert (await pipe.write(tokens, np.arange(8))).complete
        assert (await pipe.write(tokens[: 4 * BLOCK] + 1000, np.arange(8, 12))).complete
        monkeypatch.setattr(engine_module.HostEngine, "scatter", slow)
        store.counts["get"] = 0
        out: dict[str, Any] = {}

        async def read() -> None:
            start = anyio.current_time()
            out["read"] = await pipe.read(tokens, np.arange(20, 28), timeout=2.0)
            out["took"] = anyio.current_time() - start

        async def other() -> None:
            await anyio.sleep(0.5)
            await pipe.read(tokens[: 4 * BLOCK] + 1000, np.arange(40, 44))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            tg.start_soon(other)
        assert out["took"] == pytest.approx(2.1)
        assert (out["read"].loaded, out["read"].stop_reason) == (0, "total_timeout")
        assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0


async def test_deleting_a_corrupt_block_does_not_hold_a_device_read_past_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device path, one copy thread busy with another read's long scatter. A read's
    block 2 fails verification twice: the reader passes the sound blocks before it to the
    swapper (where they wait behind that scatter) and deletes block 2, which takes the store
    5 s. The read ends at its deadline; the deletion held it (the caller's side leaves a
    request an actor holds to that actor) until the deadline guard, ``deadline_slack``
    later, for a best-effort clean-up the read does not wait for."""
    monkeypatch.setattr(engine_module.HostEngine, "name", "device-like")  # the device path
    scatter = engine_module.HostEngine.scatter
    delays = [10.0]  # the other read's scatter

    async def slow(self: Any, plan: Any, lease: Any, after: Any = None, **kw: Any) -> Any:
        if delays:
            await anyio.sleep(delays.pop(0))  # shielded by the swapper
        return await scatter(self, plan, lease, after, **kw)

    class SlowDelete(ScriptedStore):
        async def delete(self, keys: Sequence[str]) -> None:
            await anyio.sleep(5)
            await super().delete(keys)

    store = SlowDelete(gets={1: Act(corrupt=[2]), 2: Act(corrupt=[0])})
    cfg = kvpipe.PipelineConfig(slice_block_num=4, copy_threads=1, total_timeout=15.0)
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        tokens = TOKENS[: 4 * BLOCK]
        assert (await pipe.write(tokens, IDS[:4])).complete
        assert (await pipe.write(tokens + 1000, IDS[4:8])).complete
        monkeypatch.setattr(engine_module.HostEngine, "scatter", slow)
        out: dict[str, Any] = {}

        async def read() -> None:
            await anyio.sleep(0.5)
            start = anyio.current_time()
            out["read"] = await pipe.read(tokens, np.arange(20, 24), timeout=2.0)
            out["took"] = anyio.current_time() - start

        async with anyio.create_task_group() as tg:
            tg.start_soon(pipe.read, tokens + 1000, np.arange(40, 44))  # get 0: the slow one
            tg.start_soon(read)
        assert len(store.calls_of("get")) == 3  # block 2 was fetched again
        assert out["took"] == pytest.approx(2.0)
        assert (out["read"].loaded, out["read"].stop_reason) == (0, "total_timeout")
        assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
        assert store.deleted  # still deleted, after the fact


@pytest.mark.parametrize("call", ["write", "read"])
async def test_a_call_with_no_block_to_move_queued_past_its_deadline_is_complete(
    call: str,
) -> None:
    """A prompt shorter than one block moves no block: queued behind a hung probe until its
    deadline, its result is still complete and says nothing stopped it. It said
    ``complete=True`` with ``stop_reason="total_timeout"`` (a write) or with block 0 in
    ``failed_blocks`` (a read)."""
    store = ScriptedStore(exists={0: Act(hang=True)})
    config = _config(queue_depth=1, lookup_timeout=10)  # one scheduler worker, held
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
        out: dict[str, Any] = {}

        async def held() -> None:
            with pytest.raises(kvpipe.OperationTimeout):
                await pipe.lookup(TOKENS)

        async def short() -> None:
            await store.wait_calls("exists")
            tokens, ids = np.arange(BLOCK - 1), np.arange(0)
            start = anyio.current_time()
            if call == "write":
                out["result"] = await pipe.write(tokens, ids, timeout=2)
            else:
                out["result"] = await pipe.read(tokens, ids, timeout=2)
            out["took"] = anyio.current_time() - start

        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            tg.start_soon(short)
        result = out["result"]
        assert out["took"] == pytest.approx(2.0)  # it did wait in the queue until then
        assert result.requested == 0 and result.complete
        assert result.stop_reason is None and result.error is None
        if call == "read":
            assert result.failed_blocks == ()


class _DeafStore(kvpipe.MemoryStore):
    """A store whose gets (``uses_sink`` False: nothing of theirs writes into the cache)
    ignore cancellation for ``deaf`` seconds, then fail: a vendor call awaited in a thread
    that is not abandoned on cancellation (``anyio.to_thread.run_sync``'s default)."""

    def __init__(self, deaf: float) -> None:
        super().__init__()
        self.deaf = deaf

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(self.deaf)
        return [BlockStatus.FAILED] * len(batch.keys)


async def test_a_host_read_whose_fetch_ignores_cancellation_returns_by_the_deadline_guard() -> None:
    """The deadline guard ends a read whose store call ignores its cancellation at
    ``deadline + deadline_slack``, as it ends a write: a fetch into staging writes nothing
    into the caller's cache, so the read holds no claim on it while the fetch runs. It held
    one (taken before the fetch, for a store's row sink, also for a store that uses none),
    so the caller waited the whole 100 s of the deaf call, shielded, past the guard."""
    store = _DeafStore(100.0)
    cfg = _config(total_timeout=5.0, deadline_slack=0.25)
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        start = anyio.current_time()
        r = await pipe.read(TOKENS, np.arange(20, 36))
        assert anyio.current_time() - start == pytest.approx(5.25)
        assert (r.loaded, r.complete, r.stop_reason) == (0, False, "total_timeout")
        assert pipe.statistics().counters["deadline_guard_expired"] == 1


class _DeafSinkStore(_DeafStore):
    """:class:`_DeafStore` whose gets take the batch's sink: the read's claim on the cache
    is held from before the fetch until the deaf call is over."""

    uses_sink = True


async def test_a_read_failed_by_close_waiting_for_its_claim_is_not_counted_by_the_guard(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The close fails a read (``PipelineClosed``) whose fetch, under its claim on the cache,
    ignores cancellation: its ending is decided, it only waits for the claim to go. Past
    ``deadline + deadline_slack`` the guard took it for a request with no outcome: it
    counted ``deadline_guard_expired`` and logged 'ending it as timed out' (the ending it
    then tried changed nothing: the read still ends as closed)."""
    store = _DeafSinkStore(10.0)
    cfg = _config(total_timeout=5.0, deadline_slack=0.25, close_timeout=1.0)
    failed: list[BaseException] = []
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        start = anyio.current_time()

        async def read() -> None:
            try:
                await pipe.read(TOKENS, np.arange(20, 36), request_id="closed-1")
            except kvpipe.PipelineClosed as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await until(lambda: sum(pipe.statistics().in_flight.values()) == 1)
            await pipe.aclose()
    assert len(failed) == 1
    # Its claim held it until the deaf call was over: nothing writes into the cache after.
    assert anyio.current_time() - start == pytest.approx(10.0)
    assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
    assert not [r for r in caplog.records if "no outcome by its deadline" in r.getMessage()]


class _DeafPut(ScriptedStore):
    """Its puts ignore cancellation for ``deaf`` seconds (a vendor call awaited in a thread
    that is not abandoned), then take up a cancellation received meanwhile at their next
    checkpoint, as a store's further awaits do."""

    def __init__(self, deaf: float) -> None:
        super().__init__()
        self.deaf = deaf

    async def put_blocks(self, batch: Any) -> Any:
        with anyio.CancelScope(shield=True):
            await anyio.sleep(self.deaf)
        return await super().put_blocks(batch)


async def test_a_slice_cut_off_at_the_deadline_is_counted_when_the_writer_is_cancelled() -> None:
    """A put ignores cancellation past its write's deadline: the deadline guard ends the
    write, recording the slice as ``total_timeout`` in its result. The close then cancels
    the writer, still in the put, at its deadline. The slice was counted (in
    ``statistics().slices`` and by the observers) only as the put returned normally, so the
    cancellation left it in the result but in neither count."""
    seen: list[tuple[str, str]] = []
    store = _DeafPut(30.0)
    cfg = _config(total_timeout=2.0, slice_timeout=10.0, deadline_slack=0.25, close_timeout=1.0)
    async with kvpipe.open_pipeline(
        _cache(), store, config=cfg, observer=lambda k, s, o: seen.append((k, o))
    ) as pipe:
        w = await pipe.write(TOKENS[: 4 * BLOCK], IDS[:4])
        assert (w.written, w.stop_reason) == (0, "total_timeout")
        assert [s.outcome for s in w.slices] == ["total_timeout"]
        await pipe.aclose()  # cancels the writer at the close deadline, in its put
    await anyio.sleep(60)  # the deaf put is over; the writer has unwound
    assert store.counts["put"] == 1
    assert pipe.statistics().slices == {"total_timeout": 1}
    assert [o for k, o in seen if k == "write_slice"] == ["total_timeout"]


async def test_a_store_whose_calls_ignore_cancellation_logs_a_bounded_number_of_guard_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose calls ignore their cancellation (a vendor call in a thread not abandoned)
    ends every read by the deadline guard, and the guard logged 'no outcome by its deadline'
    at WARNING for each: one per request. The first shows (with its request id), the rest at
    DEBUG until the interval passes; ``deadline_guard_expired`` counts every one."""
    store = _DeafStore(5.5)
    cfg = _config(total_timeout=5.0, deadline_slack=0.25)
    n = 10
    caplog.set_level("DEBUG", logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=cfg) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
        caplog.clear()
        for i in range(n):
            r = await pipe.read(TOKENS, np.arange(20, 36), request_id=f"deaf{i}")
            assert r.stop_reason == "total_timeout"
        assert pipe.statistics().counters["deadline_guard_expired"] == n
    guard = [r for r in caplog.records if "no outcome by its deadline" in r.getMessage()]
    loud = [r.getMessage() for r in guard if r.levelno >= 30]
    assert len(loud) == 1 and "deaf0" in loud[0], loud
    assert len(guard) == n
