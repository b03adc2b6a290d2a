"""Shared fixtures. anyio's own pytest plugin runs the async tests (``anyio_mode = "auto"``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import kvpipe
from kvpipe import _lograte
from tests.helpers import LAYOUTS
from tests.watchdog import keep_stderr, watch


def pytest_configure(config: pytest.Config) -> None:
    """Keep the real standard error for the watchdog before pytest captures it."""
    keep_stderr()


@pytest.fixture(autouse=True)
def _watchdog(request: pytest.FixtureRequest) -> Iterator[None]:
    """Leave every thread's and task's stack on standard error if a test hangs."""
    with watch(request.node.nodeid):
        yield


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio by default; tests that need trio's MockClock ask for it."""
    return "asyncio"


@pytest.fixture(params=sorted(LAYOUTS))
def any_layout(request: pytest.FixtureRequest) -> kvpipe.CacheLayout:
    """Each of the four layouts (small, but with the real per-token widths for DSA)."""
    return LAYOUTS[request.param]()


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector off for the test: what is not freed by reference
    counting alone stays."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(autouse=True)
def _fresh_log_limits() -> None:
    """Each test starts with no repeated log line held back (as a fresh process)."""
    _lograte.reset_all()
