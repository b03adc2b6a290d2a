"""The in-process memory store: a dictionary of immutable values, optionally bounded.

Values a pipeline gathered for it are kept as they are, in memory from the store's
:class:`~kvpipe._staging.ValueMemory` (which reuses deleted values' memory); other values are
copied, into that memory when large.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import final

import anyio
import numpy as np
import numpy.typing as npt

from .._errors import ConfigError
from .._results import ResidencyEntry
from .._staging import StagingLease, ValueMemory
from .._workers import INLINE_COPY_BYTES
from ._base import (
    BlockStatus,
    GetBatch,
    KeyBatch,
    PutBatch,
    StorageBackend,
    validate_entry,
    validate_key,
)

__all__ = ("MemoryStore",)

Bytes = npt.NDArray[np.uint8]


def _copies(values: Sequence[memoryview]) -> list[Bytes]:
    """One read-only array copy per value."""
    out = []
    for value in values:
        a = np.frombuffer(value, np.uint8).copy()
        a.flags.writeable = False
        out.append(a)
    return out


def _copies_into(
    memory: ValueMemory, values: Sequence[memoryview], slot_nbytes: int
) -> tuple[StagingLease, list[Bytes]]:
    """A read-only copy of each value in the store's reusable memory, and that memory's
    lease (to be released on the event loop's thread)."""
    lease = memory.lease(slot_nbytes, len(values))
    rows = lease.pool.buffer
    out = []
    for value, slot in zip(values, lease.slots, strict=True):
        a = rows[slot, : len(value)]
        a[:] = np.frombuffer(value, np.uint8)
        a.flags.writeable = False
        out.append(a)
    return lease, out


@final
class MemoryStore(StorageBackend):
    """Blocks kept in this process's memory. Shared by pipelines of one process only, on
    any of its event loops (its dictionary and counts are updated under a lock).

    Args:
        capacity_bytes: When set, a put that would exceed it reports ``NO_SPACE`` for the
            blocks that do not fit (nothing is evicted). It bounds the stored values' bytes,
            not the memory held: a put's values share one buffer, freed when all are gone.
        recycle_bytes: At most this much memory of deleted or replaced values is held for
            new puts to reuse (0: none); freed when the store is closed or dropped.
    """

    name = "memory"
    keeps_values = True
    exists_answers_every_key = True

    def __init__(self, capacity_bytes: int | None = None, *, recycle_bytes: int = 1 << 30) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ConfigError("capacity_bytes", f"must be positive, got {capacity_bytes!r}")
        if recycle_bytes < 0:
            raise ConfigError("recycle_bytes", f"must be >= 0, got {recycle_bytes!r}")
        self._capacity = capacity_bytes
        self._memory = ValueMemory(recycle_bytes)
        # Read-only numpy arrays: numpy copies release the GIL (``bytes(view)`` does not).
        self._data: dict[str, Bytes] = {}
        self._residency: dict[str, dict[str, ResidencyEntry]] = {}
        self._bytes = 0
        # Pipelines on event loops of other threads may share the store: each put's, get's
        # and delete's dictionary work and its counts go under it (never across an await).
        self._lock = threading.Lock()
        self._counters = {"puts": 0, "gets": 0, "blocks_put": 0, "blocks_got": 0, "no_space": 0}

    @property
    def nbytes(self) -> int:
        """Bytes of block values held."""
        return self._bytes

    def value_memory(self, slot_nbytes: int, count: int) -> StagingLease:
        """Memory for values a put will keep, reused where possible (thread-safe)."""
        return self._memory.lease(slot_nbytes, count)

    def keys(self) -> list[str]:
        """Every stored key."""
        return list(self._data)

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        """Store every value, kept or copied (see :class:`StorageBackend`).

        Cancellation: nothing of a cancelled call is stored.
        """
        for key in batch.keys:
            validate_key(key)
        values = batch.values
        if batch.may_keep:  # memory of the batch's own: kept as it is, not copied
            copies = [np.frombuffer(v, np.uint8) for v in values]
            await anyio.lowlevel.checkpoint()
        elif len(values) * batch.value_nbytes <= INLINE_COPY_BYTES:
            copies = _copies(values)
            await anyio.lowlevel.checkpoint()
        else:
            lease, copies = await batch.run_sync(
                _copies_into, self._memory, values, batch.value_nbytes
            )
            lease.release()  # the memory stays with the copies, and comes back after them
        statuses = []
        with self._lock:
            self._counters["puts"] += 1
            for key, value in zip(batch.keys, copies, strict=True):
                previous = self._data.get(key)
                old = 0 if previous is None else len(previous)
                if self._capacity is not None and self._bytes - old + len(value) > self._capacity:
                    statuses.append(BlockStatus.NO_SPACE)
                    self._counters["no_space"] += 1
                    continue
                self._data[key] = value
                self._bytes += len(value) - old
                statuses.append(BlockStatus.OK)
            self._counters["blocks_put"] += statuses.count(BlockStatus.OK)
        return statuses

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        """Lend or copy stored values into the batch's buffers (see :class:`StorageBackend`).

        Cancellation: buffers may be partly written (a copy in a worker thread runs on).

        Raises:
            RequestError: A key :func:`validate_key` refuses (before anything is read).
        """
        statuses: list[BlockStatus] = []
        found: dict[int, Bytes] = {}
        for i, key in enumerate(batch.keys):
            value = self._data.get(validate_key(key))
            if value is None:
                statuses.append(BlockStatus.MISSING)
            elif len(value) != batch.value_nbytes:
                statuses.append(BlockStatus.CORRUPT)
            else:
                found[i] = value
                statuses.append(BlockStatus.OK)
        if batch.may_lend:  # values are immutable: lent, not copied
            await anyio.lowlevel.checkpoint()
            for i, value in found.items():
                batch.lend(i, value)
        else:
            buffers = batch.buffers

            def copy() -> None:
                for i, value in found.items():
                    np.frombuffer(buffers[i], np.uint8)[:] = value

            if len(found) * batch.value_nbytes <= INLINE_COPY_BYTES:
                copy()
                await anyio.lowlevel.checkpoint()
            else:
                await batch.run_sync(copy)
        with self._lock:
            self._counters["gets"] += 1
            self._counters["blocks_got"] += statuses.count(BlockStatus.OK)
        return statuses

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        """Whether each key is stored; a cancelled call answers nothing."""
        await anyio.lowlevel.checkpoint()
        return [validate_key(key) in self._data for key in batch.keys]

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove keys (missing ones are ignored); a cancelled call removes none, nor does
        one with an invalid key (``RequestError``, a ``ValueError``)."""
        await anyio.lowlevel.checkpoint()
        checked = [validate_key(key) for key in keys]
        with self._lock:
            for key in checked:
                value = self._data.pop(key, None)
                if value is not None:
                    self._bytes -= len(value)

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        """Record where each entry's node holds its block; a cancelled call records none, nor
        does one with an invalid entry (``RequestError``, a ``ValueError``: see
        :func:`~kvpipe.backends._base.validate_entry`)."""
        await anyio.lowlevel.checkpoint()
        for e in entries:
            validate_entry(e)
        with self._lock:
            for e in entries:
                self._residency.setdefault(e.key, {})[e.node_id] = e

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        """Every node's record for each key; a cancelled call answers nothing."""
        await anyio.lowlevel.checkpoint()
        return [tuple(self._residency.get(validate_key(key), {}).values()) for key in keys]

    async def aclose(self) -> None:
        """Free the memory held for reuse and hold none from now on; the values stay, and the
        store still answers calls. Not a checkpoint (nothing to cancel)."""
        self._memory.clear()

    def statistics(self) -> Mapping[str, float]:
        """Blocks, bytes, call counters, and the memory held for reuse (``recycle_held_bytes``;
        ``recycle_reused`` / ``recycle_allocated``: puts' memory reused / new)."""
        m = self._memory
        return {
            "blocks": len(self._data),
            "bytes": self._bytes,
            **self._counters,
            "recycle_held_bytes": m.held_bytes,
            "recycle_reused": m.reused,
            "recycle_allocated": m.allocated,
        }
