"""Registrations never let staging go that the store may still have registered."""

from __future__ import annotations

import asyncio
import math

import anyio
import pytest

import kvpipe
from kvpipe.backends import _registration
from kvpipe.backends._registration import Registrations


class SlowUnregister(kvpipe.MemoryStore):
    """Registers (a no-op) and unregisters only once let go."""

    def __init__(self) -> None:
        super().__init__()
        self.unregistering = anyio.Event()
        self.go_on = anyio.Event()

    async def register_staging(self, buffer: memoryview) -> None:
        pass

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistering.set()
        await self.go_on.wait()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_unregistering_cut_short_by_asyncio_s_own_cancel_keeps_the_staging() -> None:
    """anyio's shield does not keep out asyncio's own cancellation (Task.cancel: a timeout
    around a close, a shutdown): the buffers aclose had taken off its list were then neither
    unregistered nor kept, so the pipeline freed staging the store still had registered."""
    store = SlowUnregister()
    regs = Registrations(store)
    buffer = memoryview(bytearray(64))
    await regs.add(buffer)
    kept = len(_registration.KEPT)
    task = asyncio.ensure_future(regs.aclose(math.inf))
    await store.unregistering.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert regs.kept
    assert len(_registration.KEPT) == kept + 1 and _registration.KEPT[-1] is buffer
