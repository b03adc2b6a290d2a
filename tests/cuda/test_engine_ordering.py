"""Ordering after the producer, cancellation, and completion without blocking the loop —
the CUDA engine over the driver's test double (which fails a test when a copy touches
memory before the producer's work it must wait for has been reached)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe._plan import copy_plan, layout_segments
from kvpipe.cuda._resources import CudaOptions
from tests.cuda.devcache import device_rows, fake_device_cache, fill_device, free_device_cache
from tests.cuda.engines import engine
from tests.cuda.fake_driver import DriverViolation, FakeDriver, Gate


def _layout() -> kvpipe.CacheLayout:
    return kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=4, block_size=3)


def _producer_write(fake: FakeDriver, cache: kvpipe.KVCache, block: int, value: int):  # type: ignore[no-untyped-def]
    """What the model's kernel does: write ``value`` into every tensor's ``block``."""
    ranges = []
    for (role, _l), ptr in zip(cache.layout.tensor_order(), cache.pointers, strict=True):
        n = cache.layout.role(role).block_nbytes
        ranges.append((ptr + block * n, n))

    def run() -> None:
        for addr, n in ranges:
            fake.write_device(addr, bytes([value]) * n)

    return run, ranges


async def _until(pred, limit: int = 2000) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit):
        if pred():
            return
        await anyio.sleep(0.001)
    raise AssertionError("condition never became true")


async def _polled_pending(fake: FakeDriver, times: int = 2) -> None:
    """Return once the engine has polled its events ``times`` more times: with the producer's
    gate closed, each poll found its copy still pending (no wall-clock wait)."""
    start = fake.calls.count("event_query")
    await _until(lambda: fake.calls.count("event_query") >= start + times)


async def test_gather_waits_for_the_producers_write(fake: FakeDriver, producer: int) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    fill_device(fake, cache, seed=1)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        gate = Gate()
        run, ranges = _producer_write(fake, cache, 2, 0x5A)
        fake.host_op(producer, run, writes=ranges, gate=gate, label="model writes block 2")
        mark = eng.mark(producer)  # at call time: after the model's write was queued
        lease = await pool.acquire(1)
        done = anyio.Event()

        async def gather() -> None:
            await eng.gather(copy_plan(segs, [2], lease.slots), lease, after=mark)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(gather)
            await _polled_pending(fake)  # the engine saw the copy pending, and polls on
            assert not done.is_set()  # still waiting for the model (not blocking the loop)
            gate.open()
        assert (pool.buffer[lease.slots[0], : layout.block_nbytes] == 0x5A).all()
        mark.release()
        lease.release()
    free_device_cache(fake, cache)


async def test_scatter_waits_until_the_producer_stops_reading(
    fake: FakeDriver, producer: int
) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    fill_device(fake, cache, seed=2)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        gate = Gate()
        seen: list[bytes] = []
        _run, ranges = _producer_write(fake, cache, 1, 0)
        fake.host_op(
            producer,
            lambda: seen.append(fake.read_device(ranges[0][0], ranges[0][1])),
            reads=ranges,
            gate=gate,
            label="model reads block 1",
        )
        old = fake.read_device(ranges[0][0], ranges[0][1])
        mark = eng.mark(producer)
        lease = await pool.acquire(1)
        pool.buffer[lease.slots[0], : layout.block_nbytes] = 0x77
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.scatter, copy_plan(segs, [1], lease.slots), lease, mark)
            await _polled_pending(fake)  # queued behind the model's read, and pending
            gate.open()
        assert seen == [old]  # the model read the old contents, then kvpipe overwrote them
        assert all((r[1] == 0x77).all() for r in device_rows(fake, cache))
        mark.release()
        lease.release()
    free_device_cache(fake, cache)


async def test_without_the_mark_the_double_catches_the_race(
    fake: FakeDriver, producer: int
) -> None:
    """The double's ordering check is real: a gather not ordered after the producer's
    pending write is flagged (this is the silent-corruption bug the mark prevents)."""
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    segs = layout_segments(layout)
    gate = Gate()
    async with engine(fake, cache) as (eng, pool):
        run, ranges = _producer_write(fake, cache, 3, 0x11)
        fake.host_op(producer, run, writes=ranges, gate=gate)
        lease = await pool.acquire(1)
        with pytest.raises(DriverViolation, match="ordering"):
            await eng.gather(copy_plan(segs, [3], lease.slots), lease)  # no after=
        assert any("missing event wait" in v for v in fake.violations)
        fake.violations.clear()
        gate.open()
        fake.run_until_idle()
        lease.release()
    free_device_cache(fake, cache)


async def test_a_mark_outlives_the_request_while_a_copy_uses_it(
    fake: FakeDriver, producer: int
) -> None:
    """A copy waiting for scratch holds its own reference on the mark: the request may
    end (and drop its reference) before the copy has queued its wait."""
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    segs = layout_segments(layout)
    async with engine(fake, cache, options=CudaOptions(max_calls=1)) as (eng, pool):
        gate = Gate()
        fake.host_op(producer, lambda: None, gate=gate)
        first = eng.mark(producer)
        lease = await pool.acquire(2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.gather, copy_plan(segs, [0], lease.slots[:1]), lease, first)
            await _until(lambda: eng.accounting().scratch_in_use == 1)
            second = eng.mark(producer)
            tg.start_soon(eng.gather, copy_plan(segs, [1], lease.slots[1:]), lease, second)
            # the second copy has taken its reference and waits for the only scratch set
            await _until(lambda: second._refs == 2)
            first.release()
            second.release()  # both requests "ended"
            assert first.released and not second.released
            gate.open()
        assert second.released
        with pytest.raises(RuntimeError):
            second.retain()
        live = eng.accounting().events
        again = eng.mark(producer)  # events went back to the pool and are reused
        assert eng.accounting().events == live
        again.release()
        lease.release()
    free_device_cache(fake, cache)


async def test_bad_streams_are_request_errors(fake: FakeDriver) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    async with engine(fake, cache) as (eng, _pool):
        for bad in (-1, True, 1.5, "0"):
            with pytest.raises(kvpipe.RequestError):
                eng.mark(bad)  # type: ignore[arg-type]
        with pytest.raises(kvpipe.RequestError, match="pass stream="):
            eng.mark(None)  # a DLPack/torch-like cache of unknown framework
    free_device_cache(fake, cache)


async def test_cancelled_while_waiting_for_scratch_takes_nothing(
    fake: FakeDriver, producer: int
) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    segs = layout_segments(layout)
    async with engine(fake, cache, options=CudaOptions(max_calls=1)) as (eng, pool):
        gate = Gate()
        fake.host_op(producer, lambda: None, gate=gate)
        mark = eng.mark(producer)
        lease = await pool.acquire(2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.gather, copy_plan(segs, [0], lease.slots[:1]), lease, mark)
            await _until(lambda: eng.accounting().scratch_in_use == 1)
            try:
                queued = len(fake.calls)
                with anyio.move_on_after(0.02) as scope:
                    await eng.gather(copy_plan(segs, [1], lease.slots[1:]), lease, mark)
                assert scope.cancelled_caught
                polling = ("event_query", "make_current", "get_current", "set_current")
                calls = {c for c in fake.calls[queued:] if c not in polling}
                assert calls == set()  # nothing was queued or allocated for it
            finally:
                gate.open()  # else the first copy (shielded) would wait forever
        mark.release()
        assert mark.released
        lease.release()
    free_device_cache(fake, cache)


async def test_cancelled_after_queueing_waits_for_the_device(
    fake: FakeDriver, producer: int
) -> None:
    layout = _layout()
    cache = fake_device_cache(fake, layout, 4)
    fill_device(fake, cache, seed=3)
    segs = layout_segments(layout)
    async with engine(fake, cache) as (eng, pool):
        gate = Gate()
        run, ranges = _producer_write(fake, cache, 0, 0x33)
        fake.host_op(producer, run, writes=ranges, gate=gate)
        mark = eng.mark(producer)
        lease = await pool.acquire(1)
        returned = anyio.Event()
        scope = anyio.CancelScope()

        async def gather() -> None:
            with scope:
                await eng.gather(copy_plan(segs, [0], lease.slots), lease, mark)
            returned.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(gather)
            try:
                await _until(lambda: eng.accounting().scratch_in_use == 1)  # queued
                scope.cancel()
                await _polled_pending(fake)  # polled after the cancel, copy still pending
                assert not returned.is_set()  # shielded: the device is still to write staging
            finally:
                gate.open()
        assert returned.is_set()
        assert (pool.buffer[lease.slots[0], : layout.block_nbytes] == 0x33).all()
        mark.release()
        lease.release()
    free_device_cache(fake, cache)


async def test_polling_does_not_block_the_event_loop(fake: FakeDriver, producer: int) -> None:
    cache = fake_device_cache(fake, _layout(), 2)
    segs = layout_segments(cache.layout)
    async with engine(fake, cache) as (eng, pool):
        gate = Gate()
        fake.host_op(producer, lambda: None, gate=gate)
        mark = eng.mark(producer)
        lease = await pool.acquire(1)
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while not gate.is_open:
                ticks += 1
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.gather, copy_plan(segs, [1], lease.slots), lease, mark)
            tg.start_soon(ticker)
            # the loop ran on while the copy was pending, and the engine polled it
            await _until(lambda: ticks >= 10 and fake.calls.count("event_query") >= 3)
            gate.open()
        polls = fake.calls.count("event_query")
        assert 3 <= polls < 200  # backed off, not spinning
        mark.release()
        lease.release()
    free_device_cache(fake, cache)


async def test_trio_backend(fake: FakeDriver) -> None:
    """The engine runs on trio too (anyio primitives only)."""
    cache = fake_device_cache(fake, _layout(), 3)
    rows = fill_device(fake, cache, seed=9)
    segs = layout_segments(cache.layout)

    async def main() -> None:
        async with engine(fake, cache) as (eng, pool):
            lease = await pool.acquire(2)
            await eng.gather(copy_plan(segs, [2, 0], lease.slots), lease)
            got = pool.buffer[lease.slots[0], : cache.layout.block_nbytes]
            assert got.tobytes() == np.concatenate([r[2] for r in rows]).tobytes()
            lease.release()

    await anyio.to_thread.run_sync(lambda: anyio.run(main, backend="trio"))
    free_device_cache(fake, cache)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("first", ["asyncio cancel", "failed launch"])
async def test_a_copy_recovering_on_a_busy_stream_waits_through_asyncio_cancels(
    fake: FakeDriver, first: str
) -> None:
    """A copy whose queued work is still pending on its (busy) stream is cut short, first by
    asyncio's own cancellation or a failed launch, and recovers: it waits for the stream
    before giving anything back. A (second) ``Task.cancel`` during that wait got through
    anyio's shield: the copy returned at once, its scratch set neither given back nor retired
    and its staging lease not kept, so its caller released slots the device was still to
    write. It waits on, gives the set back once the stream is done, then is cancelled."""
    import asyncio

    cache = fake_device_cache(fake, _layout(), 4)
    fill_device(fake, cache, seed=4)
    segs = layout_segments(cache.layout)
    async with engine(fake, cache) as (eng, pool):
        busy = Gate()  # earlier work on the gather stream, still running
        fake.host_op(eng._streams["gather"], lambda: None, gate=busy, label="busy stream")
        lease = await pool.acquire(2)
        if first == "failed launch":
            fake.fail_next("launch", "CUDA_ERROR_LAUNCH_FAILED")  # the pair upload is queued
        task = asyncio.ensure_future(eng.gather(copy_plan(segs, [1, 2], lease.slots), lease))

        async def polled() -> None:  # polled twice more (still pending), or returned
            start = fake.calls.count("event_query")
            await _until(lambda: fake.calls.count("event_query") >= start + 2 or task.done())

        try:
            await _until(lambda: eng.accounting().scratch_in_use == 1 or task.done())
            await polled()
            if first == "asyncio cancel":
                task.cancel("first")
                await polled()  # recovering: waiting for the stream
            task.cancel("again")
            await polled()
            assert not task.done()  # the device may still write the slots and the scratch
            assert eng.accounting().scratch_in_use == 1
        finally:
            busy.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()  # the cancellation is not swallowed
        assert eng.accounting().scratch_in_use == 0  # given back, the stream having drained
        lease.release()
        assert lease.released
        other = await pool.acquire(1)
        await eng.gather(copy_plan(segs, [3], other.slots), other)
        assert eng.accounting().scratch_buffers == 1  # the set was reused, not retired
        other.release()
    free_device_cache(fake, cache)
