"""The backend conformance suite: what every :class:`kvpipe.StorageBackend` must do.

Run it against your own backend by subclassing and providing a ``backend`` fixture::

    import pytest
    from kvpipe.testing import BackendConformance

    class TestMyStore(BackendConformance):
        @pytest.fixture
        async def backend(self):
            store = MyStore(...)
            yield store
            await store.aclose()

It needs pytest and anyio's pytest plugin (``anyio_mode = "auto"`` or an ``anyio`` mark).
The built-in stores run exactly this suite.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import numpy as np
import pytest

from .._blockformat import value_nbytes
from .._results import Residency, ResidencyEntry
from .._staging import StagingPool
from .._workers import ThreadRunner
from ..backends import BlockStatus, GetBatch, PutBatch, StorageBackend
from .batches import Batches, random_values

__all__ = ("BackendConformance",)


@asynccontextmanager
async def _watching(
    backend: StorageBackend, b: Batches, keys: Sequence[str], published: set[str]
) -> AsyncIterator[list[str]]:
    """While the body runs, ask over and over whether each of ``keys`` exists, one key per
    call: a key found joins ``published``; one that was in ``published`` before it was asked
    about and is not found joins the list yielded (a published block that vanished).

    Every key has a task of its own asking about it alone, with nothing in between its
    calls, so each key is asked about at every schedule point of the body: a block that is
    visible (or missing) for a single one is seen. (One task asking about the keys in turn
    saw a key only every so many schedule points, so a put that published a block and took
    it back at its next await passed or failed by where the turn happened to be.) An
    ``exists`` that does not yield gets a checkpoint after each call, so the body still runs.
    """
    done = anyio.Event()
    vanished: list[str] = []

    async def watch(key: str) -> None:
        batch = b.key_batch([key])
        answer: list[bool] = []

        async def ask() -> None:
            (found,) = await backend.exists(batch)
            answer.append(found)

        pace: bool | None = None
        while not done.is_set():
            known = key in published  # an answer may predate a put that returns meanwhile
            answer.clear()
            if pace is None:
                pace = not await _yields(ask)
            else:
                await ask()
            if answer[0]:
                published.add(key)
            elif known:
                vanished.append(key)
            if pace:
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for key in keys:
            tg.start_soon(watch, key)
        try:
            yield vanished
        finally:
            done.set()


@asynccontextmanager
async def _reading(
    backend: StorageBackend, b: Batches, keys: Sequence[str], allowed: Sequence[set[bytes]]
) -> AsyncIterator[list[str]]:
    """While the body runs, get each of ``keys`` over and over, one key per call: a get that
    reports a key ``OK`` with bytes other than one of its ``allowed`` values, or ``CORRUPT``,
    adds a line to the list yielded (a reader saw a value torn, or another key's).

    As in :func:`_watching`, every key has a task of its own, so it is read at every
    schedule point of the body; a ``get_blocks`` that does not yield gets a checkpoint after
    each call.
    """
    done = anyio.Event()
    seen: list[str] = []

    async def read(index: int, key: str) -> None:
        answer: list[tuple[BlockStatus, bytes]] = []

        async def ask() -> None:
            (status,), (value,) = await b.get(backend, [key])
            answer.append((status, value))

        pace: bool | None = None
        while not done.is_set():
            answer.clear()
            if pace is None:
                pace = not await _yields(ask)
            else:
                await ask()
            status, value = answer[0]
            if status is BlockStatus.CORRUPT:
                seen.append(f"key {index}: CORRUPT while it was being stored")
            elif status is BlockStatus.OK and value not in allowed[index]:
                seen.append(f"key {index}: OK with bytes that are no value put under it")
            if pace:
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for index, key in enumerate(keys):
            tg.start_soon(read, index, key)
        try:
            yield seen
        finally:
            done.set()


async def _cancelled_put(
    backend: StorageBackend, b: Batches, keys: Sequence[str], values: Sequence[bytes], steps: int
) -> None:
    """``put_blocks`` of ``keys`` (consecutive blocks) cancelled after ``steps`` schedule
    points of the caller (0: at the call's first await). The batch is staged before the
    cancel scope, so the call itself is what gets cancelled."""
    ((_, first, tokens, parent),) = b._runs(keys)
    lease = await b.pool.acquire(len(keys))
    try:
        for slot, value in zip(lease.slots, values, strict=True):
            b.pool.slot(slot)[:] = np.frombuffer(value, np.uint8)
        batch = b._staged(PutBatch, list(keys), first, tokens, parent, lease)
        with anyio.CancelScope() as scope:
            if steps == 0:
                scope.cancel()
                await backend.put_blocks(batch)
            else:

                async def cancel_later() -> None:
                    for _ in range(steps):
                        await anyio.lowlevel.checkpoint()
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_later)
                    await backend.put_blocks(batch)
    finally:
        lease.release()


async def _yields(call: Callable[[], Awaitable[object]]) -> bool:
    """Whether awaiting ``call()`` let the event loop run (a schedule point)."""
    try:
        import trio

        me = trio.lowlevel.current_task()  # RuntimeError unless trio is running
    except (ImportError, RuntimeError):
        me = None
    if me is not None:
        steps = 0

        class Steps(trio.abc.Instrument):
            def before_task_step(self, task: trio.lowlevel.Task) -> None:
                nonlocal steps
                steps += task is me

        steps_seen = Steps()
        trio.lowlevel.add_instrument(steps_seen)
        try:
            await call()
        finally:
            trio.lowlevel.remove_instrument(steps_seen)
        return steps > 0  # this task was suspended, then stepped again
    ran = False

    async def mark() -> None:
        nonlocal ran
        ran = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(mark)  # asyncio runs ready tasks first come, first served
        await call()
        seen = ran
    return seen


class BackendConformance:
    """Subclass this in a test module and provide an async ``backend`` fixture."""

    #: Payload bytes per block used by the suite (a stored value adds a 48-byte trailer).
    payload_nbytes = 4096 + 13

    @pytest.fixture
    async def backend(self) -> AsyncIterator[StorageBackend]:
        """Override: yield a fresh, empty backend."""
        pytest.fail("subclasses of BackendConformance must provide a `backend` fixture")
        yield  # pragma: no cover

    @asynccontextmanager
    async def _batches(
        self, backend: StorageBackend, payload_nbytes: int | None = None, slots: int = 64
    ) -> AsyncIterator[Batches]:
        pool = StagingPool(value_nbytes(payload_nbytes or self.payload_nbytes), slots)
        async with ThreadRunner() as runner:
            await backend.register_staging(pool.buffer.data.cast("B"))
            try:
                yield Batches(pool, runner)
            finally:
                await backend.unregister_staging(pool.buffer.data.cast("B"))
            assert pool.in_use == 0, "the backend left staging leased after its call returned"

    async def test_put_then_get_is_byte_exact(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(8)
            values = random_values(8, b.pool.slot_nbytes, seed=1)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 8
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 8
            assert got == values

    async def test_large_values_are_byte_exact(self, backend: StorageBackend) -> None:
        """Values of several pages and a partial one, as real KV blocks are (staging slots
        this large start on a page: a backend may take its fast paths)."""
        async with self._batches(backend, 3 * (64 << 10) + 13, slots=8) as b:
            keys, _ = b.keys(6, seed=30)
            values = random_values(6, b.pool.slot_nbytes, seed=30)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 6
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 6
            assert got == values

    async def test_partial_block_keys_are_ordinary_keys(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(3, seed=2, partial=True)
            assert keys[-1].endswith(":partial:3")
            values = random_values(3, b.pool.slot_nbytes, seed=2)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 3
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 3 and got == values

    async def test_missing_keys_are_reported_per_block(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(6, seed=3)
            values = random_values(6, b.pool.slot_nbytes, seed=3)
            stored = [0, 1, 3]
            await b.put(backend, [keys[i] for i in stored], [values[i] for i in stored])
            statuses, got = await b.get(backend, keys)
            assert statuses == [
                BlockStatus.OK,
                BlockStatus.OK,
                BlockStatus.MISSING,
                BlockStatus.OK,
                BlockStatus.MISSING,
                BlockStatus.MISSING,
            ]
            assert [got[i] for i in stored] == [values[i] for i in stored]

    async def test_exists_answers_per_key(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(5, seed=4)
            await b.put(backend, keys[:2], random_values(2, b.pool.slot_nbytes, seed=4))
            flags = list(await backend.exists(b.key_batch(keys)))
            assert len(flags) == 5
            assert flags[:3] == [True, True, False]
            assert not any(flags[2:])

    async def test_delete_removes_and_ignores_missing(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(4, seed=5)
            await b.put(backend, keys, random_values(4, b.pool.slot_nbytes, seed=5))
            # The missing key between the stored ones: the keys after it are removed too.
            await backend.delete([keys[1], "conformance@0123456789abcdef@0-1@none", keys[3]])
            # A backend may answer False for everything after the first missing key, so ask
            # about each key on its own too.
            flags = list(await backend.exists(b.key_batch(keys)))
            assert flags[:2] == [True, False]
            if backend.exists_answers_every_key:  # as it declares: past the miss too
                assert flags == [True, False, True, False]
            for key, want in zip(keys, [True, False, True, False], strict=True):
                assert list(await backend.exists(b.key_batch([key]))) == [want]
            statuses, _ = await b.get(backend, keys)
            assert statuses[1] is BlockStatus.MISSING and statuses[3] is BlockStatus.MISSING

    async def test_overwrite_replaces_the_value(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(2, seed=6)
            first, second = (
                random_values(2, b.pool.slot_nbytes, seed=6),
                random_values(2, b.pool.slot_nbytes, 7),
            )
            await b.put(backend, keys, first)
            assert await b.put(backend, keys, second) == [BlockStatus.OK] * 2
            _, got = await b.get(backend, keys)
            assert got == second

    async def test_residency_index(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(3, seed=8)
            now = time.time()
            await backend.put_residency(
                [ResidencyEntry(k, "node-a", Residency.GPU, now) for k in keys[:2]]
                + [ResidencyEntry(keys[0], "node-b", Residency.CPU, now)]
            )
            # node-a's new records replace its own; node-b's record of keys[0] stays.
            await backend.put_residency(
                [
                    ResidencyEntry(keys[1], "node-a", Residency.EVICTED, now),
                    ResidencyEntry(keys[0], "node-a", Residency.CPU, now),
                ]
            )
            records = list(await backend.get_residency(keys))
            assert len(records) == 3
            first = {(e.node_id, e.residency) for e in records[0]}
            assert first == {("node-a", Residency.CPU), ("node-b", Residency.CPU)}
            assert len(records[0]) == 2, "one record per node"
            assert [(e.node_id, e.residency) for e in records[1]] == [("node-a", Residency.EVICTED)]
            assert list(records[2]) == []
            assert all(e.key == keys[0] for e in records[0])

    async def test_a_block_not_reported_ok_is_never_visible(self, backend: StorageBackend) -> None:
        """A put publishes exactly the blocks it reports ``OK``: a fresh key reported
        otherwise is visible at no time, during the call or after it, and one reported ``OK``
        is visible and whole once the call returns. (A store that stores every block passes
        at once; one that fails some blocks must never show them, not even for a moment.)"""
        async with self._batches(backend) as b:
            keys, _ = b.keys(16, seed=40)
            values = random_values(16, b.pool.slot_nbytes, seed=40)
            seen: set[str] = set()
            statuses: list[BlockStatus] = []
            async with _watching(backend, b, keys, seen) as vanished:
                for lo in range(0, 16, 4):
                    statuses += await b.put(backend, keys[lo : lo + 4], values[lo : lo + 4])
            assert not vanished, f"blocks seen stored, then gone: {sorted(set(vanished))}"
            ok = {k for k, s in zip(keys, statuses, strict=True) if s is BlockStatus.OK}
            assert seen <= ok, f"seen during the put, then reported not stored: {seen - ok}"
            got_statuses, got = await b.get(backend, keys)
            for key, status, value, want in zip(keys, got_statuses, got, values, strict=True):
                assert list(await backend.exists(b.key_batch([key]))) == [key in ok]
                if key in ok:
                    assert status is BlockStatus.OK and value == want
                else:
                    assert status is BlockStatus.MISSING

    async def test_a_published_block_stays_until_deleted(self, backend: StorageBackend) -> None:
        """Once visible, a block stays visible until it is deleted (or evicted): writers
        storing the same keys at once (two requests of one prompt prefix do) never make it
        disappear, not even for a moment, whatever their puts report."""
        async with self._batches(backend) as b:
            keys, _ = b.keys(8, seed=41)
            values = random_values(8, b.pool.slot_nbytes, seed=41)
            published: set[str] = set()

            async def writer(w: int) -> None:
                for _ in range(3):
                    for lo in range(w % 2, 8, 4):
                        hi = min(lo + 4, 8)
                        got = await b.put(backend, keys[lo:hi], values[lo:hi])
                        published.update(
                            k for k, s in zip(keys[lo:hi], got, strict=True) if s is BlockStatus.OK
                        )

            async with (
                _watching(backend, b, keys, published) as vanished,
                anyio.create_task_group() as tg,
            ):
                for w in range(4):
                    tg.start_soon(writer, w)
            assert not vanished, f"published blocks disappeared: {sorted(set(vanished))}"
            statuses, got = await b.get(backend, sorted(published, key=keys.index))
            assert set(statuses) <= {BlockStatus.OK}
            assert got == [values[keys.index(k)] for k in sorted(published, key=keys.index)]

    async def test_a_value_is_never_seen_torn(self, backend: StorageBackend) -> None:
        """A value becomes visible to readers all at once, never torn (StorageBackend): while
        puts store new keys, then replace each value with another, a get of a key reports
        ``MISSING`` (or ``FAILED``) or ``OK`` with exactly one of the values put under it —
        at every schedule point of the puts, never ``OK`` with bytes half written, nor
        ``CORRUPT``. (Only a reader during the put sees this: a store that publishes a key
        before its bytes are all in place reads back whole once the put has returned.)"""
        async with self._batches(backend) as b:
            keys, _ = b.keys(8, seed=42)
            first = random_values(8, b.pool.slot_nbytes, seed=42)
            second = random_values(8, b.pool.slot_nbytes, seed=43)
            allowed = [{a, z} for a, z in zip(first, second, strict=True)]
            async with _reading(backend, b, keys, allowed) as torn:
                for values in (first, second):
                    for lo in range(0, 8, 4):
                        await b.put(backend, keys[lo : lo + 4], values[lo : lo + 4])
            assert not torn, f"readers saw values not whole: {sorted(set(torn))}"

    async def test_concurrent_calls(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            groups = [b.keys(4, seed=10 + g)[0] for g in range(6)]
            values = [random_values(4, b.pool.slot_nbytes, seed=10 + g) for g in range(6)]
            results: dict[int, list[BlockStatus]] = {}

            async def put(g: int) -> None:
                results[g] = await b.put(backend, groups[g], values[g])

            async with anyio.create_task_group() as tg:
                for g in range(6):
                    tg.start_soon(put, g)
            assert all(r == [BlockStatus.OK] * 4 for r in results.values())
            got: dict[int, list[bytes]] = {}

            async def get(g: int) -> None:
                got[g] = (await b.get(backend, groups[g]))[1]

            async with anyio.create_task_group() as tg:
                for g in range(6):
                    tg.start_soon(get, g)
            assert all(got[g] == values[g] for g in range(6))

    async def test_puts_and_gets_are_checkpoints(self, backend: StorageBackend) -> None:
        """A put or get that returns has let the event loop run (StorageBackend): a task
        started just before the call has run by the time it returns — for new and stored
        keys, and for missing ones."""
        async with self._batches(backend) as b:
            keys, _ = b.keys(2, seed=40)
            _, first, tokens, parent = b._runs(keys)[0]
            values = random_values(2, b.pool.slot_nbytes, seed=40)
            lease = b.pool.try_acquire(2)
            assert lease is not None
            try:
                for slot, value in zip(lease.slots, values, strict=True):
                    b.pool.slot(slot)[:] = np.frombuffer(value, np.uint8)
                put = b._staged(PutBatch, list(keys), first, tokens, parent, lease)
                get = b._staged(GetBatch, list(keys), first, tokens, parent, lease)

                async def yielded(batch: PutBatch | GetBatch) -> bool:
                    if isinstance(batch, PutBatch):
                        return await _yields(lambda: backend.put_blocks(batch))
                    return await _yields(lambda: backend.get_blocks(batch))

                assert await yielded(get), "get_blocks of missing keys returned without yielding"
                assert await yielded(put), "put_blocks of new keys returned without yielding"
                assert await yielded(put), "put_blocks of stored keys returned without yielding"
                assert await yielded(get), "get_blocks of stored keys returned without yielding"
            finally:
                lease.release()

    async def test_a_cancelled_put_leaves_the_backend_usable(self, backend: StorageBackend) -> None:
        """A put cancelled at its first await, or a few schedule points later, leaves each
        value absent or whole, and the backend usable."""
        async with self._batches(backend) as b:
            keys, _ = b.keys(8, seed=20)
            values = random_values(8, b.pool.slot_nbytes, seed=20)
            for steps, (lo, hi) in enumerate([(0, 3), (3, 6), (6, 8)]):
                await _cancelled_put(backend, b, keys[lo:hi], values[lo:hi], steps)
            with anyio.fail_after(30):  # a cancelled call's thread may run on, on staging
                while b.pool.in_use:  # noqa: ASYNC110 (a worker thread, no event to wait on)
                    await anyio.sleep(0.01)
            # Whatever the cancelled calls left, a value is either absent or whole.
            statuses, got = await b.get(backend, keys)
            for status, value, want in zip(statuses, got, values, strict=True):
                assert status in (BlockStatus.OK, BlockStatus.MISSING)
                if status is BlockStatus.OK:
                    assert value == want
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 8

    async def test_pipeline_round_trip(self, backend: StorageBackend) -> None:
        """The whole pipeline over this backend: write (partial tail too), read elsewhere."""
        from .._cache import create_kv_cache
        from .._config import PipelineConfig
        from .._layout import CacheLayout
        from ..pipeline import open_pipeline

        layout = CacheLayout.dsa(
            num_layers=2,
            kv_lora_rank=128,
            rope_dim=16,
            index_head_dim=64,
            quant_block=64,
            block_size=8,
        )
        src = create_kv_cache(layout, 32)
        dst = create_kv_cache(layout, 32)
        rng = np.random.default_rng(30)
        for rows in src.byte_rows:
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        tokens = np.arange(8 * 11 + 3)
        config = PipelineConfig(slice_block_num=4, staging_bytes=1 << 22)
        # A fresh namespace: a store shared between tests may hold (and lease) old keys.
        namespace = f"conf{secrets.token_hex(4)}"
        async with open_pipeline(src, backend, config=config, namespace=namespace) as pipe:
            w = await pipe.write(tokens, np.arange(12), include_partial=True)
            assert w.complete and w.written == 12, w
            assert await pipe.lookup(tokens, include_partial=True) == 12
        ids = np.arange(31, 19, -1)
        dst.byte_rows[0][:] = 0
        async with open_pipeline(dst, backend, config=config, namespace=namespace) as pipe:
            r = await pipe.read(tokens, ids, include_partial=True, require_all=True)
            assert r.loaded == 12
            assert pipe.statistics().staging_in_use_bytes == 0
        for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
            assert np.array_equal(a[np.arange(12)], b[ids])
