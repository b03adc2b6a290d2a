"""The file store's catalog: an SQLite database (WAL) under the root, shared by processes.

It holds the residency index and a record of every block (size, parent, times) for capacity
and eviction; block data lives only in the block files. A put reserves its bytes in one
``BEGIN IMMEDIATE`` transaction, evicting prefix tails (blocks no stored block names as
parent), least recently used first, never the blocks being written or their parent; a block
that cannot be admitted is refused, and so is every block after it in the batch. A put that
must evict first settles the reservations of puts that are over (:meth:`Catalog.reserve`):
their writers died, in a process that may be the only one to have reopened the store.

A write transaction on a full disk is rolled back and raises :class:`CatalogFull`. A catalog
that cannot be opened for writing (SQLite must create its ``-shm`` and ``-wal`` files) is
opened read-only: lookups work, every write raises :class:`CatalogFull`. A damaged one (not a
database, or a malformed one) is set aside and replaced by an empty one
(:func:`open_or_replace`): the blocks live in their files, which the store's scan at open
adopts again.

All methods block; connections are pooled, one per thread at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeAlias, TypeVar, final
from urllib.parse import quote

from ..._results import Residency, ResidencyEntry
from ._format import key_namespace
from ._sysio import owner_is_dead

__all__ = (
    "UNKNOWN",
    "Catalog",
    "CatalogFull",
    "CatalogStats",
    "Reservation",
    "SizeOf",
    "open_or_replace",
)

#: The sizes of the block files at keys' names now (``None``: there is none; :data:`UNKNOWN`:
#: it could not be looked at).
SizeOf: TypeAlias = Callable[[Sequence[str]], list[int | None]]
#: A size :data:`SizeOf` could not learn (``EMFILE``, ``EACCES``, ``EIO``...: the file may be
#: there): the key's record is left as it is.
UNKNOWN: Final = -1

log = logging.getLogger("kvpipe.file_store")
R = TypeVar("R")

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS blocks (
    key TEXT PRIMARY KEY,
    parent TEXT,
    namespace TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    created REAL NOT NULL,
    last_access REAL NOT NULL,
    ready INTEGER NOT NULL DEFAULT 0,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS blocks_parent ON blocks(parent);
CREATE INDEX IF NOT EXISTS blocks_access ON blocks(ready, last_access);
CREATE TABLE IF NOT EXISTS residency (
    key TEXT NOT NULL,
    node_id TEXT NOT NULL,
    residency TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (key, node_id)
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('bytes', 0);
"""
#: The record of a block file found published: (key, parent, namespace, nbytes, created,
#: last_access).
_INSERT_READY: Final = (
    "INSERT INTO blocks (key, parent, namespace, nbytes, created, last_access, ready) "
    "VALUES (?, ?, ?, ?, ?, ?, 1)"
)


#: Seconds a catalog call waits for another connection's lock before it fails.
_BUSY_TIMEOUT: Final = 30.0


def _to_wal(db: sqlite3.Connection) -> None:
    """Put the database of ``db`` in WAL mode (a no-op once it is). Two connections turning a
    new database to WAL at once (processes opening a new store together) may get
    ``SQLITE_BUSY`` at once, without SQLite waiting out its busy timeout: retried until then.

    Raises:
        sqlite3.Error: SQLite refused it, or stayed busy past :data:`_BUSY_TIMEOUT`.
    """
    deadline = time.monotonic() + _BUSY_TIMEOUT
    pause = 0.001
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def _abandoned(
    reserved: float, owner: str | None, cutoff: float, dead: dict[str | None, bool]
) -> bool:
    """Whether a reservation made at ``reserved`` by ``owner`` is abandoned: made before
    ``cutoff``, or by a dead process of this host and PID namespace
    (:func:`._sysio.owner_is_dead`; ``dead`` caches its answers by owner)."""
    if reserved < cutoff:
        return True
    if owner not in dead:
        dead[owner] = owner_is_dead(owner)
    return dead[owner]


class CatalogFull(OSError):
    """The catalog cannot record a change: its disk is full (or it was opened read-only
    because the disk was full). Nothing of the transaction was recorded."""


#: Less free space than this makes an I/O error at open a full disk (SQLite's shared memory
#: file of a WAL database takes 32 KiB).
_NEARLY_FULL: Final = 1 << 20


def _disk_full(exc: sqlite3.Error, path: str) -> bool:
    """Whether SQLite failed for want of space: ``SQLITE_FULL``, or (opening a WAL database
    whose shared-memory file cannot be sized) an ``SQLITE_IOERR`` on a nearly full disk."""
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    if code == sqlite3.SQLITE_FULL:
        return True
    if code != sqlite3.SQLITE_IOERR:
        return False
    st = os.statvfs(os.path.dirname(path) or ".")
    return st.f_bavail * st.f_frsize < _NEARLY_FULL


def open_or_replace(
    path: str, owner: str, scan: Callable[[Catalog, bool], R]
) -> tuple[Catalog, R, str | None]:
    """Open the catalog at ``path`` and ``scan`` it (the store's repairs at open). One SQLite
    finds damaged on the way (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``: not a full disk, a lock
    or an I/O error) is renamed, with its ``-wal``, ``-shm`` and ``-journal`` files, to
    ``<name>.damaged-<time>-<pid>``, and an empty catalog takes its place, scanned again.
    That loses the residency records and the blocks' parents and access times; the scan
    adopts the block files again. Replacing it happens under an exclusive lock on
    ``<path>.lock``, taken only then: of two processes finding it damaged at once, the
    second finds the first's new catalog.

    Args:
        scan: Called with the catalog and whether it was just replaced (then it must walk
            the block files, or the store would not know them).

    Returns:
        The catalog, what ``scan`` returned, and where the damaged catalog went (``None``:
        it was sound).
    """
    try:
        return (*_scanned(path, owner, scan, False), None)
    except _Damaged:
        pass
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return (*_scanned(path, owner, scan, False), None)  # replaced meanwhile?
        except _Damaged as exc:
            cause = exc.args[0]
        aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        for suffix in ("", "-wal", "-shm", "-journal"):  # a stale WAL must not meet a new db
            with contextlib.suppress(FileNotFoundError):
                os.rename(path + suffix, aside + suffix)
        log.error(
            "file store catalog %s is damaged (%s): moved to %s and replaced by an empty "
            "one; the block files are adopted again, the residency records are lost. "
            "Processes that had this store open keep using the damaged one: restart them",
            path,
            cause,
            aside,
        )
        try:
            return (*_scanned(path, owner, scan, True), aside)
        except _Damaged as exc:
            raise sqlite3.DatabaseError(exc.args[0]) from None
    finally:
        os.close(lock)  # and its lock


class _Damaged(Exception):
    """The catalog is damaged (args: SQLite's message)."""


def _scanned(
    path: str, owner: str, scan: Callable[[Catalog, bool], R], replaced: bool
) -> tuple[Catalog, R]:
    catalog = None
    try:
        catalog = Catalog(path, owner)
        return catalog, scan(catalog, replaced)
    except BaseException as exc:
        if catalog is not None:
            catalog.close()
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
            raise _Damaged(str(exc)) from None
        raise


@final
@dataclass(frozen=True, slots=True)
class Reservation:
    """What a put may write.

    Attributes:
        admitted: Per block of the batch: reserved (write it) or refused (no space).
        victims: Keys evicted to make room (their files must be removed).
        evicted_bytes: Bytes those victims held.
    """

    admitted: list[bool]
    victims: list[str]
    evicted_bytes: int


@final
@dataclass(frozen=True, slots=True)
class CatalogStats:
    """Totals for statistics and ``kvpipe store-info``."""

    blocks: int
    bytes: int
    pending: int
    namespaces: dict[str, int]
    residency_records: int


@final
class Catalog:
    """The catalog database (see the module docstring)."""

    def __init__(self, path: str, owner: str = "", *, writable: bool = True) -> None:
        """Open (and create, when ``writable``) the catalog at ``path``.

        Args:
            writable: ``False``: open an existing catalog for reading only (inspection),
                creating and changing nothing, so that a store on a read-only file system,
                or another user's, can be read; every write raises :class:`CatalogFull`.
        """
        self.path = path
        self.owner = owner
        self._pool: queue.SimpleQueue[sqlite3.Connection] = queue.SimpleQueue()
        self._all: list[sqlite3.Connection] = []
        self._write_lock = threading.Lock()
        #: How the catalog was opened read-only (not ``writable``, or its disk was full), or
        #: ``None``.
        self.read_only: str | None = None
        if not writable:
            self._open_read_only(None)
            return
        # Owner-only, like every file of the store (SQLite gives -wal/-shm the same mode).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        try:
            with self._conn() as db:
                db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            self.close()
            if not (isinstance(exc, sqlite3.OperationalError) and _disk_full(exc, path)):
                raise
            self._open_read_only(exc)

    def _open_read_only(self, cause: sqlite3.Error | None) -> None:
        """Open an existing catalog for reading only: ``mode=ro`` where SQLite can use the
        WAL's shared memory, else ``immutable=1`` (it cannot be created: the disk is too
        full, so no other process has the database open, or the directory cannot be
        written, so none has written it since the last one closed it). ``cause``: why the
        catalog cannot be written (logged), or ``None`` when it is opened so on purpose."""
        failed = cause
        for mode in ("mode=ro", "immutable=1"):
            self.read_only = mode
            try:
                with self._conn() as db:
                    db.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()
            except sqlite3.Error as exc:
                self.close()
                failed = failed or exc
                continue
            if cause is not None:
                log.warning(
                    "file store catalog %s opened read-only (%s: %s): blocks are served, "
                    "writes are refused until the store is reopened with room",
                    self.path,
                    mode,
                    str(cause),  # text: a kept record would hold the error's frames
                )
            return
        self.read_only = None
        assert failed is not None
        raise failed

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:
            uri = f"file:{quote(self.path)}?{self.read_only}"
            db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            db = sqlite3.connect(
                self.path, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
            )
            _to_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=30000")
        self._all.append(db)
        return db

    @contextlib.contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        try:
            db = self._pool.get_nowait()
        except queue.Empty:
            db = self._connect()
        try:
            yield db
        finally:
            self._pool.put(db)

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        # One writer at a time in this process (SQLite's busy handler sleeps in growing steps).
        if self.read_only:
            raise CatalogFull(errno.ENOSPC, f"catalog opened read-only ({self.read_only})")
        with self._write_lock, self._conn() as db:
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:  # SQLite may have rolled back already (disk full)
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_FULL:
                    raise
                raise CatalogFull(errno.ENOSPC, f"catalog: {exc}") from exc

    def close(self) -> None:
        """Close every connection."""
        self._pool = queue.SimpleQueue()
        for db in self._all:
            db.close()
        self._all.clear()

    # -- blocks ------------------------------------------------------------------------------

    def reserve(
        self,
        keys: Sequence[str],
        parent: str | None,
        namespace: str,
        nbytes: int,
        capacity: int | None,
        room: int,
        stale_after: float | None = None,
        size_of: SizeOf | None = None,
    ) -> Reservation:
        """Reserve room for a batch of consecutive blocks (``parent`` precedes ``keys[0]``).

        Args:
            room: Bytes the batch may take on disk (:func:`._space.room`). Each block counts
                ``nbytes`` against it (a file is written before it replaces an older one);
                blocks past it are refused, without eviction.
            stale_after: With ``size_of``: before it first evicts, settle (as
                :meth:`reconcile` does) every other put's reservation made more than this
                many seconds ago, or by a dead process of this host and PID namespace
                (:func:`._sysio.owner_is_dead`). A writer killed mid-put leaves its
                reservations unsettled, and only an open settles them otherwise: processes
                that share a store and never reopen it (ranks in containers, each of its own
                PID namespace) would lose that capacity, and the chain each continues would
                stay pinned against eviction. Nothing bounds how long a live put takes (a
                caller that stops waiting does not stop its thread): a put is assumed to end
                within ``stale_after`` (the store's ``stale_temp_after``, which its recovery
                at open assumes of temporary files and reservations already). One that does
                not loses its reservation: its record is made to say what is at its name,
                and its own settling records the block it publishes; meanwhile the capacity
                may be overshot by that put's blocks.

        Raises:
            CatalogFull: The disk is full: nothing was reserved.
        """
        now = time.time()
        admitted: list[bool] = []
        victims: list[str] = []
        freed = 0
        protect = {*keys, parent}
        sweep = size_of is not None and stale_after is not None
        with self._write() as db:
            (total,) = db.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()
            for i, key in enumerate(keys):
                if admitted and not admitted[-1]:
                    admitted.append(False)
                    continue
                row = db.execute("SELECT nbytes FROM blocks WHERE key=?", (key,)).fetchone()
                need = nbytes - (row[0] if row else 0)
                if room < nbytes:
                    admitted.append(False)
                    continue
                if capacity is not None and total + need > capacity and sweep:
                    assert size_of is not None and stale_after is not None
                    sweep = False  # once per reservation
                    db.execute("UPDATE meta SET value=? WHERE name='bytes'", (total,))
                    self._settle_abandoned(db, now - stale_after, size_of, protect)
                    (total,) = db.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()
                if capacity is not None and total + need > capacity:
                    got, gone = self._evict(db, total + need - capacity, protect)
                    victims += gone
                    freed += got
                    total -= got
                    if total + need > capacity:
                        admitted.append(False)
                        continue
                block_parent = keys[i - 1] if i else parent
                if row:
                    # Unsettled again until this put settles it: a block being written is
                    # never evicted (another put evicting it here would see this one publish
                    # it again, with no room reserved for it).
                    db.execute(
                        "UPDATE blocks SET nbytes=?, last_access=?, ready=0, owner=? WHERE key=?",
                        (nbytes, now, self.owner, key),
                    )
                else:
                    db.execute(
                        "INSERT INTO blocks (key, parent, namespace, nbytes, created, "
                        "last_access, ready, owner) VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
                        (key, block_parent, namespace, nbytes, now, now, self.owner),
                    )
                total += need
                room -= nbytes
                admitted.append(True)
            db.execute("UPDATE meta SET value=? WHERE name='bytes'", (total,))
        return Reservation(admitted, victims, freed)

    @staticmethod
    def _settle_abandoned(
        db: sqlite3.Connection, cutoff: float, size_of: SizeOf, protect: set[str | None]
    ) -> None:
        """Settle, in the transaction of ``db``, the reservations (unsettled records) not in
        ``protect`` made before ``cutoff`` or by a dead process of this PID namespace (see
        :meth:`reserve`). Reads only the unsettled records (an index's range: the blocks
        being written now, by every process)."""
        dead: dict[str | None, bool] = {}
        keys = [
            key
            for key, at, owner in db.execute(
                "SELECT key, last_access, owner FROM blocks WHERE ready=0"
            ).fetchall()
            if key not in protect and _abandoned(at, owner, cutoff, dead)
        ]
        if keys:
            log.warning(
                "file store: a put needing room settled %d reservation(s) of writers that "
                "died or have been writing for over stale_temp_after (first: %s)",
                len(keys),
                keys[0],
            )
            Catalog._reconcile(db, keys, size_of, None)

    @staticmethod
    def _evict(
        db: sqlite3.Connection, need: int, protect: set[str | None]
    ) -> tuple[int, list[str]]:
        freed, gone = 0, []
        # Enough tails that one is not protected whenever there is one: protected tails
        # stay (the batch's own blocks), and 64 of them must not hide every other block.
        limit = 64 + len(protect)
        while freed < need:
            rows = db.execute(
                "SELECT key, nbytes FROM blocks b WHERE ready=1 AND NOT EXISTS "
                "(SELECT 1 FROM blocks c WHERE c.parent = b.key) ORDER BY last_access LIMIT ?",
                (limit,),
            ).fetchall()
            rows = [r for r in rows if r[0] not in protect]
            if not rows:
                break
            for key, size in rows:
                db.execute("DELETE FROM blocks WHERE key=?", (key,))
                freed += size
                gone.append(key)
                if freed >= need:
                    break
        return freed, gone

    def settle(
        self,
        written: Sequence[str],
        failed: Sequence[str],
        size_of: SizeOf,
        parents: Mapping[str, str | None] | None = None,
    ) -> None:
        """Record a put's outcome: each key as :meth:`reconcile` finds it, the ``written``
        ones read just now (for LRU eviction). ``parents``: each key's parent in the put's
        batch, for a record made again (a delete or an eviction dropped it meanwhile), so
        that its parent is not taken for a prefix tail."""
        with self._write() as db:
            self._reconcile(db, written, size_of, time.time(), parents)
            self._reconcile(db, failed, size_of, None, parents)

    def reconcile(self, keys: Sequence[str], size_of: SizeOf) -> int:
        """Make each key's record say what ``size_of`` finds at its name now: a ready block
        of that many bytes, or no record at all (a size :data:`UNKNOWN` leaves the record as
        it is: never dropped for a file that may be there). Returns how many records it removed (of
        keys whose file is gone; one removed already, by another process say, is not
        counted).

        Every operation that changes a block file (put, delete, eviction, quarantine) ends
        with this, inside one write transaction, so another process's change to the same
        key that came between its file step and its record is never undone: the catalog
        records the files there are, whichever operation finishes last.
        """
        with self._write() as db:
            return self._reconcile(db, keys, size_of, None)

    def reconcile_abandoned(self, keys: Sequence[str], size_of: SizeOf, cutoff: float) -> int:
        """:meth:`reconcile`, except for a key whose record is, in the transaction, a
        reservation made at or after ``cutoff`` by a process not known dead (see
        :meth:`reserve`): a live writer's, left as it is. Recovery at open judges the records
        it read before walking the tree; a live writer may have reserved one of those keys
        again meanwhile. Returns how many records it removed."""
        with self._write() as db:
            dead: dict[str | None, bool] = {}
            settled = []
            for key in keys:
                row = db.execute(
                    "SELECT ready, last_access, owner FROM blocks WHERE key=?", (key,)
                ).fetchone()
                if row is None or row[0] or _abandoned(row[1], row[2], cutoff, dead):
                    settled.append(key)
            return self._reconcile(db, settled, size_of, None)

    @staticmethod
    def _reconcile(
        db: sqlite3.Connection,
        keys: Sequence[str],
        size_of: SizeOf,
        now: float | None,
        parents: Mapping[str, str | None] | None = None,
    ) -> int:
        """:meth:`reconcile` in the transaction of ``db``; the records removed."""
        change = removed = 0
        for key, size in zip(keys, size_of(keys), strict=True):
            if size == UNKNOWN:
                continue
            row = db.execute("SELECT nbytes FROM blocks WHERE key=?", (key,)).fetchone()
            if size is None:
                if row:
                    db.execute("DELETE FROM blocks WHERE key=?", (key,))
                    change -= row[0]
                    removed += 1
            elif row:
                db.execute(
                    "UPDATE blocks SET nbytes=?, ready=1, last_access=coalesce(?, last_access) "
                    "WHERE key=?",
                    (size, now, key),
                )
                change += size - row[0]
            else:  # published, its record dropped meanwhile (a delete, an eviction...)
                at = now or time.time()
                parent = parents.get(key) if parents else None
                db.execute(_INSERT_READY, (key, parent, key_namespace(key), size, at, at))
                change += size
        if change:
            db.execute("UPDATE meta SET value=value+? WHERE name='bytes'", (change,))
        return removed

    def touch(self, keys: Sequence[str]) -> None:
        """Record a read of these blocks (for LRU eviction); skipped when the disk is full.
        A block being written again (its reservation unsettled) is left as it is: its time
        says when it was reserved, for telling an abandoned reservation (:meth:`reserve`),
        and its put's settling records it as used then."""
        now = time.time()
        with contextlib.suppress(CatalogFull), self._write() as db:
            db.executemany(
                "UPDATE blocks SET last_access=? WHERE key=? AND ready=1",
                [(now, k) for k in keys],
            )

    def records(self) -> dict[str, tuple[bool, float, str | None]]:
        """Every block record: key → (ready, last reserved or read, owner of an unsettled
        reservation). The time is not the record's creation: a put of a key stored long
        ago reserves it again now."""
        with self._conn() as db:
            rows = db.execute("SELECT key, ready, last_access, owner FROM blocks")
            return {k: (bool(r), c, o) for k, r, c, o in rows}

    def adopt(self, key: str, namespace: str, nbytes: int, created: float, size_of: SizeOf) -> bool:
        """Record a valid block file of ``nbytes`` the catalog did not know, if ``size_of``
        still finds it at its name in the transaction (a delete that removed it since it was
        checked is not undone: see :meth:`reconcile`); ``False`` if the catalog knew it, or
        the file is gone (or was replaced: its put records it)."""
        with self._write() as db:
            there = size_of([key])[0] == nbytes
            row = db.execute("SELECT ready FROM blocks WHERE key=?", (key,)).fetchone()
            if row or not there:
                if row and not row[0] and there:
                    db.execute("UPDATE blocks SET ready=1 WHERE key=?", (key,))
                return False
            db.execute(_INSERT_READY, (key, None, namespace, nbytes, created, created))
            db.execute("UPDATE meta SET value=value+? WHERE name='bytes'", (nbytes,))
        return True

    def known_keys(self) -> set[str]:
        """Every key the catalog records."""
        with self._conn() as db:
            return {r[0] for r in db.execute("SELECT key FROM blocks")}

    def stats(self) -> CatalogStats:
        """Totals over the whole store."""
        with self._conn() as db:
            (blocks,) = db.execute("SELECT COUNT(*) FROM blocks WHERE ready=1").fetchone()
            (total,) = db.execute("SELECT value FROM meta WHERE name='bytes'").fetchone()
            (pending,) = db.execute("SELECT COUNT(*) FROM blocks WHERE ready=0").fetchone()
            spaces = dict(
                db.execute("SELECT namespace, COUNT(*) FROM blocks WHERE ready=1 GROUP BY 1")
            )
            (records,) = db.execute("SELECT COUNT(*) FROM residency").fetchone()
        return CatalogStats(blocks, total, pending, spaces, records)

    # -- residency ---------------------------------------------------------------------------

    def put_residency(
        self, entries: Sequence[ResidencyEntry], abandoned: Callable[[], bool] | None = None
    ) -> None:
        """Upsert one record per (key, node); nothing when ``abandoned()`` is true once this
        has the write lock (its caller stopped waiting: a later call of that caller's may
        have recorded newer entries already, which these must not replace)."""
        with self._write() as db:
            if abandoned is not None and abandoned():
                return
            db.executemany(
                "INSERT INTO residency VALUES (?, ?, ?, ?) ON CONFLICT (key, node_id) DO "
                "UPDATE SET residency=excluded.residency, updated_at=excluded.updated_at",
                [(e.key, e.node_id, e.residency.value, e.updated_at) for e in entries],
            )

    def get_residency(self, keys: Sequence[str]) -> list[tuple[ResidencyEntry, ...]]:
        """Every node's record for each key.

        Raises:
            sqlite3.DataError: A record this version cannot read (a residency it does not
                know, a time that is no number: another writer's, or damaged).
        """
        out: list[tuple[ResidencyEntry, ...]] = []
        with self._conn() as db:
            for key in keys:
                rows = db.execute(
                    "SELECT node_id, residency, updated_at FROM residency WHERE key=? "
                    "ORDER BY node_id",
                    (key,),
                ).fetchall()
                out.append(tuple(_entry(key, *row) for row in rows))
        return out


def _entry(key: str, node: str, residency: object, updated_at: object) -> ResidencyEntry:
    """The record of ``key`` on ``node`` from its catalog row.

    Raises:
        sqlite3.DataError: The row holds a residency or a time this version cannot read.
    """
    if isinstance(updated_at, int | float) and not isinstance(updated_at, bool):
        try:
            return ResidencyEntry(key, node, Residency(residency), float(updated_at))
        except ValueError:
            pass
    raise sqlite3.DataError(
        f"residency record of {key!r} on {node!r}: residency {residency!r}, "
        f"updated_at {updated_at!r}"
    )
