"""The device path: the only package that imports ``cuda-python`` (lazily, never at import).

* :func:`probe_device` — is a CUDA device usable here? Degrades cleanly where there is no
  driver (the host path is used and ``statistics()`` says why).
* :func:`open_cuda_engine` / :class:`CudaEngine` — copies between a device cache and pinned
  staging with the NVRTC-compiled kernels of ``ext/`` (see ``docs/cuda.md``).
* :class:`Driver` / :class:`CudaDriver` — the few driver calls it makes, errors translated
  to :class:`kvpipe.DeviceError`; tests substitute a test double.

Submodules: ``_driver`` (driver interface), ``_nvrtc`` (compile + disk cache), ``_kernels``
(pure: names, packing, launch shapes, reference implementations), ``_pinned`` (pinned
buffers), ``_resources`` (ledger, events, scratch), ``_engine``, ``_open``, ``_hostcache``
(``create_host_cache``). Device tensors and current streams are recognised in the core
(``kvpipe._device_tensors``: no driver calls). The engine names below load on first use,
so ``import kvpipe`` stays light.
"""

from __future__ import annotations

import functools
import importlib
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


@functools.cache
def probe_device() -> DeviceProbe:
    """Probe the CUDA driver once per process. Never raises.

    The ``cuda-python`` import is lazy: it happens here, not when kvpipe is imported.
    """
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
