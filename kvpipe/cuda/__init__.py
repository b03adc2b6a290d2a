"""The device path's entry: the only package that imports ``cuda-python``.

For now it answers one question — is a CUDA device usable here? — and degrades cleanly where
there is no driver (the host path is used and ``statistics()`` says why). The device copy
engine (streams, pinned staging, NVRTC kernels) builds on this.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import final

__all__ = ("DeviceProbe", "probe_device")


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
