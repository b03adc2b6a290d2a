"""The reader's :class:`~kvpipe.backends._base.FetchSink` for a host cache.

Where kvpipe's C extension was built, a value's hashes, trailer check and row copies are one
call that releases the GIL once (:func:`~kvpipe._blockformat.place_if_sound`); a value it
cannot decide (a trailer without a checksum), and every value where it was not built, is
checked in Python and copied with numpy.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import xxhash

from .. import _blockformat
from .._blockformat import (
    PLACED,
    TRAILER_NBYTES,
    UNREADABLE,
    WHOLE_MISMATCH,
    check_blocks,
    check_trailer,
    place_if_sound,
)
from .._hostcopy import Rows, scatter_values
from ..backends._base import FetchSink
from ._base import ActorContext
from ._channels import SliceJob
from ._state import ReadState

__all__ = ("RowSink",)


class RowSink(FetchSink):
    """A host-cache read slice's :class:`FetchSink`: each value the store hands over is
    hashed once, its trailer checked and, when sound, copied into the cache rows, in the
    store's thread. Nothing is copied after :meth:`close` (the read's claim on the cache
    ends only once :meth:`wait_idle` has seen every copy out)."""

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
        self._native = _blockformat.native is not None
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

    @property
    def maps(self) -> bool:
        """Mapped values go through the extension, whose read of them is guarded."""
        return self._native

    def fetched(
        self, index: int, checksum: int, value: memoryview | None = None, *, mapped: bool = False
    ) -> bool | None:
        data: npt.NDArray[np.uint8] | memoryview
        if value is None:
            data = self._values[index]
        elif (nbytes := memoryview(value).nbytes) < (want := self._payload + TRAILER_NBYTES):
            # Not what the store wrote (every value kvpipe writes is a block long): never
            # placed nor read past its end; if the store reports it OK, its check says why.
            self.checks[index] = f"value of {nbytes} bytes, shorter than a block ({want} bytes)"
            self.seen[index] = True
            return False
        else:  # the store's own buffer: staging will not hold this value
            data = value
            self.elsewhere = True
        block = int(self._blocks[index])
        if self._native and self._enter():
            try:
                verdict = place_if_sound(
                    data,
                    self._payload,
                    checksum,
                    self._digests[index],
                    self._verify,
                    self._groups.rows,
                    block,
                    self._groups.table,
                    mapped,
                )
            except (ValueError, IndexError, BufferError):  # rows it does not take
                self._native = False
                verdict = None
            finally:
                self._exit()
            if verdict in (WHOLE_MISMATCH, UNREADABLE):
                return False
            if verdict == PLACED:
                self.seen[index] = self.placed[index] = True
                return True
        if mapped:
            return None  # its pages may fault, and only the extension's read is guarded
        return self._fetched_slowly(index, checksum, np.frombuffer(data, np.uint8), block)

    def _fetched_slowly(
        self, index: int, checksum: int, data: npt.NDArray[np.uint8], block: int
    ) -> bool:
        """:meth:`fetched` through python-xxhash and numpy (never a mapped value): where the
        extension cannot take the cache, or the value's trailer is not one it expects."""
        payload = self._payload
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
                scatter_values(self._segments, [data], [block], self._groups)
                self.placed[index] = True
            finally:
                self._exit()
        return True

    def place_unseen(self, unseen: list[int], sources: list[Rows]) -> None:
        """Check values ``unseen``, never handed over, in ``sources`` (one each) and copy the
        sound ones into the cache, recording their verdicts. Blocking; the caller holds the
        read's claim on the cache (after :meth:`close`)."""
        checks = check_blocks(
            sources, self._payload, [self._digests[i] for i in unseen], self._verify
        )
        sound = [j for j, c in enumerate(checks) if c is None]
        if sound:
            blocks = [int(self._blocks[unseen[j]]) for j in sound]
            scatter_values(self._segments, [sources[j] for j in sound], blocks, self._groups)
        for i, check in zip(unseen, checks, strict=True):
            self.checks[i], self.seen[i], self.placed[i] = check, True, check is None

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
