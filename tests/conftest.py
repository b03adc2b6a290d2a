"""Shared fixtures. anyio's own pytest plugin runs the async tests (``anyio_mode = "auto"``)."""

from __future__ import annotations

import pytest

import kvpipe
from tests.helpers import LAYOUTS


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio by default; tests that need trio's MockClock ask for it."""
    return "asyncio"


@pytest.fixture(params=sorted(LAYOUTS))
def any_layout(request: pytest.FixtureRequest) -> kvpipe.CacheLayout:
    """Each of the four layouts (small, but with the real per-token widths for DSA)."""
    return LAYOUTS[request.param]()
