"""What the CUDA engine allocates, exactly, and that it frees all of it: the pinned budget,
scratch owned by the engine (never global, never shared by concurrent calls), rollback when
opening fails, recovery when a copy fails, and close — over the driver's test double."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._plan import copy_plan, layout_segments
from kvpipe._staging import stride_for
from kvpipe.cuda._engine import CudaEngine
from kvpipe.cuda._kernels import PAIR_NBYTES, SEGMENT_NBYTES
from kvpipe.cuda._open import open_cuda_engine
from kvpipe.cuda._resources import CudaOptions
from tests.cuda.devcache import fake_device_cache, fill_device, free_device_cache
from tests.cuda.engines import engine, engine_opener, open_engine
from tests.cuda.fake_driver import FakeDriver, Gate
from tests.helpers import LAYOUTS


def _layout() -> kvpipe.CacheLayout:
    return LAYOUTS["gqa_fp8"]()


async def test_exact_accounting_and_no_leaks(fake: FakeDriver) -> None:
    fake.latency = 4  # copies take a few polls: the two calls overlap
    layout = _layout()
    cache = fake_device_cache(fake, layout, 8)
    cache_allocs = len(fake.alloc_log)
    segs = layout_segments(layout)
    stride = stride_for(value_nbytes(layout.block_nbytes))
    opts = CudaOptions(max_calls=2, scratch_bytes=2 * stride, d2h="staged")
    async with engine(fake, cache, capacity=10, max_blocks=4, options=opts) as (eng, pool):
        acct = eng.accounting()
        # pinned staging: exactly capacity * stride, the budget, no rounding
        assert acct.staging_requested == acct.staging_allocated == 10 * stride
        assert acct.staging_budget == 10 * stride
        assert fake.alloc_log[cache_allocs:][:1] == [("pinned", 10 * stride)]
        assert acct.pinned_bytes == 10 * stride and acct.pinned_allocations == 1
        assert acct.device_bytes == len(segs) * SEGMENT_NBYTES  # the pointer table only
        assert (acct.streams, acct.scratch_buffers) == (2, 0)
        leases = [await pool.acquire(4), await pool.acquire(4)]
        async with anyio.create_task_group() as tg:
            for i, lease in enumerate(leases):
                plan = copy_plan(segs, [i, i + 2, i + 4, i + 6], lease.slots)
                tg.start_soon(eng.gather, plan, lease)
        acct = eng.accounting()
        # two calls at once: two scratch sets, each a pair table (pinned + device) and a
        # data buffer of chunk_blocks * stride
        assert acct.scratch_buffers == 2 and acct.scratch_in_use == 0
        assert acct.device_bytes == len(segs) * SEGMENT_NBYTES + 2 * (4 * PAIR_NBYTES + 2 * stride)
        assert acct.pinned_bytes == 10 * stride + 2 * 4 * PAIR_NBYTES
        for lease in leases:
            lease.release()
    free_device_cache(fake, cache)
    fake.assert_clean()
    assert fake.opened == 1


async def test_staging_over_budget_is_refused_and_nothing_leaks(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    slot = value_nbytes(cache.layout.block_nbytes)
    opener = functools.partial(
        open_cuda_engine,
        cache,
        slot_nbytes=slot,
        capacity=4,
        budget=4 * stride_for(slot) - 1,
        max_blocks=4,
        driver=fake,
    )
    with pytest.raises(ValueError, match="budget"):
        await anyio.to_thread.run_sync(opener)
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize(
    "call",
    [
        "module_load",
        "module_function",
        "stream_create",
        "host_alloc",
        "host_device_pointer",
        "mem_alloc",
        "memcpy_htod_async",
        "event_create",
    ],
)
async def test_a_failure_while_opening_releases_everything(fake: FakeDriver, call: str) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    fake.fail_next(call, "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(kvpipe.DeviceError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        await open_engine(fake, cache)
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize("fails", [None, "module_load", "memcpy_htod_async"])
async def test_opening_gives_its_thread_back_the_context_it_had(
    fake: FakeDriver, fails: str | None
) -> None:
    """open_cuda_engine runs in a worker thread others share; whether it opens or fails, the
    thread's current context is the one it had before (here another device's)."""
    cache = fake_device_cache(fake, _layout(), 2)
    if fails is not None:
        fake.fail_next(fails)

    def open_from_a_thread_with_its_own_context() -> tuple[object, int]:
        fake.set_current(fake.FOREIGN)
        try:
            return engine_opener(fake, cache, capacity=4, max_blocks=4)(), fake.current_of()
        except kvpipe.DeviceError as exc:
            return exc, fake.current_of()

    opened, current = await anyio.to_thread.run_sync(open_from_a_thread_with_its_own_context)
    assert current == fake.FOREIGN
    if fails is None:
        assert isinstance(opened, CudaEngine)
        await opened.aclose()
    else:
        assert isinstance(opened, kvpipe.DeviceError)
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_the_engine_leaves_the_event_loop_thread_s_context_as_it_was(
    fake: FakeDriver, producer: int
) -> None:
    """The engine's calls run on the event loop's thread, the server's, where its framework
    has its own context current (another device's here). A mark, a copy (while it waits
    for the device, other tasks of the loop run), a copy that allocates a scratch set, and
    close each make the engine's context current only around their driver calls."""
    cache = fake_device_cache(fake, _layout(), 4)
    fill_device(fake, cache, seed=9)
    segs = layout_segments(cache.layout)
    eng, pool = await open_engine(fake, cache, options=CudaOptions(max_calls=2))
    fake.set_current(fake.FOREIGN)
    model = Gate()
    fake.host_op(producer, lambda: None, gate=model, label="model kernel")
    mark = eng.mark(producer)
    assert fake.current_of() == fake.FOREIGN
    lease = await pool.acquire(4)
    seen: list[int] = []
    async with anyio.create_task_group() as tg:
        gather = copy_plan(segs, [0, 1], lease.slots[:2])
        tg.start_soon(functools.partial(eng.gather, gather, lease, after=mark))
        polls = fake.calls.count("event_query")
        while fake.calls.count("event_query") < polls + 5:  # it waits for the model
            await anyio.lowlevel.checkpoint()
            seen.append(fake.current_of())
        # A second call at once: a second scratch set is created for it.
        await eng.scatter(copy_plan(segs, [2, 3], lease.slots[2:]), lease)
        assert eng.accounting().scratch_buffers == 2
        seen.append(fake.current_of())
        model.open()
    assert set(seen) == {fake.FOREIGN}
    assert fake.current_of() == fake.FOREIGN
    mark.release()
    lease.release()
    await eng.aclose()
    assert fake.current_of() == fake.FOREIGN
    assert fake.violations == []  # every driver call ran with the engine's context current
    free_device_cache(fake, cache)


async def test_an_upload_that_never_completes_fails_the_open_and_frees_nothing_it_uses(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pointer table's upload stream never completes: opening gives up after
    ``drain_timeout`` with a DeviceError (it used to poll for ever), releases what the upload
    does not use, and keeps what it may still read or write (its pinned copy, the table, its
    stream and event) and the context they live in."""
    cache = fake_device_cache(fake, _layout(), 2)
    stuck = True
    query = fake.event_query
    monkeypatch.setattr(fake, "event_query", lambda event: query(event) and not stuck)
    opener = engine_opener(
        fake, cache, capacity=4, max_blocks=4, options=CudaOptions(drain_timeout=0.05)
    )
    try:
        with anyio.fail_after(10), pytest.raises(kvpipe.DeviceError, match="did not complete"):
            await anyio.to_thread.run_sync(opener, abandon_on_cancel=True)
    finally:
        stuck = False  # (unbounded, the open's thread polls until the stream completes)
    _assert_upload_kept(fake, cache)


def _assert_upload_kept(fake: Any, cache: Any) -> None:
    """Nothing the queued table upload uses was freed or destroyed under it; then let it end."""
    assert fake.violations == []  # nothing freed or destroyed under the queued copy
    live = fake.live()
    assert (live["pinned_allocations"], live["streams"], live["events"]) == (1, 1, 1)
    assert live["modules"] == 0 and live["contexts"] == 1
    assert live["device_allocations"] == 1 + len(cache.pointers)  # the table, the cache's
    fake.make_current()
    fake.run_until_idle()


@pytest.mark.parametrize("call", ["event_record", "event_query"])
async def test_an_upload_whose_completion_cannot_be_known_frees_nothing_it_uses(
    fake: FakeDriver, call: str
) -> None:
    """The pointer table's copy is queued, then recording or querying its event fails: the
    copy may still run, so opening fails with the driver's error but keeps what it may read
    or write (its pinned copy, the table, its stream) and their context, as for an upload
    that never completes. (It freed them, and destroyed the stream, under the queued copy.)"""
    cache = fake_device_cache(fake, _layout(), 2)
    fake.fail_next(call, "CUDA_ERROR_LAUNCH_FAILED")
    opener = engine_opener(fake, cache, capacity=4, max_blocks=4)
    with pytest.raises(kvpipe.DeviceError, match="CUDA_ERROR_LAUNCH_FAILED"):
        await anyio.to_thread.run_sync(opener)
    assert fake.violations == []  # nothing freed or destroyed under the queued copy
    live = fake.live()
    assert (live["pinned_allocations"], live["streams"], live["contexts"]) == (1, 1, 1)
    assert live["device_allocations"] == 1 + len(cache.pointers)  # the table, the cache's
    assert live["modules"] == 0
    fake.make_current()
    fake.run_until_idle()


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_an_upload_interrupted_while_polling_frees_nothing_it_uses(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """Something other than a driver error is raised while opening polls the queued pointer
    table's upload (Ctrl-C in a caller opening from its main thread, a MemoryError): it
    propagates as it is, and what the copy may still read or write (its pinned copy, the
    table, its stream and event) and their context are kept, as for a driver error. (They
    were freed, and the stream destroyed, under the queued copy.)"""
    cache = fake_device_cache(fake, _layout(), 2)
    query = fake.event_query

    def interrupted(event: int) -> bool:
        if not query(event):
            raise error
        return True

    monkeypatch.setattr(fake, "event_query", interrupted)
    with pytest.raises(error):
        engine_opener(fake, cache, capacity=4, max_blocks=4)()
    _assert_upload_kept(fake, cache)


async def test_a_failed_launch_is_reported_and_the_engine_recovers(fake: FakeDriver) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 6)
    rows = fill_device(fake, cache, seed=1)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        lease = await pool.acquire(2)
        fake.fail_next("launch", "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")
        with pytest.raises(kvpipe.DeviceError, match="OUT_OF_RESOURCES"):
            await eng.gather(copy_plan(segs, [1, 2], lease.slots), lease)
        assert eng.accounting().scratch_in_use == 0
        await eng.gather(copy_plan(segs, [4, 5], lease.slots), lease)
        got = pool.buffer[lease.slots[1], : len(rows[0][5])]
        assert got.tobytes() == rows[0][5].tobytes()
        assert eng.accounting().scratch_buffers == 1  # the set was reused
        lease.release()
        assert lease.released
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize("call", ["event_create", "host_alloc", "mem_alloc"])
async def test_a_failure_creating_a_scratch_set_leaks_nothing(
    fake: FakeDriver, producer: int, call: str
) -> None:
    # A set is its completion event, then its pinned and device pair tables; when one of
    # them fails, what was taken must be given back (it is in no set: close never frees it).
    cache = fake_device_cache(fake, _layout(), 2)
    segs = layout_segments(cache.layout)
    async with engine(fake, cache) as (eng, pool):
        held = eng.mark(producer)  # takes the only pooled event: the set's must be created
        lease = await pool.acquire(1)
        fake.fail_next(call, "CUDA_ERROR_OUT_OF_MEMORY")
        with pytest.raises(kvpipe.DeviceError, match="OUT_OF_MEMORY"):
            await eng.gather(copy_plan(segs, [0], lease.slots), lease)
        acct = eng.accounting()
        assert acct.scratch_buffers == 0 and acct.scratch_in_use == 0
        assert acct.pinned_allocations == 1  # the staging only
        assert acct.device_allocations == 1  # the pointer table only
        held.release()
        lease.release()
    free_device_cache(fake, cache)
    live = fake.live()
    assert live["pinned_allocations"] == live["device_allocations"] == 0, live


async def test_a_device_that_cannot_drain_retires_slots_and_scratch(fake: FakeDriver) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 6)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        lease = await pool.acquire(2)
        fake.fail_next("launch", "CUDA_ERROR_ILLEGAL_ADDRESS")
        fake.fail_next("event_record", "CUDA_ERROR_ILLEGAL_ADDRESS")  # recovery fails too
        with pytest.raises(kvpipe.DeviceError):
            await eng.gather(copy_plan(segs, [1, 2], lease.slots), lease)
        lease.release()
        assert not lease.released  # the engine kept a reference: slots never reused
        assert pool.in_use == 2
        other = await pool.acquire(2)
        await eng.gather(copy_plan(segs, [3, 4], other.slots), other)
        assert eng.accounting().scratch_buffers == 2  # the retired set is not handed out
        other.release()
    free_device_cache(fake, cache)
    fake.assert_clean()  # retired scratch is still freed at close, after the streams drained


async def test_calls_beyond_the_slice_size_are_refused(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, _layout(), 6)
    segs = layout_segments(cache.layout)
    async with engine(fake, cache, max_blocks=2) as (eng, pool):
        lease = await pool.acquire(3)
        with pytest.raises(ValueError, match="exceed"):
            await eng.gather(copy_plan(segs, [0, 1, 2], lease.slots), lease)
        await eng.gather(copy_plan(segs, [], []), lease)  # empty: nothing to do
        assert fake.launches == []
        lease.release()
    with pytest.raises(RuntimeError, match="closed"):
        await eng.gather(copy_plan(segs, [0], [0]), lease)
    with pytest.raises(RuntimeError, match="closed"):
        eng.mark(0)
    await eng.aclose()  # idempotent
    free_device_cache(fake, cache)
    fake.assert_clean()


async def test_close_can_leave_staging_to_a_thread_still_using_it(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache, capacity=4)
    staging = eng.staging
    await eng.aclose(staging_in_use=True)
    live = fake.live()
    assert live["pinned_allocations"] == 1 and live["streams"] == 0
    assert live["contexts"] == 1  # pinned memory lives as long as its context: kept
    assert not staging.freed
    fake.make_current()  # (close gave the thread back its context: none)
    staging.free()  # as the process would at exit: free it by hand here
    fake.close()
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize("fails", ["mem_free", "stream_destroy", "module_unload"])
async def test_a_failed_free_at_close_still_keeps_the_context_of_staging_in_use(
    fake: FakeDriver, fails: str
) -> None:
    """Staging a thread may still use is left allocated at close, and with it the context
    it lives in. Should freeing the engine's other resources fail first, the context must
    still be kept: releasing it (the last reference destroys a primary context) frees the
    pinned staging under the thread. (It was released whenever a free failed.)"""
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache, capacity=4)
    staging = eng.staging
    fake.fail_next(fails)
    await eng.aclose(staging_in_use=True)
    assert not staging.freed
    assert fake.live()["contexts"] == 1  # kept for the thread, as without the failure
    fake.make_current()
    staging.free()  # as the process would at exit: free it by hand here
    fake.close()
    free_device_cache(fake, cache)


@pytest.mark.parametrize("fails", ["mem_free", "host_free"])
async def test_memory_whose_free_fails_stays_in_the_accounting(
    fake: FakeDriver, fails: str
) -> None:
    """accounting() is what the engine holds, exactly: memory the driver failed to free at
    close (the pointer table, the pinned staging) is still allocated, so it is still counted.
    (The ledger forgot an allocation before asking the driver to free it: a failed free was
    reported as freed.)"""
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache, capacity=4)
    fake.fail_next(fails)
    await eng.aclose()
    # Close stops at the failure: a failed table free leaves the staging too.
    held = {"mem_free": (1, 1), "host_free": (0, 1)}[fails]  # (device, pinned) allocations
    live = fake.live()
    assert (live["device_allocations"] - len(cache.pointers), live["pinned_allocations"]) == held
    acct = eng.accounting()
    assert (acct.device_allocations, acct.pinned_allocations) == held


async def test_close_does_not_free_memory_a_stuck_stream_may_use(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache, options=CudaOptions(drain_timeout=0.05))
    gate = Gate()
    fake.host_op(eng._streams["gather"], lambda: None, gate=gate, label="hung kernel")
    await eng.aclose()
    assert fake.live()["pinned_allocations"] == 1  # leaked on purpose, and logged
    assert fake.live()["device_allocations"] >= 1
    gate.open()
    fake.run_until_idle()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_close_cancelled_by_asyncio_still_frees_everything_then_is_cancelled(
    fake: FakeDriver,
) -> None:
    """anyio's shield does not keep out asyncio's own cancellation (``Task.cancel``: a
    timeout around the close, a shutdown): a close waiting for a stream to drain returned at
    once, marked closed, so no later close freed anything (streams, scratch, the pointer
    table, pinned staging, the context: all held for good). It waits on through it, frees
    everything once the stream is done, then is cancelled."""
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache)
    gate = Gate()
    fake.host_op(eng._streams["gather"], lambda: None, gate=gate, label="copy still running")

    async def polls(n: int) -> None:
        start = fake.calls.count("event_query")
        for _ in range(2000):
            if fake.calls.count("event_query") >= start + n or task.done():
                return
            await anyio.sleep(0.001)

    task = asyncio.ensure_future(eng.aclose())
    try:
        await polls(3)
        task.cancel("shutting down")
        await polls(3)
        assert not task.done()  # still draining
        assert fake.live()["pinned_allocations"] == 1
    finally:
        gate.open()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()  # the cancellation is not swallowed
    free_device_cache(fake, cache)
    fake.assert_clean()


@pytest.mark.parametrize(
    "bad",
    [
        {"d2h": "fast"},
        {"h2d": "dma"},
        {"scratch_bytes": 0},
        {"max_calls": 0},
        {"poll_max": 0.0},
        {"drain_timeout": -1.0},
    ],
)
def test_options_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CudaOptions(**bad)  # type: ignore[arg-type]


async def test_only_a_producer_mark_orders_a_copy(fake: FakeDriver) -> None:
    from kvpipe._engine import OrderMark

    class Other(OrderMark):
        def retain(self) -> None: ...

        def release(self) -> None: ...

    cache = fake_device_cache(fake, _layout(), 2)
    async with engine(fake, cache) as (eng, pool):
        lease = await pool.acquire(1)
        with pytest.raises(TypeError, match="ProducerMark"):
            await eng.gather(
                copy_plan(layout_segments(cache.layout), [0], lease.slots), lease, Other()
            )
        lease.release()
    free_device_cache(fake, cache)


async def test_close_waits_for_a_call_that_got_its_scratch_after_close_began(
    fake: FakeDriver, producer: int
) -> None:
    # One scratch set; calls 1 and 2 wait for it while call 0 runs. Close begins and waits
    # for the calls in flight. Call 2 gets the scratch only after close's drain began, and
    # queues work (ordered after the producer's) that the drain does not cover: close must
    # wait for it too, not free the scratch and streams it still uses.
    fake.latency = 50  # call 0 is still running when the others and close come
    cache = fake_device_cache(fake, _layout(), 4)
    segs = layout_segments(cache.layout)
    eng, pool = await open_engine(fake, cache, options=CudaOptions(max_calls=1))
    busy = Gate()  # a scatter still running on the engine's other stream
    fake.host_op(eng._streams["scatter"], lambda: None, gate=busy, label="scatter in flight")
    model = Gate()
    fake.host_op(producer, lambda: None, gate=model, label="model kernel")
    mark = eng.mark(producer)
    lease = await pool.acquire(3)
    finished: list[int] = []

    async def copy(block: int) -> None:
        plan = copy_plan(segs, [block], lease.slots[block : block + 1])
        await eng.gather(plan, lease, after=mark if block == 2 else None)
        finished.append(block)

    async def polls(n: int) -> None:
        start = fake.calls.count("event_query")
        for _ in range(2000):
            if fake.calls.count("event_query") >= start + n:
                return
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        for block in range(3):
            tg.start_soon(copy, block)
            await anyio.lowlevel.checkpoint()
        assert eng.accounting().scratch_in_use == 1
        tg.start_soon(eng.aclose)
        for _ in range(2000):  # call 2 has queued its work (behind the model's)
            if "stream_wait_event" in fake.calls:
                break
            await anyio.sleep(0.001)
        busy.open()
        await polls(20)  # close polls on; it must still be waiting for call 2
        assert fake.live()["streams"] == 3  # the engine's two and the producer's
        model.open()
    assert sorted(finished) == [0, 1, 2]
    mark.release()
    lease.release()
    free_device_cache(fake, cache)


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        import trio.testing

        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    async def test_a_scatter_still_waiting_for_scratch_at_its_start_by_never_starts(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """One scratch set, held by a gather waiting on the model's stream: a scatter given
        ``start_by`` gives up waiting then (``NotStarted``), queues nothing, and takes no
        scratch; the cache blocks it would have written keep their bytes."""
        from kvpipe._workers import NotStarted
        from tests.cuda.devcache import device_rows

        cache = fake_device_cache(fake, _layout(), 4)
        fill_device(fake, cache, seed=6)
        segs = layout_segments(cache.layout)
        async with engine(fake, cache, options=CudaOptions(max_calls=1)) as (eng, pool):
            model = Gate()
            fake.host_op(producer, lambda: None, gate=model, label="model kernel")
            mark = eng.mark(producer)
            held, lease = await pool.acquire(1), await pool.acquire(1)
            pool.buffer[lease.slots[0]] = 0x5A
            before = device_rows(fake, cache)
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    functools.partial(
                        eng.gather, copy_plan(segs, [0], held.slots), held, after=mark
                    )
                )
                start = anyio.current_time()
                try:
                    while eng.accounting().scratch_in_use == 0:  # the gather takes it
                        await anyio.lowlevel.checkpoint()
                    launches = len(fake.launches)
                    with anyio.fail_after(50), pytest.raises(NotStarted):
                        await eng.scatter(
                            copy_plan(segs, [3], lease.slots), lease, start_by=start + 5
                        )
                    assert anyio.current_time() == pytest.approx(start + 5, abs=0.01)
                    assert len(fake.launches) == launches
                    assert eng.accounting().scratch_in_use == 1
                finally:
                    model.open()  # the gather (shielded) can end
            mark.release()
            fake.run_until_idle()
            after = device_rows(fake, cache)
            assert all((new[3] == old[3]).all() for old, new in zip(before, after, strict=True))
            held.release()
            lease.release()
        free_device_cache(fake, cache)

    async def test_a_scatter_whose_producer_is_still_busy_at_its_start_by_never_starts(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """The model's work the scatter is ordered after is still running at ``start_by``:
        the scatter gives up then (``NotStarted``) and queues nothing. (It used to queue its
        copy behind the model's work at once and wait for it, shielded: its caller, a read
        past its deadline, waited as long as the model's stream stayed busy, and the copy
        wrote into the cache whenever that ended.)"""
        from kvpipe._workers import NotStarted
        from tests.cuda.devcache import device_rows

        cache = fake_device_cache(fake, _layout(), 4)
        fill_device(fake, cache, seed=7)
        segs = layout_segments(cache.layout)
        async with engine(fake, cache) as (eng, pool):
            model = Gate()
            fake.host_op(producer, lambda: None, gate=model, label="model kernel")
            mark = eng.mark(producer)
            lease = await pool.acquire(1)
            pool.buffer[lease.slots[0]] = 0x5A
            before = device_rows(fake, cache)
            launches = len(fake.launches)
            start = anyio.current_time()
            outcome: list[object] = []

            async def model_ends() -> None:
                await anyio.sleep_until(start + 20)
                model.open()

            async with anyio.create_task_group() as tg:
                tg.start_soon(model_ends)
                try:
                    await eng.scatter(
                        copy_plan(segs, [3], lease.slots), lease, after=mark, start_by=start + 5
                    )
                    outcome.append(("scattered", anyio.current_time() - start))
                except NotStarted:
                    outcome.append(("not started", anyio.current_time() - start))
            assert outcome == [("not started", pytest.approx(5, abs=0.01))]
            assert len(fake.launches) == launches
            assert eng.accounting().scratch_in_use == 0
            mark.release()
            fake.run_until_idle()
            after = device_rows(fake, cache)
            assert all((new[3] == old[3]).all() for old, new in zip(before, after, strict=True))
            lease.release()
        free_device_cache(fake, cache)

    async def test_a_copy_still_waiting_for_scratch_at_the_close_deadline_queues_nothing(
        self, fake: FakeDriver, producer: int
    ) -> None:
        """One scratch set, held by a gather behind the model's stream, which never drains.
        A scatter waits for the set; the close deadline passes: the scatter gives up then
        (DeviceError) and queues nothing, so nothing is written into the cache after close.
        (Its wait for scratch ignored the deadline: once the gather gave up its set there,
        the scatter took it and queued its copy, which wrote into the cache afterwards.)"""
        from tests.cuda.devcache import device_rows

        cache = fake_device_cache(fake, _layout(), 4)
        fill_device(fake, cache, seed=8)
        segs = layout_segments(cache.layout)
        eng, pool = await open_engine(fake, cache, options=CudaOptions(max_calls=1))
        model = Gate()
        fake.host_op(producer, lambda: None, gate=model, label="hung model kernel")
        mark = eng.mark(producer)
        held, lease = await pool.acquire(1), await pool.acquire(1)
        pool.buffer[lease.slots[0]] = 0x5A
        before = device_rows(fake, cache)
        errors: list[str] = []

        async def copy(name: str, call: Any) -> None:
            try:
                await call()
            except kvpipe.DeviceError:
                errors.append(name)

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            gather = functools.partial(
                eng.gather, copy_plan(segs, [0], held.slots), held, after=mark
            )
            tg.start_soon(copy, "gather", gather)
            while eng.accounting().scratch_in_use == 0:  # the gather takes the set
                await anyio.lowlevel.checkpoint()
            launches = len(fake.launches)
            scatter = functools.partial(eng.scatter, copy_plan(segs, [3], lease.slots), lease)
            tg.start_soon(copy, "scatter", scatter)
            await anyio.sleep(0.5)
            await eng.aclose(deadline=start + 1)
        assert anyio.current_time() - start == pytest.approx(1, abs=0.01)
        assert sorted(errors) == ["gather", "scatter"]
        assert len(fake.launches) == launches  # the scatter queued nothing
        model.open()
        mark.release()
        fake.run_until_idle()
        after = device_rows(fake, cache)
        assert all((new[3] == old[3]).all() for old, new in zip(before, after, strict=True))

    @pytest.mark.parametrize(
        ("parked", "first"),
        [("producer", "close"), ("producer", "call"), ("scratch", "close")],
    )
    async def test_a_copy_waiting_to_start_at_the_close_deadline_does_not_make_close_leak(
        self,
        fake: FakeDriver,
        producer: int,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
        parked: str,
        first: str,
    ) -> None:
        """A copy still waiting to start (for the producer's mark, or for scratch) when the
        close deadline passes has queued nothing; close and the copy wake at that deadline,
        in the order the event loop picks. Here the order is set: the copy's wait is held
        (shielded, as if the loop woke it later) until close decided, or until it ended
        before close decides. Either way close frees everything, and the copy fails
        (DeviceError) without a driver call after close decided. (If close ran first, it
        counted the waiting copy as running, logged "still running", and leaked the staging,
        scratch, table, streams and context of an idle engine; the copy, woken afterwards,
        polled the producer's event or took a scratch set and queued its copy after close.)
        """
        from kvpipe.cuda import _engine

        cache = fake_device_cache(fake, _layout(), 4)
        segs = layout_segments(cache.layout)
        eng, pool = await open_engine(fake, cache)
        model = Gate()
        fake.host_op(producer, lambda: None, gate=model, label="hung model kernel")
        mark = eng.mark(producer)
        lease = await pool.acquire(1)
        waiting, woken, ended = anyio.Event(), anyio.Event(), anyio.Event()

        async def held(wait: Any, *args: Any, **kwargs: Any) -> Any:
            waiting.set()
            with anyio.CancelScope(shield=True):  # neither the deadline nor close cuts it
                await woken.wait()
                return await wait(*args, **kwargs)  # as if its wait had just ended

        real_wait, real_acquire = eng._wait, eng._scratch.acquire
        if parked == "producer":

            async def wait(event: int, **kwargs: Any) -> None:
                if event != mark.event:
                    return await real_wait(event, **kwargs)
                return await held(real_wait, event, **kwargs)  # type: ignore[no-any-return]

            monkeypatch.setattr(eng, "_wait", wait)
        else:
            monkeypatch.setattr(eng._scratch, "acquire", functools.partial(held, real_acquire))
        if first == "call":  # the copy ends before close decides
            real_shielded = _engine.shielded

            async def shielded(*args: Any, **kwargs: Any) -> bool:
                done = await real_shielded(*args, **kwargs)
                if not woken.is_set():  # close's wait for idle ended: let the copy end first
                    woken.set()
                    await ended.wait()
                return done

            monkeypatch.setattr(_engine, "shielded", shielded)
        start = anyio.current_time()
        errors: list[BaseException] = []

        async def scatter() -> None:
            plan = copy_plan(segs, [3], lease.slots)
            try:
                if parked == "producer":
                    await eng.scatter(plan, lease, after=mark, start_by=start + 100)
                else:
                    await eng.scatter(plan, lease, after=mark)
            except kvpipe.DeviceError as exc:
                errors.append(exc)
            finally:
                ended.set()

        launches = len(fake.launches)
        async with anyio.create_task_group() as tg:
            tg.start_soon(scatter)
            await waiting.wait()
            await eng.aclose(deadline=start + 1)
            assert anyio.current_time() == pytest.approx(start + 1, abs=1e-3)
            assert "still running" not in caplog.text
            calls = len(fake.calls)
            woken.set()
        assert fake.calls[calls:] == []  # nothing after close, its free included
        assert len(errors) == 1
        assert len(fake.launches) == launches
        model.open()
        mark.release()
        lease.release()
        free_device_cache(fake, cache)
        live = fake.live()
        assert (live["pinned_allocations"], live["device_allocations"]) == (0, 0), live
        assert (live["streams"], live["modules"], live["contexts"]) == (1, 0, 1), live

    async def test_close_ends_at_its_deadline_whatever_poll_max(self, fake: FakeDriver) -> None:
        """A stream that never drains: close gives up at its deadline exactly, not at the
        end of a back-off sleep of up to ``poll_max`` begun before it (it used to: with
        ``poll_max`` 5 s, a close due at +1 s returned at +1.64 s)."""
        cache = fake_device_cache(fake, _layout(), 2)
        options = CudaOptions(poll_max=5.0, drain_timeout=100.0)
        eng, _pool = await open_engine(fake, cache, options=options)
        gate = Gate()
        fake.host_op(eng._streams["gather"], lambda: None, gate=gate, label="hung kernel")
        start = anyio.current_time()
        await eng.aclose(deadline=start + 1)
        assert anyio.current_time() - start == pytest.approx(1, abs=1e-3)
        assert fake.live()["pinned_allocations"] == 1  # leaked on purpose, and logged
        gate.open()
        fake.run_until_idle()


async def test_an_idle_engine_closed_past_its_deadline_frees_everything(fake: FakeDriver) -> None:
    """A pipeline's close whose deadline its requests used up closes the engine with the
    deadline already passed. Nothing runs: the engine frees everything. (It leaked its
    pinned staging, device memory, streams and context, logging copies "still running":
    the wait for idle, cut at once by the passed deadline, counted as copies still running,
    and the drain's first poll of an idle stream came before the device completed it.)"""
    cache = fake_device_cache(fake, _layout(), 2)
    eng, _pool = await open_engine(fake, cache, capacity=4)
    await eng.aclose(deadline=anyio.current_time() - 1)
    free_device_cache(fake, cache)
    fake.assert_clean()
