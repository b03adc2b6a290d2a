"""The device path: the only package that imports ``cuda-python`` (lazily, never at import).

:func:`probe_device` says whether a CUDA device is usable (the host path is used otherwise);
:func:`open_cuda_engine` / :class:`CudaEngine` copy between a device cache and pinned staging
with the NVRTC-compiled kernels of ``ext/`` (``docs/cuda.md``); :class:`Driver` /
:class:`CudaDriver` are the driver calls it makes. The engine names load on first use, so
``import kvpipe`` stays light.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

if TYPE_CHECKING:
    from ._driver import CudaDriver, DeviceInfo, Driver
    from ._engine import CudaEngine
    from ._open import open_cuda_engine
    from ._resources import CudaOptions, EngineAccounting

__all__ = (
    "CudaDriver",
    "CudaEngine",
    "CudaOptions",
    "DeviceInfo",
    "DeviceProbe",
    "Driver",
    "EngineAccounting",
    "open_cuda_engine",
    "probe_device",
)

_LAZY = {
    "CudaDriver": "._driver",
    "DeviceInfo": "._driver",
    "Driver": "._driver",
    "CudaEngine": "._engine",
    "open_cuda_engine": "._open",
    "CudaOptions": "._resources",
    "EngineAccounting": "._resources",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpipe.cuda' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


@final
@dataclass(frozen=True, slots=True)
class DeviceProbe:
    """Whether CUDA is usable, and why (not).

    Attributes:
        available: A driver initialised and at least one device exists.
        device_count: Devices seen (0 when unavailable).
        note: A human-readable reason, for logs and statistics.
    """

    available: bool
    device_count: int
    note: str


#: The CUDA driver library, found by the system's search only (as ``cuda-python`` finds it).
_DRIVER_LIBRARY = "libcuda.so.1"


@functools.cache
def probe_device() -> DeviceProbe:
    """Probe the CUDA driver once per process (importing ``cuda-python`` only where the
    driver library loads: that import takes tens of milliseconds and leaves ~8,000 objects
    that every full garbage collection of the process traverses). Never raises."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL(_DRIVER_LIBRARY)
        except OSError as exc:
            return DeviceProbe(False, 0, f"no CUDA driver: {exc}")
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return DeviceProbe(False, 0, f"cuda-python not importable ({exc})")
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return DeviceProbe(False, 0, f"cuInit failed: {err.name}")
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count == 0:
            return DeviceProbe(False, 0, "no CUDA device")
    except Exception as exc:  # the bindings raise when the driver library is absent
        reason = str(exc).split(".")[0] or type(exc).__name__
        return DeviceProbe(False, 0, f"no CUDA driver: {reason}")
    return DeviceProbe(True, int(count), f"{count} CUDA device(s)")
