"""Fixtures shared by the integration tests."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import anyio.from_thread
import pytest
import trio.testing


@pytest.fixture
def virtual_loop(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """The adapters' loop threads made in the test run trio on this ``MockClock``
    (autojump): a deadline in the loop passes once every task there waits, not after real
    seconds, so a loaded machine cannot make a store's answer late. The callers' own waits
    (``timeout`` plus ``HOP_SLACK``, on the real clock) stay: give them timeouts that only
    guard hangs.

    Only for work that never waits in the loop for a thread (small copies, an in-loop
    store): such a wait lets the clock jump to the next deadline."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    real = anyio.from_thread.start_blocking_portal

    def on_trio(
        backend: str = "asyncio", backend_options: dict[str, Any] | None = None, **kw: Any
    ) -> AbstractContextManager[anyio.from_thread.BlockingPortal]:
        return real("trio", {"clock": clock}, **kw)

    monkeypatch.setattr(anyio.from_thread, "start_blocking_portal", on_trio)
    return clock
