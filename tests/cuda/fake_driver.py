"""FakeDriver  # TEST DOUBLE: not evidence of GPU speed (nor of the CUDA code's correctness).

A host-memory double of the few CUDA driver calls kvpipe's device path makes
(:class:`kvpipe.cuda.Driver`). It lets the CUDA engine run on a machine without a GPU while
checking what the engine asks of the driver:

* **Memory.** Device allocations are numpy arrays at fake addresses (``0xD…``, never valid
  host addresses, with unmapped gaps between allocations); pinned allocations are real,
  page-aligned host memory (numpy can view them, as with ``cuMemHostAlloc``) with a separate
  fake device alias (``0xE…``) for mapped access. Fresh memory is filled with garbage
  (``0xDD`` / ``0xCD``), as the real driver does not zero it.
* **Pointer arithmetic and sizes.** Every kernel access, every DMA and every launch pointer
  must lie entirely inside one allocation of the right kind: kernels address device memory
  or *mapped* pinned memory (by its device alias, not its host pointer); DMAs go between
  device memory and *pinned* host memory (a pageable source would make the "async" copy
  synchronous). Launches are checked against the hardware's limits and their grids against
  the work (x = pairs x segments, y chunks covering the largest segment).
* **Kernels.** A launch runs the kernel's numpy reference implementation
  (:func:`kvpipe.cuda._kernels.reference_launch`) on this memory — not the CUDA code.
* **Streams and events.** Work is queued per stream and runs only when the device "makes
  progress" (on :meth:`event_query`, after ``latency`` polls), in stream order, after the
  events it waits on — so an engine that reads staging before its completion event has been
  reached sees garbage. Ops can be *gated* by the test (a producer kernel still running). An
  op that touches memory that an op queued *earlier* on another stream still has pending
  is an ordering violation (e.g. a gather reading a cache block before the producer's write
  it should have waited for).
* **Lifetimes.** Contexts, streams, events, modules and allocations are counted so tests can
  check that close frees everything; freeing memory that queued work still uses is a
  violation.
* **Current contexts.** Each thread has its own current context: none, the device's primary
  context (:attr:`FakeDriver.CONTEXT`, made current by ``make_current`` / ``set_current``;
  ``open`` leaves it as it was), or another one the test sets (:attr:`FakeDriver.FOREIGN`, a
  framework's context on another device). A call other than ``open``, ``close`` and the
  context calls from a thread whose current context is not the primary one is a violation;
  tests check that kvpipe gives the caller's thread back its own context.

Violations raise :class:`DriverViolation` (an ``AssertionError``) at the call or at the op's
execution, and are kept in :attr:`FakeDriver.violations` for the test to assert on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvpipe import DeviceError, Unsupported
from kvpipe.cuda._driver import DeviceInfo, Driver
from kvpipe.cuda._kernels import (
    KERNELS,
    MAX_GRID_X,
    MAX_GRID_Y,
    PAIR_NBYTES,
    SEGMENT_NBYTES,
    reference_launch,
    unpack_args,
)
from tests.cuda.fake_device import (
    DriverViolation,
    FakeDevice,
    Gate,
    _Op,
    _Recorder,
)

__all__ = ("DriverViolation", "FakeDriver", "Gate")


class FakeDriver(FakeDevice, Driver):  # TEST DOUBLE: not evidence of GPU speed
    """See the module docstring.

    Args:
        capability: Compute capability reported (kernels are compiled for it by NVRTC).
        device_count: Devices present.
        latency: Polls an op waits at the head of its stream before it may run.
        can_map_host_memory: Whether kernels may address mapped pinned memory.
    """

    name = "FakeDriver (test double)"
    #: The handle of the device's primary context.
    CONTEXT = 0xC7C7
    #: A context the driver does not own (the caller's framework's, on another device).
    FOREIGN = 0xF0F0

    def __init__(
        self,
        *,
        capability: tuple[int, int] = (8, 0),
        device_count: int = 1,
        latency: int = 2,
        can_map_host_memory: bool = True,
    ) -> None:
        super().__init__(latency)
        self.capability = capability
        self.device_count = device_count
        self.can_map_host_memory = can_map_host_memory
        self.contexts = 0
        self.opened = 0
        self._ordinal = 0  # the device of the open context (opens nest, as in Driver.open)
        self.calls: list[str] = []
        self.launches: list[tuple[str, tuple[int, int, int], tuple[int, int, int]]] = []
        self._current: dict[int, int] = {}  # thread ident -> its current context (0: none)
        self._modules: dict[int, bytes] = {}
        self._functions: dict[int, str] = {}
        self._fn_owner: dict[int, tuple[int, str]] = {}
        self._fail: dict[str, str] = {}

    # -- test controls -----------------------------------------------------------------------

    def fail_next(self, call: str, code: str = "CUDA_ERROR_UNKNOWN") -> None:
        """Make the next ``call`` (a method name, e.g. ``"launch"``) raise DeviceError."""
        self._fail[call] = code

    def live(self) -> dict[str, int]:
        """What is still allocated / open."""
        return {
            "device_allocations": sum(a.kind == "device" for a in self._allocs.values()),
            "pinned_allocations": sum(a.kind == "pinned" for a in self._allocs.values()),
            "streams": len(self._streams),
            "events": len(self._events),
            "modules": len(self._modules),
            "contexts": self.contexts,
        }

    def assert_clean(self) -> None:
        """No violation, nothing left allocated or open."""
        assert self.violations == [], self.violations
        assert all(v == 0 for v in self.live().values()), self.live()

    def current_of(self, ident: int | None = None) -> int:
        """The context current on thread ``ident`` (default: the calling one; 0: none)."""
        return self._current.get(threading.get_ident() if ident is None else ident, 0)

    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.current_of() != self.CONTEXT and call not in ("open", "close"):
            raise self.violation(f"{call}: no current context on this thread")
        code = self._fail.pop(call, None)
        if code is not None:
            raise DeviceError(call, code, "injected by FakeDriver")

    # -- Driver ------------------------------------------------------------------------------

    def open(self, ordinal: int) -> DeviceInfo:
        with self._lock:
            self._check("open")
            if not 0 <= ordinal < self.device_count:
                raise Unsupported(f"no CUDA device {ordinal} (fake has {self.device_count})")
            if self.contexts and ordinal != self._ordinal:  # as CudaDriver: one device
                raise RuntimeError(f"the fake is open on CUDA device {self._ordinal}")
            self._ordinal = ordinal
            self.contexts += 1
            self.opened += 1
            return DeviceInfo(ordinal, "FakeGPU", self.capability, self.can_map_host_memory)

    def make_current(self) -> None:
        with self._lock:
            if self.contexts == 0:
                raise self.violation("make_current without an open context")
            self._current[threading.get_ident()] = self.CONTEXT
            self.calls.append("make_current")

    def get_current(self) -> int:
        with self._lock:
            self.calls.append("get_current")
            return self.current_of()

    def set_current(self, context: int) -> None:
        with self._lock:
            self.calls.append("set_current")
            if context == self.CONTEXT and self.contexts == 0:
                raise self.violation("set_current to the primary context, which is released")
            self._current[threading.get_ident()] = context

    def close(self) -> None:
        with self._lock:
            self._check("close")
            if self.contexts == 0:
                raise self.violation("close without open")
            self.contexts -= 1

    def stream_create(self) -> int:
        with self._lock:
            self._check("stream_create")
            stream = 0x5000 + self._next_id()
            self._streams[stream] = self._new_queue()
            return stream

    def stream_destroy(self, stream: int) -> None:
        with self._lock:
            self._check("stream_destroy")
            queue = self._streams.get(stream)
            if queue is None:
                raise self.violation(f"destroying unknown stream {stream:#x}")
            if queue:
                raise self.violation(f"stream {stream:#x} destroyed with {len(queue)} ops queued")
            del self._streams[stream]

    def event_create(self) -> int:
        with self._lock:
            self._check("event_create")
            event = 0xE7000 + self._next_id()
            self._events[event] = None
            return event

    def event_destroy(self, event: int) -> None:
        with self._lock:
            self._check("event_destroy")
            if self._events.pop(event, 0) == 0:
                raise self.violation(f"destroying unknown event {event:#x}")

    def event_record(self, event: int, stream: int) -> None:
        with self._lock:
            self._check("event_record")
            if event not in self._events:
                raise self.violation(f"recording unknown event {event:#x}")
            self._events[event] = self._op(stream, f"record {event:#x}", lambda _op: None)

    def event_query(self, event: int) -> bool:
        with self._lock:
            self._check("event_query")
            if event not in self._events:
                raise self.violation(f"querying unknown event {event:#x}")
            self._tick += 1
            self._progress()
            op = self._events[event]
            return op is None or op.done

    def stream_wait_event(self, stream: int, event: int) -> None:
        with self._lock:
            self._check("stream_wait_event")
            if event not in self._events:
                raise self.violation(f"waiting on unknown event {event:#x}")
            op = self._op(stream, f"wait {event:#x}", lambda _op: None)
            op.wait_for = self._events[event]  # captured now, as cuStreamWaitEvent does

    def host_alloc(self, nbytes: int) -> int:
        with self._lock:
            self._check("host_alloc")
            return self._new_pinned(nbytes)

    def host_device_pointer(self, host_ptr: int) -> int:
        with self._lock:
            self._check("host_device_pointer")
            if not self.can_map_host_memory:
                raise DeviceError("cuMemHostGetDevicePointer", "CUDA_ERROR_NOT_SUPPORTED")
            alloc = self._find(self._host_index, host_ptr)
            if alloc is None or alloc.alias is None:
                raise self.violation(f"{host_ptr:#x} is not pinned memory")
            return alloc.alias + (host_ptr - alloc.base)

    def host_free(self, host_ptr: int) -> None:
        with self._lock:
            self._check("host_free")
            self._free(self._find(self._host_index, host_ptr), host_ptr, "pinned")

    def mem_alloc(self, nbytes: int) -> int:
        with self._lock:
            self._check("mem_alloc")
            return self._new_device(nbytes, "mem_alloc")

    def mem_free(self, ptr: int) -> None:
        with self._lock:
            self._check("mem_free")
            alloc = self._find(self._device_index, ptr)
            self._free(alloc if alloc and alloc.kind == "device" else None, ptr, "device")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        with self._lock:
            self._check("memcpy_htod_async")
            d, doff = self._resolve_device(dst, nbytes, "cuMemcpyHtoDAsync dst")
            if d.kind != "device":
                raise self.violation("cuMemcpyHtoDAsync into mapped pinned memory")
            s, soff = self._resolve_host(src, nbytes, "cuMemcpyHtoDAsync src")
            self._copy_op(stream, "htod", d, doff, s, soff, nbytes)

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        with self._lock:
            self._check("memcpy_dtoh_async")
            s, soff = self._resolve_device(src, nbytes, "cuMemcpyDtoHAsync src")
            if s.kind != "device":
                raise self.violation("cuMemcpyDtoHAsync from mapped pinned memory")
            d, doff = self._resolve_host(dst, nbytes, "cuMemcpyDtoHAsync dst")
            self._copy_op(stream, "dtoh", d, doff, s, soff, nbytes)

    def module_load(self, image: bytes) -> int:
        with self._lock:
            self._check("module_load")
            if not (image[:4] == b"\x7fELF" or image.endswith(b"\0")):
                raise self.violation("module image is neither CUBIN nor NUL-terminated PTX")
            module = 0x3000 + self._next_id()
            self._modules[module] = bytes(image)
            return module

    def module_unload(self, module: int) -> None:
        with self._lock:
            self._check("module_unload")
            if self._modules.pop(module, None) is None:
                raise self.violation(f"unloading unknown module {module:#x}")
            for fn in [f for f, (m, _n) in self._fn_owner.items() if m == module]:
                del self._functions[fn]
                del self._fn_owner[fn]

    def module_function(self, module: int, name: str) -> int:
        with self._lock:
            self._check("module_function")
            image = self._modules.get(module)
            if image is None:
                raise self.violation(f"unknown module {module:#x}")
            if name not in KERNELS or name.encode() not in image:
                raise DeviceError("cuModuleGetFunction", "CUDA_ERROR_NOT_FOUND", name)
            function = 0x4000 + self._next_id()
            self._functions[function] = name
            self._fn_owner[function] = (module, name)
            return function

    def launch(
        self,
        function: int,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        params: Sequence[bytes],
    ) -> None:
        with self._lock:
            self._check("launch")
            name = self._functions.get(function)
            if name is None:
                raise self.violation(f"launch of unknown function {function:#x}")
            if not (1 <= grid[0] <= MAX_GRID_X and 1 <= grid[1] <= MAX_GRID_Y and grid[2] == 1):
                raise self.violation(f"{name}: grid {grid} outside the hardware limits")
            if not (1 <= block[0] * block[1] * block[2] <= 1024 and block[1:] == (1, 1)):
                raise self.violation(f"{name}: CTA {block} not a 1-D block of <= 1024 threads")
            try:
                args = unpack_args(params)
            except ValueError as exc:
                raise self.violation(f"{name}: bad parameters: {exc}") from exc
            table = self._range(args.segs, args.n_seg * SEGMENT_NBYTES, f"{name} segs")
            pairs = self._range(args.pairs, args.n_pairs * PAIR_NBYTES, f"{name} pairs")
            staging = self._range(args.staging, 1, f"{name} staging")
            if args.chunk_bytes < 16 or args.chunk_bytes % 16:
                raise self.violation(f"{name}: chunk of {args.chunk_bytes} B")
            self.launches.append((name, grid, block))

            def run(op: _Op) -> None:
                segs = self.read_device(args.segs, args.n_seg * SEGMENT_NBYTES)
                largest = int(np.frombuffer(segs, "<u8").reshape(-1, 3)[:, 2].max())
                if grid[0] != args.n_pairs * args.n_seg:
                    raise self.violation(f"{name}: grid.x {grid[0]} != pairs x segments")
                if not (grid[1] - 1) * args.chunk_bytes < largest <= grid[1] * args.chunk_bytes:
                    raise self.violation(f"{name}: grid.y {grid[1]} does not fit {largest} B")
                memory = _Recorder(self, op)
                reference_launch(name, args, grid, block, memory)
                op.reads, op.writes = memory.reads, memory.writes

            op = self._op(stream, f"{name} {grid}", run)
            op.reads = op.writes = None  # known once it has run
            op.uses = {table[0], pairs[0], staging[0]}
