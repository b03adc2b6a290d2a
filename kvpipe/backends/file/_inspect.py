"""Recovery at open and the read-only inspection behind ``kvpipe store-info``."""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import final
from urllib.parse import quote

import xxhash

from ._catalog import Catalog, CatalogFull
from ._format import (
    BLOCK_SUFFIX,
    HEADER_NBYTES,
    BlockHeader,
    HeaderError,
    block_location,
    unpack_header,
)
from ._fs import Root, owner_is_dead, still_block
from ._space import sizes

__all__ = (
    "RecoveryReport",
    "StoreReport",
    "inspect_store",
    "is_store",
    "recover",
    "remove_stale_temps",
)

log = logging.getLogger("kvpipe.file_store")


@final
@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening a store repaired."""

    temp_removed: int = 0
    adopted: int = 0
    quarantined: int = 0
    forgotten: int = 0


def _checked_header(path: str, parts: tuple[str, ...], name: str) -> tuple[BlockHeader, int]:
    """The header of the block file ``parts/name`` at ``path``, and the file's size (never
    blocks on a FIFO, never follows a link).

    Raises:
        HeaderError: It is not a regular file, its header is bad, it is not where its key
            belongs, or its size is not the header's.
        OSError: It cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return _header_of(fd, parts, name)
    finally:
        os.close(fd)


def _header_of(fd: int, parts: tuple[str, ...], name: str) -> tuple[BlockHeader, int]:
    """As :func:`_checked_header`, of the file open at ``fd``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HeaderError("not a regular file")
    header = unpack_header(os.pread(fd, HEADER_NBYTES, 0))
    if block_location(header.key) != (parts, name):
        raise HeaderError("file is not where its key belongs")
    if st.st_size != header.file_nbytes:
        raise HeaderError(f"size {st.st_size} B, header says {header.file_nbytes}")
    return header, st.st_size


def _is_block(parts: tuple[str, ...], name: str, fd: int) -> bool:
    try:
        _header_of(fd, parts, name)
    except (HeaderError, OSError):
        return False
    return True


def recover(root: Root, catalog: Catalog, stale_after: float) -> RecoveryReport:
    """Repair what a crash can leave: temporary files, unsettled records, unknown files.

    Headers are read only for files the catalog does not know. On a disk too full for the
    catalog to record a repair, the repairs stop there (logged); the store still serves the
    blocks, and a later open with room finishes them.
    """
    counts: Counter[str] = Counter()
    if removed := remove_stale_temps(root, stale_after):
        counts["temp_removed"] = removed
    try:
        _repair_catalog(root, catalog, stale_after, counts)
    except CatalogFull as exc:
        log.warning(
            "file store %s: catalog repairs at open left for later: %s", root.path, str(exc)
        )
    return RecoveryReport(**counts)


def remove_stale_temps(root: Root, stale_after: float) -> int:
    """Remove the temporary files under ``root`` of writers that are gone: dead processes
    of this host and PID namespace, or any writer's once older than ``stale_after`` seconds
    (:meth:`Root.temp_files`). Returns how many; a file that cannot be removed is logged.

    Raises:
        OSError: The tree cannot be walked.
    """
    removed = 0
    for tmp in root.temp_files(stale_after):
        try:
            if tmp.removable and root.remove_temp(tmp.parts, tmp.name):
                removed += 1
        except OSError as exc:
            log.warning("file store %s: cannot remove %s: %s", root.path, tmp.name, str(exc))
    return removed


def _repair_catalog(root: Root, catalog: Catalog, stale_after: float, counts: Counter[str]) -> None:
    records = catalog.records()
    expected = {block_location(k)[1]: k for k in records}
    seen: set[str] = set()
    for parts, entries in root.walk(("blocks",)):
        for entry in entries:
            name = entry.name
            if not name.endswith(BLOCK_SUFFIX) or name.startswith("."):
                continue
            regular = entry.is_file(follow_symlinks=False)
            if regular and name in expected and block_location(expected[name])[0] == parts:
                seen.add(expected[name])  # known to the catalog: its header is read on use
                continue
            try:
                header, size = _checked_header(entry.path, parts, name)
            except (HeaderError, OSError):
                # A live writer may have published the key at this name since: kept.
                if root.quarantine(parts, name, functools.partial(_is_block, parts, name)):
                    counts["quarantined"] += 1
                continue
            seen.add(header.key)
            if catalog.adopt(header.key, parts[1], size, header.created, sizes(root)):
                counts["adopted"] += 1
    cutoff = time.time() - stale_after
    gone = []
    # Judged again in each transaction: a live writer may have reserved a key again since
    # the records were read (its reservation stays), or another process deleted or evicted
    # it (not a repair).
    for key, (ready, reserved, owner) in records.items():
        dead = not ready and (reserved < cutoff or owner_is_dead(owner))
        if key in seen:
            if dead:  # published; its writer died unsettled
                catalog.reconcile_abandoned([key], sizes(root), cutoff)
        elif ready or dead:
            gone.append(key)  # the file is gone, or its writer died before publishing it
    if gone:
        forgotten = catalog.reconcile_abandoned(gone, sizes(root), cutoff)
        if forgotten:
            counts["forgotten"] = forgotten


@final
@dataclass
class StoreReport:
    """What ``kvpipe store-info`` prints."""

    root: str
    blocks: int = 0
    payload_bytes: int = 0
    disk_bytes: int = 0
    namespaces: Counter[str] = field(default_factory=Counter)
    oldest: float | None = None
    newest: float | None = None
    corrupt: list[str] = field(default_factory=list)
    temp_files: int = 0
    stale_temp_files: int = 0
    quarantined: int = 0
    catalog_blocks: int = 0
    catalog_bytes: int = 0
    catalog_pending: int = 0
    untracked: int = 0
    residency_records: int = 0
    verified: bool = False
    #: Why the catalog could not be read (damaged, not a file...), or ``None``; the
    #: ``catalog_*``, ``untracked`` and ``residency_records`` counts are then 0.
    catalog_error: str | None = None


def is_store(path: str) -> bool:
    """Whether the directory ``path`` is a file store's root: it holds the catalog (every
    open makes it) or a ``blocks/`` directory."""
    return os.path.isfile(os.path.join(path, "catalog.sqlite3")) or os.path.isdir(
        os.path.join(path, "blocks")
    )


def inspect_store(path: str, verify: bool = False, stale_after: float = 3600.0) -> StoreReport:
    """Walk a store without changing it. Needs no write access: a catalog this process
    cannot write (a read-only file system, another user's store that it may read) is read
    read-only. A catalog that cannot be read at all (damaged) is reported in
    :attr:`StoreReport.catalog_error`, with the block files found.

    Args:
        path: The store root.
        verify: Also read every payload and check its checksum (reads the whole store).
        stale_after: Age after which a temporary file counts as stale.

    Raises:
        FileNotFoundError: ``path`` is not a file store (see :func:`is_store`).
        OSError: ``path`` cannot be opened as a directory.
    """
    if os.path.isdir(path) and not is_store(path):
        raise FileNotFoundError(
            errno.ENOENT, "not a kvpipe store (no catalog.sqlite3, no blocks/)", path
        )
    root = Root(path, create=False)
    report = StoreReport(root.path, verified=verify)
    try:
        for tmp in root.temp_files(stale_after):
            report.temp_files += 1
            report.stale_temp_files += tmp.removable
        for _, entries in root.walk(("quarantine",)):
            report.quarantined += len(entries)
        keys = set()
        for parts, entries in root.walk(("blocks",)):
            for entry in entries:
                if not entry.name.endswith(BLOCK_SUFFIX) or entry.name.startswith("."):
                    continue
                try:
                    why = _inspect_file(entry.path, parts, entry.name, verify, report)
                except FileNotFoundError:
                    continue  # deleted or evicted since the walk listed it: no block now
                if why is not None:
                    report.corrupt.append(f"{os.path.join(*parts, entry.name)}: {why}")
                else:
                    keys.add(entry.name)
        if os.path.exists(os.path.join(root.path, "catalog.sqlite3")):
            try:
                _read_catalog(os.path.join(root.path, "catalog.sqlite3"), keys, report)
            except (OSError, sqlite3.Error) as exc:
                report.catalog_error = f"{type(exc).__name__}: {exc}"
    finally:
        root.close()
    return report


def _read_catalog(path: str, names: set[str], report: StoreReport) -> None:
    """Fill ``report``'s catalog totals from the catalog at ``path`` (``names``: the valid
    block files' names found).

    Raises:
        OSError, sqlite3.Error: The catalog cannot be opened or read (damaged, say).
    """
    catalog = _open_catalog(path)
    try:
        stats = catalog.stats()
        tracked = {block_location(k)[1] for k in catalog.known_keys()}
    finally:
        catalog.close()
    report.catalog_blocks, report.catalog_bytes = stats.blocks, stats.bytes
    report.catalog_pending = stats.pending
    report.residency_records = stats.residency_records
    report.untracked = len(names - tracked)


#: What the catalog's schema makes (:data:`._catalog._SCHEMA`), by kind.
_TABLES = frozenset({"blocks", "residency", "meta"})
_INDEXES = frozenset({"blocks_parent", "blocks_access"})


def _open_catalog(path: str) -> Catalog:
    """The catalog at ``path``, as the store opens it where that changes nothing (its last
    connection closing removes the ``-wal`` and ``-shm`` files, leaving it as it was; a
    read-only one would leave them), else read-only: a read-only file system, a catalog or
    directory of another user's that this one may only read, or a catalog the store's open
    would change (not in WAL mode, or missing an index: that open converts and creates).

    Raises:
        OSError, sqlite3.Error: It cannot be read, it is empty (no schema to read), or it
            lacks a table of the catalog or its ``bytes`` total (another program's
            database, or a damaged catalog).
    """
    if os.stat(path).st_size == 0:  # opened writable it would be given the schema
        raise sqlite3.DatabaseError(
            "empty catalog file: no schema (the store's next open makes it)"
        )
    try:
        unchanged = _opens_unchanged(path)
    except _NotACatalog:
        raise
    except sqlite3.Error as exc:  # cannot be opened so (read-only), or damaged: told below
        log.debug("file store catalog %s not probed (%s): read read-only", path, str(exc))
        unchanged = False
    if unchanged:
        try:
            return Catalog(path)
        except (OSError, sqlite3.Error) as exc:
            log.debug("file store catalog %s not writable (%s): read read-only", path, str(exc))
    return Catalog(path, writable=False)


class _NotACatalog(sqlite3.DatabaseError):
    """An SQLite database without the catalog's tables: another program's, or damaged."""


def _opens_unchanged(path: str) -> bool:
    """Whether the store's own open of the catalog at ``path`` (which creates any part of
    its schema that is missing and turns it to WAL) would leave it as it is, read through a
    connection that writes nothing (it creates no table, sets no journal mode).

    Raises:
        _NotACatalog: It lacks a table of the catalog or its ``bytes`` total: damaged, or
            not a catalog.
        sqlite3.Error: It cannot be opened so (read-only) or read.
    """
    db = sqlite3.connect(f"file:{quote(path)}?mode=rw", uri=True, isolation_level=None)
    try:
        names = {
            kind: {
                name for name, k in db.execute("SELECT name, type FROM sqlite_master") if k == kind
            }
            for kind in ("table", "index")
        }
        missing = sorted(_TABLES - names["table"])
        if missing:
            raise _NotACatalog(f"not a kvpipe catalog: no table {', '.join(missing)}")
        if db.execute("SELECT 1 FROM meta WHERE name='bytes'").fetchone() is None:
            raise _NotACatalog("damaged catalog: no 'bytes' total in its meta table")
        (journal,) = db.execute("PRAGMA journal_mode").fetchone()
    finally:
        db.close()
    return str(journal).lower() == "wal" and _INDEXES <= names["index"]


def _inspect_file(
    path: str, parts: tuple[str, ...], name: str, verify: bool, report: StoreReport
) -> str | None:
    """Why the block file at ``path`` is corrupt, or ``None`` (then counted in ``report``).
    Its header and payload are read from one descriptor, under the shared lock a store's
    readers take (:func:`._fs.still_block`), so that a block the store deletes meanwhile,
    or a file it reuses, is never taken for a corrupt one.

    Raises:
        FileNotFoundError: No block file is at ``path`` now (deleted since it was listed).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and not still_block(fd, st):
                raise FileNotFoundError(errno.ENOENT, "renamed since it was opened", path)
            header, size = _header_of(fd, parts, name)
            if verify:
                h = xxhash.xxh3_64()
                at, left = HEADER_NBYTES, header.payload_nbytes  # not a version-2's padding
                while left and (chunk := os.pread(fd, min(left, 1 << 22), at)):
                    h.update(chunk)
                    at += len(chunk)
                    left -= len(chunk)
                if h.intdigest() != header.checksum:
                    return "payload checksum mismatch"
        finally:
            os.close(fd)
    except HeaderError as exc:
        return str(exc)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    report.blocks += 1
    report.payload_bytes += header.payload_nbytes
    report.disk_bytes += size
    report.namespaces[parts[1]] += 1
    report.oldest = header.created if report.oldest is None else min(report.oldest, header.created)
    report.newest = header.created if report.newest is None else max(report.newest, header.created)
    return None
