"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpipe.backends.file import _reads


@pytest.fixture(params=["native", "os"])
def file_reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a file-store test with the native batch reader and with plain ``os`` reads."""
    if request.param == "os":
        monkeypatch.setattr(_reads, "_fileio", None)
    else:
        assert _reads.native_available(), "the native reader was not built (see setup.py)"
    yield request.param
