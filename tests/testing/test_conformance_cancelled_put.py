"""The conformance suite's cancelled-put check reaches the store: a put cancelled midway that
leaves a torn value behind fails it."""

from __future__ import annotations

from collections.abc import Sequence

import anyio.lowlevel
import numpy as np
import pytest

from kvpipe._results import ResidencyEntry
from kvpipe.backends import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend
from kvpipe.testing import BackendConformance


class TornStore(StorageBackend):
    """Writes the first half of each value, yields, then the whole value: a put cancelled at
    its first await leaves torn values stored (what the suite must catch)."""

    name = "torn"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        values = [bytes(v) for v in batch.values]
        for key, value in zip(batch.keys, values, strict=True):
            half = len(value) // 2
            self.data[key] = value[:half] + bytes(len(value) - half)
        await anyio.lowlevel.checkpoint()
        for key, value in zip(batch.keys, values, strict=True):
            self.data[key] = value
        return [BlockStatus.OK] * len(batch)

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        await anyio.lowlevel.checkpoint()
        out = []
        for key, buf in zip(batch.keys, batch.buffers, strict=True):
            value = self.data.get(key)
            if value is None:
                out.append(BlockStatus.MISSING)
            else:
                np.frombuffer(buf, np.uint8)[:] = np.frombuffer(value, np.uint8)
                out.append(BlockStatus.OK)
        return out

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        await anyio.lowlevel.checkpoint()
        return [k in self.data for k in batch.keys]

    async def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.data.pop(key, None)

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        pass

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        return [() for _ in keys]


async def test_a_torn_cancelled_put_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError):
        await suite.test_a_cancelled_put_leaves_the_backend_usable(TornStore())
