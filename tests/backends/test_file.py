"""FileStore: the shared conformance suite, durability settings, capacity and eviction."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kvpipe
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, StorageBackend
from kvpipe.testing import BackendConformance
from kvpipe.testing.batches import Batches, random_values

pytestmark = pytest.mark.usefixtures("file_io")


class TestFileStoreConformance(BackendConformance):
    @pytest.fixture(params=["none", "data", "full"])
    async def backend(
        self, tmp_path: Path, request: pytest.FixtureRequest
    ) -> AsyncIterator[StorageBackend]:
        async with kvpipe.FileStore(tmp_path / "store", durability=request.param) as store:
            yield store


async def test_a_batch_ends_only_once_every_store_thread_has_let_go_of_its_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is shared among the store's threads; where one share fails, the batch still
    returns (with that share's error) only once the others are done with the staging."""
    pool = StagingPool(4096 + 64, 4)
    finished = threading.Event()
    async with ThreadRunner() as runner, kvpipe.FileStore(tmp_path / "store", threads=2) as store:
        b = Batches(pool, runner)
        keys, _ = b.keys(4)
        assert (
            await b.put(store, keys, random_values(4, pool.slot_nbytes, 1)) == [BlockStatus.OK] * 4
        )

        def read(
            hooks: object, root: object, keys: object, bufs: object, fp: object, part: list[int]
        ) -> list[BlockStatus]:
            if 0 in part:
                raise MemoryError("the first share fails at once")
            finished.wait(0.2)  # the second is still reading into its staging meanwhile
            finished.set()
            return [BlockStatus.OK] * len(part)

        monkeypatch.setattr(store, "_read", read)
        monkeypatch.setattr(store, "_read_to_sink", read)
        with pytest.raises(MemoryError):
            await b.get(store, keys)
        assert finished.is_set(), "the batch returned while a share was still reading"
