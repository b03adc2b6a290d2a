"""The file store: kvpipe's embedded default backend.

One file per block under a root directory (:mod:`._format`), published atomically
(:mod:`._fs`), verified on every read, confined to the root, with the residency index and
block catalog in SQLite (:mod:`._catalog`). Several processes may share one root. All
blocking work runs in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar, final

import anyio

from ..._errors import BackendError, ConfigError
from ..._lograte import LogLimiter
from ..._results import ResidencyEntry
from ..._shield import DeferredCancel, shielded
from ..._workers import in_thread, in_thread_to_its_end
from .._base import (
    BlockStatus,
    FetchSink,
    GetBatch,
    KeyBatch,
    PutBatch,
    StorageBackend,
    validate_entry,
    validate_key,
)
from .._inflight import InFlight, ThreadGate
from . import _native
from ._catalog import Catalog, CatalogFull, open_or_replace
from ._direct import Scratch, is_aligned, probe_direct
from ._format import PAGE, block_location, file_nbytes, key_namespace
from ._fs import Durability, Root, owner_token, store_root
from ._inspect import RecoveryReport, recover, remove_stale_temps
from ._reads import (
    ReadHooks,
    read_batch,
    read_cached,
    read_mapped,
    regular_files,
)
from ._shares import in_shares
from ._space import room, settle, sizes
from ._spares import Spares
from ._writes import Abandon, WriteHooks, unwritten, write_batch, write_one

__all__ = ("FileStore",)

log = logging.getLogger("kvpipe.file_store")
_failed_blocks = LogLimiter(log)
T = TypeVar("T")
U = TypeVar("U")
_DURABILITIES = ("none", "data", "full")
#: Errors of the OS and of SQLite that a method's worker thread may raise: translated into
#: :class:`BackendError` at the store's boundary (``CatalogFull`` is an ``OSError``).
_VENDOR_ERRORS: Final = (OSError, sqlite3.Error)
#: Values at least this large the page cache holds whole are read by mapping their files:
#: hot reads through the pipeline ran ahead of reading them into a bounce buffer at 8 MiB,
#: about even at 4 MiB and behind at 2 MiB and below, where the bounce buffer stays in the
#: processor's cache (docs/performance.md).
MAPPED_FROM_NBYTES = 4 << 20
#: Seconds at least between two removals of dead writers' temporary files by puts that find
#: the disk full (each walks the whole tree).
SWEEP_EVERY: Final = 60.0


@final
class FileStore(StorageBackend):
    """Blocks as files under ``root``.

    Args:
        root: The store's directory (created ``0700``), a non-empty ``str`` or
            ``os.PathLike[str]``. May be shared by processes.
        durability: ``"none"`` (rename only), ``"data"`` (``fdatasync`` each file before it
            is published) or ``"full"`` (also sync the directory after the rename).
        capacity_bytes: When set, stay under it by evicting prefix tails, least recently
            used first; blocks that still do not fit are refused (``NO_SPACE``).
        threads: Worker threads a batch's file I/O is spread over.
        stale_temp_after: Seconds after which any temporary file, and any put's
            reservation of capacity, is considered abandoned (those of dead writers on this
            host, in this PID namespace, at once): a put is assumed to end within it.
            Temporary files are removed at open and by a put that finds the disk full
            (:data:`SWEEP_EVERY`); reservations are settled at open and by a
            put that must evict (:meth:`._catalog.Catalog.reserve`).
        scan_on_open: Walk the tree at open: remove stale temporary files, adopt block
            files the catalog does not know, forget records whose file is gone.
        direct_io: Use ``O_DIRECT`` for writes of page-aligned values of at least 64 KiB and
            for reads of what the page cache does not hold. ``None`` (default): where the
            file system allows it, reads always, writes unless ``durability`` is ``"none"``.
            ``True``: both; opening fails where it is not allowed. ``False``: never.
        spare_bytes: Deleted (and evicted) block files kept, up to this many bytes, for later
            puts to write over (:mod:`._spares`); removed at :meth:`aclose` and when the
            disk is full. 0: removed at once (as without the C extension).
        cached_writes: Write block files through the page cache where ``direct_io`` would
            write them directly (``"data"`` and ``"full"`` still ``fdatasync`` each file
            before publishing it), so that blocks written recently are read back from
            memory; reads of what the page cache lacks stay direct. Costs a copy into the
            page cache per write: processor time, where the disk outruns the copies
            (docs/performance.md, issue 16 ninth look). Not with ``direct_io=True``.

    Raises:
        TypeError: ``root`` is not a ``str`` or ``os.PathLike[str]``.
        ConfigError: ``root`` is empty, or another argument is out of range.

    Use ``async with FileStore(...) as store`` or ``await store.open()``; calls open it on
    first use otherwise.
    """

    name = "file"
    uses_sink = True
    #: Worker threads a batch's file I/O is spread over, unless told otherwise.
    DEFAULT_THREADS: Final = 4

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        durability: Durability = "data",
        capacity_bytes: int | None = None,
        threads: int = DEFAULT_THREADS,
        stale_temp_after: float = 3600.0,
        scan_on_open: bool = True,
        direct_io: bool | None = None,
        spare_bytes: int = 1 << 30,
        cached_writes: bool = False,
    ) -> None:
        self.path = store_root(root)
        if durability not in _DURABILITIES:
            raise ConfigError("durability", f"must be one of {_DURABILITIES}, got {durability!r}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ConfigError("capacity_bytes", f"must be positive, got {capacity_bytes!r}")
        if threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {threads!r}")
        if spare_bytes < 0:
            raise ConfigError("spare_bytes", f"must be >= 0, got {spare_bytes!r}")
        if cached_writes and direct_io:
            raise ConfigError("cached_writes", "direct_io=True writes directly; not both")
        if isinstance(stale_temp_after, bool) or not (
            isinstance(stale_temp_after, int | float) and 0 < stale_temp_after < math.inf
        ):
            raise ConfigError("stale_temp_after", f"must be finite and > 0, got {stale_temp_after}")
        self.durability: Durability = durability
        self.capacity_bytes = capacity_bytes
        self.threads = threads
        self.stale_temp_after = stale_temp_after
        self.scan_on_open = scan_on_open
        self.direct_io = direct_io
        self.cached_writes = cached_writes
        self._direct = False  # direct writes: decided at open
        self._direct_reads = False  # direct reads (of what the page cache lacks): likewise
        self._native = False  # native batch reads, writes and probes: likewise
        self._scratch = Scratch()
        self.spare_bytes = spare_bytes
        self._spares = Spares(0)  # made at open: only the native writer reuses files
        self._root: Root | None = None
        self._catalog: Catalog | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._open_lock = anyio.Lock()
        self._gate = ThreadGate(self.name, threads)
        self._counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # guards _counters and _swept_at against worker threads
        self._swept_at = -math.inf  # when a full disk last removed dead writers' temp files
        self._inflight = InFlight(lambda: OSError(errno.ESHUTDOWN, "the file store is closing"))

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Open (idempotent): create the root, open the catalog, clean up after crashes.

        Raises:
            BackendError: The root cannot be created or opened (not a directory, no
                permission, ...), or its catalog cannot be opened; or the store was closed.

        Cancellation and timeouts: no timeout (the recovery scan takes what the tree
            takes). The opening runs in a worker thread that is not abandoned: a cancelled
            call still waits for that thread, and the store is then open if it succeeded.
        """
        async with self._open_lock:
            if self._root is None:
                if self._inflight.closing:  # never open what nothing would close
                    raise BackendError(self.name, "open", f"{self.path}: the store is closed")
                try:
                    await in_thread(self._open_sync)
                except _VENDOR_ERRORS as exc:
                    raise BackendError(self.name, "open", f"{self.path}: {exc}") from exc

    def _open_sync(self) -> None:
        root = Root(self.path)
        catalog: Catalog | None = None
        try:
            allowed = self.direct_io is not False and probe_direct(root.fd, self._scratch)
            if self.direct_io and not allowed:
                raise OSError(errno.EINVAL, "the file system does not allow direct I/O")
            self._direct_reads = allowed
            self._direct = (
                allowed and not self.cached_writes and (self.direct_io or self.durability != "none")
            )
            self._native = _native.fileio is not None and root.confined_opens()
            self._spares = Spares(self.spare_bytes if self._native else 0)
            stale = self.stale_temp_after

            def scan(catalog: Catalog, replaced: bool) -> RecoveryReport | None:
                return recover(root, catalog, stale) if self.scan_on_open or replaced else None

            path = os.path.join(root.path, "catalog.sqlite3")
            catalog, report, aside = open_or_replace(path, owner_token(), scan)
        except BaseException:
            if catalog is not None:
                catalog.close()
            root.close()
            raise
        if aside is not None:
            self._count(catalog_replaced=1)
        if report is not None:
            self._count(
                temp_files_removed=report.temp_removed,
                adopted=report.adopted,
                quarantined=report.quarantined,
                forgotten=report.forgotten,
            )
            if report.temp_removed or report.quarantined or report.forgotten:
                log.warning("file store %s: recovered at open: %s", root.path, report)
        self._root, self._catalog = root, catalog
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvpipe-file")

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has run: every later call is refused."""
        return self._inflight.closing

    async def aclose(self, timeout: float = 30.0) -> None:
        """Close the catalog and the root once the worker threads still running (of calls
        whose callers gave up) have finished; after ``timeout`` seconds (of that wait and of
        waiting for an open still under way, together) the store is left open (logged),
        never closed under a running thread. The closing itself (removing the spare files,
        closing the catalog: not bounded) runs in a worker thread, none of the event loop
        library's shared ones (a server may have them all busy).

        Cancellation: shielded, from asyncio's own (``Task.cancel``) too: one received
        meanwhile is raised once closed (or left open, past ``timeout``).
        """
        deferred = DeferredCancel()
        with anyio.CancelScope(shield=True):
            await self._close(anyio.current_time() + timeout, timeout, deferred)
        deferred.raise_if_received()

    async def _close(self, deadline: float, timeout: float, deferred: DeferredCancel) -> None:
        """:meth:`aclose`'s work, each wait through ``deferred`` (asyncio's own cancel)."""
        if not await shielded(self._open_lock.acquire, deadline, deferred):
            log.error("file store %s: still opening after %.0f s; not closed", self.path, timeout)
            return
        try:
            if self._root is None or self._catalog is None:
                self._inflight.drain(0.0)  # never opened: refuse later calls all the same
                return
            left = max(0.0, deadline - anyio.current_time())
            idle = await in_thread_to_its_end(self._inflight.drain, left, deferred=deferred)
            if not idle:
                log.error(
                    "file store %s: %d worker call(s) still running after %.0f s; "
                    "not closing under them",
                    self.path,
                    self._inflight.running,
                    timeout,
                )
                return
            await in_thread_to_its_end(self._close_sync, deferred=deferred)
        finally:
            self._gate.close()
            self._open_lock.release()

    def _close_sync(self) -> None:
        """Shut the idle threads down, remove the spare files, close the catalog and root."""
        assert self._root is not None and self._catalog is not None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        root, catalog = self._root, self._catalog
        self._root = self._catalog = None
        try:
            self._spares.drain(root)
            catalog.close()
        except (OSError, sqlite3.Error) as exc:  # closed all the same: nothing left open
            log.error("file store %s: closing: %s", root.path, str(exc))
        finally:
            root.close()

    async def _ready(self) -> tuple[Root, Catalog]:
        if self._root is None:
            await self.open()
        assert self._root is not None and self._catalog is not None
        return self._root, self._catalog

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counters.update(deltas)

    @contextlib.contextmanager
    def _translated(self, op: str) -> Iterator[None]:
        """The OS's or SQLite's error of ``op`` (the catalog locked past its busy timeout,
        or read-only; an I/O error; the store closing) raised as :class:`BackendError`."""
        try:
            yield
        except _VENDOR_ERRORS as exc:
            raise BackendError(self.name, op, f"{self.path}: {type(exc).__name__}: {exc}") from exc

    async def _thread(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        with self._translated(op):
            return await self._gate.run(op, self._inflight.track(fn), *args)

    # -- blocks ------------------------------------------------------------------------------

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        """Publish every value as a block file (see :class:`StorageBackend`).

        Reserving, writing (over ``threads`` threads) and recording run in one worker-thread
        call, so the bookkeeping completes even when the caller stops waiting. The header's
        checksum is ``batch.checksums[i]`` where given, else computed here. An error in a
        thread's share (out of memory, say: I/O errors are statuses already) makes its blocks
        not yet published ``FAILED`` (counted ``io_errors``, logged); the blocks published,
        by it or by the other threads, are ``OK``.

        Cancellation: blocks not yet renamed into place are not published (their
        reservations are released); the staging stays leased until the threads return.
        """
        root, catalog = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        abandoned = Abandon()
        try:
            with self._translated("put_blocks"):  # the reservation failed, say: none published
                return await batch.run_sync(
                    self._inflight.track(self._put_sync),
                    root,
                    catalog,
                    keys,
                    batch.values,
                    batch.parent_key,
                    batch.scope.fingerprint,
                    abandoned,
                    batch.checksums,
                    _batch_label("write", batch),
                )
        except anyio.get_cancelled_exc_class():
            abandoned.set()
            raise

    def _put_sync(
        self,
        root: Root,
        catalog: Catalog,
        keys: list[str],
        values: list[memoryview],
        parent: str | None,
        fingerprint: str,
        abandoned: Abandon,
        checksums: list[int] | None,
        label: str = "",
    ) -> list[BlockStatus]:
        if not keys:
            return []
        value_nbytes = len(values[0])
        direct = self._direct and all(is_aligned(v) for v in values)
        nbytes = file_nbytes(value_nbytes, padded=direct)
        space = key_namespace(keys[0])
        try:
            res = catalog.reserve(
                keys,
                parent,
                space,
                nbytes,
                self.capacity_bytes,
                room(root),
                self.stale_temp_after,
                sizes(root),
            )
        except CatalogFull:
            self._count(no_space=len(keys))
            return [BlockStatus.NO_SPACE] * len(keys)
        admitted = [i for i, ok in enumerate(res.admitted) if ok]
        statuses = [BlockStatus.FAILED if ok else BlockStatus.NO_SPACE for ok in res.admitted]
        if res.admitted.count(False):
            self._count(no_space=res.admitted.count(False))
        if res.victims:
            self._count(evictions=len(res.victims), evicted_bytes=res.evicted_bytes)
            for key in res.victims:
                with contextlib.suppress(OSError):  # as a failed delete: its record is gone
                    self._spares.retire(root, *block_location(key))
            # Another put may have published a victim again before its file went. Never
            # raised: the reservation just made must be settled below whatever happens.
            try:
                catalog.reconcile(res.victims, sizes(root))
            except CatalogFull:
                pass
            except sqlite3.Error as exc:  # locked past SQLite's busy timeout, or damaged
                log.error(
                    "file store %s: the catalog cannot reconcile %d evicted block(s) (%s); "
                    "one published again meanwhile may stay recorded without its file "
                    "until the next open",
                    root.path,
                    len(res.victims),
                    str(exc),
                )
        written: list[str] = []
        errors: list[str] = []
        hooks = WriteHooks(self.durability, self._refuse_direct, self._count, errors, abandoned)
        try:
            for i, status in zip(
                admitted,
                self._write(hooks, root, admitted, keys, values, fingerprint, direct, checksums),
                strict=True,
            ):
                statuses[i] = status
                if status is BlockStatus.OK:
                    written.append(keys[i])
        finally:
            failed = [keys[i] for i in admitted if statuses[i] is not BlockStatus.OK]
            # the disk filled meanwhile: files of this put removed
            parents = {key: keys[i - 1] if i else parent for i, key in enumerate(keys)}
            for key in settle(catalog, root, written, failed, hooks.published, parents):
                statuses[keys.index(key)] = BlockStatus.NO_SPACE
                written.remove(key)
                self._count(no_space=1)
        if BlockStatus.NO_SPACE in statuses:
            self._spares.drain(root)
            self._sweep_temps(root)
        self._count(blocks_written=len(written), bytes_written=len(written) * value_nbytes)
        _warn(root, errors, len(keys), "failed to write", label)
        return statuses

    def _sweep_temps(self, root: Root) -> None:
        """The disk is full: remove the temporary files of writers that are gone (a peer
        process killed mid-put leaves its unpublished files and the spares it held), as an
        open does, at most once per :data:`SWEEP_EVERY` seconds. Stores that share a root
        and are never reopened would keep them for good. Never raises (logged)."""
        now = time.monotonic()
        with self._lock:
            if now < self._swept_at + SWEEP_EVERY:
                return
            self._swept_at = now
        try:
            removed = remove_stale_temps(root, self.stale_temp_after)
        except OSError as exc:
            log.warning(
                "file store %s: cannot look for stale temporary files: %s", root.path, str(exc)
            )
            return
        if removed:
            self._count(temp_files_removed=removed)
            log.warning(
                "file store %s: disk full: removed %d temporary file(s) of writers that died "
                "or are stale",
                root.path,
                removed,
            )

    def _write(
        self,
        hooks: WriteHooks,
        root: Root,
        admitted: list[int],
        keys: list[str],
        values: list[memoryview],
        fingerprint: str,
        direct: bool,
        checksums: list[int] | None,
    ) -> list[BlockStatus]:
        """Publish the admitted blocks in ``threads`` shares, each in one native call or file
        by file. ``checksums``: each value's XXH3-64, where the caller gave them."""
        scratch = self._scratch
        sums: list[int | None] = [None] * len(keys)
        if checksums is not None and len(checksums) == len(keys):
            sums[:] = checksums

        def share(part: list[int]) -> list[BlockStatus]:
            done: list[BlockStatus] = []
            try:
                ks = [keys[i] for i in part]
                vs = [values[i] for i in part]
                cs = [sums[i] for i in part]
                if not self._native:
                    for k, v, c in zip(ks, vs, cs, strict=True):
                        done.append(write_one(hooks, root, k, v, fingerprint, direct, scratch, c))
                    return done
                nbytes = file_nbytes(len(vs[0]), padded=direct)
                spares = [self._spares.take(nbytes) for _ in part]
                return write_batch(hooks, root, ks, vs, fingerprint, direct, scratch, cs, spares)
            except Exception as exc:  # statuses, not the error: other shares published theirs
                return done + unwritten(hooks, [keys[i] for i in part[len(done) :]], exc)

        return self._in_shares(share, admitted)

    def _in_shares(self, fn: Callable[[list[T]], list[U]], items: list[T]) -> list[U]:
        """``fn`` over ``threads`` consecutive shares of ``items`` in the store's threads
        (:func:`._shares.in_shares`)."""
        pool = self._executor
        if pool is None:
            raise OSError(errno.ESHUTDOWN, "the file store is closed")
        return in_shares(pool, self.threads, fn, items, self.path)

    def _refuse_direct(self, root: Root, exc: OSError) -> None:
        """A direct read or write was refused after the probe passed (a stricter alignment,
        a file system mounted inside the root...): stop trying."""
        if self._direct or self._direct_reads:
            self._direct = self._direct_reads = False
            log.warning(
                "file store %s: direct I/O refused (%s); using the page cache from now on",
                root.path,
                str(exc),
            )

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        """Read and verify block files into the batch's buffers.

        A file that fails any check (header, key, layout, size, checksum), or anything but a
        regular file at a block's name, is ``CORRUPT`` and moved to ``quarantine/`` (or
        removed); but a :class:`~kvpipe.ValueClient`'s sound value of this key at another
        size than the one asked for (a caller's mistake) is only refused, ``CORRUPT``, and
        stays. With ``batch.sink``, a file the page cache holds may be handed to the sink
        instead (which checks and places it), leaving its buffer as it was.

        Cancellation: the worker threads run on and the batch's staging stays leased until
        they return (a sink copies nothing once the read that offered it has ended).
        """
        root, catalog = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        with self._translated("get_blocks"):
            return await batch.run_sync(
                self._inflight.track(self._get_sync),
                root,
                catalog,
                keys,
                batch.buffers,
                batch.scope.fingerprint,
                batch.sink,
                _batch_label("read", batch),
            )

    def _get_sync(
        self,
        root: Root,
        catalog: Catalog,
        keys: list[str],
        buffers: list[memoryview],
        fingerprint: str,
        sink: FetchSink | None,
        label: str = "",
    ) -> list[BlockStatus]:
        errors: list[str] = []
        hooks = ReadHooks(lambda: self._direct_reads, self._refuse_direct, self._count, errors)

        def share(part: list[int]) -> list[BlockStatus]:
            if sink is not None:
                return self._read_to_sink(hooks, root, keys, buffers, fingerprint, sink, part)
            return self._read(hooks, root, keys, buffers, fingerprint, part)

        statuses = self._in_shares(share, list(range(len(keys))))
        _warn(root, errors, len(keys), "could not be read", label)
        bad = [k for k, s in zip(keys, statuses, strict=True) if s is BlockStatus.CORRUPT]
        ok = [k for k, s in zip(keys, statuses, strict=True) if s is BlockStatus.OK]
        if bad:
            self._count(corrupt=len(bad))
            try:
                catalog.reconcile(bad, sizes(root))
            except (CatalogFull, sqlite3.Error) as exc:  # files gone; the next open forgets them
                log.warning("file store %s: cannot forget corrupt blocks: %s", root.path, str(exc))
        if ok and self.capacity_bytes is not None:
            try:  # bookkeeping for eviction: never the read's failure
                catalog.touch(ok)
            except sqlite3.Error as exc:  # locked past SQLite's busy timeout, or damaged
                log.warning(
                    "file store %s: cannot record a read for eviction: %s", root.path, str(exc)
                )
        self._count(blocks_read=len(ok))
        return statuses

    def _read_to_sink(
        self,
        hooks: ReadHooks,
        root: Root,
        keys: list[str],
        buffers: list[memoryview],
        fingerprint: str,
        sink: FetchSink,
        part: list[int],
    ) -> list[BlockStatus]:
        """Read the block files ``part``: each one the page cache holds whole handed to
        ``sink`` here, mapped where the sink takes a mapping and the value is large
        (:data:`MAPPED_FROM_NBYTES`: one copy, out of the page cache into the cache rows),
        else read into this thread's bounce buffer (its bytes still in the processor's
        cache); the rest into their buffers as without a sink."""
        scratch = self._scratch
        got: list[BlockStatus | None] = [None] * len(part)
        for j, i in enumerate(part if self._native else ()):
            nbytes = len(buffers[i])
            if sink.maps and nbytes >= MAPPED_FROM_NBYTES:
                place = functools.partial(_place_mapped, sink, i)
                got[j] = read_mapped(hooks, root, keys[i], nbytes, fingerprint, place)
                if got[j] is not None:
                    continue  # else not mapped (no cachestat here, say): read it
            bounce = scratch.bounce(nbytes, sink.offset % PAGE)
            ok = functools.partial(_place_read, sink, i, bounce)
            got[j] = read_cached(hooks, root, keys[i], bounce, fingerprint, scratch, ok)
        rest = [i for i, status in zip(part, got, strict=True) if status is None]
        more = iter(self._read(hooks, root, keys, buffers, fingerprint, rest))
        return [status if status is not None else next(more) for status in got]

    def _read(
        self,
        hooks: ReadHooks,
        root: Root,
        keys: list[str],
        buffers: list[memoryview],
        fingerprint: str,
        part: list[int],
    ) -> list[BlockStatus]:
        """Read and check the block files ``part`` into their buffers."""
        ks, bufs = [keys[i] for i in part], [buffers[i] for i in part]
        return read_batch(hooks, root, ks, bufs, fingerprint, self._scratch, self._native)

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        """Whether each block file exists, stopping at the first missing one.

        Raises:
            BackendError: A block file could not be looked at (``EMFILE``, ``EACCES``,
                ``EIO``...): never answered missing, as it may be there.

        Cancellation: stops waiting at once; the probe's thread runs on (changes nothing)."""
        root, _ = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        return await self._thread("exists", regular_files, root, keys, self._native)

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove block files and their records.

        Cancellation: stops waiting at once; the removal's thread runs on to the end."""
        root, catalog = await self._ready()
        keys = [validate_key(k) for k in keys]

        def remove() -> None:
            try:
                for key in keys:
                    self._spares.retire(root, *block_location(key))
            finally:  # the files removed before an error go from the catalog too
                catalog.reconcile(keys, sizes(root))  # a put may have published one again

        await self._thread("delete", remove)

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        """Record residency in the catalog (visible to every process sharing the root); an
        invalid entry (``RequestError``: see :func:`~kvpipe.backends._base.validate_entry`) records
        none.

        Cancellation: stops waiting at once; the write's thread runs on, and records nothing
        unless it had the catalog's write lock before the call was cancelled (so it never
        replaces what a later call recorded)."""
        _, catalog = await self._ready()
        for e in entries:
            validate_entry(e)
        abandoned = Abandon()
        try:
            await self._thread(
                "put_residency", catalog.put_residency, list(entries), abandoned.is_set
            )
        except anyio.get_cancelled_exc_class():
            abandoned.set()
            raise

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        """Every node's record for each key.

        Raises:
            BackendError: The catalog failed, or holds a record of these keys that this
                version cannot read (a residency it does not know, a time that is no number).

        Cancellation: stops waiting at once; the lookup's thread runs on."""
        _, catalog = await self._ready()
        keys = [validate_key(k) for k in keys]
        return await self._thread("get_residency", catalog.get_residency, keys)

    def statistics(self) -> Mapping[str, float]:
        """Counters of this process's use of the store (evictions, corrupt blocks, ...)."""
        with self._lock:
            counters = dict(self._counters)
        spares = {"spare_files": self._spares.files, "spare_bytes": self._spares.held_bytes}
        return counters | spares


def _batch_label(op: str, batch: KeyBatch) -> str:
    """The request and blocks of a batch, for its log line (``""`` without a request id)."""
    if not batch.request_id or not batch.keys:
        return ""
    last = batch.first_block + len(batch.keys) - 1
    return f"{op} {batch.request_id} (blocks {batch.first_block}-{last}): "


def _warn(
    root: Root, errors: Sequence[str], total: int, what: str, label: str = "", shown: int = 3
) -> None:
    """Log a batch's errors in one line, not one per block: the batch's request and blocks
    (``label``), the first ``shown`` errors, and how many more there were. A disk that
    keeps failing fails every batch: those lines are bounded (:mod:`kvpipe._lograte`)."""
    if errors:
        more = f"; and {len(errors) - shown} more" if len(errors) > shown else ""
        some = "; ".join(errors[:shown]) + more
        _failed_blocks.log(
            logging.WARNING,
            f"{root.path} {what}",
            "file store %s: %s%d of %d blocks %s: %s",
            root.path,
            label,
            len(errors),
            total,
            what,
            some,
        )


def _place_read(sink: FetchSink, index: int, value: memoryview, checksum: int) -> bool:
    """Hand ``sink`` value ``index``, read into ``value``."""
    return bool(sink.fetched(index, checksum, value))


def _place_mapped(sink: FetchSink, index: int, value: memoryview, checksum: int) -> bool | None:
    """Hand ``sink`` value ``index`` as a mapping of its file (``None``: declined)."""
    return sink.fetched(index, checksum, value, mapped=True)
