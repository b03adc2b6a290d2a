"""The staging pool (FIFO fairness, cancellation, slot views, lease refcounts) and the
ThreadRunner (results, errors, and holding staging while an abandoned thread still runs)."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe._errors import ConfigError
from kvpipe._staging import StagingLease, StagingPool, ValueMemory
from tests.helpers import checkpoints, until

# ---------------------------------------------------------------- pool basics


def test_pool_larger_than_memory_says_how_much() -> None:
    # 1 PiB: numpy's allocation fails on any machine; the error names what was asked.
    with pytest.raises(ConfigError, match="could not allocate 1125899906842624 B") as info:
        StagingPool(1 << 20, 1 << 30)
    assert info.value.field == "staging_bytes" and "available now" in str(info.value)


@pytest.mark.parametrize(
    ("num_layers", "head_dim", "stride"),
    [(1, 64, 4096 + 64), (16, 256, (256 << 10) + 4096)],  # blocks of 4 KiB, 256 KiB
)
def test_slot_size_is_what_docs_say(num_layers: int, head_dim: int, stride: int) -> None:
    """docs/embedding.md, "Sizing staging_bytes": a slot is ``block_nbytes + 48`` bytes,
    rounded up to 64 bytes, or to a 4 KiB page from 64 KiB on: staging for N slots holds N."""
    layout = kvpipe.CacheLayout.gqa(
        num_layers=num_layers, num_kv_heads=2, head_dim=head_dim, block_size=8, dtype="float16"
    )
    config = kvpipe.PipelineConfig(staging_bytes=4 * stride, slice_block_num=4)
    pipe = kvpipe.Pipeline(kvpipe.create_kv_cache(layout, 4), kvpipe.MemoryStore(), config=config)
    assert pipe.slice_blocks == 4
    assert pipe.statistics().staging_capacity_bytes == 4 * stride
    assert (
        kvpipe.Pipeline(
            pipe.cache, kvpipe.MemoryStore(), config=config.replace(staging_bytes=4 * stride - 1)
        ).slice_blocks
        == 3
    )


def test_the_warning_of_cut_slices_names_what_a_block_takes_in_staging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Staging sized as ``slice_block_num * block_nbytes`` (16384 B for 4 blocks of 4096 B)
    holds 3 slots of 4160 B. The warning used to say "4 blocks of 4096 B do not fit
    staging_bytes=16384", which they do by that arithmetic: it names the slot's bytes."""
    layout = kvpipe.CacheLayout.gqa(
        num_layers=1, num_kv_heads=2, head_dim=64, block_size=8, dtype="float16"
    )
    assert layout.block_nbytes == 4096
    config = kvpipe.PipelineConfig(staging_bytes=4 * 4096, slice_block_num=4)
    with caplog.at_level("WARNING", logger="kvpipe"):
        pipe = kvpipe.Pipeline(
            kvpipe.create_kv_cache(layout, 4), kvpipe.MemoryStore(), config=config
        )
    assert pipe.slice_blocks == 3
    (record,) = [r for r in caplog.records if "slices are cut" in r.getMessage()]
    message = record.getMessage()
    assert "4 blocks" in message and "4160 B" in message and "16384" in message, message
    assert "cut to 3 blocks" in message, message


@pytest.mark.parametrize(("nbytes", "slots"), [(0, 1), (1, 0), (-1, 4)])
def test_pool_rejects_empty(nbytes: int, slots: int) -> None:
    with pytest.raises(ValueError):
        StagingPool(nbytes, slots)


def test_pool_geometry() -> None:
    pool = StagingPool(100, 4)
    assert pool.capacity == 4
    assert pool.slot_nbytes == 100
    assert pool.stride >= 100
    assert pool.stride % 64 == 0
    assert pool.buffer.shape == (4, pool.stride)
    assert pool.in_use == 0
    assert pool.waiters == 0
    assert pool.leases == 0


@pytest.mark.parametrize("count", [0, -1, 5])
async def test_acquire_rejects_bad_count(count: int) -> None:
    pool = StagingPool(10, 4)
    with pytest.raises(ValueError):
        await pool.acquire(count)
    assert pool.in_use == 0


async def test_slot_views_are_right_size_and_distinct() -> None:
    pool = StagingPool(100, 4)
    a = await pool.acquire(3)
    b = await pool.acquire(1)
    assert len(set(a.slots) | set(b.slots)) == 4
    assert list(a.slots) == sorted(a.slots)
    assert a.pool is pool
    views = [a.view(i) for i in range(3)] + [b.view(0)]
    for i, v in enumerate(views):
        assert v.shape == (100,)
        assert v.dtype == np.uint8
        assert v.flags.writeable
        v[:] = i + 1
    for i, v in enumerate(views):
        assert (v == i + 1).all()
        for j, w in enumerate(views):
            if i != j:
                assert not np.shares_memory(v, w)
    for i, slot in enumerate(a.slots):
        assert (pool.buffer[slot, :100] == i + 1).all()
    a.release()
    b.release()
    assert pool.in_use == 0


async def test_lease_refcount() -> None:
    pool = StagingPool(16, 4)
    lease = await pool.acquire(3)
    assert pool.in_use == 3
    assert pool.leases == 1
    assert not lease.released
    lease.retain()
    lease.retain()
    lease.release()
    lease.release()
    assert pool.in_use == 3
    assert not lease.released
    lease.release()
    assert lease.released
    assert pool.in_use == 0
    assert pool.leases == 0
    with pytest.raises(RuntimeError):
        lease.release()
    with pytest.raises(RuntimeError):
        lease.retain()
    assert pool.in_use == 0


async def test_released_slots_are_reused() -> None:
    pool = StagingPool(16, 2)
    for _ in range(5):
        lease = await pool.acquire(2)
        assert sorted(lease.slots) == [0, 1]
        lease.release()
    assert pool.in_use == 0


# ---------------------------------------------------------------- fairness and cancellation


def test_a_pool_of_millions_of_tiny_slots_keeps_no_object_per_slot() -> None:
    # 4M slots of 16 B (64 MiB, never touched): the free slots are a count, not a list of
    # 4M ints (about 150 MB of Python objects, and a second at every pipeline open).
    slots = 1 << 22
    buffer = np.empty((slots, 64), np.uint8)
    tracemalloc.start()
    try:
        pool = StagingPool(16, slots, buffer)
        lease = pool.try_acquire(3)
        python_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert python_bytes < 1 << 20, python_bytes
    assert lease is not None and lease.slots == (0, 1, 2)
    assert pool.in_use == 3


async def test_the_lowest_free_slots_are_leased_first() -> None:
    pool = StagingPool(16, 8)
    a = await pool.acquire(3)
    b = await pool.acquire(2)
    assert (a.slots, b.slots) == ((0, 1, 2), (3, 4))
    a.release()
    c = await pool.acquire(4)  # the three given back, then the first never leased
    assert c.slots == (0, 1, 2, 5)
    b.release()
    d = await pool.acquire(4)
    assert d.slots == (3, 4, 6, 7)
    assert pool.in_use == 8 and pool.try_acquire(1) is None
    c.release()
    d.release()
    assert pool.in_use == 0


async def test_fifo_big_waiter_not_overtaken_by_small() -> None:
    pool = StagingPool(16, 4)
    first = await pool.acquire(3)  # one slot left
    order: list[str] = []
    got: dict[str, StagingLease] = {}

    async def want(n: int, tag: str) -> None:
        got[tag] = await pool.acquire(n)
        order.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 4, "big")
        await until(lambda: pool.waiters == 1)
        tg.start_soon(want, 1, "small")
        await until(lambda: pool.waiters == 2)
        await checkpoints()
        # a slot is free, but the small request queued behind the big one
        assert order == []
        assert pool.in_use == 3
        first.release()
        await until(lambda: order == ["big"])
        assert pool.in_use == 4
        assert pool.waiters == 1
        got["big"].release()
        await until(lambda: order == ["big", "small"])
        assert pool.in_use == 1
        got["small"].release()
    assert pool.in_use == 0
    assert pool.leases == 0
    assert pool.waiters == 0


async def test_new_acquire_queues_behind_existing_waiter() -> None:
    pool = StagingPool(16, 2)
    hold = await pool.acquire(1)
    order: list[str] = []
    leases: list[StagingLease] = []

    async def want(n: int, tag: str) -> None:
        leases.append(await pool.acquire(n))
        order.append(tag)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 2, "two")
        await until(lambda: pool.waiters == 1)
        tg.start_soon(want, 1, "one")  # one slot is free, but "two" is first
        await checkpoints()
        assert order == []
        hold.release()
        await until(lambda: order == ["two"])
        leases[0].release()
        await until(lambda: order == ["two", "one"])
        leases[1].release()
    assert pool.in_use == 0


async def test_cancelled_waiter_takes_nothing() -> None:
    pool = StagingPool(16, 2)
    hold = await pool.acquire(2)
    order: list[str] = []
    other: list[StagingLease] = []
    scope = anyio.CancelScope()

    async def cancelled() -> None:
        with scope:
            await pool.acquire(1)
            order.append("cancelled-got-it")

    async def waiter() -> None:
        other.append(await pool.acquire(1))
        order.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled)
        await until(lambda: pool.waiters == 1)
        tg.start_soon(waiter)
        await until(lambda: pool.waiters == 2)
        scope.cancel()
        await until(lambda: pool.waiters == 1)
        assert pool.in_use == 2
        hold.release()
        await until(lambda: order == ["other"])
        assert pool.in_use == 1
        other[0].release()
    assert scope.cancelled_caught
    assert order == ["other"]
    assert pool.in_use == 0
    assert pool.leases == 0


async def test_cancelled_head_waiter_lets_the_next_proceed() -> None:
    pool = StagingPool(16, 4)
    hold = await pool.acquire(2)
    big_scope = anyio.CancelScope()
    small: list[StagingLease] = []

    async def big() -> None:
        with big_scope:
            await pool.acquire(4)

    async def little() -> None:
        small.append(await pool.acquire(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await until(lambda: pool.waiters == 1)
        tg.start_soon(little)
        await until(lambda: pool.waiters == 2)
        await checkpoints()
        assert small == []  # blocked behind big even though 2 slots are free
        big_scope.cancel()
        await until(lambda: len(small) == 1)
        assert pool.in_use == 3
        assert pool.waiters == 0
    small[0].release()
    hold.release()
    assert pool.in_use == 0


async def test_cancelled_before_wait_takes_nothing() -> None:
    pool = StagingPool(16, 2)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pool.acquire(1)
    assert scope.cancelled_caught
    with anyio.move_on_after(0) as scope2:
        await pool.acquire(2)
    assert scope2.cancelled_caught
    assert pool.in_use == 0
    assert pool.leases == 0
    lease = await pool.acquire(2)
    lease.release()


async def test_served_then_cancelled_is_consistent() -> None:
    pool = StagingPool(16, 1)
    hold = await pool.acquire(1)
    scope = anyio.CancelScope()
    got: list[StagingLease] = []

    async def waiter() -> None:
        with scope:
            got.append(await pool.acquire(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until(lambda: pool.waiters == 1)
        hold.release()  # hands the slot to the waiter...
        scope.cancel()  # ...which is cancelled before it resumes
    if got:
        assert pool.in_use == 1
        got[0].release()
    assert pool.in_use == 0
    assert pool.leases == 0
    again = await pool.acquire(1)
    again.release()


def test_value_memory_reuses_a_buffer_once_nothing_refers_to_it() -> None:
    memory = ValueMemory(limit_bytes=1 << 20)
    lease = memory.lease(1000, 4)
    address = lease.pool.buffer.ctypes.data
    lease.view(2)[:] = 7
    kept = np.frombuffer(lease.view(2).data, np.uint8)  # what a store keeps of a value
    lent = memoryview(kept).toreadonly()  # what a reader borrows
    lease.release()
    del lease, kept
    assert memory.held_bytes == 0  # a value of it is still referred to
    other = memory.lease(1000, 4)
    assert memory.allocated == 2 and memory.reused == 0
    assert other.pool.buffer.ctypes.data != address
    other.pool.buffer[:] = 1
    assert bytes(lent) == b"\x07" * 1000
    del lent
    assert memory.held_bytes == 4 * 1024
    again = memory.lease(1000, 4)
    assert (memory.reused, again.pool.buffer.ctypes.data) == (1, address)
    assert memory.held_bytes == 0
    memory.lease(1000, 2)  # another shape: new memory
    assert memory.allocated == 3


def test_value_memory_holds_at_most_its_limit_and_clear_frees_it() -> None:
    memory = ValueMemory(limit_bytes=4 * 1024)
    leases = [memory.lease(1000, 4) for _ in range(3)]
    del leases
    assert memory.held_bytes == 4 * 1024  # one buffer held, two freed
    in_use = memory.lease(1000, 4)
    memory.clear()
    assert memory.held_bytes == 0
    del in_use  # let go after the clear: freed, not held
    assert memory.held_bytes == 0
    none = ValueMemory(limit_bytes=0)
    none.lease(1000, 4)
    assert none.held_bytes == 0
    with pytest.raises(ValueError):
        ValueMemory(limit_bytes=-1)


def test_value_memory_never_hands_out_memory_in_use_from_many_threads() -> None:
    memory = ValueMemory(limit_bytes=64 * 4096)
    broken: list[str] = []

    def work(tag: int) -> None:
        for _ in range(200):
            lease = memory.lease(4000, 2)
            buffer = lease.pool.buffer
            buffer[:] = tag
            time.sleep(0)
            if not (buffer == tag).all():
                broken.append(f"thread {tag}: a buffer in use was handed out again")
            del lease, buffer

    threads = [threading.Thread(target=work, args=(t,)) for t in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert broken == []
    assert memory.reused > 0


def test_value_memory_freed_by_a_collection_under_its_own_lock_does_not_deadlock() -> None:
    """A value kept alive only by a reference cycle goes back when the cycle collector runs:
    in whichever thread, at whichever point it runs, the lock of the value memory held
    (Python 3.12 on: a collection any thread scheduled runs at the next call, in ``lease`` or
    the return of another buffer too). The return then takes the same lock in the same
    thread; it must not wait for itself (the event loop's thread or a copy thread, for good).
    Here the collection starts as soon as the lock is taken."""
    memory = ValueMemory(limit_bytes=1 << 20)
    inner = memory._lock

    class CollectingLock:  # stands in for a collection that starts inside the lock
        def __init__(self) -> None:
            self.entered = 0

        def __enter__(self) -> None:
            inner.acquire()
            self.entered += 1
            if self.entered == 1:
                gc.collect()

        def __exit__(self, *exc: object) -> None:
            self.entered -= 1
            inner.release()

    was_enabled = gc.isenabled()
    gc.disable()  # the cycle below waits for the collection under the lock
    try:
        lease = memory.lease(1000, 2)
        cycle: list[object] = [lease.pool.buffer]
        cycle.append(cycle)
        del lease, cycle
        memory._lock = CollectingLock()  # type: ignore[assignment]
        done = threading.Event()

        def take() -> None:
            memory.lease(1000, 2)
            done.set()

        threading.Thread(target=take, daemon=True).start()
        assert done.wait(10), "the thread waits for the lock it holds"
        assert memory.reused == 1  # the buffer the collection freed, handed out again
    finally:
        if was_enabled:
            gc.enable()
