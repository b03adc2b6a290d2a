"""Puts that carry each value's checksum (PutBatch.checksums, computed by kvpipe while it
sealed the value): the file store takes it for the header instead of hashing the value again,
and a wrong one makes the block unreadable, never a wrong value read back as sound."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash

from kvpipe._blockformat import value_nbytes
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, PutBatch
from kvpipe.backends.file import FileStore, _writes
from kvpipe.testing.batches import Batches, random_values

pytestmark = pytest.mark.usefixtures("file_io")

SIZE = value_nbytes(3 * (64 << 10) + 13)


@asynccontextmanager
async def batches() -> AsyncIterator[Batches]:
    pool = StagingPool(SIZE, 8)
    async with ThreadRunner() as runner:
        yield Batches(pool, runner)
    assert pool.in_use == 0, "staging left leased"


async def _put(
    store: FileStore, b: Batches, keys: list[str], values: list[bytes], sums: list[int]
) -> list[BlockStatus]:
    ((_, first, tokens, parent),) = b._runs(keys)
    lease = await b.pool.acquire(len(keys))
    try:
        for i, v in enumerate(values):
            b.pool.slot(lease.slots[i])[:] = memoryview(v)
        batch = b._staged(PutBatch, keys, first, tokens, parent, lease)
        batch.checksums = sums
        return list(await store.put_blocks(batch))
    finally:
        lease.release()


@pytest.mark.parametrize("durability", ["data", "none"])
async def test_the_given_checksums_are_used_not_computed_again(
    tmp_path: Path, durability: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data: object) -> int:
        hashed.append(1)
        return real(data)  # type: ignore[arg-type]

    monkeypatch.setattr(_writes, "xxhash", SimpleNamespace(xxh3_64_intdigest=counting))
    async with batches() as b, FileStore(tmp_path / "s", durability=durability) as store:  # type: ignore[arg-type]
        keys, _ = b.keys(3)
        values = random_values(3, SIZE, 1)
        sums = [real(v) for v in values]
        assert await _put(store, b, list(keys), values, sums) == [BlockStatus.OK] * 3
        assert hashed == []  # no value hashed by the store
        statuses, got = await b.get(store, list(keys))
        assert statuses == [BlockStatus.OK] * 3 and got == values


async def test_a_wrong_checksum_given_makes_the_block_unreadable(tmp_path: Path) -> None:
    async with batches() as b, FileStore(tmp_path / "s") as store:
        keys, _ = b.keys(2)
        values = random_values(2, SIZE, 2)
        sums = [xxhash.xxh3_64_intdigest(values[0]), xxhash.xxh3_64_intdigest(values[1]) ^ 1]
        assert await _put(store, b, list(keys), values, sums) == [BlockStatus.OK] * 2
        statuses, got = await b.get(store, list(keys))
        assert statuses == [BlockStatus.OK, BlockStatus.CORRUPT] and got[0] == values[0]
