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
    driver._bind(bindings)
    with pytest.raises(DeviceError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.open(0)
    assert bindings.retained == 0  # else the device's primary context is held for good
    driver.close()  # nothing left to release
    assert bindings.retained == 0


class _Context:
    """A ``CUcontext``: an opaque handle that converts to its address."""

    def __init__(self, handle: int = 0) -> None:
        self.handle = int(handle)

    def __int__(self) -> int:
        return self.handle


PRIMARY, FRAMEWORK = 0xC0, 0xF1  # device 0's primary context; the caller's (device 1's)


class _Thread(_Bindings):
    """The calls of an open that succeeds, pinned allocations, and the calling thread's
    current context (one thread: these tests make every call from it)."""

    CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_DEVICEMAP = 1, 2
    CUcontext = _Context

    def __init__(self) -> None:
        super().__init__()
        self.current = FRAMEWORK
        self.memory: dict[int, Any] = {}
        self.allocated_in: set[int] = set()
        self.freed_in: set[int] = set()

    def cuDevicePrimaryCtxRetain(self, _dev: int) -> tuple[Any, ...]:
        self.retained += 1
        return (_Result.CUDA_SUCCESS, _Context(PRIMARY))

    def cuDeviceGetAttribute(self, _attr: int, _dev: int) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, 1)

    def cuDeviceGetName(self, _n: int, _dev: int) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, b"StandIn\0")

    def cuCtxGetCurrent(self) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, _Context(self.current))

    def cuCtxSetCurrent(self, ctx: _Context) -> tuple[Any, ...]:
        self.current = int(ctx)
        return (_Result.CUDA_SUCCESS,)

    def cuMemHostAlloc(self, nbytes: int, _flags: int) -> tuple[Any, ...]:
        import numpy as np

        buf = np.empty(nbytes, np.uint8)
        self.memory[buf.ctypes.data] = buf
        self.allocated_in.add(self.current)
        return (_Result.CUDA_SUCCESS, buf.ctypes.data)

    def cuMemFreeHost(self, ptr: int) -> tuple[Any, ...]:
        del self.memory[ptr]
        self.freed_in.add(self.current)
        return (_Result.CUDA_SUCCESS,)


def _driver_over(bindings: _Bindings) -> CudaDriver:
    driver = CudaDriver.__new__(CudaDriver)  # without importing cuda-python
    driver._bind(bindings)
    return driver


def test_a_host_cache_leaves_the_caller_s_current_context_as_it_was() -> None:
    """The caller's thread has its framework's context (device 1's) current: allocating a
    pinned host cache, and freeing it, work in device 0's primary context and give the
    thread its own back (they used to leave device 0's current: the caller's later CUDA
    work silently ran on the wrong device)."""
    import kvpipe
    from kvpipe.cuda._hostcache import create_host_cache

    bindings = _Thread()
    layout = kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16"
    )
    cache = create_host_cache(layout, 3, device_driver=_driver_over(bindings))
    assert bindings.current == FRAMEWORK
    assert bindings.allocated_in == {PRIMARY} and len(bindings.memory) == 2
    cache.free()
    assert bindings.current == FRAMEWORK
    assert bindings.freed_in == {PRIMARY} and bindings.memory == {}
    assert bindings.retained == 0


def test_open_leaves_the_current_context_and_current_restores_it() -> None:
    bindings = _Thread()
    driver = _driver_over(bindings)
    driver.open(0)
    assert bindings.current == FRAMEWORK
    with pytest.raises(RuntimeError, match="inside"):
        with driver.current():
            assert bindings.current == PRIMARY
            raise RuntimeError("inside")
    assert bindings.current == FRAMEWORK
    driver.close()
    assert bindings.retained == 0


def test_a_second_open_of_the_same_device_nests_until_its_own_close() -> None:
    """One driver opened twice (given to ``create_host_cache`` and ``open_pipeline``, say):
    closing one user's open leaves the context to the other, and the last close releases
    it. (A second open used to retain the context again and a first close forget it: the
    other user's calls ran without a context, and one retain was never released.)"""
    bindings = _Thread()
    driver = _driver_over(bindings)
    first = driver.open(0)
    assert driver.open(0) == first
    driver.close()
    with driver.current():
        assert bindings.current == PRIMARY  # still open for the second user
    assert bindings.current == FRAMEWORK
    driver.close()
    assert bindings.retained == 0
    driver.close()  # nothing left to release
    assert bindings.retained == 0


class _TwoDevices(_Thread):
    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, 2)


def test_opening_another_device_on_an_open_driver_is_refused() -> None:
    """A driver holds one device's context: opening device 1 on a driver open on device 0
    is refused, and device 0's context stays the one its user works in. (It used to
    replace it silently: the first user's copies went to the other device.)"""
    bindings = _TwoDevices()
    driver = _driver_over(bindings)
    driver.open(0)
    with pytest.raises(RuntimeError, match="open on CUDA device 0"):
        driver.open(1)
    assert bindings.retained == 1
    driver.close()
    assert bindings.retained == 0


class _PerDevice(_Thread):
    """Two devices; records which one's primary context each retain was for."""

    def __init__(self) -> None:
        super().__init__()
        self.retained_on: list[int] = []

    def cuDeviceGetCount(self) -> tuple[Any, ...]:
        return (_Result.CUDA_SUCCESS, 2)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, ...]:
        self.retained_on.append(dev)
        return super().cuDevicePrimaryCtxRetain(dev)


def test_a_host_cache_works_in_the_device_it_is_given() -> None:
    """A tensor-parallel rank on device 1 allocates its host cache in device 1's context.
    (It used to be device 0's always: every rank made a context on GPU 0, each costing
    that GPU hundreds of MiB.)"""
    import kvpipe
    from kvpipe.cuda._hostcache import create_host_cache

    layout = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=8, rope_dim=4, block_size=4)
    bindings = _PerDevice()
    cache = create_host_cache(layout, 3, device=1, device_driver=_driver_over(bindings))
    assert bindings.retained_on == [1]
    cache.free()
    assert bindings.retained == 0
    default = _PerDevice()
    create_host_cache(layout, 3, device_driver=_driver_over(default)).free()
    assert default.retained_on == [0]
    for bad in (-1, True, "1", 1.0):
        with pytest.raises(kvpipe.LayoutError, match="device must be"):
            create_host_cache(layout, 3, device=bad, device_driver=_driver_over(_PerDevice()))  # type: ignore[arg-type]
