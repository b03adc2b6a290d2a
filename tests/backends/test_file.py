"""FileStore: the shared conformance suite, durability settings, capacity and eviction."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import kvpipe
from kvpipe.backends import StorageBackend
from kvpipe.testing import BackendConformance

pytestmark = pytest.mark.usefixtures("file_io")


class TestFileStoreConformance(BackendConformance):
    @pytest.fixture(params=["none", "data", "full"])
    async def backend(
        self, tmp_path: Path, request: pytest.FixtureRequest
    ) -> AsyncIterator[StorageBackend]:
        async with kvpipe.FileStore(tmp_path / "store", durability=request.param) as store:
            yield store
