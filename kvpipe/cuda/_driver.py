"""The few CUDA driver calls the device path makes, behind one small interface.

:class:`Driver` takes and returns plain ints for handles and addresses; tests substitute a
double (``tests/cuda/fake_driver.py``). :class:`CudaDriver` implements it over
``cuda.bindings.driver`` and translates every vendor error here: a failed call raises
:class:`kvpipe.DeviceError` naming the call and the ``CUresult``, a missing driver
:class:`kvpipe.Unsupported`. Only :meth:`Driver.open`, :meth:`Driver.module_load` and the
allocation calls block; the engine makes them at open, close, or once per scratch buffer.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, final

from .._errors import DeviceError, Unsupported

__all__ = ("CudaDriver", "DeviceInfo", "Driver")

Dim3 = tuple[int, int, int]


def checked(call: str, result: Any, success: Any) -> tuple[Any, ...]:
    """The outputs of a cuda-python ``result`` (``(err, *outputs)`` or a bare ``err``);
    :class:`DeviceError` naming ``call`` and the error unless ``err`` is ``success``."""
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != success:
        raise DeviceError(call, getattr(err, "name", str(err)))
    return tuple(outputs)


@final
@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the engine needs to know about its device.

    Attributes:
        ordinal: Device number (``cuda:N``).
        name: Marketing name, for logs.
        capability: Compute capability (major, minor).
        can_map_host_memory: Kernels can address mapped pinned host memory.
    """

    ordinal: int
    name: str
    capability: tuple[int, int]
    can_map_host_memory: bool


class Driver(abc.ABC):
    """The driver calls of the device path; ``stream=0`` is the legacy default stream.

    Every method raises :class:`kvpipe.DeviceError` when the driver reports an error.
    """

    #: A short name for logs and ``statistics().device_note``.
    name: str = "driver"

    @abc.abstractmethod
    def open(self, ordinal: int) -> DeviceInfo:
        """Initialise the driver and retain device ``ordinal``'s primary context (the one
        Paddle and PyTorch use). The calling thread's current context is left as it was:
        work on the opened context runs under :meth:`current`.

        Opens nest: one driver may be opened again for the same device (e.g. passed to
        both :func:`~kvpipe.cuda.create_host_cache` and ``open_pipeline``); each open needs
        its own :meth:`close`, and the context stays retained until the last one. A driver
        holds one device's context: opening another device while it is open is refused.

        Raises:
            Unsupported: No driver or no such device.
            RuntimeError: The driver is open on another device.
        """

    @abc.abstractmethod
    def make_current(self) -> None:
        """Make the opened context current on the calling thread, and leave it current."""

    @abc.abstractmethod
    def get_current(self) -> int:
        """The handle of the context current on the calling thread (``0``: none)."""

    @abc.abstractmethod
    def set_current(self, context: int) -> None:
        """Make ``context`` (a handle from :meth:`get_current`; ``0``: none) current on the
        calling thread."""

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The opened context current on the calling thread inside the block; then whatever
        was current before (the caller's own context, or none) is current again, also when
        the block raises. kvpipe's calls run on the caller's threads (the event loop's):
        they must not leave its device switched. Never await inside the block: another task
        on the thread could run in between and find the wrong context current."""
        previous = self.get_current()
        self.make_current()
        try:
            yield
        finally:
            self.set_current(previous)

    @abc.abstractmethod
    def close(self) -> None:
        """Undo one :meth:`open`; the last one releases the primary context it retained."""

    @abc.abstractmethod
    def stream_create(self) -> int:
        """A new non-blocking stream."""

    @abc.abstractmethod
    def stream_destroy(self, stream: int) -> None:
        """Destroy a stream (work already queued still completes)."""

    @abc.abstractmethod
    def event_create(self) -> int:
        """A new event without timing (``CU_EVENT_DISABLE_TIMING``)."""

    @abc.abstractmethod
    def event_destroy(self, event: int) -> None:
        """Destroy an event."""

    @abc.abstractmethod
    def event_record(self, event: int, stream: int) -> None:
        """Capture the work queued on ``stream`` so far in ``event``."""

    @abc.abstractmethod
    def event_query(self, event: int) -> bool:
        """Whether the captured work has completed (``cuEventQuery``; never blocks)."""

    @abc.abstractmethod
    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for the work ``event`` captured at this call."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Exactly ``nbytes`` of pinned host memory (``cuMemHostAlloc(PORTABLE | DEVICEMAP)``)."""

    @abc.abstractmethod
    def host_device_pointer(self, host_ptr: int) -> int:
        """The device address of mapped pinned memory (``cuMemHostGetDevicePointer``)."""

    @abc.abstractmethod
    def host_free(self, host_ptr: int) -> None:
        """Free pinned host memory from :meth:`host_alloc`."""

    @abc.abstractmethod
    def mem_alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory."""

    @abc.abstractmethod
    def mem_free(self, ptr: int) -> None:
        """Free device memory from :meth:`mem_alloc`."""

    @abc.abstractmethod
    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from pinned host ``src`` to device ``dst``."""

    @abc.abstractmethod
    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from device ``src`` to pinned host ``dst``."""

    @abc.abstractmethod
    def module_load(self, image: bytes) -> int:
        """Load a CUBIN or PTX image into the current context."""

    @abc.abstractmethod
    def module_unload(self, module: int) -> None:
        """Unload a module."""

    @abc.abstractmethod
    def module_function(self, module: int, name: str) -> int:
        """The handle of kernel ``name`` in ``module``."""

    @abc.abstractmethod
    def launch(
        self, function: int, grid: Dim3, block: Dim3, stream: int, params: Sequence[bytes]
    ) -> None:
        """Queue a kernel launch; ``params[i]`` holds the bytes of parameter ``i``."""


@final
class CudaDriver(Driver):
    """:class:`Driver` over ``cuda.bindings.driver`` (cuda-python).

    Raises:
        Unsupported: cuda-python is not importable.
    """

    name = "cuda-python"

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise Unsupported(f"cuda-python is not importable: {exc}") from exc
        self._bind(driver)

    def _bind(self, bindings: Any) -> None:
        """Start closed, over ``bindings`` (``cuda.bindings.driver``, or a test's stand-in)."""
        self._cu: Any = bindings
        self._ctx: Any = None
        self._dev: Any = None
        self._info: DeviceInfo | None = None
        self._opens = 0  # opens not yet closed (they nest: see Driver.open)
        self._lock = threading.Lock()

    def _call(self, name: str, *args: Any) -> Any:
        """Call ``cu<name>``, raise on a failed ``CUresult``; its outputs (one unwrapped)."""
        out = checked(name, getattr(self._cu, name)(*args), self._cu.CUresult.CUDA_SUCCESS)
        if not out:
            return None
        return out[0] if len(out) == 1 else out

    def open(self, ordinal: int) -> DeviceInfo:
        with self._lock:
            if self._info is not None:
                if ordinal != self._info.ordinal:
                    raise RuntimeError(
                        f"this CudaDriver is open on CUDA device {self._info.ordinal}; "
                        f"open device {ordinal} with another CudaDriver"
                    )
                self._opens += 1  # the same context, retained once: see Driver.open
                return self._info
            self._info = self._open(ordinal)
            self._opens = 1
            return self._info

    def _open(self, ordinal: int) -> DeviceInfo:
        try:
            self._call("cuInit", 0)
        except DeviceError as exc:
            raise Unsupported(f"CUDA driver unusable: {exc}") from exc
        except Exception as exc:  # the bindings raise when libcuda cannot be found
            raise Unsupported(f"no CUDA driver: {str(exc).split('.')[0]}") from exc
        count = self._call("cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise Unsupported(f"no CUDA device {ordinal} ({count} present)")
        dev = self._call("cuDeviceGet", ordinal)
        ctx = self._call("cuDevicePrimaryCtxRetain", dev)
        try:
            attr = self._cu.CUdevice_attribute
            major, minor, can_map = (
                self._call("cuDeviceGetAttribute", a, dev)
                for a in (
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    attr.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY,
                )
            )
            raw = self._call("cuDeviceGetName", 256, dev)
        except BaseException:
            # Nobody closes a driver whose open failed: let go of the context retained here.
            self._cu.cuDevicePrimaryCtxRelease(dev)
            raise
        self._dev, self._ctx = dev, ctx
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        return DeviceInfo(ordinal, name, (int(major), int(minor)), bool(can_map))

    def make_current(self) -> None:
        self._call("cuCtxSetCurrent", self._ctx)

    def get_current(self) -> int:
        return int(self._call("cuCtxGetCurrent"))

    def set_current(self, context: int) -> None:
        self._call("cuCtxSetCurrent", self._cu.CUcontext(context))

    def close(self) -> None:
        with self._lock:
            if self._opens > 1:
                self._opens -= 1
                return
            if self._dev is not None:
                self._call("cuDevicePrimaryCtxRelease", self._dev)
                self._dev = self._ctx = self._info = None
                self._opens = 0

    def stream_create(self) -> int:
        flags = self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING
        return int(self._call("cuStreamCreate", flags))

    def stream_destroy(self, stream: int) -> None:
        self._call("cuStreamDestroy", self._cu.CUstream(stream))

    def event_create(self) -> int:
        return int(self._call("cuEventCreate", self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))

    def event_destroy(self, event: int) -> None:
        self._call("cuEventDestroy", self._cu.CUevent(event))

    def event_record(self, event: int, stream: int) -> None:
        self._call("cuEventRecord", self._cu.CUevent(event), self._cu.CUstream(stream))

    def event_query(self, event: int) -> bool:
        (err,) = self._cu.cuEventQuery(self._cu.CUevent(event))
        if err == self._cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        checked("cuEventQuery", err, self._cu.CUresult.CUDA_SUCCESS)
        return True

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("cuStreamWaitEvent", self._cu.CUstream(stream), self._cu.CUevent(event), 0)

    def host_alloc(self, nbytes: int) -> int:
        flags = self._cu.CU_MEMHOSTALLOC_PORTABLE | self._cu.CU_MEMHOSTALLOC_DEVICEMAP
        return int(self._call("cuMemHostAlloc", nbytes, flags))

    def host_device_pointer(self, host_ptr: int) -> int:
        return int(self._call("cuMemHostGetDevicePointer", host_ptr, 0))

    def host_free(self, host_ptr: int) -> None:
        self._call("cuMemFreeHost", host_ptr)

    def mem_alloc(self, nbytes: int) -> int:
        return int(self._call("cuMemAlloc", nbytes))

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree", self._cu.CUdeviceptr(ptr))

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call(
            "cuMemcpyHtoDAsync", self._cu.CUdeviceptr(dst), src, nbytes, self._cu.CUstream(stream)
        )

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call(
            "cuMemcpyDtoHAsync", dst, self._cu.CUdeviceptr(src), nbytes, self._cu.CUstream(stream)
        )

    def module_load(self, image: bytes) -> int:
        return int(self._call("cuModuleLoadData", image))

    def module_unload(self, module: int) -> None:
        self._call("cuModuleUnload", self._cu.CUmodule(module))

    def module_function(self, module: int, name: str) -> int:
        return int(self._call("cuModuleGetFunction", self._cu.CUmodule(module), name.encode()))

    def launch(
        self, function: int, grid: Dim3, block: Dim3, stream: int, params: Sequence[bytes]
    ) -> None:
        # kernelParams: void* per parameter's bytes, copied by the driver at launch.
        buffers = [ctypes.create_string_buffer(p, len(p)) for p in params]
        pointers = (ctypes.c_void_p * len(buffers))(*(ctypes.addressof(b) for b in buffers))
        self._call(
            "cuLaunchKernel",
            self._cu.CUfunction(function),
            *grid,
            *block,
            0,
            self._cu.CUstream(stream),
            ctypes.addressof(pointers),
            0,
        )
