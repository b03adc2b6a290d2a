"""The reader's :class:`~kvpipe.backends._base.FetchSink` for a host cache: each value a
store hands over is hashed once, its trailer checked and, when sound, copied into the cache
rows in the store's own thread, behind a gate the reader closes when the fetch ends.

A value's rows (every layer's key and value: 64 for a 32-layer model) are copied in one call
to the file store's C extension where it was built, which releases the GIL once for all of
them: copied one by one through numpy, each copy gives the GIL up and takes it back, and
beside the store's other threads and the event loop each of those waits its turn (on two
processors a hot read's copies took twice as long that way). Without the extension, numpy
copies the rows a group of cache tensors at one stride at a time
(:class:`~kvpipe._hostcopy.RowGroups`: one copy for a cache in one buffer, one per tensor
for tensors allocated one by one)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._blockformat import TRAILER_NBYTES, check_trailer
from .._hostcopy import scatter_values
from ..backends._base import FetchSink
from ..backends.file import _native
from ._base import ActorContext
from ._channels import SliceJob
from ._state import ReadState

__all__ = ("RowSink",)

#: Copies pieces of a value into one block's rows in one GIL-free call (see the module
#: docstring); ``None`` where the extension was not built.
_scatter_rows: Callable[..., Any] | None = (
    _native.fileio.scatter_rows if _native.fileio is not None else None
)


class RowSink(FetchSink):
    """A host-cache read slice's :class:`FetchSink`: each value the store hands over is
    hashed once (the store's checksum of the whole value and the trailer's of the payload,
    in one pass), its trailer checked, and — when sound — copied into the cache rows, in the
    store's thread. Nothing is copied after :meth:`close` (the read's claim on the cache ends
    only once :meth:`wait_idle` has seen every copy out)."""

    def __init__(self, ctx: ActorContext, job: SliceJob) -> None:
        spec, state = job.spec, job.state
        assert isinstance(state, ReadState)
        n = spec.count
        self._values = [job.lease.view(i) for i in range(n)]
        self._digests = ctx.digests_of(state, spec)
        self._blocks = state.block_ids[spec.first_block : spec.end_block]
        self._groups = ctx.cache.row_groups(ctx.segments)
        rows = self._groups.rows
        self.offset = int(rows[0].ctypes.data) % 4096 if rows else 0
        self._segments = ctx.segments
        self._native = _scatter_rows
        self._payload = ctx.payload_nbytes
        self._verify = ctx.config.verify_checksums
        self.checks: list[str | None] = [None] * n
        self.seen = [False] * n
        self.placed = [False] * n
        self.elsewhere = False  # some value was placed from a buffer of the store's
        self._lock = threading.Lock()
        self._writers = 0
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()

    def fetched(self, index: int, checksum: int, value: memoryview | None = None) -> bool:
        payload = self._payload
        if value is None:
            data = self._values[index]
        else:  # the store's own buffer: staging will not hold this value
            data = np.frombuffer(value, np.uint8)
            self.elsewhere = True
        h = xxhash.xxh3_64(data[:payload].data)
        digest = h.intdigest()
        h.update(data[payload:].data)
        if h.intdigest() != checksum:
            return False
        why = check_trailer(
            data[payload : payload + TRAILER_NBYTES].tobytes(),
            payload,
            self._digests[index],
            (lambda: digest) if self._verify else None,
        )
        self.checks[index] = why
        self.seen[index] = True
        if why is None and self._enter():
            try:
                self._place(data, int(self._blocks[index]))
                self.placed[index] = True
            finally:
                self._exit()
        return True

    def _place(self, data: npt.NDArray[np.uint8], block: int) -> None:
        """Copy a sound value's segments into cache block ``block``."""
        if self._native is not None:
            try:
                self._native(data, self._groups.rows, block, self._groups.table)
                return
            except (ValueError, BufferError):  # buffers it does not take: numpy's way
                self._native = None
        # One numpy copy per group of cache tensors at one stride (one buffer, as
        # create_kv_cache allocates: one group), else per tensor.
        scatter_values(self._segments, [data], [block], self._groups)

    def covers(self, count: int) -> bool:
        """Whether the first ``count`` values were all handed over (``0``: whether none
        was)."""
        return all(self.seen[:count]) if count else not any(self.seen)

    def _enter(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._writers += 1
            self._idle.clear()
            return True

    def _exit(self) -> None:
        with self._lock:
            self._writers -= 1
            if self._writers == 0:
                self._idle.set()

    def close(self) -> bool:
        """Copy nothing more into the cache; whether no copy is running now."""
        with self._lock:
            self._closed = True
            return self._writers == 0

    def wait_idle(self) -> None:
        """Block until no copy is running (after :meth:`close`: none will again)."""
        self._idle.wait()
