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
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import numpy as np
import pytest

from .._blockformat import value_nbytes
from .._keys import Scope, Tokens, as_tokens, block_keys
from .._results import Residency, ResidencyEntry
from .._staging import StagingPool, ThreadRunner
from ..backends import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend

__all__ = ("BackendConformance", "Batches")

_SCOPE = Scope("conformance", "0123456789abcdef")
_BLOCK = 4


class Batches:
    """Builds real batches over real staging, the way the pipeline does.

    Keys come from :meth:`keys` (chained, as the pipeline makes them); a batch of them gets
    the first block index, token prefix and parent key a pipeline would give it, split into
    runs of consecutive blocks — so a token-indexed backend sees consistent batches.
    """

    def __init__(self, pool: StagingPool, runner: ThreadRunner) -> None:
        self.pool = pool
        self.runner = runner
        self._where: dict[str, tuple[Tokens, int, tuple[str, ...]]] = {}

    def keys(self, n: int, seed: int = 0, partial: bool = False) -> tuple[tuple[str, ...], Tokens]:
        """``n`` chained keys of one sequence (the last one partial if asked), its tokens."""
        tokens = as_tokens(np.arange(seed * 100_000, seed * 100_000 + n * _BLOCK - partial))
        keys = block_keys(_SCOPE, tokens, _BLOCK, partial).keys
        for i, key in enumerate(keys):
            self._where[key] = (tokens, i, keys)
        return keys, tokens

    def _runs(self, keys: Sequence[str]) -> list[tuple[list[int], int, Tokens, str | None]]:
        """Positions of ``keys`` cut into runs of consecutive blocks of one sequence, each
        with its first block index, token prefix and parent key."""
        runs: list[tuple[list[int], int, Tokens, str | None]] = []
        prev: tuple[Tokens, int, tuple[str, ...]] | None = None
        for pos, key in enumerate(keys):
            where = self._where.get(key)
            if (
                runs
                and where is not None
                and prev is not None
                and where[2] is prev[2]
                and where[1] == prev[1] + 1
            ):
                runs[-1][0].append(pos)
            else:
                if where is None:
                    runs.append(([pos], 0, as_tokens(np.arange(_BLOCK)), None))
                else:
                    tokens, index, seq = where
                    runs.append(([pos], index, tokens, seq[index - 1] if index else None))
            prev = where
        out = []
        for positions, first, tokens, parent in runs:
            end = min((first + len(positions)) * _BLOCK, len(tokens))
            out.append((positions, first, tokens[:end], parent))
        return out

    def key_batch(self, keys: Sequence[str]) -> KeyBatch:
        """A key-only batch (the keys should be consecutive blocks of one sequence)."""
        _, first, tokens, parent = self._runs(keys)[0]
        return KeyBatch(_SCOPE, "conformance", keys, first, tokens, parent)

    async def put(
        self,
        backend: StorageBackend,
        keys: Sequence[str],
        values: Sequence[bytes],
    ) -> list[BlockStatus]:
        """Put ``values`` (each ``pool.slot_nbytes`` long) under ``keys``."""
        statuses: list[BlockStatus] = [BlockStatus.FAILED] * len(keys)
        for positions, first, tokens, parent in self._runs(keys):
            lease = await self.pool.acquire(len(positions))
            try:
                for i, pos in enumerate(positions):
                    self.pool.slot(lease.slots[i])[:] = np.frombuffer(values[pos], np.uint8)
                batch = PutBatch(
                    _SCOPE,
                    "conformance",
                    [keys[p] for p in positions],
                    first,
                    tokens,
                    parent,
                    lease=lease,
                    value_nbytes=self.pool.slot_nbytes,
                    runner=self.runner,
                    limiter=None,
                )
                got = list(await backend.put_blocks(batch))
                assert len(got) == len(positions), "one status per key"
                for pos, status in zip(positions, got, strict=True):
                    statuses[pos] = status
            finally:
                lease.release()
        return statuses

    async def get(
        self, backend: StorageBackend, keys: Sequence[str]
    ) -> tuple[list[BlockStatus], list[bytes]]:
        """Get ``keys``; returns the statuses and each buffer's bytes."""
        statuses: list[BlockStatus] = [BlockStatus.FAILED] * len(keys)
        values: list[bytes] = [b""] * len(keys)
        for positions, first, tokens, parent in self._runs(keys):
            lease = await self.pool.acquire(len(positions))
            try:
                for slot in lease.slots:
                    self.pool.slot(slot)[:] = 0
                batch = GetBatch(
                    _SCOPE,
                    "conformance",
                    [keys[p] for p in positions],
                    first,
                    tokens,
                    parent,
                    lease=lease,
                    value_nbytes=self.pool.slot_nbytes,
                    runner=self.runner,
                    limiter=None,
                )
                got = list(await backend.get_blocks(batch))
                assert len(got) == len(positions), "one status per key"
                for i, (pos, status) in enumerate(zip(positions, got, strict=True)):
                    statuses[pos] = status
                    values[pos] = self.pool.slot(lease.slots[i]).tobytes()
            finally:
                lease.release()
        return statuses, values


def _values(n: int, size: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


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
            values = _values(8, b.pool.slot_nbytes, seed=1)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 8
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 8
            assert got == values

    async def test_large_values_are_byte_exact(self, backend: StorageBackend) -> None:
        """Values of several pages and a partial one, as real KV blocks are (staging slots
        this large start on a page: a backend may take its fast paths)."""
        async with self._batches(backend, 3 * (64 << 10) + 13, slots=8) as b:
            keys, _ = b.keys(6, seed=30)
            values = _values(6, b.pool.slot_nbytes, seed=30)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 6
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 6
            assert got == values

    async def test_partial_block_keys_are_ordinary_keys(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(3, seed=2, partial=True)
            assert keys[-1].endswith(":partial:3")
            values = _values(3, b.pool.slot_nbytes, seed=2)
            assert await b.put(backend, keys, values) == [BlockStatus.OK] * 3
            statuses, got = await b.get(backend, keys)
            assert statuses == [BlockStatus.OK] * 3 and got == values

    async def test_missing_keys_are_reported_per_block(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(6, seed=3)
            values = _values(6, b.pool.slot_nbytes, seed=3)
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
            await b.put(backend, keys[:2], _values(2, b.pool.slot_nbytes, seed=4))
            flags = list(await backend.exists(b.key_batch(keys)))
            assert len(flags) == 5
            assert flags[:3] == [True, True, False]
            assert not any(flags[2:])

    async def test_delete_removes_and_ignores_missing(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(4, seed=5)
            await b.put(backend, keys, _values(4, b.pool.slot_nbytes, seed=5))
            await backend.delete([keys[1], keys[3], "conformance@0123456789abcdef@0-1@none"])
            # A backend may answer False for everything after the first missing key, so ask
            # about each key on its own too.
            assert list(await backend.exists(b.key_batch(keys)))[:2] == [True, False]
            for key, want in zip(keys, [True, False, True, False], strict=True):
                assert list(await backend.exists(b.key_batch([key]))) == [want]
            statuses, _ = await b.get(backend, keys)
            assert statuses[1] is BlockStatus.MISSING and statuses[3] is BlockStatus.MISSING

    async def test_overwrite_replaces_the_value(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(2, seed=6)
            first, second = (
                _values(2, b.pool.slot_nbytes, seed=6),
                _values(2, b.pool.slot_nbytes, 7),
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
            await backend.put_residency([ResidencyEntry(keys[1], "node-a", Residency.EVICTED, now)])
            records = list(await backend.get_residency(keys))
            assert len(records) == 3
            first = {(e.node_id, e.residency) for e in records[0]}
            assert first == {("node-a", Residency.GPU), ("node-b", Residency.CPU)}
            assert [(e.node_id, e.residency) for e in records[1]] == [("node-a", Residency.EVICTED)]
            assert list(records[2]) == []
            assert all(e.key == keys[0] for e in records[0])

    async def test_concurrent_calls(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            groups = [b.keys(4, seed=10 + g)[0] for g in range(6)]
            values = [_values(4, b.pool.slot_nbytes, seed=10 + g) for g in range(6)]
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

    async def test_a_cancelled_put_leaves_the_backend_usable(self, backend: StorageBackend) -> None:
        async with self._batches(backend) as b:
            keys, _ = b.keys(8, seed=20)
            values = _values(8, b.pool.slot_nbytes, seed=20)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await b.put(backend, keys, values)
            # Whatever the cancelled call left, a value is either absent or whole.
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
