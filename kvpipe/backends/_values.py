"""Whole values under caller-named keys on any store, outside a pipeline.

For adapters of servers that name their own keys (FastDeploy's ``KVCacheStorage``):
:class:`ValueClient` builds batches over its own staging, so every store is used exactly as
a pipeline uses it.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeAlias, TypeVar

import anyio
import numpy as np

from .._errors import ConfigError, RequestError
from .._keys import Scope, as_tokens
from .._plan import leading_run
from .._staging import StagingLease, StagingPool
from .._workers import INLINE_COPY_BYTES, ThreadRunner
from ._base import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend, validate_key
from ._registration import Registrations

B = TypeVar("B", PutBatch, GetBatch)
T = TypeVar("T")
Buffer: TypeAlias = bytes | bytearray | memoryview

__all__ = ("ValueClient",)

#: The scope fingerprint of a ValueClient's values (they have no cache layout).
VALUES_FINGERPRINT: Final = hashlib.blake2b(b"kvpipe.values", digest_size=8).hexdigest()
_NO_TOKENS = as_tokens(np.zeros(0, dtype=np.int64))
#: Keys :meth:`ValueClient.exists` probes again at once (one store call each).
PROBE_WIDTH: Final = 16


def fill_slots(pool: StagingPool, slots: Sequence[int], values: Sequence[Buffer]) -> None:
    """Copy ``values[i]`` into staging slot ``slots[i]``."""
    for slot, value in zip(slots, values, strict=True):
        pool.slot(slot)[:] = np.frombuffer(value, np.uint8)


def read_slots(pool: StagingPool, slots: Sequence[int], size: int) -> list[bytearray]:
    """The first ``size`` bytes of each slot, copied out (by numpy, which lets the GIL go
    during a large copy: ``bytes`` would hold it)."""
    out = []
    for slot in slots:
        value = bytearray(size)
        np.frombuffer(value, np.uint8)[:] = pool.slot(slot)[:size]
        out.append(value)
    return out


def _size(n: int) -> int:
    """``n`` as an int (numpy's too), or 0 (refused as a size) for anything else: a bool, a
    float (not cut to an int), a string, ``None``."""
    try:
        return 0 if isinstance(n, bool) else operator.index(n)
    except TypeError:
        return 0


class ValueClient:
    """Put, get, probe and delete whole values on ``store`` under caller-named keys.

    Keys must pass :func:`validate_key`. Each value size gets its own staging pool of
    ``slots`` slots (allocated on first use, registered with the store, unregistered at exit).

    Args:
        store: An open (or self-opening) store; the client does not close it.
        namespace: Scopes the batches (as a pipeline's namespace does).
        slots: Staging slots per value size; a bigger call is sent in chunks.
        close_timeout: Seconds leaving waits for worker threads still running.

    Raises:
        ConfigError: ``store`` is no ``StorageBackend``, ``slots`` no int >= 1, or
            ``close_timeout`` no finite number >= 0.

    Use as an async context manager. Calls must come from the loop that entered it. Values
    are copied into and out of staging on the event loop when a batch's copy is small (up to
    ``INLINE_COPY_BYTES``), else in a worker thread: the loop keeps answering while a batch
    of large values is copied.
    """

    def __init__(
        self,
        store: StorageBackend,
        *,
        namespace: str = "values",
        slots: int = 32,
        close_timeout: float = 10.0,
    ) -> None:
        if not isinstance(store, StorageBackend):
            raise ConfigError(
                "store", f"expected a kvpipe.StorageBackend, got {type(store).__name__}"
            )
        try:  # an int, numpy's too (not a bool)
            count = -1 if isinstance(slots, bool) else operator.index(slots)
        except TypeError:
            count = -1
        if count < 1:
            raise ConfigError("slots", f"must be an int >= 1, got {slots!r}")
        if (
            isinstance(close_timeout, bool)
            or not isinstance(close_timeout, int | float)
            or not close_timeout >= 0
            or close_timeout == float("inf")
        ):
            raise ConfigError(
                "close_timeout", f"must be a finite number of seconds >= 0, got {close_timeout!r}"
            )
        self.store = store
        self.scope = Scope(namespace, VALUES_FINGERPRINT)
        self.slots = count
        self.close_timeout = close_timeout
        self._runner = ThreadRunner(close_timeout)
        self._pools: dict[int, StagingPool] = {}
        self._opening: dict[int, anyio.Lock] = {}  # per size, while its pool is created
        self._registrations = Registrations(store)

    async def __aenter__(self) -> ValueClient:
        """Start the client's worker threads' runner. Cancellation and timeouts: none
        (nothing is awaited for long)."""
        await self._runner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Wait up to ``close_timeout`` for worker threads still running, then unregister
        the staging (by the same deadline). Staging a thread abandoned at the deadline may
        still use, or that the store would not unregister, stays allocated and registered
        for good (logged) rather than freed under the store.

        Cancellation and timeouts: shielded from the leaving task's cancellation; every
        wait ends by the one deadline, ``close_timeout`` from the call.
        """
        deadline = anyio.current_time() + self.close_timeout
        try:
            await self._runner.__aexit__(*exc_info)
        finally:
            if self._runner.running:
                self._registrations.keep("a call abandoned at close may still use it")
            await self._registrations.aclose(deadline)
            self._pools = {}

    async def _pool(self, nbytes: int) -> StagingPool:
        """The pool for ``nbytes``-long values: one per size, however many calls ask for it
        at once (the others wait while the first registers it)."""
        pool = self._pools.get(nbytes)
        if pool is not None:
            return pool
        lock = self._opening.setdefault(nbytes, anyio.Lock())
        async with lock:
            pool = self._pools.get(nbytes)
            if pool is None:
                pool = StagingPool(nbytes, self.slots)
                await self._registrations.add(pool.buffer.data.cast("B"))
                self._pools[nbytes] = pool
        return pool

    def _batch(self, keys: Sequence[str]) -> KeyBatch:
        return KeyBatch(self.scope, "values", [validate_key(k) for k in keys], 0, _NO_TOKENS)

    def _runs(self, sizes: Sequence[int]) -> list[tuple[int, list[int]]]:
        """``(size, positions)`` groups of at most ``slots`` positions of one value size."""
        by_size: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            by_size.setdefault(n, []).append(i)
        step = self.slots
        return [(n, at[j : j + step]) for n, at in by_size.items() for j in range(0, len(at), step)]

    def _staged(self, kind: type[B], keys: list[str], lease: StagingLease, size: int) -> B:
        return kind(
            self.scope,
            "values",
            keys,
            0,
            _NO_TOKENS,
            lease=lease,
            value_nbytes=size,
            runner=self._runner,
            limiter=None,
        )

    async def _copy(self, lease: StagingLease, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a copy of ``nbytes`` bytes between staging and the caller: inline when
        small, else in a worker thread holding ``lease`` until it returns (cancelling the
        caller stops the wait; the thread finishes its copy)."""
        if nbytes <= INLINE_COPY_BYTES:
            return fn(*args)
        return await self._runner.run(fn, *args, hold=lease)

    async def put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[BlockStatus]:
        """Store ``values[i]`` under ``keys[i]`` (copied into staging first). A stored key's
        value is replaced, though a store may refuse (``FAILED``, the stored value kept) to
        replace it with one of another size: ``MooncakeStore`` does, delete the key first.

        Returns:
            One status per key.

        Raises:
            RequestError: A bad key, an empty value, or keys and values of different
                lengths (before anything is stored; a ``ValueError``).
            Exception: Whatever the store raised for the whole batch.

        Cancellation and timeouts: no deadline of the client's own (bound the call
            yourself); waiting for staging other calls hold lasts until they give it back.
            Cancelled, as the store's ``put_blocks`` (values not yet published are not); a
            copy already running in a worker thread finishes there, its staging leased.
        """
        if len(keys) != len(values):
            raise RequestError("one value per key")
        for k in keys:
            validate_key(k)
        sizes = [memoryview(v).nbytes for v in values]
        if 0 in sizes:
            raise RequestError(f"empty value for key {keys[sizes.index(0)]!r}")
        out: list[BlockStatus] = [BlockStatus.FAILED] * len(keys)
        for size, picked in self._runs(sizes):
            pool = await self._pool(size)
            lease = await pool.acquire(len(picked))
            try:
                chosen = [values[i] for i in picked]
                await self._copy(lease, size * len(picked), fill_slots, pool, lease.slots, chosen)
                del chosen
                batch = self._staged(PutBatch, [keys[i] for i in picked], lease, size)
                got = list(await self.store.put_blocks(batch))
            finally:
                lease.release()
            for i, status in zip(picked, got, strict=True):
                out[i] = status
        return out

    async def get(
        self, keys: Sequence[str], nbytes: Sequence[int]
    ) -> list[tuple[BlockStatus, bytearray]]:
        """Fetch each key's ``nbytes[i]``-long value.

        Returns:
            Per key, its status and (when ``OK``) its value (a new ``bytearray``), else an
            empty one.

        Raises:
            RequestError: A bad key or size, or keys and sizes of different lengths (a
                ``ValueError``).
            Exception: Whatever the store raised for the whole batch.

        Cancellation and timeouts: no deadline of the client's own (bound the call
            yourself); waiting for staging other calls hold lasts until they give it back.
            Cancelled, as the store's ``get_blocks``; a copy already running in a worker
            thread finishes there, its staging leased.
        """
        sizes = [_size(n) for n in nbytes]
        if len(keys) != len(sizes) or any(n < 1 for n in sizes):
            raise RequestError("one positive size per key")
        for k in keys:
            validate_key(k)
        out = [(BlockStatus.FAILED, bytearray()) for _ in keys]
        for size, picked in self._runs(sizes):
            pool = await self._pool(size)
            lease = await pool.acquire(len(picked))
            try:
                batch = self._staged(GetBatch, [keys[i] for i in picked], lease, size)
                got = list(await self.store.get_blocks(batch))
                ok = [j for j, status in enumerate(got) if status is BlockStatus.OK]
                slots = [lease.slots[j] for j in ok]
                copied = iter(
                    await self._copy(lease, size * len(ok), read_slots, pool, slots, size)
                )
                for i, status in zip(picked, got, strict=True):
                    out[i] = (status, next(copied) if status is BlockStatus.OK else bytearray())
            finally:
                lease.release()
        return out

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored. One call for all keys; a store's answers after its
        first miss may be ``False`` for stored keys (its ``exists`` may stop there), so the
        keys after it answered ``False`` are probed again, one key a call, up to
        :data:`PROBE_WIDTH` at once: every key is probed at most twice, not once per miss
        before it (not at all for a store that declares
        :attr:`~kvpipe.StorageBackend.exists_answers_every_key`).

        Cancellation and timeouts: no deadline of the client's own; cancelled, the store
        calls in flight are cancelled, as the store's.

        Raises:
            BackendError: The store could not answer (from its first failing probe, as
                itself, not in an exception group).
        """
        keys = list(keys)
        if not keys:
            return []
        out = [bool(ok) for ok in await self.store.exists(self._batch(keys))]
        lead = leading_run(out)
        unsure = [j for j in range(lead + 1, len(keys)) if not out[j]]
        if unsure and not self.store.exists_answers_every_key:
            limiter = anyio.CapacityLimiter(PROBE_WIDTH)
            failed: list[Exception] = []

            async def probe(j: int, scope: anyio.CancelScope) -> None:
                try:
                    async with limiter:
                        out[j] = bool((await self.store.exists(self._batch([keys[j]])))[0])
                except Exception as exc:  # the first probe's error, raised as itself below
                    failed.append(exc)
                    scope.cancel()

            async with anyio.create_task_group() as tg:
                for j in unsure:
                    tg.start_soon(probe, j, tg.cancel_scope)
            if failed:
                raise failed[0]
        return out

    async def stored_run(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored, in one store call.

        Cancellation and timeouts: no deadline of the client's own; as the store's.
        """
        return leading_run(await self.store.exists(self._batch(keys))) if keys else 0

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys (missing ones are ignored).

        Cancellation and timeouts: no deadline of the client's own; as the store's.
        """
        await self.store.delete([validate_key(k) for k in keys])
