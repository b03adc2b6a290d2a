"""MooncakeStore against a real Mooncake master on loopback: the shared conformance suite."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import kvpipe
from kvpipe.backends import StorageBackend
from kvpipe.backends.mooncake_local import LocalMooncake
from kvpipe.testing import BackendConformance
from tests.backends.mooncake_fixtures import mooncake, mooncake_client  # noqa: F401


class TestMooncakeConformance(BackendConformance):
    @pytest.fixture
    async def backend(
        self,
        mooncake: LocalMooncake,  # noqa: F811
        mooncake_client: Any,  # noqa: F811
    ) -> AsyncIterator[StorageBackend]:
        mooncake_client.remove_all()
        async with kvpipe.MooncakeStore(
            mooncake.master_address, mooncake.metadata_url, client=mooncake_client
        ) as store:
            yield store


async def test_unreachable_master_is_a_backend_error() -> None:
    from kvpipe.backends.mooncake_local import free_port

    port = free_port()
    store = kvpipe.MooncakeStore(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata")
    with pytest.raises(kvpipe.BackendError, match="unreachable"):
        await store.open()
