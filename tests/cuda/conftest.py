"""Fixtures of the device-path tests: a kernel cache per session (compiled once by NVRTC),
NVRTC imported up front, and the ``cuda`` marker's skip where there is no GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe import Unsupported
from kvpipe.cuda import probe_device
from kvpipe.cuda._nvrtc import nvrtc_version
from tests.cuda.fake_driver import FakeDriver


@pytest.fixture(scope="session")
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One NVRTC output directory per session (kept out of ``~/.cache``)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(autouse=True, scope="session")
def _nvrtc_imported() -> None:
    """NVRTC's bindings imported once, before any test's event loop runs: opening an engine
    imports them in a worker thread, and while trio's mock clock (the virtual-time tests)
    waits for a thread its loop spins, stretching a 0.3 s import to seconds."""
    with contextlib.suppress(Unsupported):
        nvrtc_version()


@pytest.fixture(autouse=True)
def _kernel_cache(kernel_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVPIPE_KERNEL_CACHE", str(kernel_cache_dir))
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.cuda`` tests, with the probe's reason, where no GPU is usable."""
    probe = probe_device()
    if probe.available:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU; none usable here: {probe.note}")
    for item in items:
        if "cuda" in item.keywords and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    """A fresh test double of the driver; the test fails on any violation it recorded."""
    driver = FakeDriver()
    yield driver
    assert driver.violations == [], driver.violations


@pytest.fixture
def producer(fake: FakeDriver) -> Iterator[int]:
    """A stream of "the model" (the framework holds its own context, as Paddle would)."""
    fake.open(0)
    fake.make_current()  # the framework's own context, current on its (this) thread
    stream = fake.stream_create()
    yield stream
    fake.make_current()
    fake.run_until_idle()
    fake.stream_destroy(stream)
    fake.close()
