"""CudaDriver over a stand-in for ``cuda.bindings.driver`` (no GPU): what it does with the
driver's answers, here when opening fails half-way."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest

from kvpipe import DeviceError
from kvpipe.cuda._driver import CudaDriver


class _Result(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class _Bindings:
    """The calls :meth:`CudaDriver.open` makes; ``cuDeviceGetAttribute`` fails."""

    CUresult = _Result
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76,
        CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY=19,
    )

    def __init__(self) -> None:
        self.retained = 0

    def cuInit(self, _flags: int) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS,)

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, 1)

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, ordinal)

    def cuDevicePrimaryCtxRetain(self, _dev: int) -> tuple[Any, ...]:
        self.retained += 1
        return (_Result.CUDA_SUCCESS, "primary context")

    def cuDevicePrimaryCtxRelease(self, _dev: int) -> tuple[Any, ...]:
        self.retained -= 1
        return (_Result.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, _ctx: object) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS,)

    def cuDeviceGetAttribute(self, _attr: int, _dev: int) -> tuple[Any, ...]:
        return (_Result.CUDA_ERROR_INVALID_VALUE, 0)


def test_an_open_that_fails_after_retaining_the_context_releases_it() -> None:
    bindings = _Bindings()
    driver = CudaDriver.__new__(CudaDriver)  # without importing cuda-python
    driver._cu, driver._ctx, driver._dev = bindings, None, None
    with pytest.raises(DeviceError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.open(0)
    assert bindings.retained == 0  # else the device's primary context is held for good
    driver.close()  # nothing left to release
    assert bindings.retained == 0
