"""The device model behind :class:`tests.cuda.fake_driver.FakeDriver`  # TEST DOUBLE

Memory (device allocations at fake ``0xD…`` addresses, pinned host memory with a ``0xE…``
device alias), bounds-checked resolution of every access, and the per-stream op queue with
its ordering (hazard) check. See ``fake_driver.py`` for what the double checks and why.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]
Range = tuple[int, int, int]  # (allocation id, lo, hi)

DEVICE_BASE = 0xD000_0000_0000_0000
ALIAS_BASE = 0xE000_0000_0000_0000
_GAP = 1 << 20


class DriverViolation(AssertionError):
    """The engine asked the driver for something a real GPU would fault on or race with."""


@dataclass(eq=False)
class Gate:
    """Holds a queued op back until the test opens it (a producer kernel still running)."""

    is_open: bool = False

    def open(self) -> None:
        """Let the op run at the next progress."""
        self.is_open = True


@dataclass(eq=False)
class _Alloc:
    ident: int
    kind: str  # "device" | "pinned"
    base: int  # device address, or host pointer for pinned
    nbytes: int
    data: Bytes
    alias: int | None = None  # pinned: the device address kernels use
    backing: Any = None


@dataclass(eq=False)
class _Op:
    seq: int
    stream: int
    label: str
    run: Callable[[_Op], None]
    ready_tick: int
    reads: list[Range] | None = field(default_factory=list)  # None: unknown until run
    writes: list[Range] | None = field(default_factory=list)
    uses: set[int] = field(default_factory=set)  # allocation ids it references
    wait_for: _Op | None = None
    gate: Gate | None = None
    done: bool = False


def _overlaps(a: list[Range], b: list[Range]) -> bool:
    return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)


class _Recorder:
    """The :class:`kvpipe.cuda._kernels.Memory` a kernel op runs on: bounds-checked,
    device-side, and recording every range it touches."""

    def __init__(self, fake: FakeDevice, op: _Op) -> None:
        self.fake = fake
        self.reads: list[Range] = []
        self.writes: list[Range] = []
        self.op = op

    def read(self, address: int, nbytes: int) -> Bytes:
        alloc, off = self.fake._resolve_device(address, nbytes, self.op.label)
        self.reads.append((alloc.ident, off, off + nbytes))
        return alloc.data[off : off + nbytes]

    def write(self, address: int, data: Bytes) -> None:
        alloc, off = self.fake._resolve_device(address, len(data), self.op.label)
        self.writes.append((alloc.ident, off, off + len(data)))
        alloc.data[off : off + len(data)] = data


class FakeDevice:
    """Memory and queues of the fake GPU (no driver API here; see ``FakeDriver``)."""

    def __init__(self, latency: int) -> None:
        self.latency = latency
        self.violations: list[str] = []
        self.alloc_log: list[tuple[str, int]] = []
        self._lock = threading.RLock()
        self._ids = 0
        self._device_cursor = DEVICE_BASE
        self._alias_cursor = ALIAS_BASE
        self._allocs: dict[int, _Alloc] = {}
        self._device_index: list[tuple[int, _Alloc]] = []  # sorted by device address
        self._host_index: list[tuple[int, _Alloc]] = []  # pinned, sorted by host pointer
        self._streams: dict[int, deque[_Op]] = {}
        self._events: dict[int, _Op | None] = {}
        self._pending: list[_Op] = []
        self._tick = 0
        self._seq = 0
        self.memcpys: list[tuple[str, int]] = []

    def violation(self, message: str) -> DriverViolation:
        """Record a violation and return the exception to raise."""
        self.violations.append(message)
        return DriverViolation(message)

    def device_alloc(self, nbytes: int) -> int:
        """Test setup: device memory outside the engine (e.g. a fake device cache)."""
        with self._lock:
            return self._new_device(nbytes, "device")

    def device_free(self, address: int) -> None:
        """Test teardown: free memory from :meth:`device_alloc`."""
        with self._lock:
            alloc = self._find(self._device_index, address)
            self._free(alloc if alloc and alloc.kind == "device" else None, address, "device")

    def write_device(self, address: int, data: bytes | Bytes) -> None:
        """Test setup: store bytes in device memory now (outside any stream)."""
        arr = np.frombuffer(bytes(data), dtype=np.uint8)
        alloc, off = self._resolve_device(address, len(arr), "test write")
        alloc.data[off : off + len(arr)] = arr

    def read_device(self, address: int, nbytes: int) -> bytes:
        """Test check: the bytes in device memory now (outside any stream)."""
        alloc, off = self._resolve_device(address, nbytes, "test read")
        return alloc.data[off : off + nbytes].tobytes()

    def host_op(
        self,
        stream: int,
        fn: Callable[[], None],
        *,
        reads: Sequence[tuple[int, int]] = (),
        writes: Sequence[tuple[int, int]] = (),
        gate: Gate | None = None,
        label: str = "producer",
    ) -> None:
        """Queue a stand-in for the model's kernel on ``stream``: ``fn`` runs when the op
        executes; ``reads`` / ``writes`` are the (device address, bytes) it touches."""
        with self._lock:
            op = self._op(stream, label, lambda _op: fn(), gate=gate)
            op.reads = [self._range(a, n, label) for a, n in reads]
            op.writes = [self._range(a, n, label) for a, n in writes]
            op.uses = {r[0] for r in op.reads + op.writes}

    def run_until_idle(self) -> None:
        """Run everything runnable (ignores latency; gated ops stay queued)."""
        with self._lock:
            self._tick += self.latency + 1
            self._progress()

    # -- memory model ------------------------------------------------------------------------

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _new_device(self, nbytes: int, label: str) -> int:
        if nbytes < 1:
            raise self.violation(f"{label}: allocation of {nbytes} bytes")
        base = self._device_cursor
        self._device_cursor += -(-nbytes // _GAP) * _GAP + _GAP
        alloc = _Alloc(self._next_id(), "device", base, nbytes, np.full(nbytes, 0xDD, np.uint8))
        self._allocs[alloc.ident] = alloc
        bisect.insort(self._device_index, (base, alloc), key=lambda t: t[0])
        self.alloc_log.append(("device", nbytes))
        return base

    def _new_pinned(self, nbytes: int) -> int:
        """Real, page-aligned host memory (numpy can view it) with a fake device alias."""
        if nbytes < 1:
            raise self.violation(f"pinned allocation of {nbytes} bytes")
        backing = np.full(nbytes + 4096, 0xCD, dtype=np.uint8)
        start = -backing.ctypes.data % 4096
        data = backing[start : start + nbytes]
        alias = self._alias_cursor
        self._alias_cursor += -(-nbytes // _GAP) * _GAP + _GAP
        alloc = _Alloc(
            self._next_id(), "pinned", int(data.ctypes.data), nbytes, data, alias, backing
        )
        self._allocs[alloc.ident] = alloc
        bisect.insort(self._host_index, (alloc.base, alloc), key=lambda t: t[0])
        bisect.insort(self._device_index, (alias, alloc), key=lambda t: t[0])
        self.alloc_log.append(("pinned", nbytes))
        return alloc.base

    @staticmethod
    def _new_queue() -> deque[_Op]:
        return deque()

    def _find(self, index: list[tuple[int, _Alloc]], address: int) -> _Alloc | None:
        i = bisect.bisect_right(index, address, key=lambda t: t[0]) - 1
        if i < 0:
            return None
        start, alloc = index[i]
        return alloc if address < start + alloc.nbytes else None

    def _resolve_device(self, address: int, nbytes: int, who: str) -> tuple[_Alloc, int]:
        """A device-side access: device memory, or mapped pinned memory by its alias."""
        alloc = self._find(self._device_index, address)
        if alloc is None:
            pinned = self._find(self._host_index, address)
            if pinned is not None:
                raise self.violation(f"{who}: device access to host pointer {address:#x}")
            raise self.violation(f"{who}: device access to unallocated address {address:#x}")
        start = alloc.alias if alloc.kind == "pinned" and alloc.alias is not None else alloc.base
        off = address - start
        if nbytes < 0 or off + nbytes > alloc.nbytes:
            raise self.violation(
                f"{who}: {nbytes} B at {address:#x} overrun a {alloc.nbytes} B allocation "
                f"by {off + nbytes - alloc.nbytes} B"
            )
        return alloc, off

    def _resolve_host(self, address: int, nbytes: int, who: str) -> tuple[_Alloc, int]:
        alloc = self._find(self._host_index, address)
        if alloc is None:
            raise self.violation(f"{who}: host address {address:#x} is not pinned memory")
        off = address - alloc.base
        if off + nbytes > alloc.nbytes:
            raise self.violation(f"{who}: {nbytes} B at {address:#x} overrun pinned memory")
        return alloc, off

    def _range(self, address: int, nbytes: int, who: str) -> Range:
        alloc, off = self._resolve_device(address, nbytes, who)
        return (alloc.ident, off, off + nbytes)

    # -- the queue ---------------------------------------------------------------------------

    def _op(
        self, stream: int, label: str, run: Callable[[_Op], None], gate: Gate | None = None
    ) -> _Op:
        if stream not in self._streams:
            raise self.violation(f"{label}: unknown stream {stream:#x}")
        self._seq += 1
        op = _Op(self._seq, stream, label, run, self._tick + self.latency, gate=gate)
        self._streams[stream].append(op)
        self._pending.append(op)
        return op

    def _runnable(self, op: _Op) -> bool:
        if op.gate is not None and not op.gate.is_open:
            return False
        if op.wait_for is not None and not op.wait_for.done:
            return False
        return self._tick >= op.ready_tick

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for queue in self._streams.values():
                while queue and self._runnable(queue[0]):
                    self._execute(queue.popleft())
                    moved = True

    def _execute(self, op: _Op) -> None:
        op.run(op)
        op.done = True
        self._pending.remove(op)
        for other in self._pending:
            if other.seq > op.seq or other.stream == op.stream:
                continue
            if other.reads is None or other.writes is None or op.reads is None:
                continue
            assert op.writes is not None
            if _overlaps(op.writes, other.reads + other.writes) or _overlaps(
                op.reads, other.writes
            ):
                raise self.violation(
                    f"ordering: {op.label} (stream {op.stream:#x}) touched memory that "
                    f"{other.label} (stream {other.stream:#x}), queued before it, had not "
                    "finished with — a missing event wait"
                )

    def _free(self, alloc: _Alloc | None, address: int, kind: str) -> None:
        if alloc is None or alloc.kind != kind or alloc.base != address:
            raise self.violation(f"freeing {address:#x}, not the start of a {kind} allocation")
        for op in self._pending:
            if alloc.ident in op.uses:
                raise self.violation(f"{kind} memory {address:#x} freed while {op.label} is queued")
        del self._allocs[alloc.ident]
        if kind == "pinned":
            self._host_index.remove((alloc.base, alloc))
            self._device_index.remove((alloc.alias, alloc))
        else:
            self._device_index.remove((alloc.base, alloc))

    def _copy_op(
        self, stream: int, kind: str, d: _Alloc, doff: int, s: _Alloc, soff: int, n: int
    ) -> None:
        if n < 1:
            raise self.violation(f"{kind} copy of {n} bytes")

        def run(_op: _Op) -> None:
            d.data[doff : doff + n] = s.data[soff : soff + n]

        op = self._op(stream, f"{kind} {n} B", run)
        op.reads = [(s.ident, soff, soff + n)]
        op.writes = [(d.ident, doff, doff + n)]
        op.uses = {s.ident, d.ident}
        self.memcpys.append((kind, n))
