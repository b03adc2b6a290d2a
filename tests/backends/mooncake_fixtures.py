"""A real Mooncake Store on 127.0.0.1 for the tests: servers per module, a shared client."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvpipe.backends.mooncake_local import LocalMooncake


@pytest.fixture(scope="module")
def mooncake() -> Iterator[LocalMooncake]:
    """A metadata server and a master on free loopback ports, stopped by PID afterwards."""
    with LocalMooncake() as server:
        yield server


def make_client(server: LocalMooncake, segment: int = 512 << 20) -> Any:
    """A set-up vendor client contributing ``segment`` bytes (blocking)."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(
        "127.0.0.1", server.metadata_url, segment, 64 << 20, "tcp", "", server.master_address
    )
    assert rc == 0, f"mooncake setup returned {rc}"
    return client


@pytest.fixture(scope="module")
def mooncake_client(mooncake: LocalMooncake) -> Iterator[Any]:
    """One client per module (``setup`` is quick, ``close`` takes ~2 s)."""
    client = make_client(mooncake)
    yield client
    client.close()
