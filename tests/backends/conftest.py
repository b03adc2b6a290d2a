"""Fixtures shared by the backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpipe.backends.file import _native


@pytest.fixture(params=["native", "os"])
def file_io(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run a file-store test with the native batch reads and writes (the C extension) and
    with plain ``os`` calls."""
    if request.param == "os":
        monkeypatch.setattr(_native, "fileio", None)
    else:
        assert _native.fileio is not None, "the C extension was not built (see setup.py)"
    yield request.param
