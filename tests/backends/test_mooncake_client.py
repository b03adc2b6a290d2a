"""MooncakeStore over a fake vendor client (a TCP listener stands in for the master's port):
a closed store stays closed, and a failed unregister_buffer is not taken for success."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.abc
import numpy as np
import pytest

import kvpipe
from kvpipe._keys import Scope, as_tokens
from kvpipe.backends import KeyBatch
from kvpipe.backends import mooncake as mc
from kvpipe.backends._values import VALUES_FINGERPRINT


class FakeClient:
    def __init__(self) -> None:
        self.closed = 0

    def setup(self, *args: object) -> int:
        return 0

    def close(self) -> int:
        self.closed += 1
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return -1  # still registered: the caller must not free the memory


@pytest.fixture
async def master() -> AsyncIterator[str]:
    """An address whose port answers (the store probes it before ``setup``)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    try:
        yield f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
    finally:
        await listener.aclose()


async def test_a_call_after_aclose_does_not_set_up_a_new_client(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clients: list[FakeClient] = []

    def load() -> FakeClient:
        clients.append(FakeClient())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    await store.open()
    await store.aclose()
    assert len(clients) == 1 and clients[0].closed == 1
    scope = Scope("ns", VALUES_FINGERPRINT)
    batch = KeyBatch(scope, "r", ["k1"], 0, as_tokens(np.zeros(0, np.int64)))
    with pytest.raises(kvpipe.BackendError):
        await store.exists(batch)
    # refused without connecting (and mounting a segment) again: nothing would close it
    assert len(clients) == 1


async def test_a_failed_unregister_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mc, "_load_client", FakeClient)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        await store.register_staging(staging.data)
        with pytest.raises(kvpipe.BackendError, match="unregister_buffer"):
            await store.unregister_staging(staging.data)
