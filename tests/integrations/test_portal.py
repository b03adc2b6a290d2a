"""The loop thread behind the synchronous adapters: closing it is bounded."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from kvpipe.integrations._portal import LoopThread


class _StuckExit:
    """An async context manager whose exit waits, shielded, until ``release`` is set (a
    store's close waiting on a disk or a server that is gone)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def __aenter__(self) -> _StuckExit:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.release.wait, 30)


def test_close_returns_by_its_timeout_while_a_closer_is_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stuck = _StuckExit()
    loop = LoopThread("kvpipe-test", close_timeout=0.1)
    loop.enter(stuck)
    watchdog = threading.Timer(20, stuck.release.set)  # a guard against a hang
    watchdog.start()
    try:
        with caplog.at_level("ERROR", logger="kvpipe.integrations"):
            loop.close()
        assert not stuck.release.is_set(), "close waited for the stuck closer"
    finally:
        watchdog.cancel()
        stuck.release.set()
    assert any("left to finish" in r.getMessage() for r in caplog.records)
