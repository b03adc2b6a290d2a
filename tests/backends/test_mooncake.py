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
    """The whole suite, with writes in pieces (``put_in_pieces``) and without."""

    @pytest.fixture(params=[False, True], ids=["contiguous", "pieces"])
    async def backend(
        self,
        request: pytest.FixtureRequest,
        mooncake: LocalMooncake,  # noqa: F811
        mooncake_client: Any,  # noqa: F811
    ) -> AsyncIterator[StorageBackend]:
        mooncake_client.remove_all()
        async with kvpipe.MooncakeStore(
            mooncake.master_address,
            mooncake.metadata_url,
            client=mooncake_client,
            put_in_pieces=request.param,
        ) as store:
            assert store.accepts_parts is request.param
            yield store


def test_put_pieces_splits_calls_at_the_piece_cap() -> None:
    from kvpipe.backends import mooncake as mc

    calls: list[int] = []

    def put(keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        calls.append(sum(map(len, ptrs)))
        return [0] * len(keys)

    n = mc._MAX_PIECES_PER_CALL // 100 * 3 + 1  # 100 pieces per key
    ptrs = [[1] * 100 for _ in range(n)]
    codes = mc._put_pieces(put)([f"k{i}" for i in range(n)], ptrs, ptrs)
    assert codes == [0] * n
    assert sum(calls) == 100 * n and max(calls) <= mc._MAX_PIECES_PER_CALL
    # A key with more pieces than the cap still goes, alone.
    calls.clear()
    assert mc._put_pieces(put)(["a", "b"], [[1] * 600, [1]], [[1] * 600, [1]]) == [0, 0]
    assert calls == [600, 1]


async def test_unreachable_master_is_a_backend_error() -> None:
    from kvpipe.backends.mooncake_local import free_port

    port = free_port()
    store = kvpipe.MooncakeStore(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata")
    with pytest.raises(kvpipe.BackendError, match="unreachable"):
        await store.open()
