"""The conformance suite's check that a call is a schedule point: on asyncio and on trio,
it tells a call that yields from one that does not."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from kvpipe.testing.conformance import _yields


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _no_yield() -> None:
    pass


async def _two_yields() -> None:
    await anyio.lowlevel.checkpoint()
    await anyio.lowlevel.checkpoint()


async def test_a_call_that_yields_is_seen_to() -> None:
    for _ in range(20):  # trio orders the tasks of a batch at random
        assert await _yields(anyio.lowlevel.checkpoint)
        assert await _yields(_two_yields)


async def test_a_call_that_never_yields_is_caught() -> None:
    for _ in range(20):
        assert not await _yields(_no_yield)
