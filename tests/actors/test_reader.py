"""The reader alone: fetch, verify, stop at the first bad block, delete corrupt ones — for a
device cache's slices (handed on one by one) and a host cache's whole reads (leased, fetched
and placed slice by slice, inline or in tasks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio.testing
import xxhash

import kvpipe
from kvpipe import _blockformat
from kvpipe._plan import plan_slices
from kvpipe._workers import NotStarted
from kvpipe.actors import ActorContext, Reader, SliceJob, Swapper, Writer
from kvpipe.actors import reader as reader_module
from kvpipe.backends import BlockStatus, GetBatch, StorageBackend
from tests.actors.harness import BLOCK, Harness, harness, small_layout
from tests.fakes import Act, ScriptedStore
from tests.helpers import needs_native_digests

TOKENS = np.arange(8 * BLOCK)


async def _store_all(h: Harness) -> None:
    """Write the 8 blocks, slice by slice (each slice's staging let go before the next is
    leased: a pool smaller than the write will do)."""
    state = h.write_state(TOKENS, np.arange(8))
    swapper = Swapper(h.ctx, h.inboxes["swapper"])
    writer = Writer(h.ctx, h.inboxes["writer"])
    for spec in state.slices:
        await swapper.handle(SliceJob(state, spec, await h.ctx.pool.acquire(spec.count)))
        for job in h.sent("writer"):
            await writer.handle(job)
    assert state.result is not None and state.result.complete


async def _read_slice(h: Harness, index: int = 0):  # type: ignore[no-untyped-def]
    state = h.read_state(TOKENS, np.arange(30, 38))
    state.plan(plan_slices(0, 8, 8, BLOCK, len(TOKENS)))
    spec = state.slices[index]
    job = SliceJob(state, spec, await h.ctx.pool.acquire(spec.count))
    await Reader(h.ctx, h.inboxes["reader"]).handle(job)
    return state, job


async def test_sound_blocks_are_verified_and_scattered_in_one_call() -> None:
    """A host cache: the reader verifies and scatters a sound slice itself (one worker call,
    no hop to the swapper), resolves it and lets go of its staging."""
    store = ScriptedStore()
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        assert h.sent("swapper") == [] and job.valid == 0 and job.lease.released
        assert state.result is not None and state.result.loaded == 8
        for rows in h.ctx.cache.byte_rows:
            assert np.array_equal(rows[0:8], rows[30:38])
        assert h.ctx.pool.in_use == 0


async def test_a_block_corrupt_in_transit_is_fetched_again_and_kept() -> None:
    store = ScriptedStore(gets={0: Act(corrupt=[3])})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        assert job.valid == 8 and state.machine.stop_block is None
        assert [c.first_block for c in store.calls_of("get")] == [0, 3]  # blocks 3.. again
        assert store.deleted == []
        job.lease.release()


async def test_a_refetch_carries_the_token_prefix_of_its_own_blocks() -> None:
    """Blocks fetched again (from a corrupt one up to the first the store did not return)
    go as a batch whose token prefix ends with its last block, as every batch's does (a
    token-indexed store finds its blocks by it), not with the slice's last block."""
    store = ScriptedStore(gets={0: Act(corrupt=[3], fail=[6])})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        first, again = store.calls_of("get")
        assert (first.first_block, len(first.keys), first.token_prefix_len) == (0, 8, 8 * BLOCK)
        assert (again.first_block, len(again.keys)) == (3, 3)  # blocks 3, 4, 5
        assert again.token_prefix_len == 6 * BLOCK
        assert job.valid == 6 and state.machine.stop_block == 6
        job.lease.release()


async def test_a_refetch_that_fails_is_logged_and_the_first_failure_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The store raising on the fetch of a corrupt block again was swallowed: the read
    reported the corruption, and nothing said the store had failed meanwhile."""
    store = ScriptedStore(gets={0: Act(corrupt=[3]), 1: Act(error=OSError("store went away"))})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        with caplog.at_level("WARNING", logger="kvpipe.reader"):
            state, job = await _read_slice(h)
        assert state.machine.stop_block == 3 and state.machine.stop_reason == "failed_block"
        assert "fetching block 3 again" in caplog.text and "store went away" in caplog.text
        assert h.ctx.pool.in_use == 0 and job.lease.released


async def test_a_corrupt_block_stops_loading_and_is_deleted() -> None:
    store = ScriptedStore(gets={0: Act(corrupt=[3]), 1: Act(corrupt=[0])})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        # the three sound blocks are in the cache already: nothing for the swapper
        assert job.valid == 0 and h.sent("swapper") == []
        assert state.result is not None and state.result.loaded == 3
        assert state.machine.stop_block == 3 and state.machine.stop_reason == "failed_block"
        assert 3 in state.machine.failed
        assert store.deleted == [store.calls_of("get")[0].keys[3]]
        assert h.ctx.metrics.counters["blocks_failed_verify"] == 1
        assert h.ctx.pool.in_use == 0


@pytest.mark.parametrize("act", [Act(fail=[3]), Act(corrupt=[3])], ids=["failed", "corrupt"])
async def test_blocks_placed_before_a_failed_one_are_loaded(act: Act) -> None:
    """The sound blocks a host cache's slice placed before its failed block are loaded (the
    read counters count what the result counts: tests/test_metrics.py)."""
    store = ScriptedStore(gets={0: act, 1: Act(corrupt=[0])})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, _ = await _read_slice(h)
        assert state.result is not None and state.result.loaded == 3


async def test_a_block_the_store_returns_for_another_key_is_rejected() -> None:
    class Swapping(ScriptedStore):
        async def get_blocks(self, batch):  # type: ignore[no-untyped-def]
            statuses = await super().get_blocks(batch)
            bufs = batch.buffers
            tmp = bytes(bufs[1])
            bufs[1][:] = bufs[2]
            bufs[2][:] = tmp
            return statuses

    store = Swapping()
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        # first fetch: blocks 1 and 2 come back crosswise; the second fetch (of blocks 1..)
        # gets block 1 right and swaps 2 and 3: loading stops at block 2
        assert job.valid == 2
        assert state.machine.stop_reason == "failed_block"
        assert "another key" in (state.machine.stop_detail or "")
        job.lease.release()


async def test_missing_block_reported_by_the_store() -> None:
    store = ScriptedStore(gets={0: Act(fail=[0])})
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        state, job = await _read_slice(h)
        assert job.valid == 0 and state.done
        assert state.result is not None
        assert (state.result.loaded, state.result.failed_blocks) == (0, (0,))
        assert h.sent("swapper") == []
        assert h.ctx.pool.in_use == 0


async def test_unverified_reads_still_check_the_key(monkeypatch: object) -> None:
    store = ScriptedStore(gets={0: Act(corrupt=[2])})
    config = kvpipe.PipelineConfig(slice_block_num=8, verify_checksums=False)
    async with harness(store, slice_blocks=8, config=config) as h:
        await _store_all(h)
        state, _job = await _read_slice(h)
        # byte 7 of the payload flipped: not detectable without checksums, so all 8 load
        assert state.result is not None and state.result.loaded == 8


@pytest.fixture(params=["inline", "tasks"])
def runs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a host cache's slices run: inline (small slices from a store that keeps its
    values in memory) and in tasks of their own (every slice counted as large)."""
    if request.param == "tasks":
        monkeypatch.setattr(reader_module, "INLINE_COPY_BYTES", 0)
    return str(request.param)


def _whole_read(h: Harness, slice_blocks: int, *, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    state = h.read_state(TOKENS, np.arange(30, 38), timeout=timeout)
    state.plan(plan_slices(0, 8, slice_blocks, BLOCK, len(TOKENS)))
    return state


def _loaded_rows_match(h: Harness, count: int) -> bool:
    return all(np.array_equal(r[0:count], r[30 : 30 + count]) for r in h.ctx.cache.byte_rows)


@pytest.mark.parametrize("store", [kvpipe.MemoryStore, ScriptedStore])
async def test_a_host_cache_s_read_runs_whole(runs: str, store: type[StorageBackend]) -> None:
    """The reader leases, fetches, verifies and places each slice of a whole read itself,
    with no hop to the swapper, and lets go of all its staging."""
    backend = store()
    async with harness(backend, slice_blocks=2) as h:
        h.ctx.keep_values = backend.keeps_values
        await _store_all(h)
        state = _whole_read(h, 2)
        await Reader(h.ctx, h.inboxes["reader"]).handle(state)
        assert state.result is not None and state.result.loaded == 8
        assert _loaded_rows_match(h, 8)
        assert h.sent("swapper") == [] and h.ctx.pool.in_use == 0


async def test_a_whole_read_stops_at_a_failed_block(runs: str) -> None:
    store = ScriptedStore(gets={1: Act(fail=[1])})
    async with harness(store, slice_blocks=2) as h:
        await _store_all(h)
        state = _whole_read(h, 2)
        await Reader(h.ctx, h.inboxes["reader"]).handle(state)
        assert state.result is not None
        assert (state.result.loaded, state.result.stop_reason) == (3, "failed_block")
        assert _loaded_rows_match(h, 3)
        assert h.ctx.pool.in_use == 0


async def test_a_whole_read_with_less_staging_than_it_needs_completes(runs: str) -> None:
    """Two slots of staging for four slices of two blocks: each slice waits for the one
    before it to let go of its staging (it never waits while holding some)."""
    async with harness(ScriptedStore(), slice_blocks=2, pool_slots=2) as h:
        await _store_all(h)
        state = _whole_read(h, 2)
        await Reader(h.ctx, h.inboxes["reader"]).handle(state)
        assert state.result is not None and state.result.loaded == 8
        assert _loaded_rows_match(h, 8) and h.ctx.pool.in_use == 0


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    async def test_waiting_for_staging_is_bounded_by_the_deadline(self, runs: str) -> None:
        async with harness(ScriptedStore(), slice_blocks=2, pool_slots=4) as h:
            await _store_all(h)
            hog = await h.ctx.pool.acquire(4)
            state = _whole_read(h, 2, timeout=7)
            start = anyio.current_time()
            await Reader(h.ctx, h.inboxes["reader"]).handle(state)
            assert anyio.current_time() - start == pytest.approx(7.0)
            assert state.result is not None
            assert (state.result.loaded, state.result.stop_reason) == (0, "total_timeout")
            assert state.machine.pending == set()
            hog.release()
            assert h.ctx.pool.in_use == 0

    async def test_a_slice_whose_check_never_starts_is_counted_and_observed_once(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The copy threads stay busy until the read's deadline, so the check-and-scatter
        of a slice whose ``get_blocks`` finished never starts: that backend call is counted
        once (``read_total_timeout``) and reported once to the observers, as every other
        slice is."""
        async with harness(ScriptedStore(), slice_blocks=8) as h:
            await _store_all(h)

            async def busy_until(  # type: ignore[no-untyped-def]
                ctx, nbytes, fn, *args, hold, start_by=None, on_cache=False
            ):
                """No copy thread comes free before ``start_by``."""
                assert start_by is not None
                await anyio.sleep_until(start_by)
                raise NotStarted

            monkeypatch.setattr(reader_module, "INLINE_COPY_BYTES", 0)
            monkeypatch.setattr(ActorContext, "run_copy", busy_until)
            seen: list[tuple[str, str]] = []
            assert h.ctx.observers is not None
            h.ctx.observers.add(lambda kind, _s, outcome: seen.append((kind, outcome)))
            state = h.read_state(TOKENS, np.arange(30, 38), timeout=5)
            state.plan(plan_slices(0, 8, 8, BLOCK, len(TOKENS)))
            job = SliceJob(state, state.slices[0], await h.ctx.pool.acquire(8))
            await Reader(h.ctx, h.inboxes["reader"]).handle(job)
            assert state.result is not None
            assert (state.result.loaded, state.result.stop_reason) == (0, "total_timeout")
            read_counts = {k: v for k, v in h.ctx.metrics.slices.items() if k.startswith("read")}
            assert read_counts == {"read_total_timeout": 1}
            assert seen == [("read_slice", "total_timeout")]
            assert h.ctx.pool.in_use == 0

    async def test_a_deletion_of_corrupt_blocks_that_times_out_is_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A store whose ``delete`` never returns: the deletion of a block that failed
        verification twice is given up after ``slice_timeout``, and that is logged as a
        failed deletion is. It was given up silently (only a ``BackendError`` was logged):
        the corrupt block stays, and nothing said why ``corrupt_blocks_deleted`` stood
        still while ``blocks_failed_verify`` grew."""

        class HangingDelete(ScriptedStore):
            async def delete(self, keys: Sequence[str]) -> None:
                self.deleted.extend(keys)
                await anyio.sleep_forever()

        store = HangingDelete(gets={0: Act(corrupt=[3]), 1: Act(corrupt=[0])})
        config = kvpipe.PipelineConfig(slice_block_num=8, slice_timeout=2.0)
        async with harness(store, slice_blocks=8, config=config) as h:
            await _store_all(h)
            caplog.set_level(logging.WARNING, logger="kvpipe")
            start = anyio.current_time()
            state, _ = await _read_slice(h)
            assert anyio.current_time() - start == pytest.approx(2.0)
            assert state.result is not None and state.result.loaded == 3
            assert store.deleted == [store.calls_of("get")[0].keys[3]]
            assert "corrupt_blocks_deleted" not in h.ctx.metrics.counters
            lines = [r.getMessage() for r in caplog.records if "delete" in r.getMessage()]
            assert len(lines) == 1, lines
            assert lines[0].startswith("read r: could not delete 1 corrupt block")
            assert "2 s" in lines[0]


async def test_work_on_blocks_past_where_loading_stopped_is_cancelled_as_it_starts() -> None:
    """A refetch (or any bounded work) that starts on blocks loading has already stopped
    before is cancelled at once, not left to run to its deadline holding the result back."""
    async with harness(kvpipe.MemoryStore(), slice_blocks=4) as h:
        state = h.read_state(TOKENS, np.arange(8))
        state.plan(plan_slices(0, 8, 4, BLOCK, len(TOKENS)))
        state.stop_at(2, "failed_block", [2])
        with state.bound(anyio.current_time() + 100, "before the stop", 1) as before:
            await anyio.lowlevel.checkpoint()
        with anyio.fail_after(5), state.bound(anyio.current_time() + 100, "past", 4) as past:
            await anyio.sleep_forever()
        assert not before.cancelled_caught and past.cancelled_caught
        state.resolve(0, 2)
        state.resolve(1, 0)


class _ShortValueStore(ScriptedStore):
    """A third-party store that hands each value to the batch's sink from a buffer of its
    own, the one of block ``short`` cut to ``keep`` bytes (shorter than a block), with the
    checksum of what it hands. ``lies``: it reports every block ``OK`` whatever the sink
    said; otherwise ``CORRUPT`` where the sink said the value is not what it wrote."""

    uses_sink = True

    def __init__(self, short: int, keep: int, lies: bool) -> None:
        super().__init__()
        self.short, self.keep, self.lies = short, keep, lies
        self.verdicts: list[bool | None] = []

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        statuses = list(await super().get_blocks(batch))
        sink = batch.sink
        assert sink is not None
        for i, buffer in enumerate(batch.buffers):
            value = bytes(buffer)
            if batch.first_block + i == self.short:
                value = value[: self.keep]
            verdict = sink.fetched(i, xxhash.xxh3_64_intdigest(value), memoryview(value))
            self.verdicts.append(verdict)
            if not verdict and not self.lies:
                statuses[i] = BlockStatus.CORRUPT
        return statuses


@pytest.mark.parametrize("placing", ["native", "python"])
@pytest.mark.parametrize("cut", ["payload", "trailer"])
@pytest.mark.parametrize("lies", [False, True], ids=["reports_corrupt", "reports_ok"])
async def test_a_value_shorter_than_a_block_from_a_store_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, placing: str, cut: str, lies: bool
) -> None:
    """A store of someone else's that hands the sink a value shorter than a block (cut in
    its payload or its trailer): the sink says it is not what the store wrote (no
    ``struct.error`` out of the store's call), the block is not loaded, and the read stops
    there cleanly with the blocks before it — whether the store then reports it ``CORRUPT``
    or, lying, ``OK``."""
    if placing == "python":
        monkeypatch.setattr(_blockformat, "native", None)
    else:
        needs_native_digests()
    payload = small_layout().block_nbytes
    keep = {"payload": payload - 1, "trailer": payload + 8}[cut]
    store = _ShortValueStore(short=3, keep=keep, lies=lies)
    async with harness(store, slice_blocks=8) as h:
        await _store_all(h)
        before = [rows[33].copy() for rows in h.ctx.cache.byte_rows]
        state = _whole_read(h, 8)
        await Reader(h.ctx, h.inboxes["reader"]).handle(state)
        assert state.result is not None
        assert (state.result.loaded, state.result.stop_reason) == (3, "failed_block")
        assert 3 in state.result.failed_blocks
        assert store.verdicts[3] is False
        assert _loaded_rows_match(h, 3)
        for rows, old in zip(h.ctx.cache.byte_rows, before, strict=True):
            assert np.array_equal(rows[33], old)  # the short value placed nothing
        assert h.ctx.pool.in_use == 0
