"""MemoryStore: the shared conformance suite, plus its capacity bound."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import kvpipe
from kvpipe.backends import BlockStatus, StorageBackend
from kvpipe.testing import BackendConformance


class TestMemoryStoreConformance(BackendConformance):
    @pytest.fixture
    async def backend(self) -> AsyncIterator[StorageBackend]:
        async with kvpipe.MemoryStore() as store:
            yield store


async def test_capacity_reports_no_space_for_what_does_not_fit() -> None:
    suite = BackendConformance()
    store = kvpipe.MemoryStore(capacity_bytes=3 * (suite.payload_nbytes + 48))
    async with suite._batches(store) as b:
        keys, _ = b.keys(5)
        values = [bytes([i]) * b.pool.slot_nbytes for i in range(5)]
        statuses = await b.put(store, keys, values)
        assert statuses == [BlockStatus.OK] * 3 + [BlockStatus.NO_SPACE] * 2
        assert store.statistics()["no_space"] == 2
        assert store.nbytes == 3 * b.pool.slot_nbytes


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        kvpipe.MemoryStore(capacity_bytes=0)
