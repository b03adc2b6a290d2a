"""The storage backend contract: one abstract class every backend implements.

A backend stores opaque block values under string keys, answers which keys exist, and keeps
the residency index of ``flush_index``. It reports **per-block** results; the pipeline
decides what counts (the leading run of successes). Batches also carry the request id, first
block index and token prefix, for token-indexed stores. See ``docs/backends.md``.
"""

from __future__ import annotations

import abc
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from .._errors import RequestError
from .._keys import Scope, Tokens
from .._results import Residency, ResidencyEntry
from .._staging import StagingLease, private_lease
from .._workers import Lane, ThreadRunner

__all__ = (
    "BlockStatus",
    "FetchSink",
    "GetBatch",
    "KeyBatch",
    "PutBatch",
    "StorageBackend",
    "validate_entry",
    "validate_key",
)

T = TypeVar("T")
_KEY_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:-]{0,511}")


def validate_key(key: str) -> str:
    """Check that a key is 1–512 characters of ``[A-Za-z0-9._@:-]``; backends call it on
    every key they receive.

    Raises:
        RequestError: The key has another character, is empty, or is too long (a
            ``ValueError``).
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise RequestError(f"invalid block key {key!r}")
    return key


def validate_entry(entry: ResidencyEntry) -> ResidencyEntry:
    """Check a residency record a store is handed: a :class:`ResidencyEntry` of a valid key
    (:func:`validate_key`), a node id that can name a record (non-empty, printable, without
    spaces or ``@``, as ``PipelineConfig.node_id``), a :class:`Residency` and a finite
    number of seconds. The built-in stores check every entry before recording any.

    Raises:
        RequestError: Any of that is not so (a ``ValueError``).
    """
    if type(entry) is not ResidencyEntry:
        raise RequestError(f"expected a kvpipe.ResidencyEntry, got {type(entry).__name__}")
    validate_key(entry.key)
    node = entry.node_id
    if (
        not isinstance(node, str)
        or not node
        or not node.isprintable()
        or any(c.isspace() or c == "@" for c in node)
    ):
        raise RequestError(f"node id {node!r}: printable, without spaces or '@'")
    if not isinstance(entry.residency, Residency):
        raise RequestError(f"residency must be a kvpipe.Residency, got {entry.residency!r}")
    t = entry.updated_at
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise RequestError(f"updated_at must be a finite number of seconds, got {t!r}")
    return entry


class BlockStatus(enum.Enum):
    """A backend's verdict on one block of a batch."""

    OK = "ok"  #: stored (put) / fetched into the buffer (get)
    MISSING = "missing"  #: get: no such key
    FAILED = "failed"  #: the operation failed for this block
    CORRUPT = "corrupt"  #: get: the stored value failed the backend's own checks
    NO_SPACE = "no_space"  #: put: the store is full


class KeyBatch:
    """A batch of consecutive blocks of one request.

    Attributes:
        scope: Namespace, layout fingerprint, rank and world size.
        request_id: The request these blocks belong to.
        keys: One key per block, in sequence order.
        first_block: Sequence index of ``keys[0]``.
        token_prefix: Token ids from the start of the sequence to the end of the last block
            of the batch (read-only int64).
        parent_key: Key of block ``first_block - 1`` (``None`` for block 0 or when unknown);
            ``keys[i - 1]`` is the parent of ``keys[i]``.
    """

    __slots__ = ("first_block", "keys", "parent_key", "request_id", "scope", "token_prefix")

    def __init__(
        self,
        scope: Scope,
        request_id: str,
        keys: Sequence[str],
        first_block: int,
        token_prefix: Tokens,
        parent_key: str | None = None,
    ) -> None:
        self.scope = scope
        self.request_id = request_id
        self.keys = tuple(keys)
        self.first_block = first_block
        self.token_prefix = token_prefix
        self.parent_key = parent_key

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request={self.request_id!r}, blocks="
            f"[{self.first_block}, {self.first_block + len(self.keys)}))"
        )


class _StagedBatch(KeyBatch):
    __slots__ = ("_lease", "_limiter", "_offset", "_runner", "value_nbytes")

    def __init__(
        self,
        scope: Scope,
        request_id: str,
        keys: Sequence[str],
        first_block: int,
        token_prefix: Tokens,
        parent_key: str | None = None,
        *,
        lease: StagingLease,
        value_nbytes: int,
        runner: ThreadRunner,
        limiter: Lane | None,
        offset: int = 0,
    ) -> None:
        super().__init__(scope, request_id, keys, first_block, token_prefix, parent_key)
        if offset < 0 or offset + len(self.keys) > len(lease.slots):
            raise ValueError("the batch's blocks do not fit its staging lease")
        self._offset = offset
        self._lease = lease
        self._runner = runner
        self._limiter = limiter
        self.value_nbytes = value_nbytes

    def buffer_addresses(self) -> list[int]:
        """Addresses of each block's staging buffer (for registered-memory transports)."""
        base = self._lease.pool.buffer.ctypes.data
        stride = self._lease.pool.stride
        return [base + slot * stride for slot in self._slots()]

    def _slots(self) -> tuple[int, ...]:
        return self._lease.slots[self._offset : self._offset + len(self.keys)]

    def _views(self) -> list[memoryview]:
        return [self._lease.pool.slot(s).data for s in self._slots()]

    def hold(self) -> Callable[[], None]:
        """Keep this batch's staging leased past the call, for work that completes in the
        background; call the returned function when that work no longer touches the buffers
        (further calls do nothing). Event loop thread only, for both."""
        self._lease.retain()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._lease.release()

        return release

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` (I/O on this batch's buffers) in a worker thread.

        Cancellation and timeouts: no deadline of its own (the caller's cancel scope, in a
            pipeline ``min(slice_timeout, time left)``, bounds the wait); cancelled, the
            caller stops waiting at once and the thread runs on with the staging leased
            until ``fn`` returns; one still waiting in its lane for a thread (at most
            ``io_threads`` run per pipeline) never starts. Exceptions from ``fn`` propagate.
        """
        return await self._runner.run(fn, *args, hold=self._lease, lane=self._limiter)


class PutBatch(_StagedBatch):
    """Blocks to store: one value per key in staging (:attr:`values`).

    Attributes:
        may_keep: The values' memory belongs to this batch alone and is never written again
            (the backend sets :attr:`StorageBackend.keeps_values`): the backend may keep
            :attr:`values` without copying. Otherwise they are views of reused staging and
            must be copied.
        checksums: The XXH3-64 of each whole value where kvpipe computed it while sealing,
            for a store that keeps one; ``None``: not given.
    """

    __slots__ = ("checksums", "may_keep")

    def __init__(self, *args: Any, may_keep: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.may_keep = may_keep
        self.checksums: list[int] | None = None

    def sub_batch(self, start: int, stop: int) -> PutBatch:
        """The blocks ``[start, stop)`` as a batch of their own over the same staging (no
        copy), with their keys, first block, parent key, token prefix, :attr:`may_keep` and
        :attr:`checksums`. Its :meth:`hold` keeps the whole lease.

        Raises:
            ValueError: ``[start, stop)`` is empty or not within the batch.
        """
        if not 0 <= start < stop <= len(self.keys):
            raise ValueError(f"blocks [{start}, {stop}) are not a run of a {len(self)}-block batch")
        sub = PutBatch(
            self.scope,
            self.request_id,
            self.keys[start:stop],
            self.first_block + start,
            _prefix_through(self, stop),
            self.keys[start - 1] if start else self.parent_key,
            lease=self._lease,
            value_nbytes=self.value_nbytes,
            runner=self._runner,
            limiter=self._limiter,
            offset=self._offset + start,
            may_keep=self.may_keep,
        )
        if self.checksums is not None:
            sub.checksums = self.checksums[start:stop]
        return sub

    @property
    def values(self) -> list[memoryview]:
        """One read-only ``value_nbytes``-long buffer per key (views of staging memory)."""
        return [m.toreadonly() for m in self._views()]


def _prefix_through(batch: KeyBatch, stop: int) -> Tokens:
    """``batch.token_prefix`` cut at the end of block ``stop - 1`` of the batch (block size
    inferred from the prefix; only the last key, ``...:partial:N``, may be partial).

    Raises:
        ValueError: The prefix's length does not fit the keys (not a kvpipe batch).
    """
    n = len(batch.keys)
    if stop == n:
        return batch.token_prefix
    _, sep, tail = batch.keys[-1].rpartition(":partial:")
    partial = int(tail) if sep and tail.isdigit() else 0
    full = batch.first_block + n - (1 if partial else 0)
    block_size, rest = divmod(len(batch.token_prefix) - partial, full)
    if rest or block_size <= 0 or (partial and partial >= block_size):
        raise ValueError(
            f"a token prefix of {len(batch.token_prefix)} tokens does not fit blocks "
            f"[{batch.first_block}, {batch.first_block + n})"
        )
    return batch.token_prefix[: (batch.first_block + stop) * block_size]


class FetchSink(abc.ABC):
    """Offered to a store that checks each value against a checksum of its own
    (:attr:`GetBatch.sink`): it calls :meth:`fetched` with the XXH3-64 it recorded, and
    kvpipe hashes the bytes once for both checks and copies a sound value into the cache in
    that call, in the store's thread. A store that ignores the sink loses nothing: kvpipe
    checks and copies every value it was not told about afterwards.
    """

    #: Offset past a 4096-byte boundary at which a store's own ``value`` buffer copies
    #: fastest into the cache (that of the destination).
    offset: int = 0

    @property
    def maps(self) -> bool:
        """Whether :meth:`fetched` takes a ``value`` that maps a file (``mapped=True``)."""
        return False

    @abc.abstractmethod
    def fetched(
        self, index: int, checksum: int, value: memoryview | None = None, *, mapped: bool = False
    ) -> bool | None:
        """Value ``index`` is in ``buffers[index]`` — or in ``value``, a buffer of the
        store's own, valid until this returns (``buffers[index]`` is then left as it was):
        check that its ``value_nbytes`` bytes hash (XXH3-64) to ``checksum`` and, if so,
        verify and place it.

        ``mapped`` (only where :attr:`maps`): ``value`` maps a file, whose pages may fault
        (``SIGBUS``) where it shrank since it was mapped; the sink reads it only in a call
        that catches that (and then returns ``False``), and where it cannot settle the value
        in that call it returns ``None``: hand it over again, read into a buffer.

        Thread-safe and blocking: call it from the store's worker thread, before the call
        that fetches the batch returns.

        A ``value`` shorter than ``value_nbytes`` is not what the store wrote: ``False``,
        and it is never placed.

        Returns:
            Whether the bytes hash to ``checksum``. ``False``: the value is not what the
            store wrote; report it ``CORRUPT``. ``None``: only with ``mapped``, see above.
        """


class GetBatch(_StagedBatch):
    """Blocks to fetch: write each value into :attr:`buffers` (``value_nbytes`` each) — or,
    where :attr:`may_lend` allows, :meth:`lend` it.

    Attributes:
        may_lend: kvpipe accepts a stored value by :meth:`lend` instead of a copy into
            :attr:`buffers`.
        sink: A :class:`FetchSink` to hand checksummed values to; ``None``: not offered
            (kvpipe sets it for a host cache).
    """

    __slots__ = ("_lent", "may_lend", "sink")

    def __init__(self, *args: Any, may_lend: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.may_lend = may_lend
        self.sink: FetchSink | None = None
        self._lent: dict[int, memoryview] = {}

    @property
    def buffers(self) -> list[memoryview]:
        """One writable ``value_nbytes``-long buffer per key (views of staging memory)."""
        return self._views()

    def lend(self, index: int, value: Any) -> None:
        """Answer key ``index`` with ``value`` itself (``value_nbytes`` bytes) rather than a
        copy into ``buffers[index]``; report it ``OK``. The value must never change (a new
        put of the key replaces it, never writes into it).

        Raises:
            RuntimeError: :attr:`may_lend` is false.
            ValueError: ``index`` is out of range or ``value`` is not ``value_nbytes`` long.
        """
        if not self.may_lend:
            raise RuntimeError("this batch takes values by copy into its buffers only")
        view = memoryview(value).cast("B").toreadonly()
        if not 0 <= index < len(self.keys) or len(view) != self.value_nbytes:
            raise ValueError(f"cannot lend {len(view)} bytes as value {index}")
        self._lent[index] = view

    def lent(self) -> dict[int, memoryview]:
        """The values lent so far, by key index."""
        return dict(self._lent)


class StorageBackend(abc.ABC):
    """What kvpipe needs from a store.

    Implementations must be safe to call concurrently from many tasks of one event loop and
    must honour cancellation: kvpipe runs every call in a cancel scope (slice and total
    timeouts) and treats a cancelled call as not done. Blocking work belongs in worker
    threads (:meth:`PutBatch.run_sync`), never on the event loop.

    :meth:`put_blocks` and :meth:`get_blocks` are checkpoints: a call that returns has let
    the event loop run at least once (e.g. ``anyio.lowlevel.checkpoint()``).

    An exception from any method fails the whole call; kvpipe wraps it in
    :class:`kvpipe.BackendError` (chained) and counts no block of the batch as done.
    """

    #: A short name for logs and statistics.
    name: str = "backend"
    #: The backend keeps put values in memory: kvpipe gathers each put into memory of its own
    #: (:meth:`value_memory`, :attr:`PutBatch.may_keep`) so it need not copy them.
    keeps_values: bool = False
    #: The backend uses :attr:`GetBatch.sink`: kvpipe offers one with each get.
    uses_sink: bool = False
    #: The backend's :meth:`exists` answers every key on its own, never ``False`` for a
    #: stored key only because one before it is missing: a :class:`ValueClient` then takes
    #: its answers past a miss as they are, without probing those keys again one by one.
    exists_answers_every_key: bool = False

    @abc.abstractmethod
    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        """Store ``batch.values[i]`` under ``batch.keys[i]``.

        Returns:
            One status per key: ``OK`` when the block is durably stored (per the backend's
            own durability) and readable, otherwise ``FAILED`` or ``NO_SPACE``. A value
            must become visible to readers all at once, never torn.

        Cancellation and timeouts: kvpipe runs it in a cancel scope of ``min(slice_timeout,
            time left of the request)``; a block whose put was cancelled may or may not end
            up stored (whole, never torn); kvpipe counts it as not stored.
        """

    @abc.abstractmethod
    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        """Fetch the value of ``batch.keys[i]`` into ``batch.buffers[i]``.

        Returns:
            One status per key: ``OK`` (buffer filled), ``MISSING``, ``CORRUPT`` or
            ``FAILED``.

        Cancellation and timeouts: kvpipe runs it in a cancel scope of ``min(slice_timeout,
            time left of the request)``; cancelled, buffers may be partly written, and
            kvpipe discards the whole batch.
        """

    @abc.abstractmethod
    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        """Whether each key is stored (one bool per key). kvpipe counts only the leading run
        of ``True``: a backend may answer ``False`` for every key after the first missing one.

        Cancellation and timeouts: each call gets at most ``slice_timeout`` (and the
        request's deadline, or ``lookup_timeout``); a cancelled call counts as not done.
        """

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Remove these keys (missing keys are ignored).

        Cancellation and timeouts: kvpipe bounds it by ``slice_timeout``; a cancelled call
        may remove some.
        """

    @abc.abstractmethod
    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        """Record, per entry, where ``entry.node_id`` holds ``entry.key`` (replacing that
        node's previous record for the key). Other nodes sharing the store must see it.

        Cancellation and timeouts: bounded by the ``flush_index`` call's deadline
        (``lookup_timeout`` or its ``timeout``); a cancelled call may record some.
        """

    @abc.abstractmethod
    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        """Every node's record for each key (empty when none).

        Cancellation and timeouts: bounded by the ``locate`` call's deadline
        (``lookup_timeout`` or its ``timeout``); a cancelled call counts as not done.
        """

    def value_memory(self, slot_nbytes: int, count: int) -> StagingLease:
        """Memory for ``count`` values of up to ``slot_nbytes`` bytes that a put is gathered
        into and the backend keeps (only when :attr:`keeps_values`). Must be thread-safe.
        May raise :class:`MemoryError`: the slice is then gathered into staging, and the put
        copies it (``may_keep`` false). Default: new memory."""
        return private_lease(slot_nbytes, count)

    async def open(self) -> None:  # noqa: B027
        """Make the store ready (idempotent). :func:`kvpipe.open_pipeline` awaits it before
        the pipeline serves, so that slow opening (a recovery scan, a connection) is not
        charged to the first request's timeout. A store used without it must open itself on
        first use. Default: nothing.

        Raises:
            BackendError: The store cannot be opened.

        Cancellation and timeouts: kvpipe sets no deadline of its own here (bound slow
            opening in the store, as ``MooncakeStore``'s ``setup_timeout`` does); cancelling
            ``open_pipeline`` while it waits cancels this call, and the pipeline does not
            open. Opening again after a cancelled call must work.
        """

    async def register_staging(self, buffer: memoryview) -> None:  # noqa: B027
        """Called when a pipeline opens, with its whole staging buffer, for registered-memory
        transports (Mooncake). Default: nothing.

        Raises:
            Exception: Anything: ``open_pipeline`` raises ``ConfigError("store")``.

        Cancellation and timeouts: no deadline of kvpipe's; a call cancelled midway counts
            as registered (the vendor call may still complete): the buffer is unregistered
            at close, or kept allocated for good.
        """

    async def unregister_staging(self, buffer: memoryview) -> None:  # noqa: B027
        """Called when the pipeline closes, once per registered buffer, after the worker
        threads that may use it are done. Default: nothing.

        Raises:
            Exception: Anything: logged, and the buffer is kept allocated for good (never
                freed under the store).

        Cancellation and timeouts: shielded from the closing task's cancellation; cancelled
            at the owner's deadline (a pipeline's: ``UNWIND_GRACE``, 1 s, past its close
            deadline; a :class:`ValueClient`'s: its ``close_timeout``), when the buffers not
            yet unregistered are kept allocated for good (logged).
        """

    def statistics(self) -> Mapping[str, float]:
        """Backend counters for :meth:`Pipeline.statistics` (default: none)."""
        return {}

    @property
    def closed(self) -> bool:
        """Whether the backend was closed (:meth:`aclose`) and refuses calls; a pipeline
        refuses a closed store at open. Default: ``False``."""
        return False

    async def aclose(self) -> None:  # noqa: B027
        """Release the backend's resources. Default: nothing. kvpipe never calls it: whoever
        created the backend closes it (``async with backend``).

        Cancellation and timeouts: up to the backend (``FileStore``'s and
        ``MooncakeStore``'s are shielded and bounded by their own timeout; ``MemoryStore``'s
        waits for nothing).
        """

    async def __aenter__(self: _B) -> _B:
        """Open the backend (:meth:`open`); leaving the block closes it (:meth:`aclose`)."""
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_B = TypeVar("_B", bound=StorageBackend)
