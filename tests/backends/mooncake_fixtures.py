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


def remove_every_key(client: Any) -> None:
    """Empty the master of every object, those read lately included (blocking).

    A read gives its objects a lease (the master's ``default_kv_lease_ttl``, 10 s), and the
    vendor's ``remove_all()`` skips leased objects: keys a test read just before stayed
    stored, so the next test of the module (or a repeat of the same one) began with its own
    keys stored already. ``force=True`` skips the lease check.
    """
    removed = client.remove_all(True)
    assert removed >= 0, f"mooncake remove_all returned {removed}"


@pytest.fixture(scope="module")
def mooncake_client(mooncake: LocalMooncake) -> Iterator[Any]:
    """One client per module (``setup`` is quick, ``close`` takes ~2 s)."""
    client = make_client(mooncake)
    yield client
    client.close()
