"""Dry run of ``tests/cuda/test_gpu.py`` on the driver's test double, for machines without a
GPU: ``PYTHONPATH=. python tests/cuda/gpu_dry_run.py [-k EXPR]``.

It swaps the real driver for :class:`FakeDriver` and pretends the probe found a device, so
the GPU tests' own Python (setup, checks, the benchmark's bookkeeping) is exercised. It
proves nothing about a GPU, and the GB/s it prints are host memcpy speeds of the double.
Not collected by pytest (the name does not start with ``test_``).
"""

from __future__ import annotations

import sys

import cuda.bindings.driver as cu
import pytest

import kvpipe._runtime as runtime
import kvpipe.cuda as kc
import kvpipe.cuda._open as opener
import tests.cuda.conftest as conftest
import tests.cuda.test_gpu as gpu_tests
from tests.cuda.fake_driver import FakeDriver

SHARED = FakeDriver(latency=1)
PROBE = kc.DeviceProbe(True, 1, "dry run on FakeDriver (test double)")


class _Shared(FakeDriver):
    def __new__(cls) -> FakeDriver:  # type: ignore[misc]
        return SHARED


def main() -> int:
    runtime.probe_device = lambda: PROBE  # type: ignore[assignment]
    conftest.probe_device = lambda: PROBE  # type: ignore[assignment]
    opener.CudaDriver = _Shared  # type: ignore[assignment,misc]
    gpu_tests.CudaDriver = _Shared  # type: ignore[assignment,misc]
    cu.cuMemGetInfo = lambda: (0, 0, 0)
    args = ["-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    return pytest.main([*args, "tests/cuda/test_gpu.py", "-s", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
